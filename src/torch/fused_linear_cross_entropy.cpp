// torch.ops.bastile.fused_linear_cross_entropy: the loss of
// F.cross_entropy((hidden @ weight.T + bias).float(), target, ignore_index, reduction) without the
// [rows, vocab] logits. Rows go in chunks whose logits (hidden's dtype, from cuBLAS) stay within a
// memory budget; per chunk, our kernel turns the logits into the loss rows and, in place, into
// d(loss)/d(logits), and two more GEMMs fold that into grad_hidden and grad_weight. The forward thus
// produces every gradient for a unit upstream gradient; the backward only scales them.
//
//   fused_linear_cross_entropy(...) -> loss                   what users call; differentiable
//   fused_linear_cross_entropy_forward(..., grad_mask) -> (loss, grad_hidden, grad_weight, grad_bias)
//   fused_linear_cross_entropy_backward(grad_loss, grad_hidden, grad_weight, grad_bias) -> the three scaled
#include <ATen/autocast_mode.h>
#include <c10/core/DeviceGuard.h>
#include <torch/autograd.h>
#include <torch/csrc/autograd/graph_task.h>
#include <torch/csrc/autograd/autograd_not_implemented_fallback.h>

#include <array>
#include <cmath>
#include <cstdlib>

#include "bastile/src/fused_linear_cross_entropy.rs.h"
#include "common.h"
#include "fused_linear_cross_entropy.h"

