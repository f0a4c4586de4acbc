// torch.ops.bastile.attention_sink (cuda/attention_sink.cu): an attention output `out` [..., heads, dim] computed
// without a sink logit per head, and its rows' log-sum-exp `lse` [..., heads], joined to the sinks: the softmax's
// normaliser gains exp(sink), so y = out * exp(lse - L) with L = logaddexp(lse, sink). attention_sink_forward also
// returns L, and attention_sink_backward the gradients of out (given lse), lse and sinks from y and L: what a
// flash kernel's forward and backward need around them (python_shim/bastile/sinks.py). L and the per-row
// gradients lie in memory as [heads, tokens], the flash kernels' log-sum-exp layout. Autograd saves y, L, the sinks
// and (where out needs a gradient) lse; autocast leaves the op alone, as it leaves HF's softmax over the sinks.
#include "op.h"

namespace bastile {
namespace {

// `rows` is [..., heads] over out [..., heads, dim] (y in the backward), in the statistics' dtype; sinks [heads].
void check(const char* op, Named out, Named rows, const at::Tensor& sinks) {
  check_float(op, {out, {"sinks", sinks}});
  TORCH_CHECK(out.t.dim() >= 2, "bastile.", op, ": ", out.name, " must be [..., heads, dim], got shape ",
              out.t.sym_sizes());
  const auto heads = out.t.sym_sizes().slice(0, out.t.dim() - 1);
  TORCH_CHECK(rows.t.sym_sizes() == heads, "bastile.", op, ": ", rows.name, " must have ", out.name,
              "'s shape without its last dim, ", heads, ", got ", rows.t.sym_sizes());
  TORCH_CHECK(rows.t.scalar_type() == stats_dtype(out.t), "bastile.", op, ": ", rows.name, " must be ",
              stats_dtype(out.t), " for ", out.name, " of ", out.t.scalar_type(), ", got ", rows.t.scalar_type());
  TORCH_CHECK(sinks.dim() == 1 && sinks.sym_size(0) == out.t.sym_size(-2), "bastile.", op,
              ": sinks must have shape [heads] = [", out.t.sym_size(-2), "], got ", sinks.sym_sizes());
  check_device(op, out, {rows, {"sinks", sinks}});
}

// A per-row tensor of out [..., heads, dim]: [..., heads], laid out in memory as [heads, tokens].
at::Tensor per_row(const at::Tensor& out) {
  const auto sizes = out.sym_sizes().slice(0, out.dim() - 1);
  std::vector<c10::SymInt> strides(sizes.size());
  c10::SymInt tokens = 1;
  for (int64_t i = (int64_t)sizes.size() - 2; i >= 0; --i) {
    strides[i] = tokens;
    tokens *= sizes[i];
  }
  strides.back() = tokens;
  return at::empty_strided_symint(sizes, strides, out.options().dtype(stats_dtype(out)));
}

// The (token, head) strides of a per-row tensor viewed as [tokens, heads] (a copy of one that cannot be).
struct Rows {
  at::Tensor t;
  std::array<int64_t, 2> strides;
  Rows(const at::Tensor& rows, int64_t tokens, int64_t heads) : t(rows.reshape({tokens, heads})) {
    strides = {t.stride(0), t.stride(1)};
  }
};

struct AttentionSinkForwardOp {
  static constexpr const char* schema = "attention_sink_forward(Tensor out, Tensor lse, Tensor sinks) -> (Tensor, Tensor)";

  static std::tuple<at::Tensor, at::Tensor> kernel(const at::Tensor& out_in, const at::Tensor& lse,
                                                   const at::Tensor& sinks) {
    constexpr const char* op = "attention_sink_forward";
    check(op, {"out", out_in}, {"lse", lse}, sinks);
    auto y = at::empty_symint(out_in.sym_sizes(), out_in.options());
    auto normaliser = per_row(out_in);
    if (out_in.is_meta() || normaliser.numel() == 0) return {y, normaliser};
    const auto out = out_in.contiguous();
    const int64_t heads = out.size(-2), tokens = normaliser.numel() / heads;
    const Rows l(lse, tokens, heads), n(normaliser, tokens, heads);
    const auto s = sinks.to(stats_dtype(out)).contiguous();
    launch(out, AttentionSinkForward{.out = out.data_ptr(), .lse = l.t.data_ptr(), .sinks = s.data_ptr(),
                                     .y = y.data_ptr(), .normaliser = normaliser.data_ptr(), .tokens = tokens,
                                     .heads = heads, .dim = out.size(-1), .lse_strides = {l.strides[0], l.strides[1]},
                                     .normaliser_strides = {n.strides[0], n.strides[1]},
                                     .dtype = dtype_code(op, {"out", out})});
    return {y, normaliser};
  }
};

struct AttentionSinkBackwardOp {
  static constexpr const char* schema =
      "attention_sink_backward(Tensor grad_y, Tensor y, Tensor normaliser, Tensor sinks, Tensor? lse=None) -> "
      "(Tensor, Tensor, Tensor)";

