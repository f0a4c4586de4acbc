// torch.ops.bastile.expert_linear (cuda/expert_linear.cu): a mixture of experts' grouped product. x [pairs, in]
// grouped by expert, weight [experts, out, in] (transformers' stored down_proj; contiguous, or its transpose
// contiguous), offsets [experts] (int32, each expert's end; the last is pairs), and optionally a low-rank product
// summed in, lora_x [pairs, rank] with lora_weight [experts, out, rank] (an expert LoRA's factors): returns y
// [pairs, out] with row r = x[r] @ weight[e]^T + lora_x[r] @ lora_weight[e]^T for its expert e. On compute
// capability 9.0 (bf16, the widths include/expert_linear.h names) our grouped GEMM, reading the weight in the layout
// it comes in, the low-rank product as one more stage; elsewhere on CUDA torch's grouped GEMM where it takes the
// operands (bf16; the low-rank product apart), else a plain kernel; on the CPU the reference. A piece of the experts' own autograd node
// (python_shim/bastile/experts.py): no backward of its own.
#include "op.h"

namespace bastile {
namespace {

struct ExpertLinearOp {
  static constexpr const char* schema =
      "expert_linear(Tensor x, Tensor weight, Tensor offsets, Tensor? lora_x=None, Tensor? lora_weight=None) -> Tensor";

  static at::Tensor kernel(const at::Tensor& x_in, const at::Tensor& weight_in, const at::Tensor& offsets_in,
                           const std::optional<at::Tensor>& lora_x_in, const std::optional<at::Tensor>& lora_weight_in) {
    constexpr const char* op = "expert_linear";
    const auto dt = check_grouped(op, x_in, weight_in, offsets_in, "[experts, out, in]",
                                  [](const c10::SymInt&) { return true; });
    const bool lora = check_lora(op, x_in, weight_in, "out", lora_x_in, lora_weight_in);
    const auto empty = [&] { return at::empty_symint({x_in.sym_size(0), weight_in.sym_size(1)}, x_in.options()); };
    if (x_in.is_meta() || x_in.size(0) == 0 || weight_in.size(1) == 0) return empty();
    check_experts(op, x_in, weight_in);
    const int64_t rank = lora ? lora_x_in->size(1) : 0;
    if (x_in.size(1) == 0)  // sums over nothing but the low-rank product's
      return rank ? kernel(*lora_x_in, *lora_weight_in, offsets_in, {}, {}) : empty().zero_();
    const auto x = x_in.contiguous(), offsets = offsets_in.contiguous();
    // N-major: the weight's transpose is contiguous (where both are, K-major).
    const bool n_major = !weight_in.is_contiguous() && weight_in.transpose(-2, -1).is_contiguous();
    const auto weight = n_major ? weight_in : weight_in.contiguous();
    const int64_t in = x.size(1), out = weight.size(1);
    const bool fits = dt == BASTILE_BF16 && in % 8 == 0 && aligned16(x) && aligned16(weight);
    const auto plan = decide(ExpertLinearPlan{.in = in, .out = out, .experts = int32_t(weight.size(0)),
                                              .device = x.is_cuda() ? x.device().index() : -1, .rank = rank,
                                              .fits = fits, .n_major = n_major});
    // bf16 on CUDA but not one Hopper kernel: each product by its fastest path, rounded, then their sum.
    if (rank && x.is_cuda() && !plan.hopper && dt == BASTILE_BF16)
      return kernel(x_in, weight_in, offsets_in, {}, {}).add_(kernel(*lora_x_in, *lora_weight_in, offsets_in, {}, {}));
    if (x.is_cuda() && !plan.hopper && dt == BASTILE_BF16 && in % 8 == 0 && out % 8 == 0)
      return at::_grouped_mm(x, weight.transpose(-2, -1), offsets);
    // The Hopper kernel reads lora_weight in the weight's layout, the rows kernel both K-major.
    const auto read = plan.hopper ? weight : weight.contiguous();
    at::Tensor lx, lw;
    if (rank) lx = contiguous16(*lora_x_in), lw = plan.hopper ? in_layout(*lora_weight_in, n_major) : lora_weight_in->contiguous();
    auto y = empty();
    launch(x, ExpertLinear{.x = x.data_ptr(), .weight = read.data_ptr(), .offsets = offsets.data_ptr<int32_t>(),
                           .lora_x = rank ? lx.data_ptr() : nullptr, .lora_weight = rank ? lw.data_ptr() : nullptr,
                           .y = y.data_ptr(), .pairs = x.size(0), .in = in, .out = out, .rank = rank,
                           .experts = int32_t(weight.size(0)), .dtype = dt, .hopper = plan.hopper,
                           .n_major = plan.hopper && n_major});
    return y;
  }

  // t [experts, out, rank] in the weight's layout, as TMA reads it: contiguous (K-major) or its transpose
  // contiguous (N-major), starting on 16 bytes; itself where it is.
  static at::Tensor in_layout(const at::Tensor& t, bool n_major) {
    return n_major ? contiguous16(t.transpose(-2, -1)).transpose(-2, -1) : contiguous16(t);
  }
};

}  // namespace
}  // namespace bastile

BASTILE_OPS(bastile::ExpertLinearOp)
