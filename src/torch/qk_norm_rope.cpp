// torch.ops.bastile.qk_norm_rope: Qwen3 attention's per-head RMSNorm of q and k followed by the rotary
// embedding (cuda/qk_norm_rope.cu), differentiable in q, k and the weights (cos and sin get no gradient).
// The norm rounds as rms_norm's: Qwen3's by default, with cast_after_weight Gemma 4's (the weight multiplies
// in f32 before the cast), and with weight_offset 1 Gemma 3's (1 + weight).
//
// q: [batch, seq, q_heads, head_dim], k: [batch, seq, k_heads, head_dim] (any strides; a last-dim stride
// other than 1 costs a copy), cos/sin: [seq, head_dim], [1, seq, head_dim] or [batch, seq, head_dim].
// Outputs are contiguous [batch, seq, heads, head_dim]; HF's layout is their .transpose(1, 2). Autograd
// saves the inputs and the per-head rstd (qk_norm_rope_forward); autocast leaves the op alone, as it leaves
// HF's norms and rotary embedding.
#include "op.h"

namespace bastile {
namespace {

constexpr const char* kOp = "qk_norm_rope";

// HF's dtype of the result: promote(n, cos), n of promote(x, weight), or x's dtype with cast_after_weight.
at::ScalarType out_dtype(const at::Tensor& q, const at::Tensor& w, const at::Tensor& cos, bool cast_after_weight) {
  const auto n = cast_after_weight ? q.scalar_type() : at::promote_types(q.scalar_type(), w.scalar_type());
  return at::promote_types(n, cos.scalar_type());
}

void check(const at::Tensor& q, const at::Tensor& k, const at::Tensor& qw, const at::Tensor& kw, const at::Tensor& cos,
           const at::Tensor& sin, bool cast_after_weight, double weight_offset) {
  check_float(kOp, {{"q", q}, {"k", k}, {"q_weight", qw}, {"k_weight", kw}, {"cos", cos}, {"sin", sin}});
  TORCH_CHECK(weight_offset == 0 || cast_after_weight, "bastile.qk_norm_rope: weight_offset ", weight_offset,
              " needs cast_after_weight=True (the offset weight multiplies in f32)");
  TORCH_CHECK(q.dim() == 4 && k.dim() == 4, "bastile.qk_norm_rope: q and k must be [batch, seq, heads, head_dim], got ",
              q.sym_sizes(), " and ", k.sym_sizes());
  TORCH_CHECK(k.sym_size(0) == q.sym_size(0) && k.sym_size(1) == q.sym_size(1) && k.sym_size(3) == q.sym_size(3),
              "bastile.qk_norm_rope: q ", q.sym_sizes(), " and k ", k.sym_sizes(),
              " must agree in batch, seq and head_dim");
  const auto& d = q.sym_size(3);
  TORCH_CHECK(d % 2 == 0, "bastile.qk_norm_rope: head_dim must be even, got ", d);
  check_same_dtype(kOp, {"q", q}, {"k", k});
  TORCH_CHECK(qw.dim() == 1 && qw.sym_size(0) == d && kw.dim() == 1 && kw.sym_size(0) == d,
              "bastile.qk_norm_rope: q_weight and k_weight must have shape [", d, "] (head_dim), got ",
              qw.sym_sizes(), " and ", kw.sym_sizes());
  check_same_dtype(kOp, {"q_weight", qw}, {"k_weight", kw});
  check_tables(kOp, cos, sin, q.sym_size(0), q.sym_size(1), d);
  check_device(kOp, {"q", q}, {{"k", k}, {"q_weight", qw}, {"k_weight", kw}, {"cos", cos}, {"sin", sin}});
}

// cos/sin as [batch or 1, seq, head_dim] with unit last stride.
at::Tensor table(const at::Tensor& t) { return unit_last(t.dim() == 2 ? t.unsqueeze(0) : t); }

QkNormRopeShape shape_of(const at::Tensor& q, const at::Tensor& k, const at::Tensor& cos, const at::Tensor& sin) {
  const auto batch = [](const at::Tensor& t) { return t.size(0) == 1 ? 0 : t.stride(0); };  // one table, every row
  return {.batch = q.size(0), .seq = q.size(1), .q_heads = q.size(2), .k_heads = k.size(2), .head_dim = q.size(3),
          .q_stride = {q.stride(0), q.stride(1), q.stride(2)}, .k_stride = {k.stride(0), k.stride(1), k.stride(2)},
          .cos_stride = {batch(cos), cos.stride(1)}, .sin_stride = {batch(sin), sin.stride(1)}};
}

c10::SymIntArrayRef stats_shape(const at::Tensor& x) { return x.sym_sizes().slice(0, 3); }

using Four = std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor>;

// Outputs, and the statistics when `with_rstd` (autograd needs them; inference does not).
Four run_forward(const at::Tensor& q_in, const at::Tensor& k_in, const at::Tensor& qw_in, const at::Tensor& kw_in,
                 const at::Tensor& cos_in, const at::Tensor& sin_in, double eps, bool cast_after_weight,
                 double weight_offset, bool with_rstd) {
  check(q_in, k_in, qw_in, kw_in, cos_in, sin_in, cast_after_weight, weight_offset);
  const auto out = q_in.options().dtype(out_dtype(q_in, qw_in, cos_in, cast_after_weight));
  auto q_out = at::empty_symint(q_in.sym_sizes(), out), k_out = at::empty_symint(k_in.sym_sizes(), out);
  const auto stats = [&](const at::Tensor& x) {
    return with_rstd ? at::empty_symint(stats_shape(x), q_in.options().dtype(stats_dtype(q_in))) : at::Tensor();
  };
  auto q_rstd = stats(q_in), k_rstd = stats(k_in);
  if (q_in.is_meta() || (q_in.numel() == 0 && k_in.numel() == 0)) return {q_out, k_out, q_rstd, k_rstd};
  const auto q = unit_last(q_in), k = unit_last(k_in), qw = qw_in.contiguous(), kw = kw_in.contiguous();
  const auto cos = table(cos_in), sin = table(sin_in);
  launch(q, QkNormRopeForward{.q = q.data_ptr(), .k = k.data_ptr(), .q_weight = qw.data_ptr(),
                              .k_weight = kw.data_ptr(), .cos = cos.data_ptr(), .sin = sin.data_ptr(),
                              .q_out = q_out.data_ptr(), .k_out = k_out.data_ptr(),
                              .q_rstd = with_rstd ? q_rstd.data_ptr() : nullptr,
                              .k_rstd = with_rstd ? k_rstd.data_ptr() : nullptr, .shape = shape_of(q, k, cos, sin),
                              .eps = eps, .x_dtype = dtype_code(kOp, {"q", q}),
                              .w_dtype = dtype_code(kOp, {"q_weight", qw}),
                              .c_dtype = dtype_code(kOp, {"cos", cos}), .cast_after_weight = cast_after_weight,
                              .weight_offset = (float)weight_offset});
  return {q_out, k_out, q_rstd, k_rstd};
}

struct QkNormRopeForwardOp {
  static constexpr const char* schema =
      "qk_norm_rope_forward(Tensor q, Tensor k, Tensor q_weight, Tensor k_weight, Tensor cos, Tensor sin, "
      "float eps, bool cast_after_weight=False, float weight_offset=0.0) -> (Tensor, Tensor, Tensor, Tensor)";

