// torch.ops.bastile.qk_norm_rope: schemas, checks, CPU/CUDA/Meta kernels, autograd and autocast.
//
//   qk_norm_rope(q, k, q_weight, k_weight, cos, sin, eps) -> (q_out, k_out)
//       what users call; differentiable in q, k and the weights (cos and sin get no gradient)
//   qk_norm_rope_forward(same) -> (q_out, k_out, q_rstd, k_rstd)    what autograd saves from
//   qk_norm_rope_backward(grad_q, grad_k, q, k, q_weight, k_weight, cos, sin, q_rstd, k_rstd)
//       -> (grad_q, grad_k, grad_q_weight, grad_k_weight)
//
// q: [batch, seq, q_heads, head_dim], k: [batch, seq, k_heads, head_dim] (any strides; a last-dim stride
// other than 1 costs a copy), cos/sin: [seq, head_dim], [1, seq, head_dim] or [batch, seq, head_dim].
// Outputs are contiguous [batch, seq, heads, head_dim]; HF's layout is their .transpose(1, 2).
#include <ATen/autocast_mode.h>
#include <c10/core/DeviceGuard.h>
#include <torch/autograd.h>
#include <torch/csrc/autograd/autograd_not_implemented_fallback.h>

#include "bastile/src/qk_norm_rope.rs.h"
#include "common.h"
#include "qk_norm_rope.h"

