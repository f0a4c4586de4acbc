// torch.ops.bastile.fused_linear_cross_entropy: the loss of
// F.cross_entropy((hidden @ weight.T + bias).float(), target, ignore_index, reduction) without the
// [rows, vocab] logits, through the fused heads' driver (fused_head.h). The forward produces every gradient
// for a unit upstream gradient (fused_linear_cross_entropy_forward); the backward only scales them
// (fused_linear_cross_entropy_backward). Reduction "none" gives the row losses, whose upstream gradients
// differ by row and are known only in the backward: its forward keeps no gradient, and its backward
// (fused_linear_cross_entropy_rows_backward) makes the logits again, chunk by chunk, with the row's upstream
// gradient folded into the kernel's pass: one more GEMM than the other reductions.
#include "fused_head.h"

namespace bastile {
namespace {

using namespace head;
constexpr const char* kOp = "fused_linear_cross_entropy";
using Four = std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor>;

struct FlceForwardOp {
  static constexpr const char* schema =
      "fused_linear_cross_entropy_forward(Tensor hidden, Tensor weight, Tensor target, Tensor? bias=None, "
      "int ignore_index=-100, str reduction=\"mean\", float softcap=0.0, float z_loss=0.0, "
      "bool fp32_weight_grad=True, int chunk_bytes=0, float label_smoothing=0.0, float logit_scale=1.0, "
      "bool[3] grad_mask=[True, True, True]) -> (Tensor loss, Tensor grad_hidden, Tensor grad_weight, Tensor grad_bias)";

  static Four kernel(const at::Tensor& hidden, const at::Tensor& weight, const at::Tensor& target,
                     const std::optional<at::Tensor>& bias, int64_t ignore_index, c10::string_view reduction,
                     double softcap, double z_loss, bool fp32_weight_grad, int64_t chunk_bytes,
                     double label_smoothing, double logit_scale, Mask mask) {
    const auto o = options(ignore_index, reduction, softcap, z_loss, fp32_weight_grad, chunk_bytes, label_smoothing,
                           logit_scale);
    TORCH_CHECK(o.reduction != Reduction::None || !(mask[0] || mask[1] || mask[2]),
                "bastile.fused_linear_cross_entropy_forward: reduction \"none\" forms no gradients in the forward ",
                "(their upstream gradients differ by row): fused_linear_cross_entropy_rows_backward makes them");
    auto r = run(hidden, weight, target, bias, o, mask);
    return {r.loss, r.grad_hidden, r.grad_weight, r.grad_bias};
  }
};

struct FlceRowsBackwardOp {
  static constexpr const char* schema =
      "fused_linear_cross_entropy_rows_backward(Tensor grad_rows, Tensor hidden, Tensor weight, Tensor target, "
      "Tensor? bias=None, int ignore_index=-100, float softcap=0.0, float z_loss=0.0, bool fp32_weight_grad=True, "
      "int chunk_bytes=0, float label_smoothing=0.0, float logit_scale=1.0, bool[3] grad_mask=[True, True, True]) "
      "-> (Tensor grad_hidden, Tensor grad_weight, Tensor grad_bias)";

  static Three kernel(
      const at::Tensor& grad_rows, const at::Tensor& hidden, const at::Tensor& weight, const at::Tensor& target,
      const std::optional<at::Tensor>& bias, int64_t ignore_index, double softcap, double z_loss,
      bool fp32_weight_grad, int64_t chunk_bytes, double label_smoothing, double logit_scale, Mask mask) {
    const auto o = options(ignore_index, "none", softcap, z_loss, fp32_weight_grad, chunk_bytes, label_smoothing,
                           logit_scale);
    TORCH_CHECK(grad_rows.is_floating_point() && grad_rows.sym_sizes() == target.sym_sizes(),
                "bastile.fused_linear_cross_entropy_rows_backward: grad_rows must be floating with target's shape ",
                target.sym_sizes(), ", got ", grad_rows.scalar_type(), " of shape ", grad_rows.sym_sizes());
    check_device(kOp, {"hidden", hidden}, {{"grad_rows", grad_rows}});
    auto r = run(hidden, weight, target, bias, o, mask, grad_rows);
    return {r.grad_hidden, r.grad_weight, r.grad_bias};
  }
};

struct FlceOp {
  static constexpr const char* schema =
      "fused_linear_cross_entropy(Tensor hidden, Tensor weight, Tensor target, Tensor? bias=None, "
      "int ignore_index=-100, str reduction=\"mean\", float softcap=0.0, float z_loss=0.0, "
      "bool fp32_weight_grad=True, int chunk_bytes=0, float label_smoothing=0.0, float logit_scale=1.0) -> Tensor";

