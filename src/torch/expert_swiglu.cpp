// torch.ops.bastile.expert_swiglu (cuda/expert_swiglu.cu): a mixture of experts' gate/up products and their gated
// activation. x [pairs, in] grouped by expert, weight [experts, 2 * inter, in] (transformers' stored gate_up_proj:
// gate's rows, then up's), offsets [experts] (int32, each expert's end; the last is pairs): returns gate_up [pairs,
// 2 * inter] with row r = x[r] @ weight[e]^T for its expert e, and h [pairs, inter] = swiglu(gate, up,
// activation) of its halves, rounded as the `swiglu` op rounds it; optionally a low-rank product summed into
// gate_up, lora_x [pairs, rank] with lora_weight [experts, 2 * inter, rank] (an expert LoRA's factors). On compute
// capability 9.0 (bf16, in a multiple of 8, inter of 128, the low-rank product as one more stage) one kernel
// computes both; elsewhere on CUDA bf16 through `expert_linear` and `swiglu`, other dtypes a plain kernel; on the
// CPU the reference. A piece of the experts' own autograd node (python_shim/bastile/experts.py): no backward of its own.
#include "op.h"

namespace bastile {
namespace {

const auto& swiglu_op() {
  static const auto op = c10::Dispatcher::singleton()
                             .findSchemaOrThrow("bastile::swiglu", "")
                             .typed<at::Tensor(const at::Tensor&, const at::Tensor&, c10::string_view)>();
  return op;
}

const auto& expert_linear_op() {
  using Optional = const std::optional<at::Tensor>&;
  static const auto op =
      c10::Dispatcher::singleton()
          .findSchemaOrThrow("bastile::expert_linear", "")
          .typed<at::Tensor(const at::Tensor&, const at::Tensor&, const at::Tensor&, Optional, Optional)>();
  return op;
}

struct ExpertSwigluOp {
  static constexpr const char* schema =
      "expert_swiglu(Tensor x, Tensor weight, Tensor offsets, str activation=\"silu\", Tensor? lora_x=None, "
      "Tensor? lora_weight=None) -> (Tensor, Tensor)";

  static std::tuple<at::Tensor, at::Tensor> kernel(const at::Tensor& x_in, const at::Tensor& weight_in,
                                                   const at::Tensor& offsets_in, c10::string_view activation,
                                                   const std::optional<at::Tensor>& lora_x_in,
                                                   const std::optional<at::Tensor>& lora_weight_in) {
    constexpr const char* op = "expert_swiglu";
    const auto dt = check_grouped(op, x_in, weight_in, offsets_in, "[experts, 2 * inter, in]",
                                  [](const c10::SymInt& rows) { return rows % 2 == 0; });
    const int32_t act = gate_activation(op, activation);
    const bool lora = check_lora(op, x_in, weight_in, "2 * inter", lora_x_in, lora_weight_in);
    const auto& pairs = x_in.sym_size(0);
    const auto inter = weight_in.sym_size(1) / 2;
    auto gate_up = at::empty_symint({pairs, 2 * inter}, x_in.options());
    auto h = at::empty_symint({pairs, inter}, x_in.options());
    if (x_in.is_meta() || gate_up.numel() == 0) return {gate_up, h};
    check_experts(op, x_in, weight_in);
    const int64_t rank = lora ? lora_x_in->size(1) : 0;
    if (x_in.size(1) == 0)  // sums over nothing but the low-rank product's (none: act(0) * 0)
      return rank ? kernel(*lora_x_in, *lora_weight_in, offsets_in, activation, {}, {})
                  : std::tuple<at::Tensor, at::Tensor>{gate_up.zero_(), h.zero_()};
    const auto x = x_in.contiguous(), weight = weight_in.contiguous(), offsets = offsets_in.contiguous();
    const bool fits = dt == BASTILE_BF16 && x.size(1) % 8 == 0 && aligned16(x) && aligned16(weight);
    const auto plan = decide(ExpertSwigluPlan{.inter = inter.expect_int(), .rank = rank,
                                              .experts = int32_t(weight.size(0)),
                                              .device = x.is_cuda() ? x.device().index() : -1, .fits = fits});
    if (x.is_cuda() && !plan.hopper && dt == BASTILE_BF16) {
      const int64_t n = inter.expect_int();
      gate_up = expert_linear_op().call(x, weight, offsets, lora_x_in, lora_weight_in);
      return {gate_up, swiglu_op().call(gate_up.narrow(-1, 0, n), gate_up.narrow(-1, n, n), activation)};
    }
    at::Tensor lx, lw;
    if (rank) lx = contiguous16(*lora_x_in), lw = contiguous16(*lora_weight_in);
    launch(x, ExpertSwiglu{.x = x.data_ptr(), .weight = weight.data_ptr(), .offsets = offsets.data_ptr<int32_t>(),
                           .lora_x = rank ? lx.data_ptr() : nullptr, .lora_weight = rank ? lw.data_ptr() : nullptr,
                           .gate_up = gate_up.data_ptr(), .h = h.data_ptr(), .pairs = x.size(0), .in = x.size(1),
                           .inter = inter.expect_int(), .rank = rank, .experts = int32_t(weight.size(0)),
                           .dtype = dt, .activation = act, .hopper = plan.hopper});
    return {gate_up, h};
  }
};

}  // namespace
}  // namespace bastile

BASTILE_OPS(bastile::ExpertSwigluOp)
