// torch.ops.bastile.rope: HF apply_rotary_pos_emb (cuda/rope.cu), q and k in one launch; rope_backward is
// the transposed rotation, from the gradients of q_embed and k_embed to those of q and k.
//
// q, k: [batch, heads, seq, head_dim] (unsqueeze_dim 1) or [batch, seq, heads, head_dim] (2), any strides
// with a unit last stride (HF's are transposed views, read in place); cos, sin: [seq, rot] or
// [1 or batch, seq, rot], rot <= head_dim: the first rot elements of each head rotate, the rest pass
// through (Phi-3's partial rotary); `interleaved` pairs them (2j, 2j + 1) with the tables' first half, as
// GLM-4's apply_rotary_pos_emb does, else (i, i + rot / 2) as rotate_half does. Results keep the input's
// layout where it is dense, as HF's would. Autograd saves cos and sin only; autocast leaves the op alone,
// as it leaves HF's apply_rotary_pos_emb.
#include "op.h"

namespace bastile {
namespace {

// What the checks call the operands of each op.
struct Names {
  const char* op;
  const char* q;
  const char* k;
};
constexpr Names kForward{"rope", "q", "k"};
constexpr Names kBackward{"rope_backward", "grad_q", "grad_k"};

int seq_dim(int64_t unsqueeze_dim) { return unsqueeze_dim == 1 ? 2 : 1; }
int heads_dim(int64_t unsqueeze_dim) { return unsqueeze_dim == 1 ? 1 : 2; }

void check(const Names& n, const at::Tensor& q, const at::Tensor& k, const at::Tensor& cos, const at::Tensor& sin,
           int64_t unsqueeze_dim) {
  check_float(n.op, {{n.q, q}, {n.k, k}, {"cos", cos}, {"sin", sin}});
  TORCH_CHECK(unsqueeze_dim == 1 || unsqueeze_dim == 2, "bastile.", n.op,
              ": unsqueeze_dim must be 1 (q, k of shape [batch, heads, seq, head_dim]) or 2 ([batch, seq, "
              "heads, head_dim]), got ",
              unsqueeze_dim);
  TORCH_CHECK(q.dim() == 4 && k.dim() == 4, "bastile.", n.op, ": ", n.q, " and ", n.k,
              " must be 4-D ([batch, heads, seq, head_dim] or [batch, seq, heads, head_dim]), got shapes ",
              q.sym_sizes(), " and ", k.sym_sizes());
  check_same_dtype(n.op, {n.q, q}, {n.k, k});
  check_device(n.op, {n.q, q}, {{n.k, k}, {"cos", cos}, {"sin", sin}});
  const int s = seq_dim(unsqueeze_dim);
  const c10::SymInt& dim = q.sym_size(3);
  TORCH_CHECK(k.sym_size(3) == dim && k.sym_size(0) == q.sym_size(0) && k.sym_size(s) == q.sym_size(s), "bastile.",
              n.op, ": ", n.q, " and ", n.k, " must agree in batch, seq and head_dim (dims 0, ", s,
              " and 3 for unsqueeze_dim=", unsqueeze_dim, "), got shapes ", q.sym_sizes(), " and ", k.sym_sizes());
  TORCH_CHECK(dim % 2 == 0, "bastile.", n.op, ": head_dim must be even, got ", dim);
  check_tables(n.op, cos, sin, q.sym_size(0), q.sym_size(s), dim, /*partial=*/true);
}

// An output like t: HF's elementwise result keeps a dense layout (the transposed view's), anything
// else comes out contiguous.
at::Tensor like(const at::Tensor& t, at::ScalarType dtype) {
  if (t.is_non_overlapping_and_dense()) return at::empty_like(t, t.options().dtype(dtype));
  return at::empty_symint(t.sym_sizes(), t.options().dtype(dtype));
}

// Element strides of [batch, seq, heads] (stride 0 for a size-1 dimension, which is never stepped).
RopeTensor operand(const at::Tensor& t, int64_t unsqueeze_dim) {
  const auto stride = [&](int d) { return t.size(d) == 1 ? 0 : t.stride(d); };
  return {t.data_ptr(), stride(0), stride(seq_dim(unsqueeze_dim)), stride(heads_dim(unsqueeze_dim))};
}

RopeTensor table(const at::Tensor& t) {
  const int64_t batch = t.dim() == 3 && t.size(0) > 1 ? t.stride(0) : 0;
  return {t.data_ptr(), batch, t.size(-2) == 1 ? 0 : t.stride(-2), 0};
}

// The forward (`backward` false) or its transpose; results in promote(q, cos), or q's dtype backward.
std::tuple<at::Tensor, at::Tensor> run(const Names& n, bool backward, const at::Tensor& q_in, const at::Tensor& k_in,
                                       const at::Tensor& cos_in, const at::Tensor& sin_in, int64_t unsqueeze_dim,
                                       bool interleaved) {
  check(n, q_in, k_in, cos_in, sin_in, unsqueeze_dim);
  const auto q = unit_last(q_in), k = unit_last(k_in), cos = unit_last(cos_in), sin = unit_last(sin_in);
  const auto dtype = backward ? q.scalar_type() : at::promote_types(q.scalar_type(), cos.scalar_type());
  auto q_out = like(q, dtype), k_out = like(k, dtype);
  if (q.is_meta() || (q.numel() == 0 && k.numel() == 0)) return {q_out, k_out};
  launch(q, Rope{.q = operand(q, unsqueeze_dim), .k = operand(k, unsqueeze_dim),
                 .q_out = operand(q_out, unsqueeze_dim), .k_out = operand(k_out, unsqueeze_dim), .cos = table(cos),
                 .sin = table(sin), .batch = q.size(0), .seq = q.size(seq_dim(unsqueeze_dim)),
                 .q_heads = q.size(heads_dim(unsqueeze_dim)), .k_heads = k.size(heads_dim(unsqueeze_dim)),
                 .head_dim = q.size(3), .rot = cos.size(-1), .interleaved = interleaved,
                 .in_dtype = dtype_code(n.op, {n.q, q}),
                 .cs_dtype = dtype_code(n.op, {"cos", cos}), .out_dtype = dtype_code(n.op, {"output", q_out}),
                 .backward = backward});
  return {q_out, k_out};
}

struct RopeBackwardOp {
  static constexpr const char* schema =
      "rope_backward(Tensor grad_q, Tensor grad_k, Tensor cos, Tensor sin, int unsqueeze_dim, bool interleaved=False) "
      "-> (Tensor, Tensor)";

