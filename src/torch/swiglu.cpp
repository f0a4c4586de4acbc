// torch.ops.bastile.swiglu: schemas, checks, CPU/CUDA/Meta kernels, autograd and autocast.
//
//   swiglu(gate, up) -> y                                  y = silu(gate) * up; differentiable
//   swiglu_backward(grad_y, gate, up) -> (grad_gate, grad_up)
//
// Autograd saves only gate and up: the backward recomputes the sigmoid, so no activation is stored.
#include <ATen/autocast_mode.h>
#include <torch/autograd.h>
#include <torch/csrc/autograd/autograd_not_implemented_fallback.h>

#include "bastile/src/swiglu.rs.h"
#include "common.h"
#include "swiglu.h"

namespace bastile {
namespace {

constexpr const char* kOp = "swiglu";

// Checks `t` against gate (dtype, shape, device) for every kernel, Meta included (hence sym_sizes).
void check_like(const at::Tensor& gate, const at::Tensor& t, const char* op, const char* name) {
  dtype_code(t, op, name);
  TORCH_CHECK(t.scalar_type() == gate.scalar_type(), "bastile.", op, ": gate and ", name,
              " must have the same dtype, got ", gate.scalar_type(), " and ", t.scalar_type());
  TORCH_CHECK(t.sym_sizes() == gate.sym_sizes(), "bastile.", op, ": gate and ", name,
              " must have the same shape, got ", gate.sym_sizes(), " and ", t.sym_sizes());
  TORCH_CHECK(t.device() == gate.device(), "bastile.", op, ": gate is on ", gate.device(), " but ", name,
              " is on ", t.device());
}

void check_inputs(const at::Tensor& gate, const at::Tensor& up, const char* op) {
  dtype_code(gate, op, "gate");
  check_like(gate, up, op, "up");
}

at::Tensor swiglu(const at::Tensor& gate_in, const at::Tensor& up_in) {
  check_inputs(gate_in, up_in, kOp);
  const auto gate = gate_in.contiguous();
  const auto up = up_in.contiguous();
  auto y = at::empty(gate.sizes(), gate.options());
  if (gate.numel() == 0) return y;
  SwigluForward p{};
  p.gate = gate.data_ptr();
  p.up = up.data_ptr();
  p.y = y.data_ptr();
  p.n = gate.numel();
  p.dtype = dtype_code(gate, kOp, "gate");
  on_device(
      gate, kOp, [&](int device, size_t stream) { rs::swiglu::forward_cuda(p, device, stream); },
      [&] { rs::swiglu::forward_cpu(p); });
  return y;
}

std::tuple<at::Tensor, at::Tensor> swiglu_backward(const at::Tensor& grad_y_in, const at::Tensor& gate_in,
                                                   const at::Tensor& up_in) {
  constexpr const char* op = "swiglu_backward";
  check_inputs(gate_in, up_in, op);
  check_like(gate_in, grad_y_in, op, "grad_y");
  const auto grad_y = grad_y_in.contiguous();
  const auto gate = gate_in.contiguous();
  const auto up = up_in.contiguous();
  auto grad_gate = at::empty(gate.sizes(), gate.options());
  auto grad_up = at::empty(gate.sizes(), gate.options());
  if (gate.numel() == 0) return {grad_gate, grad_up};
  SwigluBackward p{};
  p.grad_y = grad_y.data_ptr();
  p.gate = gate.data_ptr();
  p.up = up.data_ptr();
  p.grad_gate = grad_gate.data_ptr();
  p.grad_up = grad_up.data_ptr();
  p.n = gate.numel();
  p.dtype = dtype_code(gate, op, "gate");
  on_device(
      gate, op, [&](int device, size_t stream) { rs::swiglu::backward_cuda(p, device, stream); },
      [&] { rs::swiglu::backward_cpu(p); });
  return {grad_gate, grad_up};
}

// Meta kernels: shapes and dtypes only, symbolic sizes kept for torch.compile(dynamic=True).
at::Tensor swiglu_meta(const at::Tensor& gate, const at::Tensor& up) {
  check_inputs(gate, up, kOp);
  return at::empty_symint(gate.sym_sizes(), gate.options());
}

std::tuple<at::Tensor, at::Tensor> swiglu_backward_meta(const at::Tensor& grad_y, const at::Tensor& gate,
                                                        const at::Tensor& up) {
  check_inputs(gate, up, "swiglu_backward");
  check_like(gate, grad_y, "swiglu_backward", "grad_y");
  return {at::empty_symint(gate.sym_sizes(), gate.options()), at::empty_symint(gate.sym_sizes(), gate.options())};
}

at::Tensor call_swiglu(const at::Tensor& gate, const at::Tensor& up) {
  static const auto op = c10::Dispatcher::singleton()
                             .findSchemaOrThrow("bastile::swiglu", "")
                             .typed<at::Tensor(const at::Tensor&, const at::Tensor&)>();
  return op.call(gate, up);
}

class SwigluFunction : public torch::autograd::Function<SwigluFunction> {
 public:
  static at::Tensor forward(torch::autograd::AutogradContext* ctx, const at::Tensor& gate, const at::Tensor& up) {
    const at::AutoDispatchBelowADInplaceOrView below_autograd;
    auto y = call_swiglu(gate, up);
    ctx->save_for_backward({gate, up});
    return y;
  }

  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grads) {
    static const auto op =
        c10::Dispatcher::singleton()
            .findSchemaOrThrow("bastile::swiglu_backward", "")
            .typed<std::tuple<at::Tensor, at::Tensor>(const at::Tensor&, const at::Tensor&, const at::Tensor&)>();
    if (!grads[0].defined()) return {at::Tensor(), at::Tensor()};
    const auto saved = ctx->get_saved_variables();
    auto [grad_gate, grad_up] = op.call(grads[0], saved[0], saved[1]);
    return {grad_gate, grad_up};
  }
};

at::Tensor swiglu_autograd(const at::Tensor& gate, const at::Tensor& up) {
  if (at::GradMode::is_enabled() && (gate.requires_grad() || up.requires_grad()))
    return SwigluFunction::apply(gate, up);
  // Nothing to differentiate: nothing saved.
  const at::AutoDispatchBelowADInplaceOrView below_autograd;
  return call_swiglu(gate, up);
}

// Autocast leaves swiglu alone, as it leaves HF's activation and product: the inputs' dtype stays.
at::Tensor swiglu_autocast(const at::Tensor& gate, const at::Tensor& up) {
  const c10::impl::ExcludeDispatchKeyGuard no_autocast(c10::autocast_dispatch_keyset);
  return call_swiglu(gate, up);
}

}  // namespace
}  // namespace bastile

