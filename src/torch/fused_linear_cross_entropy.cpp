// torch.ops.bastile.fused_linear_cross_entropy: the loss of
// F.cross_entropy((hidden @ weight.T + bias).float(), target, ignore_index, reduction) without the
// [rows, vocab] logits. Rows go in chunks whose logits (hidden's dtype, from cuBLAS) stay within a memory
// budget (src/fused_linear_cross_entropy.rs: chunk_rows; `chunk_bytes` overrides it); per chunk, our kernel
// (cuda/fused_linear_cross_entropy.cu) turns the logits into the loss rows and, in place, into
// d(loss)/d(logits), and two more GEMMs fold that into grad_hidden and grad_weight. The forward thus
// produces every gradient for a unit upstream gradient (fused_linear_cross_entropy_forward); the backward
// only scales them (fused_linear_cross_entropy_backward). Reduction "none" gives the row losses, whose
// upstream gradients differ by row and are known only in the backward: its forward keeps no gradient, and
// its backward (fused_linear_cross_entropy_rows_backward) makes the logits again, chunk by chunk, with the
// row's upstream gradient folded into the kernel's pass: one more GEMM than the other reductions.
#include <torch/csrc/autograd/graph_task.h>

#include <array>
#include <cmath>

#include "op.h"

namespace bastile {
namespace {

constexpr const char* kOp = "fused_linear_cross_entropy";

using Mask = std::array<bool, 3>;  // which of grad_hidden, grad_weight, grad_bias to compute
using Four = std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor>;

enum class Reduction { Mean, Sum, None };

struct Options {
  int64_t ignore_index;
  Reduction reduction;
  double softcap;
  double z_loss;
  bool fp32_weight_grad;
  int64_t chunk_bytes;
};

Options options(int64_t ignore_index, c10::string_view reduction, double softcap, double z_loss,
                bool fp32_weight_grad, int64_t chunk_bytes) {
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
  return {ignore_index, r, softcap, z_loss, fp32_weight_grad, chunk_bytes};
}

bool has(const std::optional<at::Tensor>& t) { return t.has_value() && t->defined(); }

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

// The loss (reduction "none": the row losses, target's shape), and the gradients `mask` asks for (empty
// [0] tensors for the others): of the loss, or with reduction "none" of the row losses weighted by
// `row_scale` (their upstream gradients, target's shape).
Four run(const at::Tensor& hidden_in, const at::Tensor& weight_in, const at::Tensor& target_in,
         const std::optional<at::Tensor>& bias_in, const Options& o, Mask mask,
         const at::Tensor& row_scale_in = {}) {
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
            need_b ? at::empty_symint(bias_in->sym_sizes(), bias_in->options()) : none(with_bias ? *bias_in : hidden_in)};
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
  const auto row_scale = grad && rows_out ? row_scale_in.reshape({rows}).to(stats_dtype(hidden)).contiguous()
                                          : at::Tensor();

  // The mean's divisor, counted on the device before any gradient is written: no host sync.
  const auto count = at::ne(target, o.ignore_index).logical_and_(at::ge(target, 0)).logical_and_(at::lt(target, vocab)).sum();
  const auto row_loss = at::empty({rows}, hidden.options().dtype(stats_dtype(hidden)));
  auto grad_hidden = need_h ? at::empty({rows, cols}, hidden.options()) : none(hidden_in);
  auto acc_w = need_w ? at::empty({vocab, cols}, weight.options().dtype(sum_dtype(weight_in.scalar_type(), o)))
                      : at::Tensor();
  auto acc_b = need_b ? at::empty({vocab}, bias.options().dtype(sum_dtype(bias_in->scalar_type(), o))) : at::Tensor();

