// torch.ops.bastile.expert_route (cuda/expert_route.cu): a mixture of experts' router after its logits. `logits`
// [tokens, experts] gives (weights [tokens, k], chosen [tokens, k] int64): each token's k largest logits, largest
// first, a tie to the lower index (as torch.topk picks them, NaN first), and their weights: with `renorm` the
// softmax over the chosen logits (HF's top-k of the softmax renormalised, or its softmax of the top-k logits),
// else the softmax over all experts at the chosen. In f32 (f64 for float64 logits), rounded once to `dtype`
// (default float32, float64 for float64 logits). With a `bias` [experts] (ERNIE 4.5's) the choice is by the
// float32 softmax plus the bias, and `norm_min` clamps the renormalising sum below (ERNIE's moe_norm_min). The
// logits' gradient comes from the weights' (chosen and bias have none). expert_route_backward(grad, logits, chosen,
// renorm, norm_min) is that gradient as a piece: the formulas of include/expert_route.h, of logits' dtype. Autograd
// saves the logits and chosen; autocast leaves the op alone.
// expert_route_sigmoid(logits, k, bias, renorm, eps, scale, groups, group_k, dtype) is the sigmoid router (GLM-4.5's,
// LFM2-MoE's): the scores sigmoid(logits) rounded to logits' dtype, the k largest of scores + bias (bias [experts]
// of a float dtype, the sum rounded as torch's; it only chooses; with groups > 1 only among the group_k
// groups whose two largest sum highest, GLM-4.5's n_group and topk_group), their scores as weights, with `renorm`
// over their sum plus eps, times scale; its backward piece expert_route_sigmoid_backward the same way.
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

// A backward's grad [tokens, k] and chosen (int64, of grad's shape) for logits [tokens, experts], on its device.
void check_choice(const char* op, const at::Tensor& grad, const at::Tensor& logits, const at::Tensor& chosen) {
  check_index(op, {"chosen", chosen});
  TORCH_CHECK(chosen.dim() == 2 && chosen.sym_size(0) == logits.sym_size(0), "bastile.", op,
              ": chosen must be [tokens, k] with tokens = ", logits.sym_size(0), " (logits'), got shape ",
              chosen.sym_sizes());
  check_same_shape(op, {"grad", grad}, {"chosen", chosen});
  check_device(op, {"logits", logits}, {{"grad", grad}, {"chosen", chosen}});
}

// A backward piece (the block of either router, its own fields set): grad [tokens, k] and chosen for logits
// [tokens, experts], the gradient of logits' dtype.
template <class Block>
at::Tensor backward_piece(const char* op, const at::Tensor& grad_in, const at::Tensor& logits_in,
                          const at::Tensor& chosen_in, bool renorm, Block block) {
  block.dtype = dtype_code(op, {"logits", checked_logits(op, logits_in)});
  block.weights_dtype = dtype_code(op, {"grad", grad_in});
  check_choice(op, grad_in, logits_in, chosen_in);
  auto out = at::empty_symint(logits_in.sym_sizes(), logits_in.options());
  if (logits_in.is_meta() || out.numel() == 0) return out;
  if (chosen_in.size(1) == 0) return out.zero_();
  const auto grad = grad_in.contiguous(), logits = logits_in.contiguous(), chosen = chosen_in.contiguous();
  block.grad = grad.data_ptr();
  block.logits = logits.data_ptr();
  block.chosen = chosen.data_ptr<int64_t>();
  block.grad_logits = out.data_ptr();
  block.tokens = logits.size(0);
  block.experts = logits.size(1);
  block.k = chosen.size(1);
  block.renorm = renorm;
  launch(logits, block);
  return out;
}

struct ExpertRouteBackwardOp {
  static constexpr const char* schema =
      "expert_route_backward(Tensor grad, Tensor logits, Tensor chosen, bool renorm, float norm_min=0.0) -> Tensor";

  static at::Tensor kernel(const at::Tensor& grad, const at::Tensor& logits, const at::Tensor& chosen, bool renorm,
                           double norm_min) {
    return backward_piece("expert_route_backward", grad, logits, chosen, renorm,
                          ExpertRouteBackward{.norm_min = static_cast<float>(norm_min)});
  }
};

