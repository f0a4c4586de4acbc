// torch.ops.bastile.rope: schemas, checks, CPU/CUDA/Meta kernels, autograd and autocast.
//
//   rope(q, k, cos, sin, unsqueeze_dim=1) -> (q_embed, k_embed)    HF apply_rotary_pos_emb; differentiable
//   rope_backward(grad_q, grad_k, cos, sin, unsqueeze_dim) -> gradients of q and k, given those of
//                 q_embed and k_embed (the transposed rotation)
//
// q, k: [batch, heads, seq, head_dim] (unsqueeze_dim 1) or [batch, seq, heads, head_dim] (2), any strides
// with a unit last stride (HF's are transposed views, read in place); cos, sin: [seq, head_dim] or
// [1 or batch, seq, head_dim]. Results keep the input's layout where it is dense, as HF's would.
#include <ATen/autocast_mode.h>
#include <c10/core/DeviceGuard.h>
#include <torch/autograd.h>
#include <torch/csrc/autograd/autograd_not_implemented_fallback.h>

#include "bastile/src/rope.rs.h"
#include "common.h"
#include "rope.h"

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

// Shape, dtype and device checks shared by every kernel, Meta included (hence the sym_ sizes).
void check_inputs(const Names& n, const at::Tensor& q, const at::Tensor& k, const at::Tensor& cos,
                  const at::Tensor& sin, int64_t unsqueeze_dim) {
  dtype_code(q, n.op, n.q);
  dtype_code(k, n.op, n.k);
  dtype_code(cos, n.op, "cos");
  dtype_code(sin, n.op, "sin");
  TORCH_CHECK(unsqueeze_dim == 1 || unsqueeze_dim == 2, "bastile.", n.op,
              ": unsqueeze_dim must be 1 (q, k of shape [batch, heads, seq, head_dim]) or 2 ([batch, seq, "
              "heads, head_dim]), got ",
              unsqueeze_dim);
  TORCH_CHECK(q.dim() == 4 && k.dim() == 4, "bastile.", n.op, ": ", n.q, " and ", n.k,
              " must be 4-D ([batch, heads, seq, head_dim] or [batch, seq, heads, head_dim]), got shapes ",
              q.sym_sizes(), " and ", k.sym_sizes());
  TORCH_CHECK(q.scalar_type() == k.scalar_type(), "bastile.", n.op, ": ", n.q, " and ", n.k,
              " must have one dtype, got ", q.scalar_type(), " and ", k.scalar_type());
  TORCH_CHECK(cos.scalar_type() == sin.scalar_type(), "bastile.", n.op,
              ": cos and sin must have one dtype, got ", cos.scalar_type(), " and ", sin.scalar_type());
  TORCH_CHECK(k.device() == q.device() && cos.device() == q.device() && sin.device() == q.device(), "bastile.",
              n.op, ": all tensors must be on one device, got ", n.q, " on ", q.device(), ", ", n.k, " on ",
              k.device(), ", cos on ", cos.device(), ", sin on ", sin.device());
  const int s = seq_dim(unsqueeze_dim);
  const c10::SymInt& dim = q.sym_size(3);
  TORCH_CHECK(k.sym_size(3) == dim && k.sym_size(0) == q.sym_size(0) && k.sym_size(s) == q.sym_size(s), "bastile.",
              n.op, ": ", n.q, " and ", n.k, " must agree in batch, seq and head_dim (dims 0, ", s,
              " and 3 for unsqueeze_dim=", unsqueeze_dim, "), got shapes ", q.sym_sizes(), " and ", k.sym_sizes());
  TORCH_CHECK(dim % 2 == 0, "bastile.", n.op, ": head_dim must be even, got ", dim);
  TORCH_CHECK(cos.sym_sizes() == sin.sym_sizes(), "bastile.", n.op, ": cos and sin must have one shape, got ",
              cos.sym_sizes(), " and ", sin.sym_sizes());
  TORCH_CHECK((cos.dim() == 2 || cos.dim() == 3) && cos.sym_size(-1) == dim && cos.sym_size(-2) == q.sym_size(s) &&
                  (cos.dim() == 2 || cos.sym_size(0) == 1 || cos.sym_size(0) == q.sym_size(0)),
              "bastile.", n.op, ": cos and sin must have shape [seq, head_dim], [1, seq, head_dim] or [batch, seq, "
              "head_dim] with batch, seq, head_dim = ",
              q.sym_size(0), ", ", q.sym_size(s), ", ", dim, " (from ", n.q, " of shape ", q.sym_sizes(),
              ", unsqueeze_dim=", unsqueeze_dim, "), got ", cos.sym_sizes());
}

// The kernels read rows in place; only a strided last dimension is copied.
at::Tensor unit_stride(const at::Tensor& t) { return t.sym_stride(-1) == 1 ? t : t.contiguous(); }

