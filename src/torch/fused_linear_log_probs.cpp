// torch.ops.bastile.fused_linear_log_probs: the fused heads' pass (fused_head.h) as TRL's per-token heads see
// it: per row, log p(target) of softmax(softcap(logit_scale * logits) / temperature), its entropy (both
// differentiable), log(sum p^2), the mean scaled logit and whether the target is the argmax. Its upstream
// gradients differ by row in general (GRPO, DPO, DFT), so its backward makes the logits again as
// fused_linear_cross_entropy's reduction "none" does. With uniform_grad, the caller promises one upstream
// gradient for every counted row (SFT's negative log-likelihood: -1 / tokens each); the forward then forms
// the gradients as reduction "sum" does, the backward checks the promise on the device (no host sync) and
// scales them.
#include <cmath>
#include <limits>

#include "fused_head.h"

namespace bastile {
namespace {

using namespace head;

constexpr const char* kLogProbs = "fused_linear_log_probs";

Options log_prob_options(int64_t ignore_index, double temperature, double logit_scale, double softcap,
                         bool fp32_weight_grad, int64_t chunk_bytes) {
  auto o = options(ignore_index, "none", softcap, 0.0, fp32_weight_grad, chunk_bytes);
  TORCH_CHECK(std::isfinite(temperature) && temperature > 0,
              "bastile.fused_linear_log_probs: temperature must be > 0, got ", temperature);
  TORCH_CHECK(std::isfinite(logit_scale), "bastile.fused_linear_log_probs: logit_scale must be finite, got ",
              logit_scale);
  o.logit_scale = logit_scale, o.temperature = temperature, o.stats = true;
  return o;
}

using Five = std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor>;

// log_probs, entropy, log_sum_sq_probs, mean_logits, is_top1 (target's shape) of a run with stats.
Five per_row(const Result& r, const at::Tensor& target) {
  if (r.stats.is_meta()) {
    const auto like = [&] { return at::empty_like(r.row_loss); };
    return {like(), like(), like(), like(), at::empty_like(r.row_loss, r.row_loss.options().dtype(at::kBool))};
  }
  const auto column = [&](int k) { return r.stats.select(1, k).reshape(target.sizes()); };
  return {r.row_loss.neg(), column(0).clone(), column(1).clone(), column(2).clone(), column(3).gt(0)};
}

struct FlpForwardOp {
  static constexpr const char* schema =
      "fused_linear_log_probs_forward(Tensor hidden, Tensor weight, Tensor target, Tensor? bias=None, "
      "int ignore_index=-100, float temperature=1.0, float logit_scale=1.0, float softcap=0.0, "
      "bool fp32_weight_grad=True, int chunk_bytes=0, bool[3] grad_mask=[False, False, False]) -> "
      "(Tensor log_probs, Tensor entropy, Tensor log_sum_sq_probs, Tensor mean_logits, Tensor is_top1, "
      "Tensor grad_hidden, Tensor grad_weight, Tensor grad_bias)";

  // The per-row values and, for grad_mask, the gradients of -sum(log_probs) (as reduction "sum" forms them).
  static std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor>
  kernel(const at::Tensor& hidden, const at::Tensor& weight, const at::Tensor& target,
         const std::optional<at::Tensor>& bias, int64_t ignore_index, double temperature, double logit_scale,
         double softcap, bool fp32_weight_grad, int64_t chunk_bytes, Mask mask) {
    auto o = log_prob_options(ignore_index, temperature, logit_scale, softcap, fp32_weight_grad, chunk_bytes);
    o.reduction = Reduction::Sum;
    const auto r = run(hidden, weight, target, bias, o, mask);
    return std::tuple_cat(per_row(r, target), std::make_tuple(r.grad_hidden, r.grad_weight, r.grad_bias));
  }
};

struct FlpBackwardOp {
  static constexpr const char* schema =
      "fused_linear_log_probs_backward(Tensor? grad_log_probs, Tensor? grad_entropy, Tensor hidden, Tensor weight, "
      "Tensor target, Tensor? bias=None, int ignore_index=-100, float temperature=1.0, float logit_scale=1.0, "
      "float softcap=0.0, bool fp32_weight_grad=True, int chunk_bytes=0, bool[3] grad_mask=[True, True, True]) -> "
      "(Tensor grad_hidden, Tensor grad_weight, Tensor grad_bias)";