  static Four kernel(const at::Tensor& q, const at::Tensor& k, const at::Tensor& qw, const at::Tensor& kw,
                     const at::Tensor& cos, const at::Tensor& sin, double eps, bool cast_after_weight,
                     double weight_offset) {
    return run_forward(q, k, qw, kw, cos, sin, eps, cast_after_weight, weight_offset, true);
  }
};

struct QkNormRopeBackwardOp {
  static constexpr const char* schema =
      "qk_norm_rope_backward(Tensor grad_q, Tensor grad_k, Tensor q, Tensor k, Tensor q_weight, Tensor k_weight, "
      "Tensor cos, Tensor sin, Tensor q_rstd, Tensor k_rstd, bool cast_after_weight=False, float weight_offset=0.0) "
      "-> (Tensor, Tensor, Tensor, Tensor)";

  static Four kernel(const at::Tensor& grad_q_in, const at::Tensor& grad_k_in, const at::Tensor& q_in,
                     const at::Tensor& k_in, const at::Tensor& qw_in, const at::Tensor& kw_in, const at::Tensor& cos_in,
                     const at::Tensor& sin_in, const at::Tensor& q_rstd_in, const at::Tensor& k_rstd_in,
                     bool cast_after_weight, double weight_offset) {
    constexpr const char* op = "qk_norm_rope_backward";
    check(q_in, k_in, qw_in, kw_in, cos_in, sin_in, cast_after_weight, weight_offset);
    TORCH_CHECK(grad_q_in.sym_sizes() == q_in.sym_sizes() && grad_k_in.sym_sizes() == k_in.sym_sizes(), "bastile.",
                op, ": grad_q ", grad_q_in.sym_sizes(), " and grad_k ", grad_k_in.sym_sizes(),
                " must have the shapes of q ", q_in.sym_sizes(), " and k ", k_in.sym_sizes());
    const auto dt = out_dtype(q_in, qw_in, cos_in, cast_after_weight);
    TORCH_CHECK(grad_q_in.scalar_type() == dt && grad_k_in.scalar_type() == dt, "bastile.", op,
                ": grad_q and grad_k must be ", dt, " (the outputs' dtype), got ", grad_q_in.scalar_type(), " and ",
                grad_k_in.scalar_type());
    TORCH_CHECK(q_rstd_in.sym_sizes() == stats_shape(q_in) && k_rstd_in.sym_sizes() == stats_shape(k_in) &&
                    q_rstd_in.scalar_type() == stats_dtype(q_in) && k_rstd_in.scalar_type() == stats_dtype(q_in),
                "bastile.", op, ": q_rstd and k_rstd must be the statistics qk_norm_rope_forward returned");
    check_device(op, {"q", q_in}, {{"grad_q", grad_q_in}, {"grad_k", grad_k_in}, {"q_rstd", q_rstd_in}, {"k_rstd", k_rstd_in}});
    auto grad_q_x = at::empty_symint(q_in.sym_sizes(), q_in.options());
    auto grad_k_x = at::empty_symint(k_in.sym_sizes(), k_in.options());
    auto grad_qw = at::empty_symint(qw_in.sym_sizes(), qw_in.options());
    auto grad_kw = at::empty_symint(kw_in.sym_sizes(), kw_in.options());
    if (q_in.is_meta()) return {grad_q_x, grad_k_x, grad_qw, grad_kw};
    if (q_in.numel() == 0 && k_in.numel() == 0) return {grad_q_x, grad_k_x, grad_qw.zero_(), grad_kw.zero_()};
    const auto q = unit_last(q_in), k = unit_last(k_in), grad_q = unit_last(grad_q_in), grad_k = unit_last(grad_k_in);
    const auto qw = qw_in.contiguous(), kw = kw_in.contiguous(), cos = table(cos_in), sin = table(sin_in);
    const auto q_rstd = q_rstd_in.contiguous(), k_rstd = k_rstd_in.contiguous();
    launch(q, QkNormRopeBackward{.grad_q = grad_q.data_ptr(), .grad_k = grad_k.data_ptr(), .q = q.data_ptr(),
                                 .k = k.data_ptr(), .q_weight = qw.data_ptr(), .k_weight = kw.data_ptr(),
                                 .cos = cos.data_ptr(), .sin = sin.data_ptr(), .q_rstd = q_rstd.data_ptr(),
                                 .k_rstd = k_rstd.data_ptr(), .grad_q_in = grad_q_x.data_ptr(),
                                 .grad_k_in = grad_k_x.data_ptr(), .grad_q_weight = grad_qw.data_ptr(),
                                 .grad_k_weight = grad_kw.data_ptr(),
                                 .grad_q_stride = {grad_q.stride(0), grad_q.stride(1), grad_q.stride(2)},
                                 .grad_k_stride = {grad_k.stride(0), grad_k.stride(1), grad_k.stride(2)},
                                 .shape = shape_of(q, k, cos, sin), .x_dtype = dtype_code(kOp, {"q", q}),
                                 .w_dtype = dtype_code(kOp, {"q_weight", qw}), .c_dtype = dtype_code(kOp, {"cos", cos}),
                                 .cast_after_weight = cast_after_weight, .weight_offset = (float)weight_offset});
    return {grad_q_x, grad_k_x, grad_qw, grad_kw};
  }
};

struct QkNormRopeOp {
  static constexpr const char* schema =
      "qk_norm_rope(Tensor q, Tensor k, Tensor q_weight, Tensor k_weight, Tensor cos, Tensor sin, float eps, "
      "bool cast_after_weight=False, float weight_offset=0.0) -> (Tensor, Tensor)";