// An output like t: HF's elementwise result keeps a dense layout (the transposed view's), anything
// else comes out contiguous.
at::Tensor like(const at::Tensor& t, at::ScalarType dtype) {
  if (t.is_non_overlapping_and_dense()) return at::empty_like(t, t.options().dtype(dtype));
  return at::empty_symint(t.sym_sizes(), t.options().dtype(dtype));
}

at::ScalarType out_dtype(bool backward, const at::Tensor& q, const at::Tensor& cos) {
  return backward ? q.scalar_type() : at::promote_types(q.scalar_type(), cos.scalar_type());
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

// The forward (`backward` false) or its transpose, as a CPU or CUDA kernel.
std::tuple<at::Tensor, at::Tensor> run(const Names& n, bool backward, const at::Tensor& q_in,
                                       const at::Tensor& k_in, const at::Tensor& cos_in, const at::Tensor& sin_in,
                                       int64_t unsqueeze_dim) {
  check_inputs(n, q_in, k_in, cos_in, sin_in, unsqueeze_dim);
  const auto q = unit_stride(q_in), k = unit_stride(k_in), cos = unit_stride(cos_in), sin = unit_stride(sin_in);
  const auto dtype = out_dtype(backward, q, cos);
  auto q_out = like(q, dtype), k_out = like(k, dtype);
  if (q.numel() == 0 && k.numel() == 0) return {q_out, k_out};

  Rope p{};
  p.q = operand(q, unsqueeze_dim);
  p.k = operand(k, unsqueeze_dim);
  p.q_out = operand(q_out, unsqueeze_dim);
  p.k_out = operand(k_out, unsqueeze_dim);
  p.cos = table(cos);
  p.sin = table(sin);
  p.batch = q.size(0);
  p.seq = q.size(seq_dim(unsqueeze_dim));
  p.q_heads = q.size(heads_dim(unsqueeze_dim));
  p.k_heads = k.size(heads_dim(unsqueeze_dim));
  p.head_dim = q.size(3);
  p.in_dtype = dtype_code(q, n.op, n.q);
  p.cs_dtype = dtype_code(cos, n.op, "cos");
  p.out_dtype = dtype_code(q_out, n.op, "output");
  if (q.is_cuda()) {
    const c10::DeviceGuard guard(q.device());
    call_rust([&] { rs::rope::run_cuda(p, backward, q.device().index(), current_stream(q)); });
  } else {
    TORCH_CHECK(q.is_cpu(), "bastile.", n.op, ": unsupported device ", q.device());
    call_rust([&] { rs::rope::run_cpu(p, backward); });
  }
  return {q_out, k_out};
}

std::tuple<at::Tensor, at::Tensor> rope(const at::Tensor& q, const at::Tensor& k, const at::Tensor& cos,
                                        const at::Tensor& sin, int64_t unsqueeze_dim) {
  return run(kForward, false, q, k, cos, sin, unsqueeze_dim);
}

std::tuple<at::Tensor, at::Tensor> rope_backward(const at::Tensor& grad_q, const at::Tensor& grad_k,
                                                 const at::Tensor& cos, const at::Tensor& sin, int64_t unsqueeze_dim) {
  return run(kBackward, true, grad_q, grad_k, cos, sin, unsqueeze_dim);
}

// Meta kernels: shapes, dtypes and the layouts the real kernels produce; symbolic sizes kept for
// torch.compile(dynamic=True).
std::tuple<at::Tensor, at::Tensor> meta(const Names& n, bool backward, const at::Tensor& q, const at::Tensor& k,
                                        const at::Tensor& cos, const at::Tensor& sin, int64_t unsqueeze_dim) {
  check_inputs(n, q, k, cos, sin, unsqueeze_dim);
  const auto dtype = out_dtype(backward, q, cos);
  return {like(unit_stride(q), dtype), like(unit_stride(k), dtype)};
}

std::tuple<at::Tensor, at::Tensor> rope_meta(const at::Tensor& q, const at::Tensor& k, const at::Tensor& cos,
                                             const at::Tensor& sin, int64_t unsqueeze_dim) {
  return meta(kForward, false, q, k, cos, sin, unsqueeze_dim);
}

std::tuple<at::Tensor, at::Tensor> rope_backward_meta(const at::Tensor& grad_q, const at::Tensor& grad_k,
                                                      const at::Tensor& cos, const at::Tensor& sin,
                                                      int64_t unsqueeze_dim) {
  return meta(kBackward, true, grad_q, grad_k, cos, sin, unsqueeze_dim);
}

using Pair = std::tuple<at::Tensor, at::Tensor>;
using Signature = Pair(const at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&, int64_t);

Pair call_rope(const at::Tensor& q, const at::Tensor& k, const at::Tensor& cos, const at::Tensor& sin,
               int64_t unsqueeze_dim) {
  static const auto op = c10::Dispatcher::singleton().findSchemaOrThrow("bastile::rope", "").typed<Signature>();
  return op.call(q, k, cos, sin, unsqueeze_dim);
}

// Saves cos and sin only: the backward is the transposed rotation and needs neither q nor k.
class RopeFunction : public torch::autograd::Function<RopeFunction> {
 public:
  static torch::autograd::variable_list forward(torch::autograd::AutogradContext* ctx, const at::Tensor& q,
                                                const at::Tensor& k, const at::Tensor& cos, const at::Tensor& sin,
                                                int64_t unsqueeze_dim) {
    const at::AutoDispatchBelowADInplaceOrView below_autograd;
    auto [q_embed, k_embed] = call_rope(q, k, cos, sin, unsqueeze_dim);
    ctx->save_for_backward({cos, sin});
    // As HF's: an output requires grad only if its input does.
    if (!q.requires_grad()) ctx->mark_non_differentiable({q_embed});
    if (!k.requires_grad()) ctx->mark_non_differentiable({k_embed});
    ctx->saved_data["unsqueeze_dim"] = unsqueeze_dim;
    ctx->saved_data["dtype"] = static_cast<int64_t>(q.scalar_type());
    return {q_embed, k_embed};
  }

  // Gradients arrive materialised (zeros for an unused output), in the outputs' dtype.
  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grads) {
    static const auto op =
        c10::Dispatcher::singleton().findSchemaOrThrow("bastile::rope_backward", "").typed<Signature>();
    const auto saved = ctx->get_saved_variables();
    const auto unsqueeze_dim = ctx->saved_data["unsqueeze_dim"].toInt();
    const auto dtype = static_cast<at::ScalarType>(ctx->saved_data["dtype"].toInt());
    auto [grad_q, grad_k] = op.call(grads[0], grads[1], saved[0], saved[1], unsqueeze_dim);
    // Where cos is wider than q, q's gradient is rounded to q's dtype once, after the sum.
    return {grad_q.to(dtype), grad_k.to(dtype), at::Tensor(), at::Tensor(), at::Tensor()};
  }
};