// A router's correction bias: [experts] of a float dtype on logits' device, read by the kernels as f32 (exact).
at::Tensor checked_bias(const char* op, const std::optional<at::Tensor>& bias, const at::Tensor& logits) {
  if (!bias) return at::Tensor();
  const auto b = bias->scalar_type();
  TORCH_CHECK(b == logits.scalar_type() || b == at::kFloat || b == at::kHalf || b == at::kBFloat16, "bastile.", op,
              ": bias must be float32, float16, bfloat16 or logits' ", logits.scalar_type(), ", got ", b);
  TORCH_CHECK(bias->dim() == 1 && bias->sym_size(0) == logits.sym_size(1), "bastile.", op,
              ": bias must be [experts] = [", logits.sym_size(1), "], got shape ", bias->sym_sizes());
  check_device(op, {"logits", logits}, {{"bias", *bias}});
  return bias->to(at::kFloat).contiguous();
}

struct ExpertRouteOp {
  static constexpr const char* schema =
      "expert_route(Tensor logits, int k, bool renorm, ScalarType? dtype=None, Tensor? bias=None, "
      "float norm_min=0.0) -> (Tensor, Tensor)";
  static constexpr size_t no_grad[] = {4};  // bias: it only chooses

  static std::tuple<at::Tensor, at::Tensor> kernel(const at::Tensor& logits_in, int64_t k, bool renorm,
                                                   std::optional<at::ScalarType> dtype,
                                                   const std::optional<at::Tensor>& bias_in, double norm_min) {
    constexpr const char* op = "expert_route";
    const auto dt = dtype_code(op, {"logits", checked_logits(op, logits_in)});
    const auto& experts = logits_in.sym_size(1);
    TORCH_CHECK(k >= 0 && experts >= k, "bastile.", op, ": k must be in 0..experts = ", experts, ", got ", k);
    TORCH_CHECK(norm_min >= 0, "bastile.", op, ": norm_min must be >= 0, got ", norm_min);
    const auto bias = checked_bias(op, bias_in, logits_in);
    const auto w = dtype.value_or(stats_dtype(logits_in));
    const auto wt = dtype_code(op, "dtype", w);
    const auto& tokens = logits_in.sym_size(0);
    auto weights = at::empty_symint({tokens, k}, logits_in.options().dtype(w));
    auto chosen = at::empty_symint({tokens, k}, logits_in.options().dtype(at::kLong));
    if (logits_in.is_meta() || weights.numel() == 0) return {weights, chosen};
    const auto logits = logits_in.contiguous();
    launch(logits, ExpertRouteForward{.logits = logits.data_ptr(),
                                      .bias = bias.defined() ? bias.data_ptr<float>() : nullptr,
                                      .weights = weights.data_ptr(), .chosen = chosen.data_ptr<int64_t>(),
                                      .tokens = logits.size(0), .experts = logits.size(1), .k = k,
                                      .norm_min = static_cast<float>(norm_min), .dtype = dt, .weights_dtype = wt,
                                      .renorm = renorm});
    return {weights, chosen};
  }

  static variable_list forward(AutogradContext* ctx, const at::Tensor& logits, int64_t k, bool renorm,
                               std::optional<at::ScalarType> dtype, const std::optional<at::Tensor>& bias,
                               double norm_min) {
    auto [weights, chosen] = call<ExpertRouteOp>(logits, k, renorm, dtype, bias, norm_min);
    ctx->save_for_backward({logits, chosen});
    ctx->saved_data["renorm"] = renorm;
    ctx->saved_data["norm_min"] = norm_min;
    ctx->mark_non_differentiable({chosen});
    return {weights, chosen};
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    if (!grads[0].defined()) return {at::Tensor()};
    const auto s = ctx->get_saved_variables();
    const auto& d = ctx->saved_data;
    return {call<ExpertRouteBackwardOp>(grads[0], s[0], s[1], d.at("renorm").toBool(), d.at("norm_min").toDouble())};
  }
};

struct ExpertRouteSigmoidBackwardOp {
  static constexpr const char* schema =
      "expert_route_sigmoid_backward(Tensor grad, Tensor logits, Tensor chosen, bool renorm, float eps, float scale) "
      "-> Tensor";

  static at::Tensor kernel(const at::Tensor& grad, const at::Tensor& logits, const at::Tensor& chosen, bool renorm,
                           double eps, double scale) {
    return backward_piece("expert_route_sigmoid_backward", grad, logits, chosen, renorm,
                          ExpertRouteSigmoidBackward{.eps = static_cast<float>(eps),
                                                     .scale = static_cast<float>(scale)});
  }
};