  // The logits again, chunk by chunk, each row's gradient weighted by its two upstream gradients.
  static Three kernel(const std::optional<at::Tensor>& grad_log_probs, const std::optional<at::Tensor>& grad_entropy,
                      const at::Tensor& hidden, const at::Tensor& weight, const at::Tensor& target,
                      const std::optional<at::Tensor>& bias, int64_t ignore_index, double temperature,
                      double logit_scale, double softcap, bool fp32_weight_grad, int64_t chunk_bytes, Mask mask) {
    auto o = log_prob_options(ignore_index, temperature, logit_scale, softcap, fp32_weight_grad, chunk_bytes);
    o.stats = false;
    for (const auto* g : {&grad_log_probs, &grad_entropy})
      if (has(*g)) {
        TORCH_CHECK((*g)->is_floating_point() && (*g)->sym_sizes() == target.sym_sizes(),
                    "bastile.fused_linear_log_probs_backward: the gradients must be floating with target's shape ",
                    target.sym_sizes(), ", got ", (*g)->scalar_type(), " of shape ", (*g)->sym_sizes());
        check_device(kLogProbs, {"hidden", hidden}, {{"gradient", **g}});
      }
    // The kernel's loss is -log p: its upstream gradient is minus log p's.
    const auto row_scale = has(grad_log_probs) ? grad_log_probs->neg()
                                               : at::zeros_like(target, hidden.options().dtype(stats_dtype(hidden)));
    const auto r = run(hidden, weight, target, bias, o, mask, row_scale, has(grad_entropy) ? *grad_entropy : at::Tensor());
    return {r.grad_hidden, r.grad_weight, r.grad_bias};
  }
};

// The rows whose target counts.
at::Tensor counted(const at::Tensor& target, int64_t ignore_index, const c10::SymInt& vocab) {
  return target.ne(ignore_index).logical_and_(target.ge(0)).logical_and_(target.lt(vocab));
}

// With uniform_grad: -g, g the one upstream gradient of every counted row (0 when none is counted), which the
// device asserts (a CPU tensor is checked at once). The forward's gradients are those of -sum(log_probs).
at::Tensor uniform_factor(const at::Tensor& grad, const at::Tensor& counted) {
  if (!grad.numel()) return at::zeros({}, grad.options());
  const auto inf = std::numeric_limits<double>::infinity();
  const auto hi = at::where(counted, grad, -inf).max(), lo = at::where(counted, grad, inf).min();
  const auto any = counted.any();
  at::_assert_async(hi.eq(lo).logical_or_(any.logical_not()),
                    "bastile.fused_linear_log_probs: uniform_grad promised one upstream gradient for every counted "
                    "row, but they differ; pass uniform_grad=False");
  return at::where(any, hi.neg(), at::zeros({}, grad.options()));
}

struct FlpOp {
  static constexpr const char* schema =
      "fused_linear_log_probs(Tensor hidden, Tensor weight, Tensor target, Tensor? bias=None, int ignore_index=-100, "
      "float temperature=1.0, float logit_scale=1.0, float softcap=0.0, bool uniform_grad=False, "
      "bool fp32_weight_grad=True, int chunk_bytes=0) -> "
      "(Tensor log_probs, Tensor entropy, Tensor log_sum_sq_probs, Tensor mean_logits, Tensor is_top1)";

  static Five kernel(const at::Tensor& hidden, const at::Tensor& weight, const at::Tensor& target,
                     const std::optional<at::Tensor>& bias, int64_t ignore_index, double temperature,
                     double logit_scale, double softcap, bool uniform_grad, bool fp32_weight_grad, int64_t chunk_bytes) {
    auto [lp, h, sq, mean, top1, gh, gw, gb] = call<FlpForwardOp>(
        hidden, weight, target, bias, ignore_index, temperature, logit_scale, softcap, fp32_weight_grad, chunk_bytes,
        Mask{false, false, false});
    return {lp, h, sq, mean, top1};
  }

  static variable_list forward(AutogradContext* ctx, const at::Tensor& hidden, const at::Tensor& weight,
                               const at::Tensor& target, const std::optional<at::Tensor>& bias, int64_t ignore_index,
                               double temperature, double logit_scale, double softcap, bool uniform_grad,
                               bool fp32_weight_grad, int64_t chunk_bytes) {
    const Mask mask{hidden.requires_grad(), weight.requires_grad(), has(bias) && bias->requires_grad()};
    ctx->set_materialize_grads(false);  // an entropy used for logging only takes no backward work
    auto [lp, h, sq, mean, top1, gh, gw, gb] = call<FlpForwardOp>(
        hidden, weight, target, bias, ignore_index, temperature, logit_scale, softcap, fp32_weight_grad, chunk_bytes,
        uniform_grad ? mask : Mask{false, false, false});
    auto& d = ctx->saved_data;
    save_mask(ctx, mask);
    d["uniform_grad"] = uniform_grad, d["ignore_index"] = ignore_index;
    if (uniform_grad) {
      ctx->save_for_backward({gh, gw, gb, counted(target, ignore_index, weight.sym_size(0))});
    } else {
      ctx->save_for_backward({hidden, weight, target, has(bias) ? *bias : at::Tensor()});
      d["temperature"] = temperature, d["logit_scale"] = logit_scale, d["softcap"] = softcap;
      d["fp32_weight_grad"] = fp32_weight_grad, d["chunk_bytes"] = chunk_bytes;
    }
    ctx->mark_non_differentiable({sq, mean, top1});
    return {lp, h, sq, mean, top1};
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    auto& d = ctx->saved_data;
    const Mask mask = saved_mask(ctx);
    const auto &g_lp = grads[0], &g_h = grads[1];
    if (!g_lp.defined() && !g_h.defined()) return variable_list(4);
    auto saved = ctx->get_saved_variables();
    Three g;
    if (d["uniform_grad"].toBool()) {
      TORCH_CHECK(!g_h.defined(), "bastile.fused_linear_log_probs: with uniform_grad the forward formed the gradients ",
                  "of the log-probabilities alone, but the entropy has a gradient; pass uniform_grad=False");
      const auto factor = uniform_factor(g_lp, saved[3]);
      g = scale_formed(saved, factor);
    } else {
      const auto opt = [](const at::Tensor& t) { return t.defined() ? std::optional(t) : std::nullopt; };
      g = call<FlpBackwardOp>(opt(g_lp), opt(g_h), saved[0], saved[1], saved[2], opt(saved[3]),
                              d["ignore_index"].toInt(), d["temperature"].toDouble(), d["logit_scale"].toDouble(),
                              d["softcap"].toDouble(), d["fp32_weight_grad"].toBool(), d["chunk_bytes"].toInt(),
                              mask);
    }
    saved.clear();
    return argument_grads(g, mask);
  }

  template <c10::DeviceType device>
  static Five autocast(const auto&... a) {
    return autocast_hidden<FlpOp, device>(a...);
  }
};

}  // namespace
}  // namespace bastile

BASTILE_OPS(bastile::FlpOp, bastile::FlpForwardOp, bastile::FlpBackwardOp)
