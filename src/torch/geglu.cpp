// torch.ops.bastile.geglu: schemas, checks, CPU/CUDA/Meta kernels, autograd and autocast.
//
//   geglu(gate_up, alpha, limit) -> y              gate_up [..., 2I], gate at even and up at odd
//                                                  positions of the last dim; y [..., I]; differentiable
//   geglu_backward(grad_y, gate_up, alpha, limit) -> grad_gate_up [..., 2I], interleaved as gate_up
//
// Non-contiguous tensors are made contiguous (one copy) before the kernels, which read the pairs
// flat. Autograd saves only gate_up: the backward recomputes the sigmoid, so no activation is stored.
#include <ATen/autocast_mode.h>
#include <torch/autograd.h>
#include <torch/csrc/autograd/autograd_not_implemented_fallback.h>

#include "bastile/src/geglu.rs.h"
#include "common.h"
#include "geglu.h"

namespace bastile {
namespace {

constexpr const char* kOp = "geglu";

// Checks for every kernel, Meta included (hence sym_sizes).
void check_gate_up(const at::Tensor& x, const char* op) {
  dtype_code(x, op, "gate_up");
  TORCH_CHECK(x.dim() >= 1, "bastile.", op, ": gate_up must have at least one dimension");
  TORCH_CHECK(x.sym_size(-1) % 2 == 0, "bastile.", op,
              ": the last dim of gate_up interleaves gate and up, so it must be even, got shape ", x.sym_sizes());
}

// gate_up's shape with the last dim halved: y's.
std::vector<c10::SymInt> y_sizes(const at::Tensor& x) {
  auto sizes = x.sym_sizes().vec();
  sizes.back() = sizes.back() / 2;
  return sizes;
}

void check_grad_y(const at::Tensor& x, const at::Tensor& grad_y, const char* op) {
  dtype_code(grad_y, op, "grad_y");
  TORCH_CHECK(grad_y.scalar_type() == x.scalar_type(), "bastile.", op,
              ": gate_up and grad_y must have the same dtype, got ", x.scalar_type(), " and ", grad_y.scalar_type());
  TORCH_CHECK(grad_y.sym_sizes() == c10::SymIntArrayRef(y_sizes(x)), "bastile.", op,
              ": grad_y must have gate_up's shape with the last dim halved, got ", grad_y.sym_sizes(),
              " for gate_up of shape ", x.sym_sizes());
  TORCH_CHECK(grad_y.device() == x.device(), "bastile.", op, ": gate_up is on ", x.device(), " but grad_y is on ",
              grad_y.device());
}

at::Tensor geglu(const at::Tensor& x_in, double alpha, double limit) {
  check_gate_up(x_in, kOp);
  const auto x = x_in.contiguous();
  auto y = at::empty_symint(y_sizes(x), x.options());
  if (y.numel() == 0) return y;
  GegluForward p{};
  p.gate_up = x.data_ptr();
  p.y = y.data_ptr();
  p.n = y.numel();
  p.alpha = alpha;
  p.limit = limit;
  p.dtype = dtype_code(x, kOp, "gate_up");
  on_device(
      x, kOp, [&](int device, size_t stream) { rs::geglu::forward_cuda(p, device, stream); },
      [&] { rs::geglu::forward_cpu(p); });
  return y;
}

at::Tensor geglu_backward(const at::Tensor& grad_y_in, const at::Tensor& x_in, double alpha, double limit) {
  constexpr const char* op = "geglu_backward";
  check_gate_up(x_in, op);
  check_grad_y(x_in, grad_y_in, op);
  const auto grad_y = grad_y_in.contiguous();
  const auto x = x_in.contiguous();
  auto grad_x = at::empty(x.sizes(), x.options());
  if (grad_y.numel() == 0) return grad_x;
  GegluBackward p{};
  p.grad_y = grad_y.data_ptr();
  p.gate_up = x.data_ptr();
  p.grad_gate_up = grad_x.data_ptr();
  p.n = grad_y.numel();
  p.alpha = alpha;
  p.limit = limit;
  p.dtype = dtype_code(x, op, "gate_up");
  on_device(
      x, op, [&](int device, size_t stream) { rs::geglu::backward_cuda(p, device, stream); },
      [&] { rs::geglu::backward_cpu(p); });
  return grad_x;
}

// Meta kernels: shapes and dtypes only, symbolic sizes kept for torch.compile(dynamic=True).
at::Tensor geglu_meta(const at::Tensor& x, double, double) {
  check_gate_up(x, kOp);
  return at::empty_symint(y_sizes(x), x.options());
}

at::Tensor geglu_backward_meta(const at::Tensor& grad_y, const at::Tensor& x, double, double) {
  check_gate_up(x, "geglu_backward");
  check_grad_y(x, grad_y, "geglu_backward");
  return at::empty_symint(x.sym_sizes(), x.options());
}

at::Tensor call_geglu(const at::Tensor& x, double alpha, double limit) {
  static const auto op = c10::Dispatcher::singleton()
                             .findSchemaOrThrow("bastile::geglu", "")
                             .typed<at::Tensor(const at::Tensor&, double, double)>();
  return op.call(x, alpha, limit);
}

class GegluFunction : public torch::autograd::Function<GegluFunction> {
 public:
  static at::Tensor forward(torch::autograd::AutogradContext* ctx, const at::Tensor& x, double alpha, double limit) {
    const at::AutoDispatchBelowADInplaceOrView below_autograd;
    auto y = call_geglu(x, alpha, limit);
    ctx->save_for_backward({x});
    ctx->saved_data["alpha"] = alpha;
    ctx->saved_data["limit"] = limit;
    return y;
  }

  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grads) {
    static const auto op = c10::Dispatcher::singleton()
                               .findSchemaOrThrow("bastile::geglu_backward", "")
                               .typed<at::Tensor(const at::Tensor&, const at::Tensor&, double, double)>();
    if (!grads[0].defined()) return {at::Tensor(), at::Tensor(), at::Tensor()};
    const auto saved = ctx->get_saved_variables();
    const double alpha = ctx->saved_data["alpha"].toDouble(), limit = ctx->saved_data["limit"].toDouble();
    return {op.call(grads[0], saved[0], alpha, limit), at::Tensor(), at::Tensor()};
  }
};

at::Tensor geglu_autograd(const at::Tensor& x, double alpha, double limit) {
  if (at::GradMode::is_enabled() && x.requires_grad()) return GegluFunction::apply(x, alpha, limit);
  // Nothing to differentiate: nothing saved.
  const at::AutoDispatchBelowADInplaceOrView below_autograd;
  return call_geglu(x, alpha, limit);
}

// Autocast leaves geglu alone, as it leaves HF's clamps, sigmoid and products: the input's dtype stays.
at::Tensor geglu_autocast(const at::Tensor& x, double alpha, double limit) {
  const c10::impl::ExcludeDispatchKeyGuard no_autocast(c10::autocast_dispatch_keyset);
  return call_geglu(x, alpha, limit);
}

}  // namespace
}  // namespace bastile

