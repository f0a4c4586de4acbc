// torch.ops.bastile.fused_linear_cross_entropy: the loss of
// F.cross_entropy((hidden @ weight.T + bias).float(), target, ignore_index, reduction) without the
// [rows, vocab] logits. Rows go in chunks whose logits (hidden's dtype, from cuBLAS) stay within a memory
// budget (src/fused_linear_cross_entropy.rs: chunk_rows; `chunk_bytes` overrides it); per chunk, our kernel
// (cuda/fused_linear_cross_entropy.cu) turns the logits into the loss rows and, in place, into
// d(loss)/d(logits), and two more GEMMs fold that into grad_hidden and grad_weight. On compute capability
// 9.0 (bf16, no bias, statistics or label smoothing) the chunk's logits GEMM is our own instead, whose
// epilogue leaves values the two gradient GEMMs take as they are, up to a per-row factor
// (include/fused_linear_cross_entropy.h: CrossEntropyGemm). The forward thus
// produces every gradient for a unit upstream gradient (fused_linear_cross_entropy_forward); the backward
// only scales them (fused_linear_cross_entropy_backward). Reduction "none" gives the row losses, whose
// upstream gradients differ by row and are known only in the backward: its forward keeps no gradient, and
// its backward (fused_linear_cross_entropy_rows_backward) makes the logits again, chunk by chunk, with the
// row's upstream gradient folded into the kernel's pass: one more GEMM than the other reductions.
//
// torch.ops.bastile.fused_linear_log_probs is the same pass as TRL's per-token heads see it: per row,
// log p(target) of softmax(softcap(logit_scale * logits) / temperature), its entropy (both differentiable),
// log(sum p^2), the mean scaled logit and whether the target is the argmax. Its upstream gradients differ by
// row in general (GRPO, DPO, DFT), so its backward makes the logits again as "none" does. With
// uniform_grad, the caller promises one upstream gradient for every counted row (SFT's negative
// log-likelihood: -1 / tokens each); the forward then forms the gradients as "sum" does, the backward checks
// the promise on the device (no host sync) and scales them.
#include <torch/csrc/autograd/graph_task.h>

#include <array>
#include <cmath>
#include <limits>

#include "op.h"

