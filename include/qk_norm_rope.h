/* Parameter blocks of cuda/qk_norm_rope.cu: per-head RMSNorm of q and k followed by rotary embedding,
 * as Qwen3 attention does (q_norm/k_norm, then apply_rotary_pos_emb). The norm rounds as rms_norm's
 * (include/rms_norm.h): cast_after_weight 0 is Qwen3's w * to_x_dtype(n) in promote(x_dtype, w_dtype), 1 is
 * to_x_dtype((w + weight_offset) * n) in f32 (Gemma 4's q/k norms: offset 0; Gemma 3's (1 + w): 1). */
#pragma once
#include "bastile.h"

/* Where the rows are. q is [batch, seq, q_heads, head_dim] and k [batch, seq, k_heads, head_dim], each
 * with the element strides of its first three dimensions (the last is 1); cos and sin are
 * [batch or 1, seq, head_dim] with strides of their first two dimensions (batch stride 0 when shared). */
typedef struct QkNormRopeShape {
  int64_t batch;
  int64_t seq;
  int64_t q_heads;
  int64_t k_heads;
  int64_t head_dim;
  int64_t q_stride[3];
  int64_t k_stride[3];
  int64_t cos_stride[2];
  int64_t sin_stride[2];
} QkNormRopeShape;

typedef struct QkNormRopeForward {
  const void *q;        /* x_dtype */
  const void *k;        /* x_dtype */
  const void *q_weight; /* [head_dim], w_dtype */
  const void *k_weight; /* [head_dim], w_dtype */
  const void *cos;      /* c_dtype */
  const void *sin;      /* c_dtype */
  void *q_out;          /* [batch, seq, q_heads, head_dim] contiguous, promote(x, w, c); promote(x, c) if cast_after_weight */
  void *k_out;          /* [batch, seq, k_heads, head_dim] contiguous, as q_out */
  void *q_rstd;         /* [batch, seq, q_heads] f32 (f64 for f64 input); null when nothing needs it */
  void *k_rstd;         /* [batch, seq, k_heads], as q_rstd */
  QkNormRopeShape shape;
  double eps;
  int32_t x_dtype;
  int32_t w_dtype;
  int32_t c_dtype;
  int32_t cast_after_weight;
  float weight_offset;
  RowGeometry geo;
} QkNormRopeForward;

typedef struct QkNormRopeBackward {
  const void *grad_q;   /* shaped as q, the outputs' dtype, strides grad_q_stride (last 1) */
  const void *grad_k;   /* shaped as k, strides grad_k_stride */
  const void *q;
  const void *k;
  const void *q_weight;
  const void *k_weight;
  const void *cos;
  const void *sin;
  const void *q_rstd;   /* as the forward wrote them, contiguous */
  const void *k_rstd;
  void *grad_q_in;      /* [batch, seq, q_heads, head_dim] contiguous, x_dtype */
  void *grad_k_in;      /* [batch, seq, k_heads, head_dim] contiguous, x_dtype */
  void *grad_q_weight;  /* [head_dim], w_dtype */
  void *grad_k_weight;  /* [head_dim], w_dtype */
  float *partial;       /* [2, partials, head_dim] f32 scratch: q's weight-gradient partials, then k's (CUDA) */
  int64_t partials;
  int64_t grad_q_stride[3];
  int64_t grad_k_stride[3];
  QkNormRopeShape shape;
  int32_t x_dtype;
  int32_t w_dtype;
  int32_t c_dtype;
  int32_t cast_after_weight;
  float weight_offset;
  RowGeometry geo;
} QkNormRopeBackward;

/* qk_norm_rope_<fwd|bwd>_<x>_<w>_<cos>_<vec|scalar>[_cast_after_weight]; the backward's qk_norm_rope_bwd_reduce_<w> folds the
 * weight gradients' partials. */
#define QK_NORM_ROPE_FORWARD_KERNELS(K) QK_NORM_ROPE_X(K, fwd, f32) QK_NORM_ROPE_X(K, fwd, f16) QK_NORM_ROPE_X(K, fwd, bf16)
#define QK_NORM_ROPE_BACKWARD_KERNELS(K, REDUCE)                                                   \
  QK_NORM_ROPE_X(K, bwd, f32) QK_NORM_ROPE_X(K, bwd, f16) QK_NORM_ROPE_X(K, bwd, bf16)             \
  REDUCE(bwd, reduce, f32) REDUCE(bwd, reduce, f16) REDUCE(bwd, reduce, bf16)
#define QK_NORM_ROPE_X(K, dir, x) \
  QK_NORM_ROPE_W(K, dir, x, f32) QK_NORM_ROPE_W(K, dir, x, f16) QK_NORM_ROPE_W(K, dir, x, bf16)
#define QK_NORM_ROPE_W(K, dir, x, w) \
  QK_NORM_ROPE_C(K, dir, x, w, f32) QK_NORM_ROPE_C(K, dir, x, w, f16) QK_NORM_ROPE_C(K, dir, x, w, bf16)
#define QK_NORM_ROPE_C(K, dir, x, w, c) QK_NORM_ROPE_M(K, dir, x, w, c, ) QK_NORM_ROPE_M(K, dir, x, w, c, cast_after_weight)
#define QK_NORM_ROPE_M(K, dir, x, w, c, mode) K(dir, x, w, c, vec, mode) K(dir, x, w, c, scalar, mode)