namespace bastile {
namespace {

constexpr const char* kOp = "qk_norm_rope";

at::ScalarType stats_dtype(const at::Tensor& x) {
  return x.scalar_type() == at::kDouble ? at::kDouble : at::kFloat;
}

// HF's dtype of the result: promote(promote(x, weight), cos).
at::ScalarType out_dtype(const at::Tensor& q, const at::Tensor& w, const at::Tensor& cos) {
  return at::promote_types(at::promote_types(q.scalar_type(), w.scalar_type()), cos.scalar_type());
}

// Shape, dtype and device checks shared by every kernel, Meta included (hence the sym_ sizes).
void check_inputs(const at::Tensor& q, const at::Tensor& k, const at::Tensor& qw, const at::Tensor& kw,
                  const at::Tensor& cos, const at::Tensor& sin) {
  dtype_code(q, kOp, "q");
  dtype_code(k, kOp, "k");
  dtype_code(qw, kOp, "q_weight");
  dtype_code(kw, kOp, "k_weight");
  dtype_code(cos, kOp, "cos");
  dtype_code(sin, kOp, "sin");
  TORCH_CHECK(q.dim() == 4 && k.dim() == 4, "bastile.qk_norm_rope: q and k must be [batch, seq, heads, head_dim], got ",
              q.sym_sizes(), " and ", k.sym_sizes());
  TORCH_CHECK(k.sym_size(0) == q.sym_size(0) && k.sym_size(1) == q.sym_size(1) && k.sym_size(3) == q.sym_size(3),
              "bastile.qk_norm_rope: q ", q.sym_sizes(), " and k ", k.sym_sizes(),
              " must agree in batch, seq and head_dim");
  const auto& d = q.sym_size(3);
  TORCH_CHECK(d % 2 == 0, "bastile.qk_norm_rope: head_dim must be even, got ", d);
  TORCH_CHECK(q.scalar_type() == k.scalar_type(), "bastile.qk_norm_rope: q and k must have one dtype, got ",
              q.scalar_type(), " and ", k.scalar_type());
  TORCH_CHECK(qw.dim() == 1 && qw.sym_size(0) == d && kw.dim() == 1 && kw.sym_size(0) == d,
              "bastile.qk_norm_rope: q_weight and k_weight must have shape [", d, "] (head_dim), got ",
              qw.sym_sizes(), " and ", kw.sym_sizes());
  TORCH_CHECK(qw.scalar_type() == kw.scalar_type(), "bastile.qk_norm_rope: q_weight and k_weight must have one dtype, got ",
              qw.scalar_type(), " and ", kw.scalar_type());
  TORCH_CHECK(cos.sym_sizes() == sin.sym_sizes() && cos.scalar_type() == sin.scalar_type(),
              "bastile.qk_norm_rope: cos and sin must have one shape and dtype, got ", cos.sym_sizes(), " ",
              cos.scalar_type(), " and ", sin.sym_sizes(), " ", sin.scalar_type());
  TORCH_CHECK((cos.dim() == 2 || cos.dim() == 3) && cos.sym_size(-1) == d && cos.sym_size(-2) == q.sym_size(1) &&
                  (cos.dim() == 2 || cos.sym_size(0) == 1 || cos.sym_size(0) == q.sym_size(0)),
              "bastile.qk_norm_rope: cos and sin must be [seq, head_dim], [1, seq, head_dim] or [batch, seq, head_dim] "
              "with q ", q.sym_sizes(), ", got ", cos.sym_sizes());
  for (const auto* t : {&k, &qw, &kw, &cos, &sin})
    TORCH_CHECK(t->device() == q.device(), "bastile.qk_norm_rope: all tensors must be on q's device ", q.device(),
                ", got one on ", t->device());
}

// The kernels read rows with unit stride; any other strides are taken as they are.
at::Tensor unit_last(const at::Tensor& t) { return t.stride(-1) == 1 ? t : t.contiguous(); }

// cos/sin as [batch or 1, seq, head_dim] with unit last stride.
at::Tensor table(const at::Tensor& t) { return unit_last(t.dim() == 2 ? t.unsqueeze(0) : t); }

void fill_strides(int64_t (&dst)[3], const at::Tensor& t) {
  for (int i = 0; i < 3; ++i) dst[i] = t.stride(i);
}

void fill_table_strides(int64_t (&dst)[2], const at::Tensor& t) {
  dst[0] = t.size(0) == 1 ? 0 : t.stride(0);  // one table for every batch row
  dst[1] = t.stride(1);
}

QkNormRopeShape shape_of(const at::Tensor& q, const at::Tensor& k, const at::Tensor& cos, const at::Tensor& sin) {
  QkNormRopeShape s{};
  s.batch = q.size(0);
  s.seq = q.size(1);
  s.q_heads = q.size(2);
  s.k_heads = k.size(2);
  s.head_dim = q.size(3);
  fill_strides(s.q_stride, q);
  fill_strides(s.k_stride, k);
  fill_table_strides(s.cos_stride, cos);
  fill_table_strides(s.sin_stride, sin);
  return s;
}

std::vector<int64_t> stats_shape(const at::Tensor& x) { return {x.size(0), x.size(1), x.size(2)}; }

using Four = std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor>;

// Outputs, and the statistics when `with_rstd` (autograd needs them; inference does not).
Four run_forward(const at::Tensor& q_in, const at::Tensor& k_in, const at::Tensor& qw_in, const at::Tensor& kw_in,
                 const at::Tensor& cos_in, const at::Tensor& sin_in, double eps, bool with_rstd) {
  check_inputs(q_in, k_in, qw_in, kw_in, cos_in, sin_in);
  const auto q = unit_last(q_in), k = unit_last(k_in);
  const auto qw = qw_in.contiguous(), kw = kw_in.contiguous();
  const auto cos = table(cos_in), sin = table(sin_in);
  const auto out = q.options().dtype(out_dtype(q, qw, cos));
  auto q_out = at::empty(q.sizes(), out), k_out = at::empty(k.sizes(), out);
  at::Tensor q_rstd, k_rstd;
  if (with_rstd) {
    q_rstd = at::empty(stats_shape(q), q.options().dtype(stats_dtype(q)));
    k_rstd = at::empty(stats_shape(k), q.options().dtype(stats_dtype(q)));
  }
  if (q.numel() == 0 && k.numel() == 0) return {q_out, k_out, q_rstd, k_rstd};

  QkNormRopeForward p{};
  p.q = q.data_ptr();
  p.k = k.data_ptr();
  p.q_weight = qw.data_ptr();
  p.k_weight = kw.data_ptr();
  p.cos = cos.data_ptr();
  p.sin = sin.data_ptr();
  p.q_out = q_out.data_ptr();
  p.k_out = k_out.data_ptr();
  p.q_rstd = with_rstd ? q_rstd.data_ptr() : nullptr;
  p.k_rstd = with_rstd ? k_rstd.data_ptr() : nullptr;
  p.shape = shape_of(q, k, cos, sin);
  p.eps = eps;
  p.x_dtype = dtype_code(q, kOp, "q");
  p.w_dtype = dtype_code(qw, kOp, "q_weight");
  p.c_dtype = dtype_code(cos, kOp, "cos");
  if (q.is_cuda()) {
    const c10::DeviceGuard guard(q.device());
    call_rust([&] { rs::qk_norm_rope::forward_cuda(p, q.device().index(), current_stream(q)); });
  } else {
    TORCH_CHECK(q.is_cpu(), "bastile.qk_norm_rope: unsupported device ", q.device());
    call_rust([&] { rs::qk_norm_rope::forward_cpu(p); });
  }
  return {q_out, k_out, q_rstd, k_rstd};
}

std::tuple<at::Tensor, at::Tensor> qk_norm_rope(const at::Tensor& q, const at::Tensor& k, const at::Tensor& qw,
                                                const at::Tensor& kw, const at::Tensor& cos, const at::Tensor& sin,
                                                double eps) {
  auto [q_out, k_out, q_rstd, k_rstd] = run_forward(q, k, qw, kw, cos, sin, eps, false);
  return {q_out, k_out};
}

Four qk_norm_rope_forward(const at::Tensor& q, const at::Tensor& k, const at::Tensor& qw, const at::Tensor& kw,
                          const at::Tensor& cos, const at::Tensor& sin, double eps) {
  return run_forward(q, k, qw, kw, cos, sin, eps, true);
}

void check_backward(const at::Tensor& grad_q, const at::Tensor& grad_k, const at::Tensor& q, const at::Tensor& k,
                    const at::Tensor& qw, const at::Tensor& cos, const at::Tensor& q_rstd, const at::Tensor& k_rstd) {
  TORCH_CHECK(grad_q.sym_sizes() == q.sym_sizes() && grad_k.sym_sizes() == k.sym_sizes(),
              "bastile.qk_norm_rope_backward: grad_q ", grad_q.sym_sizes(), " and grad_k ", grad_k.sym_sizes(),
              " must have the shapes of q ", q.sym_sizes(), " and k ", k.sym_sizes());
  const auto dt = out_dtype(q, qw, cos);
  TORCH_CHECK(grad_q.scalar_type() == dt && grad_k.scalar_type() == dt,
              "bastile.qk_norm_rope_backward: grad_q and grad_k must be ", dt, " (the outputs' dtype), got ",
              grad_q.scalar_type(), " and ", grad_k.scalar_type());
  TORCH_CHECK(q_rstd.sym_sizes() == q.sym_sizes().slice(0, 3) && k_rstd.sym_sizes() == k.sym_sizes().slice(0, 3) &&
                  q_rstd.scalar_type() == stats_dtype(q) && k_rstd.scalar_type() == stats_dtype(q),
              "bastile.qk_norm_rope_backward: q_rstd and k_rstd must be the statistics qk_norm_rope_forward returned");
  for (const auto* t : {&grad_q, &grad_k, &q_rstd, &k_rstd})
    TORCH_CHECK(t->device() == q.device(), "bastile.qk_norm_rope_backward: all tensors must be on q's device ",
                q.device(), ", got one on ", t->device());
}

Four qk_norm_rope_backward(const at::Tensor& grad_q_in, const at::Tensor& grad_k_in, const at::Tensor& q_in,
                           const at::Tensor& k_in, const at::Tensor& qw_in, const at::Tensor& kw_in,
                           const at::Tensor& cos_in, const at::Tensor& sin_in, const at::Tensor& q_rstd_in,
                           const at::Tensor& k_rstd_in) {
  check_inputs(q_in, k_in, qw_in, kw_in, cos_in, sin_in);
  check_backward(grad_q_in, grad_k_in, q_in, k_in, qw_in, cos_in, q_rstd_in, k_rstd_in);
  const auto q = unit_last(q_in), k = unit_last(k_in);
  const auto grad_q = unit_last(grad_q_in), grad_k = unit_last(grad_k_in);
  const auto qw = qw_in.contiguous(), kw = kw_in.contiguous();
  const auto cos = table(cos_in), sin = table(sin_in);
  const auto q_rstd = q_rstd_in.contiguous(), k_rstd = k_rstd_in.contiguous();
  auto grad_q_x = at::empty(q.sizes(), q.options()), grad_k_x = at::empty(k.sizes(), k.options());
  auto grad_qw = at::empty(qw.sizes(), qw.options()), grad_kw = at::empty(kw.sizes(), kw.options());
  if (q.numel() == 0 && k.numel() == 0) return {grad_q_x, grad_k_x, grad_qw.zero_(), grad_kw.zero_()};

  QkNormRopeBackward p{};
  p.grad_q = grad_q.data_ptr();
  p.grad_k = grad_k.data_ptr();
  p.q = q.data_ptr();
  p.k = k.data_ptr();
  p.q_weight = qw.data_ptr();
  p.k_weight = kw.data_ptr();
  p.cos = cos.data_ptr();
  p.sin = sin.data_ptr();
  p.q_rstd = q_rstd.data_ptr();
  p.k_rstd = k_rstd.data_ptr();
  p.grad_q_in = grad_q_x.data_ptr();
  p.grad_k_in = grad_k_x.data_ptr();
  p.grad_q_weight = grad_qw.data_ptr();
  p.grad_k_weight = grad_kw.data_ptr();
  fill_strides(p.grad_q_stride, grad_q);
  fill_strides(p.grad_k_stride, grad_k);
  p.shape = shape_of(q, k, cos, sin);
  p.x_dtype = dtype_code(q, kOp, "q");
  p.w_dtype = dtype_code(qw, kOp, "q_weight");
  p.c_dtype = dtype_code(cos, kOp, "cos");
  if (q.is_cuda()) {
    const c10::DeviceGuard guard(q.device());
    const int device = q.device().index();
    p.partials = call_rust([&] { return rs::qk_norm_rope::backward_plan(p, device); });
    const auto partial = at::empty({2, p.partials, p.shape.head_dim}, q.options().dtype(at::kFloat));
    p.partial = partial.data_ptr<float>();
    call_rust([&] { rs::qk_norm_rope::backward_cuda(p, device, current_stream(q)); });
  } else {
    TORCH_CHECK(q.is_cpu(), "bastile.qk_norm_rope: unsupported device ", q.device());
    call_rust([&] { rs::qk_norm_rope::backward_cpu(p); });
  }
  return {grad_q_x, grad_k_x, grad_qw, grad_kw};
}

// Meta kernels: shapes and dtypes only, symbolic sizes kept for torch.compile(dynamic=True).
std::tuple<at::Tensor, at::Tensor> qk_norm_rope_meta(const at::Tensor& q, const at::Tensor& k, const at::Tensor& qw,
                                                     const at::Tensor& kw, const at::Tensor& cos,
                                                     const at::Tensor& sin, double) {
  check_inputs(q, k, qw, kw, cos, sin);
  const auto out = q.options().dtype(out_dtype(q, qw, cos));
  return {at::empty_symint(q.sym_sizes(), out), at::empty_symint(k.sym_sizes(), out)};
}

Four qk_norm_rope_forward_meta(const at::Tensor& q, const at::Tensor& k, const at::Tensor& qw, const at::Tensor& kw,
                               const at::Tensor& cos, const at::Tensor& sin, double eps) {
  auto [q_out, k_out] = qk_norm_rope_meta(q, k, qw, kw, cos, sin, eps);
  const auto stats = q.options().dtype(stats_dtype(q));
  return {q_out, k_out, at::empty_symint(q.sym_sizes().slice(0, 3), stats),
          at::empty_symint(k.sym_sizes().slice(0, 3), stats)};
}

Four qk_norm_rope_backward_meta(const at::Tensor& grad_q, const at::Tensor& grad_k, const at::Tensor& q,
                                const at::Tensor& k, const at::Tensor& qw, const at::Tensor& kw, const at::Tensor& cos,
                                const at::Tensor& sin, const at::Tensor& q_rstd, const at::Tensor& k_rstd) {
  check_inputs(q, k, qw, kw, cos, sin);
  check_backward(grad_q, grad_k, q, k, qw, cos, q_rstd, k_rstd);
  return {at::empty_symint(q.sym_sizes(), q.options()), at::empty_symint(k.sym_sizes(), k.options()),
          at::empty_symint(qw.sym_sizes(), qw.options()), at::empty_symint(kw.sym_sizes(), kw.options())};
}

std::tuple<at::Tensor, at::Tensor> call_qk_norm_rope(const at::Tensor& q, const at::Tensor& k, const at::Tensor& qw,
                                                     const at::Tensor& kw, const at::Tensor& cos,
                                                     const at::Tensor& sin, double eps) {
  static const auto op = c10::Dispatcher::singleton()
                             .findSchemaOrThrow("bastile::qk_norm_rope", "")
                             .typed<std::tuple<at::Tensor, at::Tensor>(const at::Tensor&, const at::Tensor&,
                                                                       const at::Tensor&, const at::Tensor&,
                                                                       const at::Tensor&, const at::Tensor&, double)>();
  return op.call(q, k, qw, kw, cos, sin, eps);
}

class QkNormRopeFunction : public torch::autograd::Function<QkNormRopeFunction> {
 public:
  static torch::autograd::variable_list forward(torch::autograd::AutogradContext* ctx, const at::Tensor& q,
                                                const at::Tensor& k, const at::Tensor& qw, const at::Tensor& kw,
                                                const at::Tensor& cos, const at::Tensor& sin, double eps) {
    static const auto op = c10::Dispatcher::singleton()
                               .findSchemaOrThrow("bastile::qk_norm_rope_forward", "")
                               .typed<Four(const at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&,
                                           const at::Tensor&, const at::Tensor&, double)>();
    const at::AutoDispatchBelowADInplaceOrView below_autograd;
    auto [q_out, k_out, q_rstd, k_rstd] = op.call(q, k, qw, kw, cos, sin, eps);
    ctx->save_for_backward({q, k, qw, kw, cos, sin, q_rstd, k_rstd});
    return {q_out, k_out};
  }

  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grads) {
    static const auto op =
        c10::Dispatcher::singleton()
            .findSchemaOrThrow("bastile::qk_norm_rope_backward", "")
            .typed<Four(const at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&,
                        const at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&)>();
    const at::Tensor none;
    if (!grads[0].defined() && !grads[1].defined()) return {none, none, none, none, none, none, none};
    const auto s = ctx->get_saved_variables();
    // One output unused: its gradient is zero.
    const auto dt = s[0].options().dtype(out_dtype(s[0], s[2], s[4]));
    const auto grad_q = grads[0].defined() ? grads[0] : at::zeros_symint(s[0].sym_sizes(), dt);
    const auto grad_k = grads[1].defined() ? grads[1] : at::zeros_symint(s[1].sym_sizes(), dt);
    auto [gq, gk, gqw, gkw] = op.call(grad_q, grad_k, s[0], s[1], s[2], s[3], s[4], s[5], s[6], s[7]);
    return {gq, gk, gqw, gkw, none, none, none};
  }
};

std::tuple<at::Tensor, at::Tensor> qk_norm_rope_autograd(const at::Tensor& q, const at::Tensor& k,
                                                         const at::Tensor& qw, const at::Tensor& kw,
                                                         const at::Tensor& cos, const at::Tensor& sin, double eps) {
  if (at::GradMode::is_enabled()) {
    TORCH_CHECK(!cos.requires_grad() && !sin.requires_grad(),
                "bastile.qk_norm_rope: cos and sin get no gradient; pass them detached (HF computes them under "
                "no_grad) or run under torch.no_grad()");
    if (q.requires_grad() || k.requires_grad() || qw.requires_grad() || kw.requires_grad()) {
      const auto out = QkNormRopeFunction::apply(q, k, qw, kw, cos, sin, eps);
      return {out[0], out[1]};
    }
  }
  // Nothing to differentiate: skip saving statistics.
  const at::AutoDispatchBelowADInplaceOrView below_autograd;
  return call_qk_norm_rope(q, k, qw, kw, cos, sin, eps);
}

// Autocast leaves the op alone, as it leaves HF's norms and rotary embedding: inputs keep their dtypes.
std::tuple<at::Tensor, at::Tensor> qk_norm_rope_autocast(const at::Tensor& q, const at::Tensor& k,
                                                         const at::Tensor& qw, const at::Tensor& kw,
                                                         const at::Tensor& cos, const at::Tensor& sin, double eps) {
  const c10::impl::ExcludeDispatchKeyGuard no_autocast(c10::autocast_dispatch_keyset);
  return call_qk_norm_rope(q, k, qw, kw, cos, sin, eps);
}

}  // namespace
}  // namespace bastile

