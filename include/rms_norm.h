/* Parameter blocks of cuda/rms_norm.cu. cast_after_weight (0 or 1) picks the rounding: 0 is
 * Llama's y = w * to_x_dtype(n) in promote(x_dtype, w_dtype), 1 is GPT-OSS's y = to_x_dtype(w * n)
 * in x_dtype, the product in f32; n = x * rstd. weight_offset is added to the weight in f32 (Gemma's
 * (1 + w): 1), with cast_after_weight only. */
#pragma once
#include "bastile.h"

typedef struct RmsNormForward {
  const void *x;      /* [rows, cols], x_dtype, contiguous */
  const void *weight; /* [cols], w_dtype */
  void *y;            /* [rows, cols], y_dtype: promote(x_dtype, w_dtype), or x_dtype if cast_after_weight */
  void *rstd;         /* [rows], f32 (f64 for f64 input); may be null when nothing will need it */
  int64_t rows;
  int64_t cols;
  double eps;
  int32_t x_dtype;
  int32_t w_dtype;
  int32_t y_dtype;
  int32_t cast_after_weight;
  float weight_offset;
  RowGeometry geo;
} RmsNormForward;

typedef struct RmsNormBackward {
  const void *grad_y; /* [rows, cols], y_dtype */
  const void *x;      /* [rows, cols], x_dtype */
  const void *weight; /* [cols], w_dtype */
  const void *rstd;   /* [rows] as saved by the forward */
  void *grad_x;       /* [rows, cols], x_dtype */
  void *grad_w;       /* [cols], w_dtype */
  float *partial;     /* [partials, cols] f32 scratch for the weight gradient (CUDA only) */
  int64_t rows;
  int64_t cols;
  int64_t partials;
  int32_t x_dtype;
  int32_t w_dtype;
  int32_t y_dtype;
  int32_t cast_after_weight;
  float weight_offset;
  RowGeometry geo;
} RmsNormBackward;

/* rms_norm_<fwd|bwd>_<x>_<w>_<vec|scalar>_<cached1|cached2|cached4|cached8|streamed>[_two_rows][_cast_after_weight]:
 * the RowGeometry a kernel runs is in its name: 16-byte vectors or single elements; that many vectors of the
 * row a thread keeps in registers, or the row streamed twice; the forward's short rows two at a time. The
 * backward's rms_norm_bwd_reduce_<w> folds the weight gradient's partials. */
#define RMS_NORM_FORWARD_KERNELS(K) RMS_NORM_X(K, fwd, f32) RMS_NORM_X(K, fwd, f16) RMS_NORM_X(K, fwd, bf16)
#define RMS_NORM_BACKWARD_KERNELS(K, REDUCE)                                                      \
  RMS_NORM_X(K, bwd, f32) RMS_NORM_X(K, bwd, f16) RMS_NORM_X(K, bwd, bf16) REDUCE(bwd, reduce, f32) \
  REDUCE(bwd, reduce, f16) REDUCE(bwd, reduce, bf16)
#define RMS_NORM_X(K, dir, x) RMS_NORM_W(K, dir, x, f32) RMS_NORM_W(K, dir, x, f16) RMS_NORM_W(K, dir, x, bf16)
#define RMS_NORM_W(K, dir, x, w) RMS_NORM_GEOMETRIES_##dir(K, x, w, ) RMS_NORM_GEOMETRIES_##dir(K, x, w, cast_after_weight)
#define RMS_NORM_GEOMETRIES_bwd(K, x, w, mode)                                                               \
  K(bwd, x, w, vec, cached1, , mode) K(bwd, x, w, vec, cached2, , mode) K(bwd, x, w, vec, cached4, , mode)   \
  K(bwd, x, w, vec, cached8, , mode) K(bwd, x, w, vec, streamed, , mode) K(bwd, x, w, scalar, streamed, , mode)
#define RMS_NORM_GEOMETRIES_fwd(K, x, w, mode)                                                               \
  K(fwd, x, w, vec, cached1, , mode) K(fwd, x, w, vec, cached2, , mode) K(fwd, x, w, vec, cached4, , mode)   \
  K(fwd, x, w, vec, cached8, , mode) K(fwd, x, w, vec, streamed, , mode) K(fwd, x, w, scalar, streamed, , mode) \
  K(fwd, x, w, vec, cached1, two_rows, mode) K(fwd, x, w, vec, cached2, two_rows, mode)                      \
  K(fwd, x, w, vec, cached4, two_rows, mode)