namespace bastile {
namespace {

constexpr const char* kOp = "fused_linear_cross_entropy";

using Mask = std::array<bool, 3>;  // which of grad_hidden, grad_weight, grad_bias to compute
using Four = std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor>;
using Three = std::tuple<at::Tensor, at::Tensor, at::Tensor>;

enum class Reduction { Mean, Sum, None };

struct Options {
  int64_t ignore_index;
  Reduction reduction;
  double softcap;
  double z_loss;
  bool fp32_weight_grad;
  int64_t chunk_bytes;
  double label_smoothing = 0.0;
  double logit_scale = 1.0;
  double temperature = 1.0;
  bool stats = false;  // the per-row statistics of fused_linear_log_probs
};

Options options(int64_t ignore_index, c10::string_view reduction, double softcap, double z_loss,
                bool fp32_weight_grad, int64_t chunk_bytes, double label_smoothing = 0.0, double logit_scale = 1.0) {
  TORCH_CHECK(reduction == "mean" || reduction == "sum" || reduction == "none",
              "bastile.fused_linear_cross_entropy: reduction must be \"mean\", \"sum\" or \"none\", got \"",
              reduction, "\"");
  TORCH_CHECK(std::isfinite(softcap) && softcap >= 0,
              "bastile.fused_linear_cross_entropy: softcap must be >= 0 (0 = off), got ", softcap);
  TORCH_CHECK(std::isfinite(z_loss) && z_loss >= 0, "bastile.fused_linear_cross_entropy: z_loss must be >= 0, got ",
              z_loss);
  TORCH_CHECK(chunk_bytes >= 0, "bastile.fused_linear_cross_entropy: chunk_bytes must be >= 0 (0 = automatic), got ",
              chunk_bytes);
  const auto r = reduction == "mean" ? Reduction::Mean : reduction == "sum" ? Reduction::Sum : Reduction::None;
  TORCH_CHECK(label_smoothing >= 0 && label_smoothing <= 1,
              "bastile.fused_linear_cross_entropy: label_smoothing must be in [0, 1], got ", label_smoothing);
  TORCH_CHECK(std::isfinite(logit_scale), "bastile.fused_linear_cross_entropy: logit_scale must be finite, got ",
              logit_scale);
  return {ignore_index, r, softcap, z_loss, fp32_weight_grad, chunk_bytes, label_smoothing, logit_scale};
}

bool has(const std::optional<at::Tensor>& t) { return t.has_value() && t->defined(); }

// The mask of an autograd node, kept in its saved_data.
void save_mask(AutogradContext* ctx, Mask m) {
  ctx->saved_data["mask"] = int64_t(m[0]) | int64_t(m[1]) << 1 | int64_t(m[2]) << 2;
}
Mask saved_mask(AutogradContext* ctx) {
  const int64_t bits = ctx->saved_data["mask"].toInt();
  return {bool(bits & 1), bool(bits & 2), bool(bits & 4)};
}

// The gradients of a head's arguments (hidden, weight, target, bias): those of g that `mask` asked for.
variable_list argument_grads(const Three& g, Mask mask) {
  variable_list out(4);
  if (mask[0]) out[0] = std::get<0>(g);
  if (mask[1]) out[1] = std::get<1>(g);
  if (mask[2]) out[3] = std::get<2>(g);
  return out;
}

void check(const at::Tensor& hidden, const at::Tensor& weight, const at::Tensor& target,
           const std::optional<at::Tensor>& bias) {
  check_float(kOp, {{"hidden", hidden}, {"weight", weight}});
  TORCH_CHECK(hidden.dim() >= 1, "bastile.fused_linear_cross_entropy: hidden must have at least one dimension");
  TORCH_CHECK(weight.dim() == 2 && weight.sym_size(1) == hidden.sym_size(-1),
              "bastile.fused_linear_cross_entropy: weight must have shape [vocab, ", hidden.sym_size(-1),
              "] (hidden's last dimension), got ", weight.sym_sizes());
  TORCH_CHECK(weight.sym_size(0) > 0, "bastile.fused_linear_cross_entropy: weight must have at least one row");
  TORCH_CHECK(target.scalar_type() == at::kLong,
              "bastile.fused_linear_cross_entropy: target must be int64 (torch.long), got ", target.scalar_type());
  TORCH_CHECK(target.sym_sizes() == hidden.sym_sizes().slice(0, hidden.dim() - 1),
              "bastile.fused_linear_cross_entropy: target must have shape ", hidden.sym_sizes().slice(0, hidden.dim() - 1),
              " (hidden's without its last dimension), got ", target.sym_sizes());
  check_device(kOp, {"hidden", hidden}, {{"weight", weight}, {"target", target}});
  if (has(bias)) {
    check_float(kOp, {{"bias", *bias}});
    TORCH_CHECK(bias->dim() == 1 && bias->sym_size(0) == weight.sym_size(0),
                "bastile.fused_linear_cross_entropy: bias must have shape [", weight.sym_size(0), "], got ",
                bias->sym_sizes());
    check_device(kOp, {"hidden", hidden}, {{"bias", *bias}});
  }
}

// Dtype the weight (bias) gradient is summed over chunks in.
at::ScalarType sum_dtype(at::ScalarType own, const Options& o) {
  return o.fp32_weight_grad ? at::promote_types(own, at::kFloat) : own;
}

// acc = a @ b (first) or acc += a @ b, in acc's dtype. cuBLAS writes an f32 acc from 16-bit operands
// directly; other pairs (the CPU has no such GEMM) go through a product in acc's dtype.
void add_product(at::Tensor& acc, const at::Tensor& a, const at::Tensor& b, bool first) {
  const double beta = first ? 0.0 : 1.0;  // beta 0: acc's (uninitialised) values are not read
  if (acc.scalar_type() == a.scalar_type()) {
    at::addmm_out(acc, acc, a, b, beta, 1.0);
  } else if (acc.is_cuda() && acc.scalar_type() == at::kFloat) {
    at::addmm_out(acc, acc, a, b, at::kFloat, beta, 1.0);
  } else {
    const auto prod = at::mm(a.to(acc.scalar_type()), b.to(acc.scalar_type()));
    first ? acc.copy_(prod) : acc.add_(prod);
  }
}

struct Result {
  at::Tensor loss, grad_hidden, grad_weight, grad_bias;
  at::Tensor stats;  // with o.stats: [rows, 4], the kernel's, and the row losses
  at::Tensor row_loss;
};

// The loss (reduction "none": the row losses, target's shape), and the gradients `mask` asks for (empty
// [0] tensors for the others): of the loss, or with reduction "none" of the row losses weighted by
// `row_scale` (their upstream gradients, target's shape) plus the entropies weighted by `entropy_scale`
// (when defined).
Result run(const at::Tensor& hidden_in, const at::Tensor& weight_in, const at::Tensor& target_in,
           const std::optional<at::Tensor>& bias_in, const Options& o, Mask mask,
           const at::Tensor& row_scale_in = {}, const at::Tensor& entropy_scale_in = {}) {
  check(hidden_in, weight_in, target_in, bias_in);
  const bool rows_out = o.reduction == Reduction::None;
  const bool with_bias = has(bias_in);
  const bool need_h = mask[0], need_w = mask[1], need_b = mask[2] && with_bias;
  const auto none = [](const at::Tensor& like) { return at::empty({0}, like.options()); };
  if (hidden_in.is_meta())
    return {rows_out ? at::empty_symint(target_in.sym_sizes(), hidden_in.options().dtype(stats_dtype(hidden_in)))
                     : at::empty({}, hidden_in.options().dtype(stats_dtype(hidden_in))),
            need_h ? at::empty_symint(hidden_in.sym_sizes(), hidden_in.options()) : none(hidden_in),
            need_w ? at::empty_symint(weight_in.sym_sizes(), weight_in.options()) : none(weight_in),
            need_b ? at::empty_symint(bias_in->sym_sizes(), bias_in->options()) : none(with_bias ? *bias_in : hidden_in),
            o.stats ? at::empty_symint({target_in.sym_numel(), 4}, hidden_in.options().dtype(stats_dtype(hidden_in)))
                    : at::Tensor(),
            o.stats ? at::empty_symint(target_in.sym_sizes(), hidden_in.options().dtype(stats_dtype(hidden_in)))
                    : at::Tensor()};
  const c10::DeviceGuard guard(hidden_in.device());
  // Rows counted by the target: with hidden size 0, hidden's shape does not tell them.
  const int64_t rows = target_in.numel(), cols = hidden_in.size(-1), vocab = weight_in.size(0);
  const auto hidden = hidden_in.reshape({rows, cols}).contiguous();
  const auto target = target_in.reshape({rows}).contiguous();
  // Mixed dtypes (autocast leaves an f32 weight): the GEMMs run in hidden's dtype, as F.linear's would.
  const auto weight = weight_in.to(hidden.scalar_type()).contiguous();
  const auto bias = with_bias ? bias_in->to(hidden.scalar_type()).contiguous() : at::Tensor();
  const bool grad = need_h || need_w || need_b;
  TORCH_INTERNAL_ASSERT(!grad || !rows_out || row_scale_in.defined(), "reduction none: gradients need row_scale");
  const auto per_row = [&](const at::Tensor& t) {
    return grad && rows_out && t.defined() ? t.reshape({rows}).to(stats_dtype(hidden)).contiguous() : at::Tensor();
  };
  const auto row_scale = per_row(row_scale_in), entropy_scale = per_row(entropy_scale_in);
  const auto stats = o.stats ? at::empty({rows, 4}, hidden.options().dtype(stats_dtype(hidden))) : at::Tensor();
  // A chunk's part of a per-row tensor, or null.
  const auto part = [](const at::Tensor& t, int64_t start) -> void* {
    return t.defined() ? static_cast<char*>(t.data_ptr()) + start * t.stride(0) * t.element_size() : nullptr;
  };

  // The mean's divisor, counted on the device before any gradient is written: no host sync.
  const auto count = at::ne(target, o.ignore_index).logical_and_(at::ge(target, 0)).logical_and_(at::lt(target, vocab)).sum();
  const auto row_loss = at::empty({rows}, hidden.options().dtype(stats_dtype(hidden)));
  auto grad_hidden = need_h ? at::empty({rows, cols}, hidden.options()) : none(hidden_in);
  auto acc_w = need_w ? at::empty({vocab, cols}, weight.options().dtype(sum_dtype(weight_in.scalar_type(), o)))
                      : at::Tensor();
  auto acc_b = need_b ? at::empty({vocab}, bias.options().dtype(sum_dtype(bias_in->scalar_type(), o))) : at::Tensor();

  const bool f32_sum = need_w && acc_w.scalar_type() == at::kFloat;
  const bool cast = need_w && acc_w.scalar_type() != weight_in.scalar_type();
  // The Hopper path (include/fused_linear_cross_entropy.h: CrossEntropyGemm) for what its epilogue
  // computes: bf16, no bias, no statistics or label smoothing; TMA reads 16-byte aligned rows.
  const auto aligned = [](const at::Tensor& t) { return reinterpret_cast<uintptr_t>(t.data_ptr()) % 16 == 0; };
  const bool own = hidden.is_cuda() && hidden.scalar_type() == at::kBFloat16 && !with_bias && !o.stats &&
                   o.label_smoothing == 0 && !entropy_scale.defined() && aligned(hidden) && aligned(weight) &&
                   rs::cross_entropy_gemm(hidden.device().index(), cols);
  const int64_t ld = own ? rs::cross_entropy_gemm_ld(vocab) : vocab;
  const int64_t step = own && !grad ? rs::cross_entropy_gemm_forward_rows(rows, vocab, o.chunk_bytes)
                                    : rs::cross_entropy_chunk_rows(rows, ld * hidden.element_size(), f32_sum,
                                                                   cast ? vocab * cols * weight_in.element_size() : 0,
                                                                   o.chunk_bytes);
  at::Tensor exps, product, scaled, factor;
  const auto ptr = [](const at::Tensor& t) { return t.defined() ? t.data_ptr() : nullptr; };
  if (own) {
    if (grad) exps = at::empty({std::min(step, rows), ld}, hidden.options());
    factor = at::empty({std::min(step, rows)}, hidden.options().dtype(at::kFloat));
    if (need_h) product = at::empty({std::min(step, rows), cols}, hidden.options().dtype(at::kFloat));
    if (need_w) scaled = at::empty({std::min(step, rows), cols}, hidden.options());
  }
  for (int64_t start = 0; start < rows; start += step) {
    const int64_t n = std::min(step, rows - start);
    const auto h = hidden.narrow(0, start, n);
    const bool first = start == 0;
    if (own) {
      CrossEntropyGemm p{.hidden = h.data_ptr(), .weight = weight.data_ptr(), .target = target.data_ptr<int64_t>() + start,
                         .exps = ptr(exps), .loss = part(row_loss, start), .factor = factor.data_ptr<float>(),
                         .count = o.reduction == Reduction::Mean ? count.data_ptr<int64_t>() : nullptr,
                         .row_scale = static_cast<const float*>(part(row_scale, start)), .rows = n, .cols = cols,
                         .vocab = vocab, .ld = ld, .ignore_index = o.ignore_index, .logit_scale = o.logit_scale,
                         .temperature = o.temperature, .softcap = o.softcap, .z_loss = o.z_loss, .grad = grad,
                         .stage = FLCE_GEMM_LOGITS};
      launch(h, p);
      if (!grad) continue;
      // d(loss)/d(logits) = factor * exps, row by row.
      const auto e = exps.narrow(0, 0, n).narrow(1, 0, vocab);
      auto prod = need_h ? product.narrow(0, 0, n) : at::Tensor();
      auto sc = need_w ? scaled.narrow(0, 0, n) : at::Tensor();
      if (need_h) add_product(prod, e, weight, true);
      p.stage = FLCE_GEMM_SCALE;
      p.product = need_h ? prod.data_ptr<float>() : nullptr;
      p.grad_hidden = need_h ? grad_hidden.narrow(0, start, n).data_ptr() : nullptr;
      p.scaled = ptr(sc);
      launch(h, p);
      if (need_w) add_product(acc_w, e.t(), sc, first);
      continue;
    }
    const auto logits = with_bias ? at::addmm(bias, h, weight.t()) : at::mm(h, weight.t());
    launch(logits, CrossEntropyChunk{.logits = logits.data_ptr(), .target = target.data_ptr<int64_t>() + start,
                                     .loss = part(row_loss, start),
                                     .count = o.reduction == Reduction::Mean ? count.data_ptr<int64_t>() : nullptr,
                                     .row_scale = part(row_scale, start), .stats = part(stats, start),
                                     .entropy_scale = part(entropy_scale, start), .rows = n, .vocab = vocab,
                                     .ld = logits.stride(0), .ignore_index = o.ignore_index,
                                     .logit_scale = o.logit_scale, .temperature = o.temperature, .softcap = o.softcap,
                                     .z_loss = o.z_loss, .label_smoothing = o.label_smoothing, .dtype = dtype_code(kOp, {"logits", logits}), .grad = grad});
    if (!grad) continue;
    // `logits` now holds d(loss)/d(logits) of the chunk's rows.
    if (need_h) {
      auto out = grad_hidden.narrow(0, start, n);
      at::mm_out(out, logits, weight);
    }
    if (need_w) add_product(acc_w, logits.t(), h, first);
    if (need_b) {
      const auto s = at::sum(logits, at::IntArrayRef{0}, false, acc_b.scalar_type());
      first ? acc_b.copy_(s) : acc_b.add_(s);
    }
  }
  exps = product = scaled = factor = at::Tensor();  // freed before the weight gradient's cast below
  if (rows == 0) {  // no chunk ran
    if (need_w) acc_w.zero_();
    if (need_b) acc_b.zero_();
  }

  auto loss = rows_out ? row_loss.view(target_in.sizes()) : row_loss.sum();
  if (o.reduction == Reduction::Mean) loss = loss / count.clamp_min(1);  // every target ignored: 0, as are the gradients
  // The one full-size cast of an f32 sum (none when the dtypes agree).
  auto grad_weight = need_w ? acc_w.to(weight_in.scalar_type()) : none(weight_in);
  auto grad_bias = need_b ? acc_b.to(bias_in->scalar_type()) : none(with_bias ? *bias_in : hidden_in);
  if (need_h) grad_hidden = grad_hidden.view(hidden_in.sizes());
  return {loss, grad_hidden, grad_weight, grad_bias, stats, o.stats ? row_loss.view(target_in.sizes()) : at::Tensor()};
}

void check_grad_loss(const at::Tensor& grad_loss) {
  TORCH_CHECK(grad_loss.dim() == 0 && grad_loss.is_floating_point(),
              "bastile.fused_linear_cross_entropy_backward: grad_loss must be a 0-dim floating tensor, got ",
              grad_loss.scalar_type(), " of shape ", grad_loss.sizes());
}

// grad * grad_loss in grad's dtype (a 0-dim factor does not promote); in place when the caller owns grad.
// On CUDA with an f32 factor, our kernel: ATen's loop for a 0-dim CUDA operand is not vectorised.
at::Tensor scale(const at::Tensor& grad, const at::Tensor& grad_loss, bool in_place) {
  if (!grad.numel()) return in_place ? grad : grad.clone();
  if (grad.is_cuda() && grad.is_contiguous() && grad.scalar_type() != at::kDouble &&
      grad_loss.scalar_type() == at::kFloat && grad_loss.device() == grad.device()) {
    auto out = in_place ? grad : at::empty_like(grad);
    launch(grad, GradScale{.src = grad.data_ptr(), .dst = out.data_ptr(), .factor = grad_loss.data_ptr<float>(),
                           .n = grad.numel(), .dtype = dtype_code(kOp, {"gradient", grad})});
    if (in_place) grad.unsafeGetTensorImpl()->bump_version();  // as mul_ would: the tensor was written
    return out;
  }
  return in_place ? grad.mul_(grad_loss) : at::mul(grad, grad_loss);
}

struct FlceForwardOp {
  static constexpr const char* schema =
      "fused_linear_cross_entropy_forward(Tensor hidden, Tensor weight, Tensor target, Tensor? bias=None, "
      "int ignore_index=-100, str reduction=\"mean\", float softcap=0.0, float z_loss=0.0, "
      "bool fp32_weight_grad=True, int chunk_bytes=0, float label_smoothing=0.0, float logit_scale=1.0, "
      "bool[3] grad_mask=[True, True, True]) -> (Tensor loss, Tensor grad_hidden, Tensor grad_weight, Tensor grad_bias)";

