/* Parameter blocks of cuda/attention_sink.cu: a learned sink logit per head (GPT-OSS) joined to an attention
 * output computed without it. A row is one (token, head) of `dim` elements, row = token * heads + head; lse is
 * the row's log-sum-exp of its scores and L = logaddexp(lse, sink) the normaliser with the sink:
 *   forward   y = out * exp(lse - L)
 *   backward  d = rowsum(grad_y * y), grad_lse = exp(sink - L) * d, grad_out = grad_y * exp(lse - L)
 * (the sink's gradient is -grad_lse summed over tokens, which the C++ layer takes). out, y, grad_y and grad_out
 * are contiguous [tokens, heads, dim] of `dtype`; the per-row tensors and sinks are f32 (f64 with f64, CPU only)
 * and the per-row ones lie at their own (token, head) strides. */
#pragma once
#include "bastile.h"

/* Threads per block; Rust chooses the threads a row shares (`group`, a power of two up to 32). */
#define ATTENTION_SINK_BLOCK 256

/* attention_sink_<fwd|bwd>_<dtype>_<vec|scalar>: 16-byte vectors where every row pointer allows them. */
#define ATTENTION_SINK_FORWARD_KERNELS(K) BASTILE_ELEMENTWISE_KERNELS(K, fwd)
#define ATTENTION_SINK_BACKWARD_KERNELS(K) BASTILE_ELEMENTWISE_KERNELS(K, bwd)

typedef struct AttentionSinkForward {
  const void *out;        /* [tokens, heads, dim] */
  const void *lse;        /* [tokens, heads] at lse_strides */
  const void *sinks;      /* [heads] */
  void *y;                /* [tokens, heads, dim] */
  void *normaliser;       /* [tokens, heads] at normaliser_strides */
  int64_t tokens;
  int64_t heads;
  int64_t dim;
  int64_t lse_strides[2];        /* token, head (elements) */
  int64_t normaliser_strides[2];
  int32_t dtype;
  int32_t group;          /* threads a row: chosen by Rust */
} AttentionSinkForward;

typedef struct AttentionSinkBackward {
  const void *grad_y;     /* [tokens, heads, dim] */
  const void *y;          /* [tokens, heads, dim] as the forward returned it */
  const void *normaliser; /* [tokens, heads] at normaliser_strides */
  const void *sinks;      /* [heads] */
  const void *lse;        /* [tokens, heads] at lse_strides, or null: grad_out is not wanted */
  void *grad_out;         /* [tokens, heads, dim] with lse, else null */
  void *grad_lse;         /* [tokens, heads] at grad_lse_strides */
  int64_t tokens;
  int64_t heads;
  int64_t dim;
  int64_t normaliser_strides[2];
  int64_t lse_strides[2];
  int64_t grad_lse_strides[2];
  int32_t dtype;
  int32_t group;
} AttentionSinkBackward;