Pair rope_autograd(const at::Tensor& q, const at::Tensor& k, const at::Tensor& cos, const at::Tensor& sin,
                   int64_t unsqueeze_dim) {
  const bool grad_mode = at::GradMode::is_enabled();
  TORCH_CHECK(!(grad_mode && (cos.requires_grad() || sin.requires_grad())),
              "bastile.rope: cos and sin require grad, but rope does not differentiate them (HF computes them "
              "under torch.no_grad()); pass cos.detach() and sin.detach()");
  if (grad_mode && (q.requires_grad() || k.requires_grad())) {
    const auto out = RopeFunction::apply(q, k, cos, sin, unsqueeze_dim);
    return {out[0], out[1]};
  }
  const at::AutoDispatchBelowADInplaceOrView below_autograd;
  return call_rope(q, k, cos, sin, unsqueeze_dim);
}

// Autocast leaves rope alone, as it leaves HF's apply_rotary_pos_emb: dtypes are kept and the result
// has dtype promote(q, cos).
Pair rope_autocast(const at::Tensor& q, const at::Tensor& k, const at::Tensor& cos, const at::Tensor& sin,
                   int64_t unsqueeze_dim) {
  const c10::impl::ExcludeDispatchKeyGuard no_autocast(c10::autocast_dispatch_keyset);
  return call_rope(q, k, cos, sin, unsqueeze_dim);
}

}  // namespace
}  // namespace bastile

TORCH_LIBRARY_FRAGMENT(bastile, m) {
  const std::vector<at::Tag> tags{at::Tag::pt2_compliant_tag};
  m.def("rope(Tensor q, Tensor k, Tensor cos, Tensor sin, int unsqueeze_dim=1) -> (Tensor, Tensor)", tags);
  m.def("rope_backward(Tensor grad_q, Tensor grad_k, Tensor cos, Tensor sin, int unsqueeze_dim) -> "
        "(Tensor, Tensor)",
        tags);
}

TORCH_LIBRARY_IMPL(bastile, CPU, m) {
  m.impl("rope", &bastile::rope);
  m.impl("rope_backward", &bastile::rope_backward);
}

TORCH_LIBRARY_IMPL(bastile, CUDA, m) {
  m.impl("rope", &bastile::rope);
  m.impl("rope_backward", &bastile::rope_backward);
}

TORCH_LIBRARY_IMPL(bastile, Meta, m) {
  m.impl("rope", &bastile::rope_meta);
  m.impl("rope_backward", &bastile::rope_backward_meta);
}

TORCH_LIBRARY_IMPL(bastile, Autograd, m) {
  m.impl("rope", &bastile::rope_autograd);
  // Not differentiable itself: a clear error instead of a silent missing grad_fn.
  m.impl("rope_backward", torch::autograd::autogradNotImplementedFallback());
}

TORCH_LIBRARY_IMPL(bastile, AutocastCUDA, m) { m.impl("rope", &bastile::rope_autocast); }
TORCH_LIBRARY_IMPL(bastile, AutocastCPU, m) { m.impl("rope", &bastile::rope_autocast); }
