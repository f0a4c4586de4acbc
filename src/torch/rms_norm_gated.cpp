// torch.ops.bastile.rms_norm_gated (cuda/rms_norm_gated.cu): Qwen3.5's gated RMSNorm, with n = x * rstd, rstd =
// 1 / rms(x) per row: y = to(x.dtype)(weight * to(x.dtype)(n) * silu(z)), the products in f32, of x's dtype
// whatever the weight's. z, the gate, has x's shape and dtype; a z whose rows lie one stride apart with a unit
// last stride (a slice of a fused projection) is read in place, any other is made contiguous, as x is.
// Autograd saves x, z, weight and rstd (rms_norm_gated_forward); autocast leaves the op alone, as it leaves
// HF's module.
#include <ATen/TensorUtils.h>

#include "op.h"

namespace bastile {
namespace {

void check(const char* op, const at::Tensor& x, const at::Tensor& z, const at::Tensor& w) {
  check_float(op, {{"x", x}, {"z", z}, {"weight", w}});
  TORCH_CHECK(x.dim() >= 1, "bastile.", op, ": x must have at least one dimension");
  check_same_shape(op, {"x", x}, {"z", z});
  check_same_dtype(op, {"x", x}, {"z", z});
  TORCH_CHECK(w.dim() == 1 && w.sym_size(0) == x.sym_size(-1), "bastile.", op, ": weight must have shape [",
              x.sym_size(-1), "] (the last dimension of x), got ", w.sym_sizes());
  check_device(op, {"x", x}, {{"z", z}, {"weight", w}});
}

c10::SymIntArrayRef row_shape(const at::Tensor& x) { return x.sym_sizes().slice(0, x.dim() - 1); }

// z (not empty) as [rows, cols] rows and the elements between two rows: itself where its strides allow
// that view with a unit last stride, else a contiguous copy.
std::tuple<at::Tensor, int64_t> gate_rows(const at::Tensor& z) {
  const std::array<int64_t, 2> rows{z.numel() / z.size(-1), z.size(-1)};
  const auto strides = at::detail::computeStride(z.sizes(), z.strides(), at::IntArrayRef(rows));
  if (strides && (*strides)[1] == 1) return {z, (*strides)[0]};
  return {z.contiguous(), rows[1]};
}

// y, and rstd when `with_rstd` (autograd needs it; inference does not).
std::tuple<at::Tensor, at::Tensor> run_forward(const at::Tensor& x_in, const at::Tensor& z_in, const at::Tensor& w_in,
                                               double eps, bool with_rstd) {
  constexpr const char* op = "rms_norm_gated";
  check(op, x_in, z_in, w_in);
  auto y = at::empty_symint(x_in.sym_sizes(), x_in.options());
  at::Tensor rstd;
  if (with_rstd) rstd = at::empty_symint(row_shape(x_in), x_in.options().dtype(stats_dtype(x_in)));
  if (x_in.is_meta()) return {y, rstd};
  if (x_in.numel() == 0) return {y, with_rstd ? rstd.zero_() : rstd};
  const auto x = x_in.contiguous(), w = w_in.contiguous();
  const auto [z, z_stride] = gate_rows(z_in);
  launch(x, RmsNormGatedForward{.x = x.data_ptr(), .z = z.data_ptr(), .weight = w.data_ptr(), .y = y.data_ptr(),
                                .rstd = with_rstd ? rstd.data_ptr() : nullptr, .rows = x.numel() / x.size(-1),
                                .cols = x.size(-1), .z_stride = z_stride, .eps = eps,
                                .dtype = dtype_code(op, {"x", x}), .w_dtype = dtype_code(op, {"weight", w})});
  return {y, rstd};
}

struct RmsNormGatedForwardOp {
  static constexpr const char* schema =
      "rms_norm_gated_forward(Tensor x, Tensor z, Tensor weight, float eps) -> (Tensor, Tensor)";

  static std::tuple<at::Tensor, at::Tensor> kernel(const at::Tensor& x, const at::Tensor& z, const at::Tensor& w,
                                                   double eps) {
    return run_forward(x, z, w, eps, true);
  }
};

struct RmsNormGatedBackwardOp {
  static constexpr const char* schema =
      "rms_norm_gated_backward(Tensor grad_y, Tensor x, Tensor z, Tensor weight, Tensor rstd) -> "
      "(Tensor, Tensor, Tensor)";

  static std::tuple<at::Tensor, at::Tensor, at::Tensor> kernel(const at::Tensor& grad_y_in, const at::Tensor& x_in,
                                                               const at::Tensor& z_in, const at::Tensor& w_in,
                                                               const at::Tensor& rstd_in) {
    constexpr const char* op = "rms_norm_gated_backward";
    check(op, x_in, z_in, w_in);
    check_same_shape(op, {"x", x_in}, {"grad_y", grad_y_in});
    check_same_dtype(op, {"x", x_in}, {"grad_y", grad_y_in});
    TORCH_CHECK(rstd_in.sym_sizes() == row_shape(x_in) && rstd_in.scalar_type() == stats_dtype(x_in), "bastile.", op,
                ": rstd must be the statistics rms_norm_gated_forward returned");
    check_device(op, {"x", x_in}, {{"grad_y", grad_y_in}, {"rstd", rstd_in}});
    auto grad_x = at::empty_symint(x_in.sym_sizes(), x_in.options());
    auto grad_z = at::empty_symint(x_in.sym_sizes(), x_in.options());
    auto grad_w = at::empty_symint(w_in.sym_sizes(), w_in.options());
    if (x_in.is_meta()) return {grad_x, grad_z, grad_w};
    if (x_in.numel() == 0) return {grad_x, grad_z, grad_w.zero_()};
    const auto x = x_in.contiguous(), w = w_in.contiguous(), grad_y = grad_y_in.contiguous(), rstd = rstd_in.contiguous();
    const auto [z, z_stride] = gate_rows(z_in);
    launch(x, RmsNormGatedBackward{.grad_y = grad_y.data_ptr(), .x = x.data_ptr(), .z = z.data_ptr(),
                                   .weight = w.data_ptr(), .rstd = rstd.data_ptr(), .grad_x = grad_x.data_ptr(),
                                   .grad_z = grad_z.data_ptr(), .grad_w = grad_w.data_ptr(),
                                   .rows = x.numel() / x.size(-1), .cols = x.size(-1), .z_stride = z_stride,
                                   .dtype = dtype_code(op, {"x", x}), .w_dtype = dtype_code(op, {"weight", w})});
    return {grad_x, grad_z, grad_w};
  }
};

struct RmsNormGatedOp {
  static constexpr const char* schema = "rms_norm_gated(Tensor x, Tensor z, Tensor weight, float eps) -> Tensor";

  static at::Tensor kernel(const at::Tensor& x, const at::Tensor& z, const at::Tensor& w, double eps) {
    return std::get<0>(run_forward(x, z, w, eps, false));
  }

  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& x, const at::Tensor& z, const at::Tensor& w,
                            double eps) {
    auto [y, rstd] = call<RmsNormGatedForwardOp>(x, z, w, eps);
    ctx->save_for_backward({x, z, w, rstd});
    return y;
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    const auto s = ctx->get_saved_variables();
    auto [grad_x, grad_z, grad_w] = call<RmsNormGatedBackwardOp>(grads[0], s[0], s[1], s[2], s[3]);
    return {grad_x, grad_z, grad_w};
  }
};

}  // namespace
}  // namespace bastile

BASTILE_OPS(bastile::RmsNormGatedOp, bastile::RmsNormGatedForwardOp, bastile::RmsNormGatedBackwardOp)
