// torch.ops.bastile.rms_norm (cuda/rms_norm.cu). With n = x * rstd, rstd = 1 / rms(x) per row:
// y = weight * to(x.dtype)(n) in promote(x, weight) (Llama, Qwen3), or with cast_after_weight
// y = to(x.dtype)(weight * n), the product in f32 (GPT-OSS), the weight plus weight_offset there (Gemma's
// (1 + weight): 1). Autograd saves x, weight and rstd
// (rms_norm_forward); autocast leaves the op alone, as it leaves HF's RMSNorm.
#include "op.h"

namespace bastile {
namespace {

constexpr const char* kOp = "rms_norm";

void check(const at::Tensor& x, const at::Tensor& w, bool cast_after_weight, double weight_offset) {
  check_float(kOp, {{"x", x}, {"weight", w}});
  TORCH_CHECK(weight_offset == 0 || cast_after_weight, "bastile.rms_norm: weight_offset ", weight_offset,
              " needs cast_after_weight=True (the offset weight multiplies in f32)");
  TORCH_CHECK(x.dim() >= 1, "bastile.rms_norm: x must have at least one dimension");
  TORCH_CHECK(w.dim() == 1 && w.sym_size(0) == x.sym_size(-1), "bastile.rms_norm: weight must have shape [",
              x.sym_size(-1), "] (the last dimension of x), got ", w.sym_sizes());
  check_device(kOp, {"x", x}, {{"weight", w}});
}

at::ScalarType out_dtype(const at::Tensor& x, const at::Tensor& w, bool cast_after_weight) {
  return cast_after_weight ? x.scalar_type() : at::promote_types(x.scalar_type(), w.scalar_type());
}

c10::SymIntArrayRef row_shape(const at::Tensor& x) { return x.sym_sizes().slice(0, x.dim() - 1); }

// y, and rstd when `with_rstd` (autograd needs it; inference does not).
std::tuple<at::Tensor, at::Tensor> run_forward(const at::Tensor& x_in, const at::Tensor& w_in, double eps,
                                               bool cast_after_weight, double weight_offset, bool with_rstd) {
  check(x_in, w_in, cast_after_weight, weight_offset);
  auto y = at::empty_symint(x_in.sym_sizes(), x_in.options().dtype(out_dtype(x_in, w_in, cast_after_weight)));
  at::Tensor rstd;
  if (with_rstd) rstd = at::empty_symint(row_shape(x_in), x_in.options().dtype(stats_dtype(x_in)));
  if (x_in.is_meta()) return {y, rstd};
  if (x_in.numel() == 0) return {y, with_rstd ? rstd.zero_() : rstd};
  const auto x = x_in.contiguous(), w = w_in.contiguous();
  launch(x, RmsNormForward{.x = x.data_ptr(), .weight = w.data_ptr(), .y = y.data_ptr(),
                           .rstd = with_rstd ? rstd.data_ptr() : nullptr, .rows = x.numel() / x.size(-1),
                           .cols = x.size(-1), .eps = eps, .x_dtype = dtype_code(kOp, {"x", x}),
                           .w_dtype = dtype_code(kOp, {"weight", w}), .y_dtype = dtype_code(kOp, {"y", y}),
                           .cast_after_weight = cast_after_weight, .weight_offset = (float)weight_offset});
  return {y, rstd};
}

struct RmsNormForwardOp {
  static constexpr const char* schema =
      "rms_norm_forward(Tensor x, Tensor weight, float eps, bool cast_after_weight=False, float weight_offset=0.0) -> "
      "(Tensor, Tensor)";

  static std::tuple<at::Tensor, at::Tensor> kernel(const at::Tensor& x, const at::Tensor& w, double eps,
                                                   bool cast_after_weight, double weight_offset) {
    return run_forward(x, w, eps, cast_after_weight, weight_offset, true);
  }
};

struct RmsNormBackwardOp {
  static constexpr const char* schema =
      "rms_norm_backward(Tensor grad_y, Tensor x, Tensor weight, Tensor rstd, bool cast_after_weight=False, "
      "float weight_offset=0.0) -> (Tensor, Tensor)";

