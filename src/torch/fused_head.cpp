// The fused heads' driver (fused_head.h).
#include "fused_head.h"

#include <cmath>

namespace bastile::head {
namespace {

constexpr const char* kOp = "fused_linear_cross_entropy";

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

// Tensors that torch.compile traces (fake or functional tensors) must not be mutated behind its back.
bool traced(const at::Tensor& t) {
  return t.key_set().has(c10::DispatchKey::Python) || t.key_set().has(c10::DispatchKey::Functionalize);
}

}  // namespace

at::ScalarType sum_dtype(at::ScalarType own, bool fp32) { return fp32 ? at::promote_types(own, at::kFloat) : own; }

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

void fold_chunk(const at::Tensor& g, const at::Tensor& hidden, const at::Tensor& weight, at::Tensor grad_hidden,
                at::Tensor& acc_w, at::Tensor& acc_b, bool first) {
  if (grad_hidden.defined()) at::mm_out(grad_hidden, g, weight);
  if (acc_w.defined()) add_product(acc_w, g.t(), hidden, first);
  if (acc_b.defined()) {
    const auto sum = at::sum(g, at::IntArrayRef{0}, false, acc_b.scalar_type());
    first ? acc_b.copy_(sum) : acc_b.add_(sum);
  }
}

Options options(int64_t ignore_index, c10::string_view reduction, double softcap, double z_loss,
                bool fp32_weight_grad, int64_t chunk_bytes, double label_smoothing, double logit_scale) {
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

void save_mask(AutogradContext* ctx, Mask m) {
  ctx->saved_data["mask"] = int64_t(m[0]) | int64_t(m[1]) << 1 | int64_t(m[2]) << 2;
}
Mask saved_mask(AutogradContext* ctx) {
  const int64_t bits = ctx->saved_data["mask"].toInt();
  return {bool(bits & 1), bool(bits & 2), bool(bits & 4)};
}

variable_list argument_grads(const Three& g, Mask mask) {
  variable_list out(4);
  if (mask[0]) out[0] = std::get<0>(g);
  if (mask[1]) out[1] = std::get<1>(g);
  if (mask[2]) out[3] = std::get<2>(g);
  return out;
}

Result run(const at::Tensor& hidden_in, const at::Tensor& weight_in, const at::Tensor& target_in,
           const std::optional<at::Tensor>& bias_in, const Options& o, Mask mask, const at::Tensor& row_scale_in,
           const at::Tensor& entropy_scale_in) {
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
  auto acc_w = need_w ? at::empty({vocab, cols}, weight.options().dtype(sum_dtype(weight_in.scalar_type(), o.fp32_weight_grad)))
                      : at::Tensor();
  auto acc_b = need_b ? at::empty({vocab}, bias.options().dtype(sum_dtype(bias_in->scalar_type(), o.fp32_weight_grad))) : at::Tensor();

  // What the Hopper path's epilogue computes (bf16, no bias, statistics, label smoothing or entropy gradient),
  // and TMA reads 16-byte aligned rows.
  const bool gemm_fits = hidden.scalar_type() == at::kBFloat16 && !with_bias && !o.stats && o.label_smoothing == 0 &&
                         !entropy_scale.defined() && aligned16(hidden) && aligned16(weight);
  const auto plan = decide(HeadPlan{
      .rows = rows, .cols = cols, .vocab = vocab, .element_bytes = hidden.element_size(),
      .cast_bytes = need_w && acc_w.scalar_type() != weight_in.scalar_type() ? vocab * cols * weight_in.element_size() : 0,
      .chunk_bytes = o.chunk_bytes, .device = hidden.is_cuda() ? hidden.device().index() : -1, .grad = grad,
      .f32_sum = need_w && acc_w.scalar_type() == at::kFloat, .gemm_fits = gemm_fits});
  const bool own = plan.gemm;
  const int64_t ld = plan.ld, step = plan.step;
  at::Tensor exps, product, scaled, factor;
  const auto ptr = [](const at::Tensor& t) { return t.defined() ? t.data_ptr() : nullptr; };
  if (own) {
    if (grad) exps = at::empty({plan.buffer_rows, ld}, hidden.options());
    factor = at::empty({plan.buffer_rows}, hidden.options().dtype(at::kFloat));
    if (need_h) product = at::empty({plan.buffer_rows, cols}, hidden.options().dtype(at::kFloat));
    if (need_w) scaled = at::empty({plan.buffer_rows, cols}, hidden.options());
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
    fold_chunk(logits, h, weight, need_h ? grad_hidden.narrow(0, start, n) : at::Tensor(), acc_w, acc_b, first);
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

}  // namespace bastile::head

namespace bastile {

head::Three FlceBackwardOp::kernel(const at::Tensor& grad_loss, const at::Tensor& grad_hidden,
                                   const at::Tensor& grad_weight, const at::Tensor& grad_bias) {
  head::check_grad_loss(grad_loss);
  if (grad_hidden.is_meta()) return {at::empty_like(grad_hidden), at::empty_like(grad_weight), at::empty_like(grad_bias)};
  return {head::scale(grad_hidden, grad_loss, false), head::scale(grad_weight, grad_loss, false),
          head::scale(grad_bias, grad_loss, false)};
}

}  // namespace bastile
