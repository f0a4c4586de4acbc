// torch.ops.bastile.swiglu: y = act(gate) * up with act "silu" or "gelu_tanh" (cuda/swiglu.cu). Autograd saves
// gate and up only: the backward recomputes the activation, so none is stored. swiglu_backward(dot=True) also gives
// each row's <grad_y, y> (the experts' routing weights' gradient, with no y made again for it). Halves of one concatenated gate/up
// tensor are read where they lie, and swiglu_backward writes such a tensor's gradient whole. Autocast leaves it alone,
// as it leaves HF's activation and product.
#include "op.h"

#include <ATen/TensorUtils.h>

namespace bastile {
namespace {

// gate, up (and grad_y): one dtype, shape and device.
void check(const char* op, const at::Tensor& gate, std::initializer_list<Named> others) {
  check_float(op, {{"gate", gate}});
  check_float(op, others);
  for (const auto& t : others) {
    check_same_dtype(op, {"gate", gate}, t);
    check_same_shape(op, {"gate", gate}, t);
  }
  check_device(op, {"gate", gate}, others);
}

// gate and up as the kernels read them: rows of their last dimension `ld` elements apart where both lie so, each
// row clear of the next (the halves of a concatenated gate/up projection, no copy), else contiguous (an expanded or
// overlapping view).
struct Rows {
  at::Tensor gate, up;
  int64_t cols, ld;
};

// t's stride between rows of its last dimension, if its elements are such rows.
std::optional<int64_t> row_stride(const at::Tensor& t, int64_t rows, int64_t cols) {
  const auto strides = at::detail::computeStride(t.sizes(), t.strides(), at::DimVector{rows, cols});
  if (!strides || (cols > 1 && (*strides)[1] != 1)) return std::nullopt;
  return rows > 1 ? (*strides)[0] : cols;
}

Rows rows_of(const at::Tensor& gate, const at::Tensor& up) {
  const int64_t cols = gate.dim() ? gate.size(-1) : 1, rows = gate.numel() / cols;
  const auto ld = row_stride(gate, rows, cols);
  if (ld && ld == row_stride(up, rows, cols) && *ld >= cols) return {gate, up, cols, *ld};
  return {gate.contiguous(), up.contiguous(), cols, cols};
}

struct SwigluBackwardOp {
  static constexpr const char* schema =
      "swiglu_backward(Tensor grad_y, Tensor gate, Tensor? up, str activation=\"silu\", bool dot=False) "
      "-> (Tensor, Tensor, Tensor)";

  // Without up, gate holds gate and up concatenated on its last dim (an experts' gate_up) and the first result is
  // its gradient, the halves written where they lie (the second result is empty).
  static std::tuple<at::Tensor, at::Tensor, at::Tensor> kernel(const at::Tensor& grad_y, const at::Tensor& gate_in,
                                                               const std::optional<at::Tensor>& up_in,
                                                               c10::string_view activation, bool dot) {
    constexpr const char* op = "swiglu_backward";
    const bool joined = !up_in.has_value();
    at::Tensor gate = gate_in, up = up_in.value_or(at::Tensor());
    if (joined) {
      TORCH_CHECK(gate_in.dim() > 0 && gate_in.sym_size(-1) % 2 == 0, "bastile.", op,
                  ": without up, gate holds gate and up concatenated on its last dim, which must be even, got shape ",
                  gate_in.sym_sizes());
      const auto cols = gate_in.sym_size(-1) / 2;
      gate = gate_in.narrow_symint(-1, 0, cols);
      up = gate_in.narrow_symint(-1, cols, cols);
      TORCH_CHECK(grad_y.sym_sizes() == gate.sym_sizes(), "bastile.", op,
                  ": grad_y must have gate's shape with the last dim halved, got ", grad_y.sym_sizes(),
                  " for gate of shape ", gate_in.sym_sizes());
    }
    check(op, gate, {{"up", up}, {"grad_y", grad_y}});
    const int32_t act = gate_activation(op, activation);
    const auto dots = row_dots(op, dot, gate.sym_sizes(), gate);
    at::Tensor grad_gate, grad_up;
    std::tuple<at::Tensor, at::Tensor, at::Tensor> out;
    if (joined) {
      const auto grad = at::empty_symint(gate_in.sym_sizes(), gate.options());
      grad_gate = grad.narrow_symint(-1, 0, gate.sym_size(-1));
      grad_up = grad.narrow_symint(-1, gate.sym_size(-1), gate.sym_size(-1));
      out = {grad, at::empty({0}, gate.options()), dots};
    } else {
      grad_gate = at::empty_symint(gate.sym_sizes(), gate.options());
      grad_up = at::empty_symint(gate.sym_sizes(), gate.options());
      out = {grad_gate, grad_up, dots};
    }
    if (gate.is_meta() || gate.numel() == 0) return out;
    const auto dy = grad_y.contiguous();
    const auto r = rows_of(gate, up);
    launch(dy, SwigluBackward{.grad_y = dy.data_ptr(), .gate = r.gate.data_ptr(), .up = r.up.data_ptr(),
                              .grad_gate = grad_gate.data_ptr(), .grad_up = grad_up.data_ptr(),
                              .dot = dot ? dots.data_ptr() : nullptr, .n = dy.numel(), .cols = r.cols, .ld = r.ld,
                              .grad_ld = joined ? 2 * r.cols : r.cols, .dtype = dtype_code(op, {"gate", gate}),
                              .activation = act});
    return out;
  }
};

struct SwigluOp {
  static constexpr const char* schema = "swiglu(Tensor gate, Tensor up, str activation=\"silu\") -> Tensor";

  static at::Tensor kernel(const at::Tensor& gate, const at::Tensor& up, c10::string_view activation) {
    check("swiglu", gate, {{"up", up}});
    const int32_t act = gate_activation("swiglu", activation);
    auto y = at::empty_symint(gate.sym_sizes(), gate.options());
    if (gate.is_meta() || gate.numel() == 0) return y;
    const auto r = rows_of(gate, up);
    launch(y, SwigluForward{.gate = r.gate.data_ptr(), .up = r.up.data_ptr(), .y = y.data_ptr(), .n = y.numel(),
                            .cols = r.cols, .ld = r.ld, .dtype = dtype_code("swiglu", {"gate", gate}),
                            .activation = act});
    return y;
  }

  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& gate, const at::Tensor& up,
                            c10::string_view activation) {
    ctx->save_for_backward({gate, up});
    ctx->saved_data["activation"] = std::string(activation);
    return call<SwigluOp>(gate, up, activation);
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    const auto saved = ctx->get_saved_variables();
    auto [grad_gate, grad_up, dots] =
        call<SwigluBackwardOp>(grads[0], saved[0], saved[1], ctx->saved_data["activation"].toStringRef(), false);
    return {grad_gate, grad_up};
  }
};

}  // namespace
}  // namespace bastile

BASTILE_OPS(bastile::SwigluOp, bastile::SwigluBackwardOp)
