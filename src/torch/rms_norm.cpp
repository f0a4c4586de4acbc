// torch.ops.bastile.rms_norm: schemas, checks, CPU/CUDA/Meta kernels, autograd and autocast.
//
//   rms_norm(x, weight, eps, cast_after_weight=False) -> y                 what users call; differentiable
//   rms_norm_forward(x, weight, eps, cast_after_weight=False) -> (y, rstd) what autograd saves from
//                                                                          (rstd: per-row 1/rms)
//   rms_norm_backward(grad_y, x, weight, rstd, cast_after_weight=False) -> (grad_x, grad_weight)
//
// With n = x * rstd: y = weight * to(x.dtype)(n) in promote(x, weight) (Llama, Qwen3), or with
// cast_after_weight y = to(x.dtype)(weight * n), the product in f32 (GPT-OSS).
#include <ATen/autocast_mode.h>
#include <c10/core/DeviceGuard.h>
#include <torch/autograd.h>
#include <torch/csrc/autograd/autograd_not_implemented_fallback.h>

#include "bastile/src/rms_norm.rs.h"
#include "common.h"
#include "rms_norm.h"

namespace bastile {
namespace {

constexpr const char* kOp = "rms_norm";

at::ScalarType stats_dtype(const at::Tensor& x) {
  return x.scalar_type() == at::kDouble ? at::kDouble : at::kFloat;
}

// Shape, dtype and device checks shared by every kernel, Meta included (hence the sym_ sizes).
void check_inputs(const at::Tensor& x, const at::Tensor& w) {
  dtype_code(x, kOp, "x");
  dtype_code(w, kOp, "weight");
  TORCH_CHECK(x.dim() >= 1, "bastile.rms_norm: x must have at least one dimension");
  TORCH_CHECK(w.dim() == 1 && w.sym_size(0) == x.sym_size(-1), "bastile.rms_norm: weight must have shape [",
              x.sym_size(-1), "] (the last dimension of x), got ", w.sym_sizes());
  TORCH_CHECK(w.device() == x.device(), "bastile.rms_norm: weight is on ", w.device(), " but x is on ",
              x.device());
}

at::ScalarType out_dtype(const at::Tensor& x, const at::Tensor& w, bool cast_after_weight) {
  return cast_after_weight ? x.scalar_type() : at::promote_types(x.scalar_type(), w.scalar_type());
}

c10::SymIntArrayRef row_shape(const at::Tensor& x) { return x.sym_sizes().slice(0, x.dim() - 1); }

RmsNormForward forward_params(const at::Tensor& x, const at::Tensor& w, const at::Tensor& y, void* rstd,
                              double eps, bool cast_after_weight) {
  RmsNormForward p{};
  p.x = x.data_ptr();
  p.weight = w.data_ptr();
  p.y = y.data_ptr();
  p.rstd = rstd;
  p.cols = x.size(-1);
  p.rows = x.numel() / p.cols;
  p.eps = eps;
  p.x_dtype = dtype_code(x, kOp, "x");
  p.w_dtype = dtype_code(w, kOp, "weight");
  p.y_dtype = dtype_code(y, kOp, "y");
  p.cast_after_weight = cast_after_weight;
  return p;
}

// y, and rstd when `with_rstd` (autograd needs it; inference does not).
std::tuple<at::Tensor, at::Tensor> run_forward(const at::Tensor& x_in, const at::Tensor& w_in, double eps,
                                               bool cast_after_weight, bool with_rstd) {
  check_inputs(x_in, w_in);
  const auto x = x_in.contiguous();
  const auto w = w_in.contiguous();
  auto y = at::empty(x.sizes(), x.options().dtype(out_dtype(x, w, cast_after_weight)));
  at::Tensor rstd;
  if (with_rstd) rstd = at::empty(x.sizes().slice(0, x.dim() - 1), x.options().dtype(stats_dtype(x)));
  if (x.numel() == 0) {
    if (with_rstd) rstd.zero_();
    return {y, rstd};
  }
  auto p = forward_params(x, w, y, with_rstd ? rstd.data_ptr() : nullptr, eps, cast_after_weight);
  if (x.is_cuda()) {
    const c10::DeviceGuard guard(x.device());
    call_rust([&] { rs::rms_norm::forward_cuda(p, x.device().index(), current_stream(x)); });
  } else {
    TORCH_CHECK(x.is_cpu(), "bastile.rms_norm: unsupported device ", x.device());
    call_rust([&] { rs::rms_norm::forward_cpu(p); });
  }
  return {y, rstd};
}

at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& w, double eps, bool cast_after_weight) {
  return std::get<0>(run_forward(x, w, eps, cast_after_weight, false));
}

std::tuple<at::Tensor, at::Tensor> rms_norm_forward(const at::Tensor& x, const at::Tensor& w, double eps,
                                                    bool cast_after_weight) {
  return run_forward(x, w, eps, cast_after_weight, true);
}

std::tuple<at::Tensor, at::Tensor> rms_norm_backward(const at::Tensor& grad_y_in, const at::Tensor& x_in,
                                                     const at::Tensor& w_in, const at::Tensor& rstd_in,
                                                     bool cast_after_weight) {
  check_inputs(x_in, w_in);
  TORCH_CHECK(grad_y_in.sizes() == x_in.sizes(), "bastile.rms_norm_backward: grad_y has shape ",
              grad_y_in.sizes(), " but x has ", x_in.sizes());
  const auto y_dtype = out_dtype(x_in, w_in, cast_after_weight);
  TORCH_CHECK(grad_y_in.scalar_type() == y_dtype, "bastile.rms_norm_backward: grad_y must be ", y_dtype,
              ", got ", grad_y_in.scalar_type());
  TORCH_CHECK(rstd_in.sizes() == x_in.sizes().slice(0, x_in.dim() - 1) &&
                  rstd_in.scalar_type() == stats_dtype(x_in),
              "bastile.rms_norm_backward: rstd must be the statistics rms_norm_forward returned");
  TORCH_CHECK(grad_y_in.device() == x_in.device() && rstd_in.device() == x_in.device(),
              "bastile.rms_norm_backward: all tensors must be on ", x_in.device());
  const auto x = x_in.contiguous();
  const auto w = w_in.contiguous();
  const auto grad_y = grad_y_in.contiguous();
  const auto rstd = rstd_in.contiguous();
  auto grad_x = at::empty(x.sizes(), x.options());
  auto grad_w = at::empty(w.sizes(), w.options());
  if (x.numel() == 0) return {grad_x, grad_w.zero_()};

  RmsNormBackward p{};
  p.grad_y = grad_y.data_ptr();
  p.x = x.data_ptr();
  p.weight = w.data_ptr();
  p.rstd = rstd.data_ptr();
  p.grad_x = grad_x.data_ptr();
  p.grad_w = grad_w.data_ptr();
  p.cols = x.size(-1);
  p.rows = x.numel() / p.cols;
  p.x_dtype = dtype_code(x, kOp, "x");
  p.w_dtype = dtype_code(w, kOp, "weight");
  p.y_dtype = dtype_code(grad_y, kOp, "grad_y");
  p.cast_after_weight = cast_after_weight;
  if (x.is_cuda()) {
    const c10::DeviceGuard guard(x.device());
    const int device = x.device().index();
    p.partials = call_rust([&] { return rs::rms_norm::backward_plan(p, device); });
    const auto partial = at::empty({p.partials, p.cols}, x.options().dtype(at::kFloat));
    p.partial = partial.data_ptr<float>();
    call_rust([&] { rs::rms_norm::backward_cuda(p, device, current_stream(x)); });
  } else {
    TORCH_CHECK(x.is_cpu(), "bastile.rms_norm: unsupported device ", x.device());
    call_rust([&] { rs::rms_norm::backward_cpu(p); });
  }
  return {grad_x, grad_w};
}

// Meta kernels: shapes and dtypes only, symbolic sizes kept for torch.compile(dynamic=True).
at::Tensor rms_norm_meta(const at::Tensor& x, const at::Tensor& w, double, bool cast_after_weight) {
  check_inputs(x, w);
  return at::empty_symint(x.sym_sizes(), x.options().dtype(out_dtype(x, w, cast_after_weight)));
}

std::tuple<at::Tensor, at::Tensor> rms_norm_forward_meta(const at::Tensor& x, const at::Tensor& w, double eps,
                                                         bool cast_after_weight) {
  return {rms_norm_meta(x, w, eps, cast_after_weight),
          at::empty_symint(row_shape(x), x.options().dtype(stats_dtype(x)))};
}

std::tuple<at::Tensor, at::Tensor> rms_norm_backward_meta(const at::Tensor& grad_y, const at::Tensor& x,
                                                          const at::Tensor& w, const at::Tensor&, bool) {
  check_inputs(x, w);
  return {at::empty_symint(x.sym_sizes(), x.options()), at::empty_symint(w.sym_sizes(), w.options())};
}

at::Tensor call_rms_norm(const at::Tensor& x, const at::Tensor& w, double eps, bool cast_after_weight) {
  static const auto op = c10::Dispatcher::singleton()
                             .findSchemaOrThrow("bastile::rms_norm", "")
                             .typed<at::Tensor(const at::Tensor&, const at::Tensor&, double, bool)>();
  return op.call(x, w, eps, cast_after_weight);
}

class RmsNormFunction : public torch::autograd::Function<RmsNormFunction> {
 public:
  static at::Tensor forward(torch::autograd::AutogradContext* ctx, const at::Tensor& x, const at::Tensor& w,
                            double eps, bool cast_after_weight) {
    static const auto op =
        c10::Dispatcher::singleton()
            .findSchemaOrThrow("bastile::rms_norm_forward", "")
            .typed<std::tuple<at::Tensor, at::Tensor>(const at::Tensor&, const at::Tensor&, double, bool)>();
    const at::AutoDispatchBelowADInplaceOrView below_autograd;
    auto [y, rstd] = op.call(x, w, eps, cast_after_weight);
    ctx->save_for_backward({x, w, rstd});
    ctx->saved_data["cast_after_weight"] = cast_after_weight;
    return y;
  }

  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grads) {
    static const auto op = c10::Dispatcher::singleton()
                               .findSchemaOrThrow("bastile::rms_norm_backward", "")
                               .typed<std::tuple<at::Tensor, at::Tensor>(const at::Tensor&, const at::Tensor&,
                                                                         const at::Tensor&, const at::Tensor&, bool)>();
    if (!grads[0].defined()) return {at::Tensor(), at::Tensor(), at::Tensor(), at::Tensor()};
    const auto saved = ctx->get_saved_variables();
    auto [grad_x, grad_w] =
        op.call(grads[0], saved[0], saved[1], saved[2], ctx->saved_data["cast_after_weight"].toBool());
    return {grad_x, grad_w, at::Tensor(), at::Tensor()};
  }
};