  static Four kernel(const at::Tensor& hidden, const at::Tensor& weight, const at::Tensor& target,
                     const std::optional<at::Tensor>& bias, int64_t ignore_index, c10::string_view reduction,
                     double softcap, double z_loss, bool fp32_weight_grad, int64_t chunk_bytes,
                     double label_smoothing, double logit_scale, Mask mask) {
    const auto o = options(ignore_index, reduction, softcap, z_loss, fp32_weight_grad, chunk_bytes, label_smoothing,
                           logit_scale);
    TORCH_CHECK(o.reduction != Reduction::None || !(mask[0] || mask[1] || mask[2]),
                "bastile.fused_linear_cross_entropy_forward: reduction \"none\" forms no gradients in the forward ",
                "(their upstream gradients differ by row): fused_linear_cross_entropy_rows_backward makes them");
    auto r = run(hidden, weight, target, bias, o, mask);
    return {r.loss, r.grad_hidden, r.grad_weight, r.grad_bias};
  }
};

struct FlceRowsBackwardOp {
  static constexpr const char* schema =
      "fused_linear_cross_entropy_rows_backward(Tensor grad_rows, Tensor hidden, Tensor weight, Tensor target, "
      "Tensor? bias=None, int ignore_index=-100, float softcap=0.0, float z_loss=0.0, bool fp32_weight_grad=True, "
      "int chunk_bytes=0, float label_smoothing=0.0, float logit_scale=1.0, bool[3] grad_mask=[True, True, True]) "
      "-> (Tensor grad_hidden, Tensor grad_weight, Tensor grad_bias)";