namespace bastile {
namespace {

constexpr const char* kOp = "fused_linear_cross_entropy";
// Logits of one chunk stay within this many bytes; BASTILE_FLCE_CHUNK_BYTES overrides it (tests use it
// to get several chunks from small inputs). 256 MiB is 768 rows of Qwen3's vocabulary in bf16. Every
// chunk's weight-gradient GEMM reads and writes the whole [vocab, hidden] accumulator, so its arithmetic
// intensity is proportional to the chunk's rows divided by the accumulator's element size: an f32
// accumulator gets twice the bytes (1664 bf16 rows of Qwen3's vocabulary), which keeps that GEMM
// compute-bound on an H100. The chunk comes on top of a model's activations at the end of its forward,
// so it sets the peak of a training step: 768 MiB gave Qwen3-0.6B (seq 4096, batch 2) a peak 1 GiB above
// Liger Kernel's. An f32 sum cast to the weight's dtype at the end needs the sum and the cast copy at
// once, so chunks up to the copy's size raise no peak the cast does not reach: the budget grows to it
// (hidden rows a chunk; H100, 8192x4096 rows x hidden, Qwen3's vocabulary: 47.0 ms for 1 GiB chunks vs
// 52.5 for 512 MiB, the op's peak 3.54 GiB for both).
constexpr int64_t kChunkBytes = int64_t(256) << 20;
constexpr int64_t kChunkBytesF32Accumulator = int64_t(512) << 20;
constexpr int64_t kChunkAlign = 128;

using Mask = std::array<bool, 3>;  // which of grad_hidden, grad_weight, grad_bias to compute

struct Options {
  int64_t ignore_index;
  bool mean;
  double softcap;
  double z_loss;
  bool fp32_weight_grad;
};

Options options(int64_t ignore_index, c10::string_view reduction, double softcap, double z_loss,
                bool fp32_weight_grad) {
  TORCH_CHECK(reduction == "mean" || reduction == "sum",
              "bastile.fused_linear_cross_entropy: reduction must be \"mean\" or \"sum\", got \"", reduction, "\"");
  TORCH_CHECK(std::isfinite(softcap) && softcap >= 0,
              "bastile.fused_linear_cross_entropy: softcap must be >= 0 (0 = off), got ", softcap);
  TORCH_CHECK(std::isfinite(z_loss) && z_loss >= 0,
              "bastile.fused_linear_cross_entropy: z_loss must be >= 0, got ", z_loss);
  return {ignore_index, reduction == "mean", softcap, z_loss, fp32_weight_grad};
}

// Shape, dtype and device checks shared by every kernel, Meta included (hence the sym_ sizes).
void check_inputs(const at::Tensor& hidden, const at::Tensor& weight, const at::Tensor& target,
                  const std::optional<at::Tensor>& bias) {
  dtype_code(hidden, kOp, "hidden");
  dtype_code(weight, kOp, "weight");
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
  TORCH_CHECK(weight.device() == hidden.device() && target.device() == hidden.device(),
              "bastile.fused_linear_cross_entropy: weight (on ", weight.device(), ") and target (on ", target.device(),
              ") must be on hidden's device, ", hidden.device());
  if (bias.has_value() && bias->defined()) {
    dtype_code(*bias, kOp, "bias");
    TORCH_CHECK(bias->dim() == 1 && bias->sym_size(0) == weight.sym_size(0),
                "bastile.fused_linear_cross_entropy: bias must have shape [", weight.sym_size(0), "], got ",
                bias->sym_sizes());
    TORCH_CHECK(bias->device() == hidden.device(), "bastile.fused_linear_cross_entropy: bias is on ",
                bias->device(), " but hidden is on ", hidden.device());
  }
}

bool has(const std::optional<at::Tensor>& t) { return t.has_value() && t->defined(); }

at::ScalarType loss_dtype(const at::Tensor& hidden) {
  return hidden.scalar_type() == at::kDouble ? at::kDouble : at::kFloat;
}

// Dtype the weight (bias) gradient is summed over chunks in.
at::ScalarType accumulate_dtype(at::ScalarType own, const Options& o) {
  return o.fp32_weight_grad ? at::promote_types(own, at::kFloat) : own;
}

// cast_bytes: the size of the weight gradient's final cast copy (0 when there is none).
int64_t chunk_rows(int64_t rows, int64_t vocab, int64_t elem_bytes, bool f32_accumulator, int64_t cast_bytes) {
  int64_t budget = std::max(f32_accumulator ? kChunkBytesF32Accumulator : kChunkBytes, cast_bytes);
  if (const char* env = std::getenv("BASTILE_FLCE_CHUNK_BYTES")) budget = std::max<int64_t>(1, std::atoll(env));
  int64_t n = std::max<int64_t>(1, budget / (vocab * elem_bytes));
  if (n >= kChunkAlign) n = n / kChunkAlign * kChunkAlign;
  return std::min(n, std::max<int64_t>(rows, 1));
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

void run_chunk(CrossEntropyChunk& p, const at::Tensor& logits) {
  if (logits.is_cuda()) {
    call_rust([&] { rs::fused_linear_cross_entropy::chunk_cuda(p, logits.device().index(), current_stream(logits)); });
  } else {
    TORCH_CHECK(logits.is_cpu(), "bastile.fused_linear_cross_entropy: unsupported device ", logits.device());
    call_rust([&] { rs::fused_linear_cross_entropy::chunk_cpu(p); });
  }
}

// The loss, and the gradients `mask` asks for (empty [0] tensors for the others).
std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> run(const at::Tensor& hidden_in, const at::Tensor& weight_in,
                                                               const at::Tensor& target_in,
                                                               const std::optional<at::Tensor>& bias_in,
                                                               const Options& o, Mask mask) {
  check_inputs(hidden_in, weight_in, target_in, bias_in);
  const c10::DeviceGuard guard(hidden_in.device());
  const int64_t cols = hidden_in.size(-1), vocab = weight_in.size(0);
  const auto hidden = hidden_in.reshape({-1, cols}).contiguous();
  const auto target = target_in.reshape({-1}).contiguous();
  const int64_t rows = hidden.size(0);
  // Mixed dtypes (autocast leaves an f32 weight): the GEMMs run in hidden's dtype, as F.linear's would.
  const auto weight = weight_in.to(hidden.scalar_type()).contiguous();
  const bool with_bias = has(bias_in);
  const auto bias = with_bias ? bias_in->to(hidden.scalar_type()).contiguous() : at::Tensor();
  const bool need_h = mask[0], need_w = mask[1], need_b = mask[2] && with_bias;
  const bool grad = need_h || need_w || need_b;

  // The mean's divisor, counted on the device before any gradient is written: no host sync.
  const auto count = at::ne(target, o.ignore_index).logical_and_(at::ge(target, 0)).logical_and_(at::lt(target, vocab)).sum();
  const auto row_loss = at::empty({rows}, hidden.options().dtype(loss_dtype(hidden)));
  auto grad_hidden = need_h ? at::empty({rows, cols}, hidden.options()) : at::empty({0}, hidden_in.options());
  auto acc_w = need_w ? at::empty({vocab, cols}, weight.options().dtype(accumulate_dtype(weight_in.scalar_type(), o)))
                      : at::Tensor();
  auto acc_b = need_b ? at::empty({vocab}, bias.options().dtype(accumulate_dtype(bias_in->scalar_type(), o)))
                      : at::Tensor();

  const bool f32_accumulator = need_w && acc_w.scalar_type() == at::kFloat;
  const bool cast = need_w && acc_w.scalar_type() != weight_in.scalar_type();
  const int64_t step = chunk_rows(rows, vocab, hidden.element_size(), f32_accumulator,
                                  cast ? vocab * cols * weight_in.element_size() : 0);
  for (int64_t start = 0; start < rows; start += step) {
    const int64_t n = std::min(step, rows - start);
    const auto h = hidden.narrow(0, start, n);
    const auto logits = with_bias ? at::addmm(bias, h, weight.t()) : at::mm(h, weight.t());
    CrossEntropyChunk p{};
    p.logits = logits.data_ptr();
    p.target = target.data_ptr<int64_t>() + start;
    p.loss = static_cast<char*>(row_loss.data_ptr()) + start * row_loss.element_size();
    p.count = o.mean ? count.data_ptr<int64_t>() : nullptr;
    p.rows = n;
    p.vocab = vocab;
    p.ld = logits.stride(0);
    p.ignore_index = o.ignore_index;
    p.softcap = o.softcap;
    p.z_loss = o.z_loss;
    p.dtype = dtype_code(logits, kOp, "logits");
    p.grad = grad;
    run_chunk(p, logits);
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

  auto loss = row_loss.sum();
  if (o.mean) loss = loss / count.clamp_min(1);  // every target ignored: loss 0, as are the gradients
  // The one full-size cast of an f32 accumulator (none when the dtypes agree).
  auto grad_weight = need_w ? acc_w.to(weight_in.scalar_type()) : at::empty({0}, weight_in.options());
  auto grad_bias = need_b ? acc_b.to(bias_in->scalar_type())
                          : at::empty({0}, with_bias ? bias_in->options() : hidden_in.options());
  if (need_h) grad_hidden = grad_hidden.view(hidden_in.sizes());
  return {loss, grad_hidden, grad_weight, grad_bias};
}

at::Tensor flce(const at::Tensor& hidden, const at::Tensor& weight, const at::Tensor& target,
                const std::optional<at::Tensor>& bias, int64_t ignore_index, c10::string_view reduction,
                double softcap, double z_loss, bool fp32_weight_grad) {
  const auto o = options(ignore_index, reduction, softcap, z_loss, fp32_weight_grad);
  return std::get<0>(run(hidden, weight, target, bias, o, {false, false, false}));
}

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> flce_forward(
    const at::Tensor& hidden, const at::Tensor& weight, const at::Tensor& target,
    const std::optional<at::Tensor>& bias, int64_t ignore_index, c10::string_view reduction, double softcap,
    double z_loss, bool fp32_weight_grad, Mask mask) {
  const auto o = options(ignore_index, reduction, softcap, z_loss, fp32_weight_grad);
  return run(hidden, weight, target, bias, o, mask);
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
    const c10::DeviceGuard guard(grad.device());
    auto out = in_place ? grad : at::empty_like(grad);
    GradScale p{};
    p.src = grad.data_ptr();
    p.dst = out.data_ptr();
    p.factor = grad_loss.data_ptr<float>();
    p.n = grad.numel();
    p.dtype = dtype_code(grad, kOp, "gradient");
    call_rust([&] { rs::fused_linear_cross_entropy::scale_cuda(p, grad.device().index(), current_stream(grad)); });
    if (in_place) grad.unsafeGetTensorImpl()->bump_version();  // as mul_ would: the tensor was written
    return out;
  }
  return in_place ? grad.mul_(grad_loss) : at::mul(grad, grad_loss);
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> flce_backward(const at::Tensor& grad_loss, const at::Tensor& grad_hidden,
                                                             const at::Tensor& grad_weight, const at::Tensor& grad_bias) {
  check_grad_loss(grad_loss);
  return {scale(grad_hidden, grad_loss, false), scale(grad_weight, grad_loss, false), scale(grad_bias, grad_loss, false)};
}

// Meta kernels: shapes and dtypes only, symbolic sizes kept for torch.compile(dynamic=True).
at::Tensor flce_meta(const at::Tensor& hidden, const at::Tensor& weight, const at::Tensor& target,
                     const std::optional<at::Tensor>& bias, int64_t ignore_index, c10::string_view reduction,
                     double softcap, double z_loss, bool fp32_weight_grad) {
  options(ignore_index, reduction, softcap, z_loss, fp32_weight_grad);
  check_inputs(hidden, weight, target, bias);
  return at::empty({}, hidden.options().dtype(loss_dtype(hidden)));
}

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> flce_forward_meta(
    const at::Tensor& hidden, const at::Tensor& weight, const at::Tensor& target,
    const std::optional<at::Tensor>& bias, int64_t ignore_index, c10::string_view reduction, double softcap,
    double z_loss, bool fp32_weight_grad, Mask mask) {
  auto loss = flce_meta(hidden, weight, target, bias, ignore_index, reduction, softcap, z_loss, fp32_weight_grad);
  const auto none = [](const at::Tensor& like) { return at::empty({0}, like.options()); };
  auto gh = mask[0] ? at::empty_symint(hidden.sym_sizes(), hidden.options()) : none(hidden);
  auto gw = mask[1] ? at::empty_symint(weight.sym_sizes(), weight.options()) : none(weight);
  auto gb = mask[2] && has(bias) ? at::empty_symint(bias->sym_sizes(), bias->options()) : none(has(bias) ? *bias : hidden);
  return {loss, gh, gw, gb};
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> flce_backward_meta(const at::Tensor& grad_loss, const at::Tensor& grad_hidden,
                                                                  const at::Tensor& grad_weight, const at::Tensor& grad_bias) {
  check_grad_loss(grad_loss);
  return {at::empty_like(grad_hidden), at::empty_like(grad_weight), at::empty_like(grad_bias)};
}

using ForwardOp = std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor>(
    const at::Tensor&, const at::Tensor&, const at::Tensor&, const std::optional<at::Tensor>&, int64_t,
    c10::string_view, double, double, bool, Mask);
using LossOp = at::Tensor(const at::Tensor&, const at::Tensor&, const at::Tensor&, const std::optional<at::Tensor>&,
                          int64_t, c10::string_view, double, double, bool);
using BackwardOp = std::tuple<at::Tensor, at::Tensor, at::Tensor>(const at::Tensor&, const at::Tensor&,
                                                                  const at::Tensor&, const at::Tensor&);

at::Tensor call_flce(const at::Tensor& hidden, const at::Tensor& weight, const at::Tensor& target,
                     const std::optional<at::Tensor>& bias, int64_t ignore_index, c10::string_view reduction,
                     double softcap, double z_loss, bool fp32_weight_grad) {
  static const auto op =
      c10::Dispatcher::singleton().findSchemaOrThrow("bastile::fused_linear_cross_entropy", "").typed<LossOp>();
  return op.call(hidden, weight, target, bias, ignore_index, reduction, softcap, z_loss, fp32_weight_grad);
}

// Tensors that torch.compile traces (fake or functional tensors) must not be mutated behind its back.
bool traced(const at::Tensor& t) {
  return t.key_set().has(c10::DispatchKey::Python) || t.key_set().has(c10::DispatchKey::Functionalize);
}

class FlceFunction : public torch::autograd::Function<FlceFunction> {
 public:
  static at::Tensor forward(torch::autograd::AutogradContext* ctx, const at::Tensor& hidden, const at::Tensor& weight,
                            const at::Tensor& target, const std::optional<at::Tensor>& bias, int64_t ignore_index,
                            c10::string_view reduction, double softcap, double z_loss, bool fp32_weight_grad) {
    static const auto op = c10::Dispatcher::singleton()
                               .findSchemaOrThrow("bastile::fused_linear_cross_entropy_forward", "")
                               .typed<ForwardOp>();
    const Mask mask{hidden.requires_grad(), weight.requires_grad(), has(bias) && bias->requires_grad()};
    const at::AutoDispatchBelowADInplaceOrView below_autograd;
    auto [loss, gh, gw, gb] = op.call(hidden, weight, target, bias, ignore_index, reduction, softcap, z_loss,
                                      fp32_weight_grad, mask);
    ctx->save_for_backward({gh, gw, gb});
    ctx->saved_data["mask"] = int64_t(mask[0]) | int64_t(mask[1]) << 1 | int64_t(mask[2]) << 2;
    return loss;
  }

  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grads) {
    static const auto op = c10::Dispatcher::singleton()
                               .findSchemaOrThrow("bastile::fused_linear_cross_entropy_backward", "")
                               .typed<BackwardOp>();
    const int64_t mask = ctx->saved_data["mask"].toInt();
    torch::autograd::variable_list out(9);
    if (!grads[0].defined()) return out;
    auto saved = ctx->get_saved_variables();
    std::tuple<at::Tensor, at::Tensor, at::Tensor> g;
    const bool retained = torch::autograd::get_current_graph_task_keep_graph();
    if (retained || traced(grads[0]) || traced(saved[0]) || traced(saved[1])) {
      g = op.call(grads[0], saved[0], saved[1], saved[2]);
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
};

at::Tensor flce_autograd(const at::Tensor& hidden, const at::Tensor& weight, const at::Tensor& target,
                         const std::optional<at::Tensor>& bias, int64_t ignore_index, c10::string_view reduction,
                         double softcap, double z_loss, bool fp32_weight_grad) {
  if (at::GradMode::is_enabled() && (hidden.requires_grad() || weight.requires_grad() || (has(bias) && bias->requires_grad())))
    return FlceFunction::apply(hidden, weight, target, bias, ignore_index, reduction, softcap, z_loss, fp32_weight_grad);
  // Nothing to differentiate: the loss alone, with no gradient GEMMs or buffers.
  const at::AutoDispatchBelowADInplaceOrView below_autograd;
  return call_flce(hidden, weight, target, bias, ignore_index, reduction, softcap, z_loss, fp32_weight_grad);
}

// Autocast treats the op as it treats F.linear followed by an f32 cross-entropy: an f32 hidden is cast
// to the autocast dtype (differentiably), so the logits are computed as HF's lm_head computes them. The
// weight and bias keep their dtypes: the op casts them for the GEMMs itself, so their gradients are
// summed in (at least) their own dtype and returned in it.
template <c10::DeviceType device_type>
at::Tensor flce_autocast(const at::Tensor& hidden, const at::Tensor& weight, const at::Tensor& target,
                         const std::optional<at::Tensor>& bias, int64_t ignore_index, c10::string_view reduction,
                         double softcap, double z_loss, bool fp32_weight_grad) {
  const c10::impl::ExcludeDispatchKeyGuard no_autocast(c10::autocast_dispatch_keyset);
  const auto h = at::autocast::cached_cast(at::autocast::get_autocast_dtype(device_type), hidden, device_type);
  return call_flce(h, weight, target, bias, ignore_index, reduction, softcap, z_loss, fp32_weight_grad);
}

}  // namespace
}  // namespace bastile

TORCH_LIBRARY_FRAGMENT(bastile, m) {
  const std::vector<at::Tag> tags{at::Tag::pt2_compliant_tag};
  m.def("fused_linear_cross_entropy(Tensor hidden, Tensor weight, Tensor target, Tensor? bias=None, "
        "int ignore_index=-100, str reduction=\"mean\", float softcap=0.0, float z_loss=0.0, "
        "bool fp32_weight_grad=True) -> Tensor",
        tags);
  m.def("fused_linear_cross_entropy_forward(Tensor hidden, Tensor weight, Tensor target, Tensor? bias=None, "
        "int ignore_index=-100, str reduction=\"mean\", float softcap=0.0, float z_loss=0.0, "
        "bool fp32_weight_grad=True, bool[3] grad_mask=[True, True, True]) -> "
        "(Tensor loss, Tensor grad_hidden, Tensor grad_weight, Tensor grad_bias)",
        tags);
  m.def("fused_linear_cross_entropy_backward(Tensor grad_loss, Tensor grad_hidden, Tensor grad_weight, "
        "Tensor grad_bias) -> (Tensor, Tensor, Tensor)",
        tags);
}

TORCH_LIBRARY_IMPL(bastile, CPU, m) {
  m.impl("fused_linear_cross_entropy", &bastile::flce);
  m.impl("fused_linear_cross_entropy_forward", &bastile::flce_forward);
  m.impl("fused_linear_cross_entropy_backward", &bastile::flce_backward);
}

TORCH_LIBRARY_IMPL(bastile, CUDA, m) {
  m.impl("fused_linear_cross_entropy", &bastile::flce);
  m.impl("fused_linear_cross_entropy_forward", &bastile::flce_forward);
  m.impl("fused_linear_cross_entropy_backward", &bastile::flce_backward);
}

TORCH_LIBRARY_IMPL(bastile, Meta, m) {
  m.impl("fused_linear_cross_entropy", &bastile::flce_meta);
  m.impl("fused_linear_cross_entropy_forward", &bastile::flce_forward_meta);
  m.impl("fused_linear_cross_entropy_backward", &bastile::flce_backward_meta);
}

TORCH_LIBRARY_IMPL(bastile, Autograd, m) {
  m.impl("fused_linear_cross_entropy", &bastile::flce_autograd);
  // The pieces are not differentiable themselves: a clear error instead of a silent missing grad_fn.
  m.impl("fused_linear_cross_entropy_forward", torch::autograd::autogradNotImplementedFallback());
  m.impl("fused_linear_cross_entropy_backward", torch::autograd::autogradNotImplementedFallback());
}

TORCH_LIBRARY_IMPL(bastile, AutocastCUDA, m) {
  m.impl("fused_linear_cross_entropy", &bastile::flce_autocast<c10::DeviceType::CUDA>);
}
TORCH_LIBRARY_IMPL(bastile, AutocastCPU, m) {
  m.impl("fused_linear_cross_entropy", &bastile::flce_autocast<c10::DeviceType::CPU>);
}