TORCH_LIBRARY_FRAGMENT(bastile, m) {
  const std::vector<at::Tag> tags{at::Tag::pt2_compliant_tag};
  m.def("geglu(Tensor gate_up, float alpha, float limit) -> Tensor", tags);
  m.def("geglu_backward(Tensor grad_y, Tensor gate_up, float alpha, float limit) -> Tensor", tags);
}

TORCH_LIBRARY_IMPL(bastile, CPU, m) {
  m.impl("geglu", &bastile::geglu);
  m.impl("geglu_backward", &bastile::geglu_backward);
}

TORCH_LIBRARY_IMPL(bastile, CUDA, m) {
  m.impl("geglu", &bastile::geglu);
  m.impl("geglu_backward", &bastile::geglu_backward);
}

TORCH_LIBRARY_IMPL(bastile, Meta, m) {
  m.impl("geglu", &bastile::geglu_meta);
  m.impl("geglu_backward", &bastile::geglu_backward_meta);
}

TORCH_LIBRARY_IMPL(bastile, Autograd, m) {
  m.impl("geglu", &bastile::geglu_autograd);
  // Not differentiable itself: a clear error instead of a silent missing grad_fn.
  m.impl("geglu_backward", torch::autograd::autogradNotImplementedFallback());
}

TORCH_LIBRARY_IMPL(bastile, AutocastCUDA, m) { m.impl("geglu", &bastile::geglu_autocast); }
TORCH_LIBRARY_IMPL(bastile, AutocastCPU, m) { m.impl("geglu", &bastile::geglu_autocast); }