  // Nothing to differentiate: the loss alone, with no gradient GEMMs or buffers.
  static at::Tensor kernel(const at::Tensor& hidden, const at::Tensor& weight, const at::Tensor& target,
                           const std::optional<at::Tensor>& bias, int64_t ignore_index, c10::string_view reduction,
                           double softcap, double z_loss, bool fp32_weight_grad, int64_t chunk_bytes,
                           double label_smoothing, double logit_scale) {
    const auto o = options(ignore_index, reduction, softcap, z_loss, fp32_weight_grad, chunk_bytes, label_smoothing,
                           logit_scale);
    return run(hidden, weight, target, bias, o, {false, false, false}).loss;
  }

  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& hidden, const at::Tensor& weight,
                            const at::Tensor& target, const std::optional<at::Tensor>& bias, int64_t ignore_index,
                            c10::string_view reduction, double softcap, double z_loss, bool fp32_weight_grad,
                            int64_t chunk_bytes, double label_smoothing, double logit_scale) {
    const Mask mask{hidden.requires_grad(), weight.requires_grad(), has(bias) && bias->requires_grad()};
    save_mask(ctx, mask);
    if (reduction == "none") {  // the backward makes the logits again
      ctx->save_for_backward({hidden, weight, target, has(bias) ? *bias : at::Tensor()});
      auto& d = ctx->saved_data;
      d["ignore_index"] = ignore_index, d["softcap"] = softcap, d["z_loss"] = z_loss;
      d["fp32_weight_grad"] = fp32_weight_grad, d["chunk_bytes"] = chunk_bytes, d["label_smoothing"] = label_smoothing;
      d["logit_scale"] = logit_scale;
      return call<FlceOp>(hidden, weight, target, bias, ignore_index, reduction, softcap, z_loss, fp32_weight_grad,
                          chunk_bytes, label_smoothing, logit_scale);
    }
    auto [loss, gh, gw, gb] = call<FlceForwardOp>(hidden, weight, target, bias, ignore_index, reduction, softcap,
                                                  z_loss, fp32_weight_grad, chunk_bytes, label_smoothing, logit_scale,
                                                  mask);
    ctx->save_for_backward({gh, gw, gb});
    return loss;
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    const Mask mask = saved_mask(ctx);
    auto saved = ctx->get_saved_variables();
    Three g;
    if (auto& d = ctx->saved_data; d.count("chunk_bytes")) {  // reduction "none"
      const std::optional<at::Tensor> bias = saved[3].defined() ? std::optional(saved[3]) : std::nullopt;
      g = call<FlceRowsBackwardOp>(grads[0], saved[0], saved[1], saved[2], bias, d["ignore_index"].toInt(),
                                   d["softcap"].toDouble(), d["z_loss"].toDouble(), d["fp32_weight_grad"].toBool(),
                                   d["chunk_bytes"].toInt(), d["label_smoothing"].toDouble(),
                                   d["logit_scale"].toDouble(), mask);
    } else {
      g = scale_formed(saved, grads[0]);
    }
    saved.clear();
    return argument_grads(g, mask);
  }

  template <c10::DeviceType device>
  static at::Tensor autocast(const auto&... a) {
    return autocast_hidden<FlceOp, device>(a...);
  }
};

}  // namespace
}  // namespace bastile

BASTILE_OPS(bastile::FlceOp, bastile::FlceForwardOp, bastile::FlceBackwardOp, bastile::FlceRowsBackwardOp)
