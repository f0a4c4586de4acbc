// torch.ops.bastile.causal_conv1d: Qwen3.5's depthwise causal conv with SiLU (cuda/causal_conv1d.cu), HF's
// causal_conv1d_fn(x.transpose(1, 2), weight, bias, "silu").transpose(1, 2) without the transposes. x: [batch,
// seq, channels], any strides with a unit channel stride (in_proj's output as it is); weight: [channels,
// width] (nn.Conv1d's [channels, 1, width] squeezed), 1 <= width <= 4; bias: [channels] in weight's dtype,
// which may differ from x's. cu_seqlens (int32 or int64, [sequences + 1]) packs sequences into one row, each
// conv restarting at its start; the CUDA kernels read it on the device with no host sync, the CPU kernel
// has it checked. y: x's shape and dtype, contiguous. Autograd saves only the inputs: the backward
// recomputes the conv. Autocast leaves the op alone: its math is f32 whatever the dtypes.
#include "op.h"

namespace bastile {
namespace {

bool has(const std::optional<at::Tensor>& t) { return t.has_value() && t->defined(); }

// On the CPU, that cu_seqlens runs from 0 to seq without decreasing (CUDA clamps instead: see the header).
void check_offsets(const char* op, const at::Tensor& cu_in, int64_t seq) {
  const auto cu = cu_in.to(at::kLong).contiguous();
  const int64_t* o = cu.const_data_ptr<int64_t>();
  const int64_t n = cu.numel();
  TORCH_CHECK(o[0] == 0 && o[n - 1] == seq, "bastile.", op, ": cu_seqlens must start at 0 and end at seq = ", seq,
              " (x's dim 1), got ", o[0], " and ", o[n - 1]);
  for (int64_t i = 1; i < n; ++i)
    TORCH_CHECK(o[i - 1] <= o[i], "bastile.", op, ": cu_seqlens must not decrease, got ", o[i - 1], " then ", o[i],
                " at index ", i);
}

void check(const char* op, const at::Tensor& x, const at::Tensor& w, const std::optional<at::Tensor>& bias,
           const std::optional<at::Tensor>& cu) {
  check_float(op, {{"x", x}, {"weight", w}});
  TORCH_CHECK(x.dim() == 3, "bastile.", op, ": x must have shape [batch, seq, channels], got ", x.sym_sizes());
  TORCH_CHECK(w.dim() == 2 && w.sym_size(0) == x.sym_size(2), "bastile.", op,
              ": weight must have shape [channels, width] with channels = ", x.sym_size(2), " (x's last dim), got ",
              w.sym_sizes());
  TORCH_CHECK(w.sym_size(1) >= 1 && w.sym_size(1) <= CAUSAL_CONV1D_MAX_WIDTH, "bastile.", op,
              ": weight's width (its last dim) must be 1 to ", CAUSAL_CONV1D_MAX_WIDTH, ", got ", w.sym_size(1));
  check_device(op, {"x", x}, {{"weight", w}});
  if (has(bias)) {
    check_same_dtype(op, {"weight", w}, {"bias", *bias});
    TORCH_CHECK(bias->dim() == 1 && bias->sym_size(0) == x.sym_size(2), "bastile.", op, ": bias must have shape [",
                x.sym_size(2), "] (x's last dim), got ", bias->sym_sizes());
    check_device(op, {"x", x}, {{"bias", *bias}});
  }
  if (has(cu)) {
    TORCH_CHECK(cu->scalar_type() == at::kInt || cu->scalar_type() == at::kLong, "bastile.", op,
                ": cu_seqlens must be int32 or int64, got ", cu->scalar_type());
    TORCH_CHECK(cu->dim() == 1 && cu->sym_size(0) >= 1, "bastile.", op,
                ": cu_seqlens must have shape [sequences + 1], got ", cu->sym_sizes());
    TORCH_CHECK(x.sym_size(0) == 1, "bastile.", op,
                ": with cu_seqlens, x holds the packed sequences in one row: batch must be 1, got ", x.sym_size(0));
    check_device(op, {"x", x}, {{"cu_seqlens", *cu}});
    if (cu->is_cpu()) check_offsets(op, *cu, x.size(1));
  }
}

// The inputs as the kernels read them: x with a unit channel stride, the others contiguous.
struct Inputs {
  at::Tensor x, w, bias, cu;

  Inputs(const at::Tensor& x_in, const at::Tensor& w_in, const std::optional<at::Tensor>& bias_in,
         const std::optional<at::Tensor>& cu_in)
      : x(unit_last(x_in)),
        w(w_in.contiguous()),
        bias(has(bias_in) ? bias_in->contiguous() : at::Tensor()),
        cu(has(cu_in) ? cu_in->contiguous() : at::Tensor()) {}