  static Three kernel(
      const at::Tensor& grad_rows, const at::Tensor& hidden, const at::Tensor& weight, const at::Tensor& target,
      const std::optional<at::Tensor>& bias, int64_t ignore_index, double softcap, double z_loss,
      bool fp32_weight_grad, int64_t chunk_bytes, double label_smoothing, double logit_scale, Mask mask) {
    const auto o = options(ignore_index, "none", softcap, z_loss, fp32_weight_grad, chunk_bytes, label_smoothing,
                           logit_scale);
    TORCH_CHECK(grad_rows.is_floating_point() && grad_rows.sym_sizes() == target.sym_sizes(),
                "bastile.fused_linear_cross_entropy_rows_backward: grad_rows must be floating with target's shape ",
                target.sym_sizes(), ", got ", grad_rows.scalar_type(), " of shape ", grad_rows.sym_sizes());
    check_device(kOp, {"hidden", hidden}, {{"grad_rows", grad_rows}});
    auto r = run(hidden, weight, target, bias, o, mask, grad_rows);
    return {r.grad_hidden, r.grad_weight, r.grad_bias};
  }
};

struct FlceBackwardOp {
  static constexpr const char* schema =
      "fused_linear_cross_entropy_backward(Tensor grad_loss, Tensor grad_hidden, Tensor grad_weight, "
      "Tensor grad_bias) -> (Tensor, Tensor, Tensor)";