  const bool f32_sum = need_w && acc_w.scalar_type() == at::kFloat;
  const bool cast = need_w && acc_w.scalar_type() != weight_in.scalar_type();
  const int64_t step = rs::cross_entropy_chunk_rows(rows, vocab, hidden.element_size(), f32_sum,
                                                    cast ? vocab * cols * weight_in.element_size() : 0, o.chunk_bytes);
  for (int64_t start = 0; start < rows; start += step) {
    const int64_t n = std::min(step, rows - start);
    const auto h = hidden.narrow(0, start, n);
    const auto logits = with_bias ? at::addmm(bias, h, weight.t()) : at::mm(h, weight.t());
    launch(logits, CrossEntropyChunk{.logits = logits.data_ptr(), .target = target.data_ptr<int64_t>() + start,
                                     .loss = static_cast<char*>(row_loss.data_ptr()) + start * row_loss.element_size(),
                                     .count = o.reduction == Reduction::Mean ? count.data_ptr<int64_t>() : nullptr,
                                     .row_scale = row_scale.defined() ? static_cast<const char*>(row_scale.data_ptr()) +
                                                                            start * row_scale.element_size()
                                                                      : nullptr,
                                     .rows = n, .vocab = vocab,
                                     .ld = logits.stride(0), .ignore_index = o.ignore_index, .softcap = o.softcap,
                                     .z_loss = o.z_loss, .dtype = dtype_code(kOp, {"logits", logits}), .grad = grad});
    if (!grad) continue;
    // `logits` now holds d(loss)/d(logits) of the chunk's rows.
    const bool first = start == 0;
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
  return {loss, grad_hidden, grad_weight, grad_bias};
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
      "bool fp32_weight_grad=True, int chunk_bytes=0, bool[3] grad_mask=[True, True, True]) -> "
      "(Tensor loss, Tensor grad_hidden, Tensor grad_weight, Tensor grad_bias)";

  static Four kernel(const at::Tensor& hidden, const at::Tensor& weight, const at::Tensor& target,
                     const std::optional<at::Tensor>& bias, int64_t ignore_index, c10::string_view reduction,
                     double softcap, double z_loss, bool fp32_weight_grad, int64_t chunk_bytes, Mask mask) {
    const auto o = options(ignore_index, reduction, softcap, z_loss, fp32_weight_grad, chunk_bytes);
    TORCH_CHECK(o.reduction != Reduction::None || !(mask[0] || mask[1] || mask[2]),
                "bastile.fused_linear_cross_entropy_forward: reduction \"none\" forms no gradients in the forward ",
                "(their upstream gradients differ by row): fused_linear_cross_entropy_rows_backward makes them");
    return run(hidden, weight, target, bias, o, mask);
  }
};

struct FlceRowsBackwardOp {
  static constexpr const char* schema =
      "fused_linear_cross_entropy_rows_backward(Tensor grad_rows, Tensor hidden, Tensor weight, Tensor target, "
      "Tensor? bias=None, int ignore_index=-100, float softcap=0.0, float z_loss=0.0, bool fp32_weight_grad=True, "
      "int chunk_bytes=0, bool[3] grad_mask=[True, True, True]) -> "
      "(Tensor grad_hidden, Tensor grad_weight, Tensor grad_bias)";

  static std::tuple<at::Tensor, at::Tensor, at::Tensor> kernel(
      const at::Tensor& grad_rows, const at::Tensor& hidden, const at::Tensor& weight, const at::Tensor& target,
      const std::optional<at::Tensor>& bias, int64_t ignore_index, double softcap, double z_loss,
      bool fp32_weight_grad, int64_t chunk_bytes, Mask mask) {
    const auto o = options(ignore_index, "none", softcap, z_loss, fp32_weight_grad, chunk_bytes);
    TORCH_CHECK(grad_rows.is_floating_point() && grad_rows.sym_sizes() == target.sym_sizes(),
                "bastile.fused_linear_cross_entropy_rows_backward: grad_rows must be floating with target's shape ",
                target.sym_sizes(), ", got ", grad_rows.scalar_type(), " of shape ", grad_rows.sym_sizes());
    check_device(kOp, {"hidden", hidden}, {{"grad_rows", grad_rows}});
    auto [rows, gh, gw, gb] = run(hidden, weight, target, bias, o, mask, grad_rows);
    return {gh, gw, gb};
  }
};

struct FlceBackwardOp {
  static constexpr const char* schema =
      "fused_linear_cross_entropy_backward(Tensor grad_loss, Tensor grad_hidden, Tensor grad_weight, "
      "Tensor grad_bias) -> (Tensor, Tensor, Tensor)";