  static std::tuple<at::Tensor, at::Tensor> kernel(const at::Tensor& grad_y_in, const at::Tensor& x_in,
                                                   const at::Tensor& w_in, const at::Tensor& rstd_in,
                                                   bool cast_after_weight, double weight_offset) {
    check(x_in, w_in, cast_after_weight, weight_offset);
    TORCH_CHECK(grad_y_in.sym_sizes() == x_in.sym_sizes(), "bastile.rms_norm_backward: grad_y has shape ",
                grad_y_in.sym_sizes(), " but x has ", x_in.sym_sizes());
    const auto y_dtype = out_dtype(x_in, w_in, cast_after_weight);
    TORCH_CHECK(grad_y_in.scalar_type() == y_dtype, "bastile.rms_norm_backward: grad_y must be ", y_dtype, ", got ",
                grad_y_in.scalar_type());
    TORCH_CHECK(rstd_in.sym_sizes() == row_shape(x_in) && rstd_in.scalar_type() == stats_dtype(x_in),
                "bastile.rms_norm_backward: rstd must be the statistics rms_norm_forward returned");
    check_device("rms_norm_backward", {"x", x_in}, {{"grad_y", grad_y_in}, {"rstd", rstd_in}});
    auto grad_x = at::empty_symint(x_in.sym_sizes(), x_in.options());
    auto grad_w = at::empty_symint(w_in.sym_sizes(), w_in.options());
    if (x_in.is_meta()) return {grad_x, grad_w};
    if (x_in.numel() == 0) return {grad_x, grad_w.zero_()};
    const auto x = x_in.contiguous(), w = w_in.contiguous(), grad_y = grad_y_in.contiguous(), rstd = rstd_in.contiguous();
    launch(x, RmsNormBackward{.grad_y = grad_y.data_ptr(), .x = x.data_ptr(), .weight = w.data_ptr(),
                              .rstd = rstd.data_ptr(), .grad_x = grad_x.data_ptr(), .grad_w = grad_w.data_ptr(),
                              .rows = x.numel() / x.size(-1), .cols = x.size(-1),
                              .x_dtype = dtype_code(kOp, {"x", x}), .w_dtype = dtype_code(kOp, {"weight", w}),
                              .y_dtype = dtype_code(kOp, {"grad_y", grad_y}),
                              .cast_after_weight = cast_after_weight, .weight_offset = (float)weight_offset});
    return {grad_x, grad_w};
  }
};

struct RmsNormOp {
  static constexpr const char* schema =
      "rms_norm(Tensor x, Tensor weight, float eps, bool cast_after_weight=False, float weight_offset=0.0) -> Tensor";

  static at::Tensor kernel(const at::Tensor& x, const at::Tensor& w, double eps, bool cast_after_weight,
                           double weight_offset) {
    return std::get<0>(run_forward(x, w, eps, cast_after_weight, weight_offset, false));
  }

  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& x, const at::Tensor& w, double eps,
                            bool cast_after_weight, double weight_offset) {
    auto [y, rstd] = call<RmsNormForwardOp>(x, w, eps, cast_after_weight, weight_offset);
    ctx->save_for_backward({x, w, rstd});
    ctx->saved_data["cast_after_weight"] = cast_after_weight;
    ctx->saved_data["weight_offset"] = weight_offset;
    return y;
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    const auto s = ctx->get_saved_variables();
    auto [grad_x, grad_w] = call<RmsNormBackwardOp>(grads[0], s[0], s[1], s[2], ctx->saved_data["cast_after_weight"].toBool(),
                                                    ctx->saved_data["weight_offset"].toDouble());
    return {grad_x, grad_w};
  }
};

}  // namespace
}  // namespace bastile

BASTILE_OPS(bastile::RmsNormOp, bastile::RmsNormForwardOp, bastile::RmsNormBackwardOp)