  static Three kernel(const at::Tensor& grad_loss, const at::Tensor& grad_hidden,
                                                               const at::Tensor& grad_weight, const at::Tensor& grad_bias) {
    check_grad_loss(grad_loss);
    if (grad_hidden.is_meta()) return {at::empty_like(grad_hidden), at::empty_like(grad_weight), at::empty_like(grad_bias)};
    return {scale(grad_hidden, grad_loss, false), scale(grad_weight, grad_loss, false), scale(grad_bias, grad_loss, false)};
  }
};

// Tensors that torch.compile traces (fake or functional tensors) must not be mutated behind its back.
bool traced(const at::Tensor& t) {
  return t.key_set().has(c10::DispatchKey::Python) || t.key_set().has(c10::DispatchKey::Functionalize);
}

// The gradients a forward formed for a unit upstream gradient, times `factor` (the upstream gradient, 0-dim).
Three scale_formed(const variable_list& formed, const at::Tensor& factor) {
  if (torch::autograd::get_current_graph_task_keep_graph() || traced(factor) || traced(formed[0]) ||
      traced(formed[1]))
    return call<FlceBackwardOp>(factor, formed[0], formed[1], formed[2]);
  // They were made for this context alone and the graph is freed after this backward, so they are scaled
  // where they lie (no second [vocab, hidden] buffer), and AccumulateGrad can take them as .grad once the
  // context releases them.
  check_grad_loss(factor);
  return {scale(formed[0], factor, true), scale(formed[1], factor, true), scale(formed[2], factor, true)};
}

// Autocast treats the heads as it treats F.linear followed by f32 math: an f32 hidden is cast to the
// autocast dtype (differentiably), so the logits are computed as HF's lm_head computes them. The weight and
// bias keep their dtypes: the ops cast them for the GEMMs themselves, so their gradients are summed in (at
// least) their own dtype and returned in it.
template <class Spec, c10::DeviceType device>
auto autocast_hidden(const at::Tensor& hidden, const auto&... rest) {
  return call<Spec>(at::autocast::cached_cast(at::autocast::get_autocast_dtype(device), hidden, device), rest...);
}

struct FlceOp {
  static constexpr const char* schema =
      "fused_linear_cross_entropy(Tensor hidden, Tensor weight, Tensor target, Tensor? bias=None, "
      "int ignore_index=-100, str reduction=\"mean\", float softcap=0.0, float z_loss=0.0, "
      "bool fp32_weight_grad=True, int chunk_bytes=0, float label_smoothing=0.0, float logit_scale=1.0) -> Tensor";