at::Tensor rms_norm_autograd(const at::Tensor& x, const at::Tensor& w, double eps, bool cast_after_weight) {
  if (at::GradMode::is_enabled() && (x.requires_grad() || w.requires_grad()))
    return RmsNormFunction::apply(x, w, eps, cast_after_weight);
  // Nothing to differentiate: skip saving statistics.
  const at::AutoDispatchBelowADInplaceOrView below_autograd;
  return call_rms_norm(x, w, eps, cast_after_weight);
}

// Autocast leaves rms_norm alone, as it leaves HF's RMSNorm: inputs keep their dtypes, statistics run
// in f32, and the result has dtype promote(x, weight) (x's with cast_after_weight).
at::Tensor rms_norm_autocast(const at::Tensor& x, const at::Tensor& w, double eps, bool cast_after_weight) {
  const c10::impl::ExcludeDispatchKeyGuard no_autocast(c10::autocast_dispatch_keyset);
  return call_rms_norm(x, w, eps, cast_after_weight);
}

}  // namespace
}  // namespace bastile

TORCH_LIBRARY_FRAGMENT(bastile, m) {
  const std::vector<at::Tag> tags{at::Tag::pt2_compliant_tag};
  m.def("rms_norm(Tensor x, Tensor weight, float eps, bool cast_after_weight=False) -> Tensor", tags);
  m.def("rms_norm_forward(Tensor x, Tensor weight, float eps, bool cast_after_weight=False) -> (Tensor, Tensor)",
        tags);
  m.def(
      "rms_norm_backward(Tensor grad_y, Tensor x, Tensor weight, Tensor rstd, bool cast_after_weight=False) -> "
      "(Tensor, Tensor)",
      tags);
}