  static std::tuple<at::Tensor, at::Tensor> kernel(const at::Tensor& q, const at::Tensor& k, const at::Tensor& qw,
                                                   const at::Tensor& kw, const at::Tensor& cos, const at::Tensor& sin,
                                                   double eps, bool cast_after_weight, double weight_offset) {
    auto [q_out, k_out, q_rstd, k_rstd] = run_forward(q, k, qw, kw, cos, sin, eps, cast_after_weight, weight_offset, false);
    return {q_out, k_out};
  }

  // cos and sin (HF computes them under no_grad).
  static constexpr size_t no_grad[] = {4, 5};

  static variable_list forward(AutogradContext* ctx, const at::Tensor& q, const at::Tensor& k, const at::Tensor& qw,
                               const at::Tensor& kw, const at::Tensor& cos, const at::Tensor& sin, double eps,
                               bool cast_after_weight, double weight_offset) {
    auto [q_out, k_out, q_rstd, k_rstd] =
        call<QkNormRopeForwardOp>(q, k, qw, kw, cos, sin, eps, cast_after_weight, weight_offset);
    ctx->save_for_backward({q, k, qw, kw, cos, sin, q_rstd, k_rstd});
    ctx->saved_data["cast_after_weight"] = cast_after_weight;
    ctx->saved_data["weight_offset"] = weight_offset;
    // As HF's: an output requires grad only if its own inputs do, so that a frozen side costs nothing
    // downstream.
    if (!q.requires_grad() && !qw.requires_grad()) ctx->mark_non_differentiable({q_out});
    if (!k.requires_grad() && !kw.requires_grad()) ctx->mark_non_differentiable({k_out});
    return {q_out, k_out};
  }