  // Nothing to differentiate: the loss alone, with no gradient GEMMs or buffers.
  static at::Tensor kernel(const at::Tensor& hidden, const at::Tensor& weight, const at::Tensor& target,
                           const std::optional<at::Tensor>& bias, int64_t ignore_index, c10::string_view reduction,
                           double softcap, double z_loss, bool fp32_weight_grad, int64_t chunk_bytes,
                           double label_smoothing, double logit_scale) {
    const auto o = options(ignore_index, reduction, softcap, z_loss, fp32_weight_grad, chunk_bytes, label_smoothing,
                           logit_scale);
    return run(hidden, weight, target, bias, o, {false, false, false}).loss;
  }

  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& hidden, const at::Tensor& weight,
                            const at::Tensor& target, const std::optional<at::Tensor>& bias, int64_t ignore_index,
                            c10::string_view reduction, double softcap, double z_loss, bool fp32_weight_grad,
                            int64_t chunk_bytes, double label_smoothing, double logit_scale) {
    const Mask mask{hidden.requires_grad(), weight.requires_grad(), has(bias) && bias->requires_grad()};
    save_mask(ctx, mask);
    if (reduction == "none") {  // the backward makes the logits again
      ctx->save_for_backward({hidden, weight, target, has(bias) ? *bias : at::Tensor()});
      auto& d = ctx->saved_data;
      d["ignore_index"] = ignore_index, d["softcap"] = softcap, d["z_loss"] = z_loss;
      d["fp32_weight_grad"] = fp32_weight_grad, d["chunk_bytes"] = chunk_bytes, d["label_smoothing"] = label_smoothing;
      d["logit_scale"] = logit_scale;
      return call<FlceOp>(hidden, weight, target, bias, ignore_index, reduction, softcap, z_loss, fp32_weight_grad,
                          chunk_bytes, label_smoothing, logit_scale);
    }
    auto [loss, gh, gw, gb] = call<FlceForwardOp>(hidden, weight, target, bias, ignore_index, reduction, softcap,
                                                  z_loss, fp32_weight_grad, chunk_bytes, label_smoothing, logit_scale,
                                                  mask);
    ctx->save_for_backward({gh, gw, gb});
    return loss;
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    const Mask mask = saved_mask(ctx);
    auto saved = ctx->get_saved_variables();
    Three g;
    if (auto& d = ctx->saved_data; d.count("chunk_bytes")) {  // reduction "none"
      const std::optional<at::Tensor> bias = saved[3].defined() ? std::optional(saved[3]) : std::nullopt;
      g = call<FlceRowsBackwardOp>(grads[0], saved[0], saved[1], saved[2], bias, d["ignore_index"].toInt(),
                                   d["softcap"].toDouble(), d["z_loss"].toDouble(), d["fp32_weight_grad"].toBool(),
                                   d["chunk_bytes"].toInt(), d["label_smoothing"].toDouble(),
                                   d["logit_scale"].toDouble(), mask);
    } else {
      g = scale_formed(saved, grads[0]);
    }
    saved.clear();
    return argument_grads(g, mask);
  }