TORCH_LIBRARY_IMPL(bastile, CPU, m) {
  m.impl("rms_norm", &bastile::rms_norm);
  m.impl("rms_norm_forward", &bastile::rms_norm_forward);
  m.impl("rms_norm_backward", &bastile::rms_norm_backward);
}

TORCH_LIBRARY_IMPL(bastile, CUDA, m) {
  m.impl("rms_norm", &bastile::rms_norm);
  m.impl("rms_norm_forward", &bastile::rms_norm_forward);
  m.impl("rms_norm_backward", &bastile::rms_norm_backward);
}

TORCH_LIBRARY_IMPL(bastile, Meta, m) {
  m.impl("rms_norm", &bastile::rms_norm_meta);
  m.impl("rms_norm_forward", &bastile::rms_norm_forward_meta);
  m.impl("rms_norm_backward", &bastile::rms_norm_backward_meta);
}

TORCH_LIBRARY_IMPL(bastile, Autograd, m) {
  m.impl("rms_norm", &bastile::rms_norm_autograd);
  // The pieces are not differentiable themselves: a clear error instead of a silent missing grad_fn.
  m.impl("rms_norm_forward", torch::autograd::autogradNotImplementedFallback());
  m.impl("rms_norm_backward", torch::autograd::autogradNotImplementedFallback());
}

TORCH_LIBRARY_IMPL(bastile, AutocastCUDA, m) { m.impl("rms_norm", &bastile::rms_norm_autocast); }
TORCH_LIBRARY_IMPL(bastile, AutocastCPU, m) { m.impl("rms_norm", &bastile::rms_norm_autocast); }
