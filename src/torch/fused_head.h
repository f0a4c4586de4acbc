// The fused heads' driver (fused_head.cpp), shared by fused_linear_cross_entropy and fused_linear_log_probs
// (fused_linear_divergence takes its GEMM helpers and gradient scaling):
// the loss of F.cross_entropy((hidden @ weight.T + bias).float(), target, ...) and its gradients without the
// [rows, vocab] logits. Rows go in chunks whose logits (hidden's dtype, from cuBLAS) stay within a memory
// budget; per chunk, our kernel (cuda/fused_linear_cross_entropy.cu) turns the logits into the loss rows
// and, in place, into d(loss)/d(logits), and two more GEMMs fold that into grad_hidden and grad_weight. On
// compute capability 9.0 (bf16, no bias, statistics or label smoothing) the chunk's logits GEMM is our own
// instead, whose epilogue leaves values the two gradient GEMMs take as they are, up to a per-row factor
// (include/fused_linear_cross_entropy.h: CrossEntropyGemm). Which path runs, the chunks' rows and the
// buffers are Rust's plan (HeadPlan, src/fused_linear_cross_entropy.rs). A head's spec file says what it
// asks of the driver: the options, the gradients, and the upstream gradients per row where they differ.
#pragma once
#include <array>
#include <optional>
#include <tuple>

#include "op.h"

namespace bastile::head {

using Mask = std::array<bool, 3>;  // which of grad_hidden, grad_weight, grad_bias to compute
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

// The options of a call, checked.
Options options(int64_t ignore_index, c10::string_view reduction, double softcap, double z_loss,
                bool fp32_weight_grad, int64_t chunk_bytes, double label_smoothing = 0.0, double logit_scale = 1.0);

inline bool has(const std::optional<at::Tensor>& t) { return t.has_value() && t->defined(); }

// Dtype a weight (bias) gradient is summed over chunks in: with fp32, at least float32.
at::ScalarType sum_dtype(at::ScalarType own, bool fp32);

// acc = a @ b (first) or acc += a @ b, in acc's dtype. cuBLAS writes an f32 acc from 16-bit operands
// directly; other pairs (the CPU has no such GEMM) go through a product in acc's dtype.
void add_product(at::Tensor& acc, const at::Tensor& a, const at::Tensor& b, bool first);

// Folds a chunk's d(loss)/d(logits) `g` [rows, vocab] into the gradients, each where defined: its rows of
// grad_hidden = g @ weight, acc_w (+)= g^T @ hidden (the chunk's rows), acc_b (+)= g's column sums; `first`: the
// first chunk, whose products start the sums.
void fold_chunk(const at::Tensor& g, const at::Tensor& hidden, const at::Tensor& weight, at::Tensor grad_hidden,
                at::Tensor& acc_w, at::Tensor& acc_b, bool first);

// The mask of an autograd node, kept in its saved_data.
void save_mask(AutogradContext* ctx, Mask m);
Mask saved_mask(AutogradContext* ctx);

// The gradients of a head's arguments (hidden, weight, target, bias): those of g that `mask` asked for.
variable_list argument_grads(const Three& g, Mask mask);

struct Result {
  at::Tensor loss, grad_hidden, grad_weight, grad_bias;
  at::Tensor stats;  // with o.stats: [rows, 4], the kernel's, and the row losses
  at::Tensor row_loss;
};

// The loss (reduction "none": the row losses, target's shape), and the gradients `mask` asks for (empty
// [0] tensors for the others): of the loss, or with reduction "none" of the row losses weighted by
// `row_scale` (their upstream gradients, target's shape) plus the entropies weighted by `entropy_scale`
// (when defined).
Result run(const at::Tensor& hidden, const at::Tensor& weight, const at::Tensor& target,
           const std::optional<at::Tensor>& bias, const Options& o, Mask mask, const at::Tensor& row_scale = {},
           const at::Tensor& entropy_scale = {});

// The gradients a forward formed for a unit upstream gradient, times `factor` (the upstream gradient, 0-dim).
Three scale_formed(const variable_list& formed, const at::Tensor& factor);

// Autocast treats the heads as it treats F.linear followed by f32 math: an f32 hidden is cast to the
// autocast dtype (differentiably), so the logits are computed as HF's lm_head computes them. The weight and
// bias keep their dtypes: the ops cast them for the GEMMs themselves, so their gradients are summed in (at
// least) their own dtype and returned in it.
template <class Spec, c10::DeviceType device>
auto autocast_hidden(const at::Tensor& hidden, const auto&... rest) {
  return call<Spec>(at::autocast::cached_cast(at::autocast::get_autocast_dtype(device), hidden, device), rest...);
}

}  // namespace bastile::head

namespace bastile {

// fused_linear_cross_entropy_backward: the formed gradients times the loss's upstream gradient. Both heads'
// backwards run it where the gradients cannot be scaled in place (scale_formed); registered with
// fused_linear_cross_entropy's ops.
struct FlceBackwardOp {
  static constexpr const char* schema =
      "fused_linear_cross_entropy_backward(Tensor grad_loss, Tensor grad_hidden, Tensor grad_weight, "
      "Tensor grad_bias) -> (Tensor, Tensor, Tensor)";

  static head::Three kernel(const at::Tensor& grad_loss, const at::Tensor& grad_hidden, const at::Tensor& grad_weight,
                            const at::Tensor& grad_bias);
};

}  // namespace bastile
