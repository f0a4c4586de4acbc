// torch.ops.bastile.expert_route (cuda/expert_route.cu): a mixture of experts' router after its logits. `logits`
// [tokens, experts] gives (weights [tokens, k], chosen [tokens, k] int64): each token's k largest logits, largest
// first, a tie to the lower index (as torch.topk picks them, NaN first), and their weights: with `renorm` the
// softmax over the chosen logits (HF's top-k of the softmax renormalised, or its softmax of the top-k logits),
// else the softmax over all experts at the chosen. In f32 (f64 for float64 logits), rounded once to `dtype`
// (default float32, float64 for float64 logits). The logits' gradient comes from the weights' (chosen has none).
// expert_route_backward(grad, logits, chosen, renorm) is that gradient as a piece: the formulas of
// include/expert_route.h, of logits' dtype. Autograd saves the logits and chosen; autocast leaves the op alone.
#include "op.h"

namespace bastile {
namespace {

// The logits as the kernels read them, checked: [tokens, experts] of a float dtype, experts counted in int32.
at::Tensor checked_logits(const char* op, const at::Tensor& logits) {
  dtype_code(op, {"logits", logits});
  TORCH_CHECK(logits.dim() == 2, "bastile.", op, ": logits must be [tokens, experts], got shape ", logits.sym_sizes());
  TORCH_CHECK(logits.sym_size(1) < std::numeric_limits<int32_t>::max(), "bastile.", op, ": ", logits.sym_size(1),
              " experts are more than int32 indices");
  return logits;
}

struct ExpertRouteBackwardOp {
  static constexpr const char* schema =
      "expert_route_backward(Tensor grad, Tensor logits, Tensor chosen, bool renorm) -> Tensor";

  static at::Tensor kernel(const at::Tensor& grad_in, const at::Tensor& logits_in, const at::Tensor& chosen_in,
                           bool renorm) {
    constexpr const char* op = "expert_route_backward";
    const auto dt = dtype_code(op, {"logits", checked_logits(op, logits_in)});
    const auto wt = dtype_code(op, {"grad", grad_in});
    check_index(op, {"chosen", chosen_in});
    TORCH_CHECK(chosen_in.dim() == 2 && chosen_in.sym_size(0) == logits_in.sym_size(0), "bastile.", op,
                ": chosen must be [tokens, k] with tokens = ", logits_in.sym_size(0), " (logits'), got shape ",
                chosen_in.sym_sizes());
    check_same_shape(op, {"grad", grad_in}, {"chosen", chosen_in});
    check_device(op, {"logits", logits_in}, {{"grad", grad_in}, {"chosen", chosen_in}});
    auto out = at::empty_symint(logits_in.sym_sizes(), logits_in.options());
    if (logits_in.is_meta() || out.numel() == 0) return out;
    if (chosen_in.size(1) == 0) return out.zero_();
    const auto grad = grad_in.contiguous(), logits = logits_in.contiguous(), chosen = chosen_in.contiguous();
    launch(logits, ExpertRouteBackward{.grad = grad.data_ptr(), .logits = logits.data_ptr(),
                                       .chosen = chosen.data_ptr<int64_t>(), .grad_logits = out.data_ptr(),
                                       .tokens = logits.size(0), .experts = logits.size(1), .k = chosen.size(1),
                                       .dtype = dt, .weights_dtype = wt, .renorm = renorm});
    return out;
  }
};

struct ExpertRouteOp {
  static constexpr const char* schema =
      "expert_route(Tensor logits, int k, bool renorm, ScalarType? dtype=None) -> (Tensor, Tensor)";

  static std::tuple<at::Tensor, at::Tensor> kernel(const at::Tensor& logits_in, int64_t k, bool renorm,
                                                   std::optional<at::ScalarType> dtype) {
    constexpr const char* op = "expert_route";
    const auto dt = dtype_code(op, {"logits", checked_logits(op, logits_in)});
    const auto& experts = logits_in.sym_size(1);
    TORCH_CHECK(k >= 0 && experts >= k, "bastile.", op, ": k must be in 0..experts = ", experts, ", got ", k);
    const auto w = dtype.value_or(stats_dtype(logits_in));
    const auto wt = dtype_code(op, "dtype", w);
    const auto& tokens = logits_in.sym_size(0);
    auto weights = at::empty_symint({tokens, k}, logits_in.options().dtype(w));
    auto chosen = at::empty_symint({tokens, k}, logits_in.options().dtype(at::kLong));
    if (logits_in.is_meta() || weights.numel() == 0) return {weights, chosen};
    const auto logits = logits_in.contiguous();
    launch(logits, ExpertRouteForward{.logits = logits.data_ptr(), .weights = weights.data_ptr(),
                                      .chosen = chosen.data_ptr<int64_t>(), .tokens = logits.size(0),
                                      .experts = logits.size(1), .k = k, .dtype = dt, .weights_dtype = wt,
                                      .renorm = renorm});
    return {weights, chosen};
  }

  static variable_list forward(AutogradContext* ctx, const at::Tensor& logits, int64_t k, bool renorm,
                               std::optional<at::ScalarType> dtype) {
    auto [weights, chosen] = call<ExpertRouteOp>(logits, k, renorm, dtype);
    ctx->save_for_backward({logits, chosen});
    ctx->saved_data["renorm"] = renorm;
    ctx->mark_non_differentiable({chosen});
    return {weights, chosen};
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    if (!grads[0].defined()) return {at::Tensor()};
    const auto s = ctx->get_saved_variables();
    return {call<ExpertRouteBackwardOp>(grads[0], s[0], s[1], ctx->saved_data["renorm"].toBool())};
  }
};

}  // namespace
}  // namespace bastile

BASTILE_OPS(bastile::ExpertRouteOp, bastile::ExpertRouteBackwardOp)
