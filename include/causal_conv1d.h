/* Parameter blocks of cuda/causal_conv1d.cu, Qwen3.5's depthwise causal conv (HF causal_conv1d_fn) over
 * channels-last rows: x [batch, seq, channels] with unit channel stride, weight [channels, width]. Packed
 * rows (cu_seqlens) restart the conv at each sequence. f64 on CPU only. */
#pragma once
#include "bastile.h"

/* Taps at most (Qwen3.5's conv has 4). */
#define CAUSAL_CONV1D_MAX_WIDTH 4
/* Channels a vector access takes: 16 bytes of x in the forward; at most this many in the backward, whose
 * per-thread sums, taps and pending dx spilled registers with 8. Rust checks alignment for these. */
#define CAUSAL_CONV1D_BACKWARD_VEC 4
/* Threads per block at most (the kernels' __launch_bounds__): Rust shapes blocks within it. */
#define CAUSAL_CONV1D_BLOCK 128

/* What both directions read. */
typedef struct CausalConv1dInputs {
  const void *x;          /* [batch, seq, channels], x_dtype, element strides below, channel stride 1 */
  const void *weight;     /* [channels, width], w_dtype, contiguous */
  const void *bias;       /* [channels], w_dtype, or null */
  const void *cu_seqlens; /* [sequences + 1], int32 or int64 (cu_int64), or null: each row is one sequence.
                             With it batch is 1 and sequence i is tokens [cu[i], cu[i + 1]). The CPU layer
                             checks 0 = cu[0] <= ... <= cu[sequences] = seq; the CUDA kernels clamp each
                             value into [0, seq], so that any values stay in bounds (results of invalid ones
                             are unspecified) */
  int64_t batch;
  int64_t seq;
  int64_t channels;
  int64_t x_batch_stride;
  int64_t x_seq_stride;
  int64_t sequences;
  int32_t width;          /* taps, 1..CAUSAL_CONV1D_MAX_WIDTH */
  int32_t silu;           /* nonzero: y = silu(conv), else y = conv */
  int32_t x_dtype;        /* of x, y and their gradients */
  int32_t w_dtype;        /* of weight, bias and their gradients */
  int32_t cu_int64;
  int32_t tile;           /* tokens a thread takes in order; chosen by Rust */
} CausalConv1dInputs;

typedef struct CausalConv1dForward {
  CausalConv1dInputs inputs;
  void *y; /* [batch, seq, channels], x_dtype, contiguous */
} CausalConv1dForward;

typedef struct CausalConv1dBackward {
  CausalConv1dInputs inputs;
  const void *grad_y; /* [batch, seq, channels], x_dtype, element strides below, channel stride 1 */
  int64_t grad_y_batch_stride;
  int64_t grad_y_seq_stride;
  void *grad_x;       /* [batch, seq, channels], x_dtype, contiguous */
  void *grad_weight;  /* [channels, width], w_dtype */
  void *grad_bias;    /* [channels], w_dtype: written with or without a bias */
  float *partial;     /* f32 scratch (CUDA only): [partials, channels * width] of the weight gradient's
                         per-block sums, then [partials, channels] of the bias gradient's */
  int64_t partials;
} CausalConv1dBackward;

/* causal_conv1d_<fwd|bwd>_<x>_<w>_<vec|scalar>: vectors of x's channels, or single channels; the
 * backward's causal_conv1d_bwd_reduce_<w> folds the partial sums of the weight and bias gradients. */
#define CAUSAL_CONV1D_FORWARD_KERNELS(K) CAUSAL_CONV1D_X(K, fwd, f32) CAUSAL_CONV1D_X(K, fwd, f16) CAUSAL_CONV1D_X(K, fwd, bf16)
#define CAUSAL_CONV1D_BACKWARD_KERNELS(K, REDUCE)                                              \
  CAUSAL_CONV1D_X(K, bwd, f32) CAUSAL_CONV1D_X(K, bwd, f16) CAUSAL_CONV1D_X(K, bwd, bf16)      \
  REDUCE(bwd, reduce, f32) REDUCE(bwd, reduce, f16) REDUCE(bwd, reduce, bf16)
#define CAUSAL_CONV1D_X(K, dir, x) CAUSAL_CONV1D_W(K, dir, x, f32) CAUSAL_CONV1D_W(K, dir, x, f16) CAUSAL_CONV1D_W(K, dir, x, bf16)
#define CAUSAL_CONV1D_W(K, dir, x, w) K(dir, x, w, vec) K(dir, x, w, scalar)