  static std::tuple<at::Tensor, at::Tensor, at::Tensor> kernel(const at::Tensor& grad_loss, const at::Tensor& grad_hidden,
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

struct FlceOp {
  static constexpr const char* schema =
      "fused_linear_cross_entropy(Tensor hidden, Tensor weight, Tensor target, Tensor? bias=None, "
      "int ignore_index=-100, str reduction=\"mean\", float softcap=0.0, float z_loss=0.0, "
      "bool fp32_weight_grad=True, int chunk_bytes=0) -> Tensor";

  // Nothing to differentiate: the loss alone, with no gradient GEMMs or buffers.
  static at::Tensor kernel(const at::Tensor& hidden, const at::Tensor& weight, const at::Tensor& target,
                           const std::optional<at::Tensor>& bias, int64_t ignore_index, c10::string_view reduction,
                           double softcap, double z_loss, bool fp32_weight_grad, int64_t chunk_bytes) {
    const auto o = options(ignore_index, reduction, softcap, z_loss, fp32_weight_grad, chunk_bytes);
    return std::get<0>(run(hidden, weight, target, bias, o, {false, false, false}));
  }

  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& hidden, const at::Tensor& weight,
                            const at::Tensor& target, const std::optional<at::Tensor>& bias, int64_t ignore_index,
                            c10::string_view reduction, double softcap, double z_loss, bool fp32_weight_grad,
                            int64_t chunk_bytes) {
    const Mask mask{hidden.requires_grad(), weight.requires_grad(), has(bias) && bias->requires_grad()};
    ctx->saved_data["mask"] = int64_t(mask[0]) | int64_t(mask[1]) << 1 | int64_t(mask[2]) << 2;
    if (reduction == "none") {  // the backward makes the logits again
      ctx->save_for_backward({hidden, weight, target, has(bias) ? *bias : at::Tensor()});
      auto& d = ctx->saved_data;
      d["ignore_index"] = ignore_index, d["softcap"] = softcap, d["z_loss"] = z_loss;
      d["fp32_weight_grad"] = fp32_weight_grad, d["chunk_bytes"] = chunk_bytes;
      return call<FlceOp>(hidden, weight, target, bias, ignore_index, reduction, softcap, z_loss, fp32_weight_grad,
                          chunk_bytes);
    }
    auto [loss, gh, gw, gb] = call<FlceForwardOp>(hidden, weight, target, bias, ignore_index, reduction, softcap,
                                                  z_loss, fp32_weight_grad, chunk_bytes, mask);
    ctx->save_for_backward({gh, gw, gb});
    return loss;
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    const int64_t mask = ctx->saved_data["mask"].toInt();
    variable_list out(4);  // hidden, weight, target, bias
    auto saved = ctx->get_saved_variables();
    std::tuple<at::Tensor, at::Tensor, at::Tensor> g;
    const bool retained = torch::autograd::get_current_graph_task_keep_graph();
    if (auto& d = ctx->saved_data; d.count("chunk_bytes")) {  // reduction "none"
      const std::optional<at::Tensor> bias = saved[3].defined() ? std::optional(saved[3]) : std::nullopt;
      g = call<FlceRowsBackwardOp>(grads[0], saved[0], saved[1], saved[2], bias, d["ignore_index"].toInt(),
                                   d["softcap"].toDouble(), d["z_loss"].toDouble(), d["fp32_weight_grad"].toBool(),
                                   d["chunk_bytes"].toInt(), Mask{bool(mask & 1), bool(mask & 2), bool(mask & 4)});
    } else if (retained || traced(grads[0]) || traced(saved[0]) || traced(saved[1])) {
      g = call<FlceBackwardOp>(grads[0], saved[0], saved[1], saved[2]);
    } else {
      // The gradients were made for this context alone and the graph is freed after this backward, so
      // they are scaled where they lie (no second [vocab, hidden] buffer), and AccumulateGrad can take
      // them as .grad once the context releases them.
      check_grad_loss(grads[0]);
      g = {scale(saved[0], grads[0], true), scale(saved[1], grads[0], true), scale(saved[2], grads[0], true)};
    }
    saved.clear();
    if (mask & 1) out[0] = std::get<0>(g);
    if (mask & 2) out[1] = std::get<1>(g);
    if (mask & 4) out[3] = std::get<2>(g);
    return out;
  }

  // Autocast treats the op as it treats F.linear followed by an f32 cross-entropy: an f32 hidden is cast to
  // the autocast dtype (differentiably), so the logits are computed as HF's lm_head computes them. The
  // weight and bias keep their dtypes: the op casts them for the GEMMs itself, so their gradients are
  // summed in (at least) their own dtype and returned in it.
  template <c10::DeviceType device>
  static at::Tensor autocast(const at::Tensor& hidden, const auto&... rest) {
    return call<FlceOp>(at::autocast::cached_cast(at::autocast::get_autocast_dtype(device), hidden, device), rest...);
  }
};

}  // namespace
}  // namespace bastile

BASTILE_OPS(bastile::FlceOp, bastile::FlceForwardOp, bastile::FlceBackwardOp, bastile::FlceRowsBackwardOp)