  // Gradients arrive materialised (zeros for an unused output). A side none of whose inputs needs a
  // gradient goes in with no heads: no rows to differentiate.
  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    const auto s = ctx->get_saved_variables();
    const bool q_side = ctx->needs_input_grad(0) || ctx->needs_input_grad(2);
    const bool k_side = ctx->needs_input_grad(1) || ctx->needs_input_grad(3);
    const auto q = [&](const at::Tensor& t) { return q_side ? t : t.narrow(2, 0, 0); };
    const auto k = [&](const at::Tensor& t) { return k_side ? t : t.narrow(2, 0, 0); };
    auto [gq, gk, gqw, gkw] = call<QkNormRopeBackwardOp>(q(grads[0]), k(grads[1]), q(s[0]), k(s[1]), s[2], s[3], s[4],
                                                         s[5], q(s[6]), k(s[7]),
                                                         ctx->saved_data["cast_after_weight"].toBool(),
                                                         ctx->saved_data["weight_offset"].toDouble());
    if (!q_side) gq = gqw = at::Tensor();
    if (!k_side) gk = gkw = at::Tensor();
    return {gq, gk, gqw, gkw};
  }
};

}  // namespace
}  // namespace bastile

BASTILE_OPS(bastile::QkNormRopeOp, bastile::QkNormRopeForwardOp, bastile::QkNormRopeBackwardOp)
