// torch.ops.bastile.geglu: GPT-OSS's clamped GLU (cuda/geglu.cu) of gate_up [..., 2I], gate at even and up
// at odd positions of the last dim, into y [..., I]. The kernels read the pairs flat, so a non-contiguous
// gate_up is made contiguous first. Autograd saves only gate_up: the backward recomputes the sigmoid.
// Autocast leaves it alone, as it leaves HF's clamps, sigmoid and products. Its gradient at the clamps' bounds
// follows the running torch's clamp (clamp_passes_at_bounds).
#include <cmath>

#include "op.h"

namespace bastile {
namespace {

// gate_up's shape with the last dim halved: y's.
std::vector<c10::SymInt> y_sizes(const at::Tensor& x) {
  auto sizes = x.sym_sizes().vec();
  sizes.back() = sizes.back() / 2;
  return sizes;
}

void check(const char* op, const at::Tensor& x, double limit) {
  check_float(op, {{"gate_up", x}});
  TORCH_CHECK(x.dim() >= 1, "bastile.", op, ": gate_up must have at least one dimension");
  TORCH_CHECK(x.sym_size(-1) % 2 == 0, "bastile.", op,
              ": the last dim of gate_up interleaves gate and up, so it must be even, got shape ", x.sym_sizes());
  TORCH_CHECK(!std::isnan(limit), "bastile.", op,
              ": limit is NaN, with which HF's clamp of up makes every output NaN; inf clamps nothing");
}

// Whether the running torch's clamp passes the gradient at its bounds themselves (through 2.11) or stops it
// there too (newer releases, pytorch/pytorch#184574: the minimum-norm subgradient). The op's gradient is that
// of HF's expression under the torch it runs in, so torch's autograd is asked, once, outside whatever mode
// (tracing, inference, no_grad, below autograd) the first call runs in.
bool clamp_passes_at_bounds() {
  static const bool passes = [] {
    const c10::impl::ForceDispatchKeyGuard plain(c10::default_included_set, c10::default_excluded_set);
    const c10::InferenceMode not_inference(false);
    const at::AutoGradMode grad(true);
    const auto x = at::ones({1}, at::kDouble).requires_grad_();
    return torch::autograd::grad({x.clamp_max(1.0)}, {x})[0].item<double>() == 1.0;
  }();
  return passes;
}

struct GegluBackwardOp {
  static constexpr const char* schema = "geglu_backward(Tensor grad_y, Tensor gate_up, float alpha, float limit) -> Tensor";

  static at::Tensor kernel(const at::Tensor& grad_y, const at::Tensor& gate_up, double alpha, double limit) {
    constexpr const char* op = "geglu_backward";
    check(op, gate_up, limit);
    check_float(op, {{"grad_y", grad_y}});
    check_same_dtype(op, {"gate_up", gate_up}, {"grad_y", grad_y});
    TORCH_CHECK(grad_y.sym_sizes() == c10::SymIntArrayRef(y_sizes(gate_up)), "bastile.", op,
                ": grad_y must have gate_up's shape with the last dim halved, got ", grad_y.sym_sizes(),
                " for gate_up of shape ", gate_up.sym_sizes());
    check_device(op, {"gate_up", gate_up}, {{"grad_y", grad_y}});
    auto grad_gate_up = at::empty_symint(gate_up.sym_sizes(), gate_up.options());
    if (gate_up.is_meta() || grad_y.numel() == 0) return grad_gate_up;
    const auto dy = grad_y.contiguous(), x = gate_up.contiguous();
    launch(x, GegluBackward{.grad_y = dy.data_ptr(), .gate_up = x.data_ptr(), .grad_gate_up = grad_gate_up.data_ptr(),
                            .n = dy.numel(), .alpha = alpha, .limit = limit,
                            .dtype = dtype_code(op, {"gate_up", x}), .at_limit = clamp_passes_at_bounds()});
    return grad_gate_up;
  }
};

struct GegluOp {
  static constexpr const char* schema = "geglu(Tensor gate_up, float alpha, float limit) -> Tensor";

  static at::Tensor kernel(const at::Tensor& gate_up, double alpha, double limit) {
    check("geglu", gate_up, limit);
    auto y = at::empty_symint(y_sizes(gate_up), gate_up.options());
    if (gate_up.is_meta() || y.numel() == 0) return y;
    const auto x = gate_up.contiguous();
    launch(x, GegluForward{.gate_up = x.data_ptr(), .y = y.data_ptr(), .n = y.numel(), .alpha = alpha, .limit = limit,
                           .dtype = dtype_code("geglu", {"gate_up", x})});
    return y;
  }

  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& gate_up, double alpha, double limit) {
    ctx->save_for_backward({gate_up});
    ctx->saved_data["alpha"] = alpha;
    ctx->saved_data["limit"] = limit;
    return call<GegluOp>(gate_up, alpha, limit);
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    const auto alpha = ctx->saved_data["alpha"].toDouble(), limit = ctx->saved_data["limit"].toDouble();
    return {call<GegluBackwardOp>(grads[0], ctx->get_saved_variables()[0], alpha, limit)};
  }
};

}  // namespace
}  // namespace bastile

BASTILE_OPS(bastile::GegluOp, bastile::GegluBackwardOp)