  CausalConv1dInputs block(const char* op, bool silu) const {
    return {.x = x.data_ptr(), .weight = w.data_ptr(), .bias = bias.defined() ? bias.data_ptr() : nullptr,
            .cu_seqlens = cu.defined() ? cu.data_ptr() : nullptr, .batch = x.size(0), .seq = x.size(1),
            .channels = x.size(2), .x_batch_stride = x.stride(0), .x_seq_stride = x.stride(1),
            .sequences = cu.defined() ? cu.numel() - 1 : 0, .width = (int32_t)w.size(1), .silu = silu,
            .x_dtype = dtype_code(op, {"x", x}), .w_dtype = dtype_code(op, {"weight", w}),
            .cu_int64 = cu.defined() && cu.scalar_type() == at::kLong};
  }
};

std::optional<at::Tensor> given(const at::Tensor& t) { return t.defined() ? std::optional(t) : std::nullopt; }

struct CausalConv1dBackwardOp {
  static constexpr const char* schema =
      "causal_conv1d_backward(Tensor grad_y, Tensor x, Tensor weight, Tensor? bias=None, Tensor? cu_seqlens=None, "
      "bool silu=True) -> (Tensor, Tensor, Tensor)";

  // (grad_x, grad_weight, grad_bias): grad_bias, [channels] in weight's dtype, whether or not there is a bias.
  static std::tuple<at::Tensor, at::Tensor, at::Tensor> kernel(const at::Tensor& grad_y, const at::Tensor& x,
                                                               const at::Tensor& w,
                                                               const std::optional<at::Tensor>& bias,
                                                               const std::optional<at::Tensor>& cu, bool silu) {
    constexpr const char* op = "causal_conv1d_backward";
    check(op, x, w, bias, cu);
    check_float(op, {{"grad_y", grad_y}});
    check_same_dtype(op, {"x", x}, {"grad_y", grad_y});
    check_same_shape(op, {"x", x}, {"grad_y", grad_y});
    check_device(op, {"x", x}, {{"grad_y", grad_y}});
    auto grad_x = at::empty_symint(x.sym_sizes(), x.options());
    auto grad_w = at::empty_symint(w.sym_sizes(), w.options());
    auto grad_b = at::empty_symint(w.sym_sizes().slice(0, 1), w.options());
    if (x.is_meta()) return {grad_x, grad_w, grad_b};
    if (x.numel() == 0) return {grad_x, grad_w.zero_(), grad_b.zero_()};
    const Inputs in(x, w, bias, cu);
    const auto dy = unit_last(grad_y);
    launch(in.x, CausalConv1dBackward{.inputs = in.block(op, silu), .grad_y = dy.data_ptr(),
                                      .grad_y_batch_stride = dy.stride(0), .grad_y_seq_stride = dy.stride(1),
                                      .grad_x = grad_x.data_ptr(), .grad_weight = grad_w.data_ptr(),
                                      .grad_bias = grad_b.data_ptr()});
    return {grad_x, grad_w, grad_b};
  }
};

struct CausalConv1dOp {
  static constexpr const char* schema =
      "causal_conv1d(Tensor x, Tensor weight, Tensor? bias=None, Tensor? cu_seqlens=None, bool silu=True) -> Tensor";

  static at::Tensor kernel(const at::Tensor& x, const at::Tensor& w, const std::optional<at::Tensor>& bias,
                           const std::optional<at::Tensor>& cu, bool silu) {
    constexpr const char* op = "causal_conv1d";
    check(op, x, w, bias, cu);
    auto y = at::empty_symint(x.sym_sizes(), x.options());
    if (x.is_meta() || y.numel() == 0) return y;
    const Inputs in(x, w, bias, cu);
    launch(in.x, CausalConv1dForward{.inputs = in.block(op, silu), .y = y.data_ptr()});
    return y;
  }

  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& x, const at::Tensor& w,
                            const std::optional<at::Tensor>& bias, const std::optional<at::Tensor>& cu, bool silu) {
    ctx->save_for_backward({x, w, has(bias) ? *bias : at::Tensor(), has(cu) ? *cu : at::Tensor()});
    ctx->saved_data["silu"] = silu;
    return call<CausalConv1dOp>(x, w, bias, cu, silu);
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    const auto s = ctx->get_saved_variables();
    auto [grad_x, grad_w, grad_b] = call<CausalConv1dBackwardOp>(grads[0], s[0], s[1], given(s[2]), given(s[3]),
                                                                 ctx->saved_data["silu"].toBool());
    return {grad_x, grad_w, s[2].defined() ? grad_b : at::Tensor()};
  }
};

}  // namespace
}  // namespace bastile

BASTILE_OPS(bastile::CausalConv1dOp, bastile::CausalConv1dBackwardOp)