TORCH_LIBRARY_FRAGMENT(bastile, m) {
  const std::vector<at::Tag> tags{at::Tag::pt2_compliant_tag};
  m.def("qk_norm_rope(Tensor q, Tensor k, Tensor q_weight, Tensor k_weight, Tensor cos, Tensor sin, float eps) "
        "-> (Tensor, Tensor)",
        tags);
  m.def("qk_norm_rope_forward(Tensor q, Tensor k, Tensor q_weight, Tensor k_weight, Tensor cos, Tensor sin, "
        "float eps) -> (Tensor, Tensor, Tensor, Tensor)",
        tags);
  m.def("qk_norm_rope_backward(Tensor grad_q, Tensor grad_k, Tensor q, Tensor k, Tensor q_weight, Tensor k_weight, "
        "Tensor cos, Tensor sin, Tensor q_rstd, Tensor k_rstd) -> (Tensor, Tensor, Tensor, Tensor)",
        tags);
}

TORCH_LIBRARY_IMPL(bastile, CPU, m) {
  m.impl("qk_norm_rope", &bastile::qk_norm_rope);
  m.impl("qk_norm_rope_forward", &bastile::qk_norm_rope_forward);
  m.impl("qk_norm_rope_backward", &bastile::qk_norm_rope_backward);
}