struct ExpertRouteSigmoidOp {
  static constexpr const char* schema =
      "expert_route_sigmoid(Tensor logits, int k, Tensor? bias=None, bool renorm=False, float eps=0.0, "
      "float scale=1.0, int groups=1, int group_k=1, ScalarType? dtype=None) -> (Tensor, Tensor)";
  static constexpr size_t no_grad[] = {2};  // bias: it only chooses

  static std::tuple<at::Tensor, at::Tensor> kernel(const at::Tensor& logits_in, int64_t k,
                                                   const std::optional<at::Tensor>& bias_in, bool renorm, double eps,
                                                   double scale, int64_t groups, int64_t group_k,
                                                   std::optional<at::ScalarType> dtype) {
    constexpr const char* op = "expert_route_sigmoid";
    const auto dt = dtype_code(op, {"logits", checked_logits(op, logits_in)});
    const auto& experts = logits_in.sym_size(1);
    TORCH_CHECK(k >= 0 && experts >= k, "bastile.", op, ": k must be in 0..experts = ", experts, ", got ", k);
    TORCH_CHECK(groups >= 1 && groups <= 32 && experts % groups == 0, "bastile.", op,
                ": groups must be in 1..32 and divide the ", experts, " experts, got ", groups);
    TORCH_CHECK(group_k >= 1 && group_k <= groups, "bastile.", op, ": group_k must be in 1..groups = ", groups,
                ", got ", group_k);
    TORCH_CHECK(group_k == groups || experts >= 2 * groups, "bastile.", op,
                ": a group scores by its two largest experts, and ", experts, " experts in ", groups,
                " groups leave fewer");
    // promoted with the scores as torch's `scores + bias`: to float32 (or float64 on the CPU), or a 16-bit sum
    const auto bias = checked_bias(op, bias_in, logits_in);
    const auto w = dtype.value_or(stats_dtype(logits_in));
    const auto wt = dtype_code(op, "dtype", w);
    const auto& tokens = logits_in.sym_size(0);
    auto weights = at::empty_symint({tokens, k}, logits_in.options().dtype(w));
    auto chosen = at::empty_symint({tokens, k}, logits_in.options().dtype(at::kLong));
    if (logits_in.is_meta() || weights.numel() == 0) return {weights, chosen};
    const auto logits = logits_in.contiguous();
    // a 16-bit bias of logits' dtype makes the choice a 16-bit sum
    const bool round_choice = bias_in && bias_in->scalar_type() == logits_in.scalar_type() &&
                              logits_in.scalar_type() != at::kFloat && logits_in.scalar_type() != at::kDouble;
    launch(logits, ExpertRouteSigmoidForward{.logits = logits.data_ptr(),
                                             .bias = bias.defined() ? bias.data_ptr<float>() : nullptr,
                                             .weights = weights.data_ptr(), .chosen = chosen.data_ptr<int64_t>(),
                                             .tokens = logits.size(0), .experts = logits.size(1), .k = k,
                                             .groups = groups, .group_k = group_k,
                                             .eps = static_cast<float>(eps), .scale = static_cast<float>(scale),
                                             .dtype = dt, .weights_dtype = wt, .renorm = renorm,
                                             .round_choice = round_choice});
    return {weights, chosen};
  }

  static variable_list forward(AutogradContext* ctx, const at::Tensor& logits, int64_t k,
                               const std::optional<at::Tensor>& bias, bool renorm, double eps, double scale,
                               int64_t groups, int64_t group_k, std::optional<at::ScalarType> dtype) {
    auto [weights, chosen] = call<ExpertRouteSigmoidOp>(logits, k, bias, renorm, eps, scale, groups, group_k, dtype);
    ctx->save_for_backward({logits, chosen});
    ctx->saved_data["renorm"] = renorm;
    ctx->saved_data["eps"] = eps;
    ctx->saved_data["scale"] = scale;
    ctx->mark_non_differentiable({chosen});
    return {weights, chosen};
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    if (!grads[0].defined()) return {at::Tensor()};
    const auto s = ctx->get_saved_variables();
    const auto& d = ctx->saved_data;
    return {call<ExpertRouteSigmoidBackwardOp>(grads[0], s[0], s[1], d.at("renorm").toBool(), d.at("eps").toDouble(),
                                               d.at("scale").toDouble())};
  }
};

}  // namespace
}  // namespace bastile

BASTILE_OPS(bastile::ExpertRouteOp, bastile::ExpertRouteBackwardOp, bastile::ExpertRouteSigmoidOp,
            bastile::ExpertRouteSigmoidBackwardOp)