  static std::tuple<at::Tensor, at::Tensor> kernel(const at::Tensor& grad_q, const at::Tensor& grad_k,
                                                   const at::Tensor& cos, const at::Tensor& sin, int64_t unsqueeze_dim,
                                                   bool interleaved) {
    return run(kBackward, true, grad_q, grad_k, cos, sin, unsqueeze_dim, interleaved);
  }
};

struct RopeOp {
  static constexpr const char* schema =
      "rope(Tensor q, Tensor k, Tensor cos, Tensor sin, int unsqueeze_dim=1, bool interleaved=False) "
      "-> (Tensor, Tensor)";

  static std::tuple<at::Tensor, at::Tensor> kernel(const at::Tensor& q, const at::Tensor& k, const at::Tensor& cos,
                                                   const at::Tensor& sin, int64_t unsqueeze_dim, bool interleaved) {
    return run(kForward, false, q, k, cos, sin, unsqueeze_dim, interleaved);
  }

  // cos and sin (HF computes them under no_grad).
  static constexpr size_t no_grad[] = {2, 3};

  static variable_list forward(AutogradContext* ctx, const at::Tensor& q, const at::Tensor& k, const at::Tensor& cos,
                               const at::Tensor& sin, int64_t unsqueeze_dim, bool interleaved) {
    auto [q_embed, k_embed] = call<RopeOp>(q, k, cos, sin, unsqueeze_dim, interleaved);
    ctx->save_for_backward({cos, sin});
    // As HF's: an output requires grad only if its input does.
    if (!q.requires_grad()) ctx->mark_non_differentiable({q_embed});
    if (!k.requires_grad()) ctx->mark_non_differentiable({k_embed});
    ctx->saved_data["unsqueeze_dim"] = unsqueeze_dim;
    ctx->saved_data["interleaved"] = interleaved;
    ctx->saved_data["dtype"] = static_cast<int64_t>(q.scalar_type());
    return {q_embed, k_embed};
  }

  // Gradients arrive materialised (zeros for an unused output), in the outputs' dtype.
  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    const auto saved = ctx->get_saved_variables();
    const auto dtype = static_cast<at::ScalarType>(ctx->saved_data["dtype"].toInt());
    auto [grad_q, grad_k] = call<RopeBackwardOp>(grads[0], grads[1], saved[0], saved[1],
                                                  ctx->saved_data["unsqueeze_dim"].toInt(),
                                                  ctx->saved_data["interleaved"].toBool());
    // Where cos is wider than q, q's gradient is rounded to q's dtype once, after the sum.
    return {grad_q.to(dtype), grad_k.to(dtype)};
  }
};

}  // namespace
}  // namespace bastile

BASTILE_OPS(bastile::RopeOp, bastile::RopeBackwardOp)
