// torch.ops.bastile.expert_linear (cuda/expert_linear.cu): a mixture of experts' grouped product. x [pairs, in]
// grouped by expert, weight [experts, out, in] (transformers' stored down_proj; contiguous, or its transpose
// contiguous), offsets [experts] (int32, each expert's end; the last is pairs): returns y [pairs, out] with row
// r = x[r] @ weight[e]^T for its expert e. On compute capability 9.0 (bf16, the widths include/expert_linear.h
// names) our grouped GEMM, reading the weight in the layout it comes in; elsewhere on CUDA torch's grouped GEMM
// where it takes the operands (bf16), else a plain kernel; on the CPU the reference. A piece of the experts' own
// autograd node (python_shim/bastile/experts.py): no backward of its own.
#include "op.h"

namespace bastile {
namespace {

struct ExpertLinearOp {
  static constexpr const char* schema = "expert_linear(Tensor x, Tensor weight, Tensor offsets) -> Tensor";

  static at::Tensor kernel(const at::Tensor& x_in, const at::Tensor& weight_in, const at::Tensor& offsets_in) {
    constexpr const char* op = "expert_linear";
    const auto dt = check_grouped(op, x_in, weight_in, offsets_in, "[experts, out, in]",
                                  [](const c10::SymInt&) { return true; });
    const auto empty = [&] { return at::empty_symint({x_in.sym_size(0), weight_in.sym_size(1)}, x_in.options()); };
    if (x_in.is_meta() || x_in.size(0) == 0 || weight_in.size(1) == 0) return empty();
    check_experts(op, x_in, weight_in);
    if (x_in.size(1) == 0) return empty().zero_();  // sums over nothing
    const auto x = x_in.contiguous(), offsets = offsets_in.contiguous();
    // N-major: the weight's transpose is contiguous (where both are, K-major).
    const bool n_major = !weight_in.is_contiguous() && weight_in.transpose(-2, -1).is_contiguous();
    const auto weight = n_major ? weight_in : weight_in.contiguous();
    const int64_t in = x.size(1), out = weight.size(1);
    const bool fits = dt == BASTILE_BF16 && in % 8 == 0 && aligned16(x) && aligned16(weight);
    const auto plan = decide(ExpertLinearPlan{.in = in, .out = out, .experts = int32_t(weight.size(0)),
                                              .device = x.is_cuda() ? x.device().index() : -1, .fits = fits,
                                              .n_major = n_major});
    if (x.is_cuda() && !plan.hopper && dt == BASTILE_BF16 && in % 8 == 0 && out % 8 == 0)
      return at::_grouped_mm(x, weight.transpose(-2, -1), offsets);
    // The other kernels read the weight K-major.
    const auto read = plan.hopper ? weight : weight.contiguous();
    auto y = empty();
    launch(x, ExpertLinear{.x = x.data_ptr(), .weight = read.data_ptr(), .offsets = offsets.data_ptr<int32_t>(),
                           .y = y.data_ptr(), .pairs = x.size(0), .in = in, .out = out,
                           .experts = int32_t(weight.size(0)), .dtype = dt, .gemm = plan.hopper,
                           .n_major = plan.hopper && n_major});
    return y;
  }
};

}  // namespace
}  // namespace bastile

BASTILE_OPS(bastile::ExpertLinearOp)