TORCH_LIBRARY_IMPL(bastile, CUDA, m) {
  m.impl("qk_norm_rope", &bastile::qk_norm_rope);
  m.impl("qk_norm_rope_forward", &bastile::qk_norm_rope_forward);
  m.impl("qk_norm_rope_backward", &bastile::qk_norm_rope_backward);
}

TORCH_LIBRARY_IMPL(bastile, Meta, m) {
  m.impl("qk_norm_rope", &bastile::qk_norm_rope_meta);
  m.impl("qk_norm_rope_forward", &bastile::qk_norm_rope_forward_meta);
  m.impl("qk_norm_rope_backward", &bastile::qk_norm_rope_backward_meta);
}

TORCH_LIBRARY_IMPL(bastile, Autograd, m) {
  m.impl("qk_norm_rope", &bastile::qk_norm_rope_autograd);
  // The pieces are not differentiable themselves: a clear error instead of a silent missing grad_fn.
  m.impl("qk_norm_rope_forward", torch::autograd::autogradNotImplementedFallback());
  m.impl("qk_norm_rope_backward", torch::autograd::autogradNotImplementedFallback());
}

TORCH_LIBRARY_IMPL(bastile, AutocastCUDA, m) { m.impl("qk_norm_rope", &bastile::qk_norm_rope_autocast); }
TORCH_LIBRARY_IMPL(bastile, AutocastCPU, m) { m.impl("qk_norm_rope", &bastile::qk_norm_rope_autocast); }