  template <c10::DeviceType device>
  static at::Tensor autocast(const auto&... a) {
    return autocast_hidden<FlceOp, device>(a...);
  }
};

// ------------------------------------------------------------------------------ fused_linear_log_probs

constexpr const char* kLogProbs = "fused_linear_log_probs";

Options log_prob_options(int64_t ignore_index, double temperature, double logit_scale, double softcap,
                         bool fp32_weight_grad, int64_t chunk_bytes) {
  auto o = options(ignore_index, "none", softcap, 0.0, fp32_weight_grad, chunk_bytes);
  TORCH_CHECK(std::isfinite(temperature) && temperature > 0,
              "bastile.fused_linear_log_probs: temperature must be > 0, got ", temperature);
  TORCH_CHECK(std::isfinite(logit_scale), "bastile.fused_linear_log_probs: logit_scale must be finite, got ",
              logit_scale);
  o.logit_scale = logit_scale, o.temperature = temperature, o.stats = true;
  return o;
}

using Five = std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor>;

// log_probs, entropy, log_sum_sq_probs, mean_logits, is_top1 (target's shape) of a run with stats.
Five per_row(const Result& r, const at::Tensor& target) {
  if (r.stats.is_meta()) {
    const auto like = [&] { return at::empty_like(r.row_loss); };
    return {like(), like(), like(), like(), at::empty_like(r.row_loss, r.row_loss.options().dtype(at::kBool))};
  }
  const auto column = [&](int k) { return r.stats.select(1, k).reshape(target.sizes()); };
  return {r.row_loss.neg(), column(0).clone(), column(1).clone(), column(2).clone(), column(3).gt(0)};
}

struct FlpForwardOp {
  static constexpr const char* schema =
      "fused_linear_log_probs_forward(Tensor hidden, Tensor weight, Tensor target, Tensor? bias=None, "
      "int ignore_index=-100, float temperature=1.0, float logit_scale=1.0, float softcap=0.0, "
      "bool fp32_weight_grad=True, int chunk_bytes=0, bool[3] grad_mask=[False, False, False]) -> "
      "(Tensor log_probs, Tensor entropy, Tensor log_sum_sq_probs, Tensor mean_logits, Tensor is_top1, "
      "Tensor grad_hidden, Tensor grad_weight, Tensor grad_bias)";

  // The per-row values and, for grad_mask, the gradients of -sum(log_probs) (as reduction "sum" forms them).
  static std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor>
  kernel(const at::Tensor& hidden, const at::Tensor& weight, const at::Tensor& target,
         const std::optional<at::Tensor>& bias, int64_t ignore_index, double temperature, double logit_scale,
         double softcap, bool fp32_weight_grad, int64_t chunk_bytes, Mask mask) {
    auto o = log_prob_options(ignore_index, temperature, logit_scale, softcap, fp32_weight_grad, chunk_bytes);
    o.reduction = Reduction::Sum;
    const auto r = run(hidden, weight, target, bias, o, mask);
    return std::tuple_cat(per_row(r, target), std::make_tuple(r.grad_hidden, r.grad_weight, r.grad_bias));
  }
};

struct FlpBackwardOp {
  static constexpr const char* schema =
      "fused_linear_log_probs_backward(Tensor? grad_log_probs, Tensor? grad_entropy, Tensor hidden, Tensor weight, "
      "Tensor target, Tensor? bias=None, int ignore_index=-100, float temperature=1.0, float logit_scale=1.0, "
      "float softcap=0.0, bool fp32_weight_grad=True, int chunk_bytes=0, bool[3] grad_mask=[True, True, True]) -> "
      "(Tensor grad_hidden, Tensor grad_weight, Tensor grad_bias)";

  // The logits again, chunk by chunk, each row's gradient weighted by its two upstream gradients.
  static Three kernel(const std::optional<at::Tensor>& grad_log_probs, const std::optional<at::Tensor>& grad_entropy,
                      const at::Tensor& hidden, const at::Tensor& weight, const at::Tensor& target,
                      const std::optional<at::Tensor>& bias, int64_t ignore_index, double temperature,
                      double logit_scale, double softcap, bool fp32_weight_grad, int64_t chunk_bytes, Mask mask) {
    auto o = log_prob_options(ignore_index, temperature, logit_scale, softcap, fp32_weight_grad, chunk_bytes);
    o.stats = false;
    for (const auto* g : {&grad_log_probs, &grad_entropy})
      if (has(*g)) {
        TORCH_CHECK((*g)->is_floating_point() && (*g)->sym_sizes() == target.sym_sizes(),
                    "bastile.fused_linear_log_probs_backward: the gradients must be floating with target's shape ",
                    target.sym_sizes(), ", got ", (*g)->scalar_type(), " of shape ", (*g)->sym_sizes());
        check_device(kLogProbs, {"hidden", hidden}, {{"gradient", **g}});
      }
    // The kernel's loss is -log p: its upstream gradient is minus log p's.
    const auto row_scale = has(grad_log_probs) ? grad_log_probs->neg()
                                               : at::zeros_like(target, hidden.options().dtype(stats_dtype(hidden)));
    const auto r = run(hidden, weight, target, bias, o, mask, row_scale, has(grad_entropy) ? *grad_entropy : at::Tensor());
    return {r.grad_hidden, r.grad_weight, r.grad_bias};
  }
};

// The rows whose target counts.
at::Tensor counted(const at::Tensor& target, int64_t ignore_index, const c10::SymInt& vocab) {
  return target.ne(ignore_index).logical_and_(target.ge(0)).logical_and_(target.lt(vocab));
}

// With uniform_grad: -g, g the one upstream gradient of every counted row (0 when none is counted), which the
// device asserts (a CPU tensor is checked at once). The forward's gradients are those of -sum(log_probs).
at::Tensor uniform_factor(const at::Tensor& grad, const at::Tensor& counted) {
  if (!grad.numel()) return at::zeros({}, grad.options());
  const auto inf = std::numeric_limits<double>::infinity();
  const auto hi = at::where(counted, grad, -inf).max(), lo = at::where(counted, grad, inf).min();
  const auto any = counted.any();
  at::_assert_async(hi.eq(lo).logical_or_(any.logical_not()),
                    "bastile.fused_linear_log_probs: uniform_grad promised one upstream gradient for every counted "
                    "row, but they differ; pass uniform_grad=False");
  return at::where(any, hi.neg(), at::zeros({}, grad.options()));
}

struct FlpOp {
  static constexpr const char* schema =
      "fused_linear_log_probs(Tensor hidden, Tensor weight, Tensor target, Tensor? bias=None, int ignore_index=-100, "
      "float temperature=1.0, float logit_scale=1.0, float softcap=0.0, bool uniform_grad=False, "
      "bool fp32_weight_grad=True, int chunk_bytes=0) -> "
      "(Tensor log_probs, Tensor entropy, Tensor log_sum_sq_probs, Tensor mean_logits, Tensor is_top1)";