TORCH_LIBRARY_FRAGMENT(bastile, m) {
  const std::vector<at::Tag> tags{at::Tag::pt2_compliant_tag};
  m.def("swiglu(Tensor gate, Tensor up) -> Tensor", tags);
  m.def("swiglu_backward(Tensor grad_y, Tensor gate, Tensor up) -> (Tensor, Tensor)", tags);
}

TORCH_LIBRARY_IMPL(bastile, CPU, m) {
  m.impl("swiglu", &bastile::swiglu);
  m.impl("swiglu_backward", &bastile::swiglu_backward);
}

TORCH_LIBRARY_IMPL(bastile, CUDA, m) {
  m.impl("swiglu", &bastile::swiglu);
  m.impl("swiglu_backward", &bastile::swiglu_backward);
}

TORCH_LIBRARY_IMPL(bastile, Meta, m) {
  m.impl("swiglu", &bastile::swiglu_meta);
  m.impl("swiglu_backward", &bastile::swiglu_backward_meta);
}

TORCH_LIBRARY_IMPL(bastile, Autograd, m) {
  m.impl("swiglu", &bastile::swiglu_autograd);
  // Not differentiable itself: a clear error instead of a silent missing grad_fn.
  m.impl("swiglu_backward", torch::autograd::autogradNotImplementedFallback());
}

TORCH_LIBRARY_IMPL(bastile, AutocastCUDA, m) { m.impl("swiglu", &bastile::swiglu_autocast); }
TORCH_LIBRARY_IMPL(bastile, AutocastCPU, m) { m.impl("swiglu", &bastile::swiglu_autocast); }