  // (grad_out given lse, else an empty tensor; grad_lse; grad_sinks in the sinks' dtype)
  static std::tuple<at::Tensor, at::Tensor, at::Tensor> kernel(const at::Tensor& grad_y_in, const at::Tensor& y_in,
                                                               const at::Tensor& normaliser, const at::Tensor& sinks,
                                                               const std::optional<at::Tensor>& lse) {
    constexpr const char* op = "attention_sink_backward";
    check(op, {"y", y_in}, {"normaliser", normaliser}, sinks);
    if (lse) check(op, {"y", y_in}, {"lse", *lse}, sinks);
    const bool want_out = lse.has_value();
    check_same_dtype(op, {"y", y_in}, {"grad_y", grad_y_in});
    check_same_shape(op, {"y", y_in}, {"grad_y", grad_y_in});
    check_device(op, {"y", y_in}, {{"grad_y", grad_y_in}});
    auto grad_out = want_out ? at::empty_symint(y_in.sym_sizes(), y_in.options()) : at::empty({0}, y_in.options());
    auto grad_lse = per_row(y_in);
    if (y_in.is_meta()) return {grad_out, grad_lse, at::empty_symint(sinks.sym_sizes(), sinks.options())};
    if (grad_lse.numel() == 0) return {grad_out, grad_lse, at::zeros_like(sinks)};
    const auto grad_y = grad_y_in.contiguous(), y = y_in.contiguous();
    const int64_t heads = y.size(-2), tokens = grad_lse.numel() / heads;
    const Rows n(normaliser, tokens, heads), g(grad_lse, tokens, heads), l(want_out ? *lse : normaliser, tokens, heads);
    const auto s = sinks.to(stats_dtype(y)).contiguous();
    launch(y, AttentionSinkBackward{.grad_y = grad_y.data_ptr(), .y = y.data_ptr(), .normaliser = n.t.data_ptr(),
                                    .sinks = s.data_ptr(), .lse = want_out ? l.t.data_ptr() : nullptr,
                                    .grad_out = want_out ? grad_out.data_ptr() : nullptr,
                                    .grad_lse = grad_lse.data_ptr(), .tokens = tokens, .heads = heads,
                                    .dim = y.size(-1), .normaliser_strides = {n.strides[0], n.strides[1]},
                                    .lse_strides = {l.strides[0], l.strides[1]},
                                    .grad_lse_strides = {g.strides[0], g.strides[1]},
                                    .dtype = dtype_code(op, {"y", y})});
    // A sink's logit raises every row's normaliser of its head: its gradient is minus grad_lse's sum over them.
    return {grad_out, grad_lse, g.t.sum(0).neg_().to(sinks.scalar_type())};
  }
};

struct AttentionSinkOp {
  static constexpr const char* schema = "attention_sink(Tensor out, Tensor lse, Tensor sinks) -> Tensor";

  static at::Tensor kernel(const at::Tensor& out, const at::Tensor& lse, const at::Tensor& sinks) {
    return std::get<0>(call<AttentionSinkForwardOp>(out, lse, sinks));
  }

  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& out, const at::Tensor& lse,
                            const at::Tensor& sinks) {
    auto [y, normaliser] = call<AttentionSinkForwardOp>(out, lse, sinks);
    ctx->save_for_backward({y, normaliser, sinks, out.requires_grad() ? lse : at::Tensor()});
    return y;
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    const auto s = ctx->get_saved_variables();
    const bool want_out = s[3].defined();
    auto [grad_out, grad_lse, grad_sinks] =
        call<AttentionSinkBackwardOp>(grads[0], s[0], s[1], s[2], want_out ? std::optional(s[3]) : std::nullopt);
    return {want_out ? grad_out : at::Tensor(), grad_lse, grad_sinks};
  }
};

}  // namespace
}  // namespace bastile

BASTILE_OPS(bastile::AttentionSinkOp, bastile::AttentionSinkForwardOp, bastile::AttentionSinkBackwardOp)