  static Five kernel(const at::Tensor& hidden, const at::Tensor& weight, const at::Tensor& target,
                     const std::optional<at::Tensor>& bias, int64_t ignore_index, double temperature,
                     double logit_scale, double softcap, bool uniform_grad, bool fp32_weight_grad, int64_t chunk_bytes) {
    auto [lp, h, sq, mean, top1, gh, gw, gb] = call<FlpForwardOp>(
        hidden, weight, target, bias, ignore_index, temperature, logit_scale, softcap, fp32_weight_grad, chunk_bytes,
        Mask{false, false, false});
    return {lp, h, sq, mean, top1};
  }

  static variable_list forward(AutogradContext* ctx, const at::Tensor& hidden, const at::Tensor& weight,
                               const at::Tensor& target, const std::optional<at::Tensor>& bias, int64_t ignore_index,
                               double temperature, double logit_scale, double softcap, bool uniform_grad,
                               bool fp32_weight_grad, int64_t chunk_bytes) {
    const Mask mask{hidden.requires_grad(), weight.requires_grad(), has(bias) && bias->requires_grad()};
    ctx->set_materialize_grads(false);  // an entropy used for logging only takes no backward work
    auto [lp, h, sq, mean, top1, gh, gw, gb] = call<FlpForwardOp>(
        hidden, weight, target, bias, ignore_index, temperature, logit_scale, softcap, fp32_weight_grad, chunk_bytes,
        uniform_grad ? mask : Mask{false, false, false});
    auto& d = ctx->saved_data;
    save_mask(ctx, mask);
    d["uniform_grad"] = uniform_grad, d["ignore_index"] = ignore_index;
    if (uniform_grad) {
      ctx->save_for_backward({gh, gw, gb, counted(target, ignore_index, weight.sym_size(0))});
    } else {
      ctx->save_for_backward({hidden, weight, target, has(bias) ? *bias : at::Tensor()});
      d["temperature"] = temperature, d["logit_scale"] = logit_scale, d["softcap"] = softcap;
      d["fp32_weight_grad"] = fp32_weight_grad, d["chunk_bytes"] = chunk_bytes;
    }
    ctx->mark_non_differentiable({sq, mean, top1});
    return {lp, h, sq, mean, top1};
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    auto& d = ctx->saved_data;
    const Mask mask = saved_mask(ctx);
    const auto &g_lp = grads[0], &g_h = grads[1];
    if (!g_lp.defined() && !g_h.defined()) return variable_list(4);
    auto saved = ctx->get_saved_variables();
    Three g;
    if (d["uniform_grad"].toBool()) {
      TORCH_CHECK(!g_h.defined(), "bastile.fused_linear_log_probs: with uniform_grad the forward formed the gradients ",
                  "of the log-probabilities alone, but the entropy has a gradient; pass uniform_grad=False");
      const auto factor = uniform_factor(g_lp, saved[3]);
      g = scale_formed(saved, factor);
    } else {
      const auto opt = [](const at::Tensor& t) { return t.defined() ? std::optional(t) : std::nullopt; };
      g = call<FlpBackwardOp>(opt(g_lp), opt(g_h), saved[0], saved[1], saved[2], opt(saved[3]),
                              d["ignore_index"].toInt(), d["temperature"].toDouble(), d["logit_scale"].toDouble(),
                              d["softcap"].toDouble(), d["fp32_weight_grad"].toBool(), d["chunk_bytes"].toInt(),
                              mask);
    }
    saved.clear();
    return argument_grads(g, mask);
  }

  template <c10::DeviceType device>
  static Five autocast(const auto&... a) {
    return autocast_hidden<FlpOp, device>(a...);
  }
};

}  // namespace
}  // namespace bastile

BASTILE_OPS(bastile::FlceOp, bastile::FlceForwardOp, bastile::FlceBackwardOp, bastile::FlceRowsBackwardOp,
            bastile::FlpOp, bastile::FlpForwardOp, bastile::FlpBackwardOp)

