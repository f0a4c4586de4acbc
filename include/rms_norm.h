/* Parameter blocks of cuda/rms_norm.cu. cast_after_weight (0 or 1) picks the rounding: 0 is
 * Llama's y = w * to_x_dtype(n) in promote(x_dtype, w_dtype), 1 is GPT-OSS's y = to_x_dtype(w * n)
 * in x_dtype, the product in f32; n = x * rstd. */
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
  RowGeometry geo;
} RmsNormBackward;

/* rms_norm_<fwd|bwd>_<x>_<w>_<variant>[_cast_after_weight], variant the RowGeometry it runs: k1, k2, k4, k8
 * (that many 16-byte vectors of the row a thread keeps in registers), vstream, sstream (the row streamed
 * twice, in vectors or elements), and the forward's k1r2, k2r2, k4r2 (two rows a step); the backward's
 * rms_norm_bwd_reduce_<w> folds the weight gradient's partials. */
#define RMS_NORM_FORWARD_KERNELS(K) RMS_NORM_X(K, fwd, f32) RMS_NORM_X(K, fwd, f16) RMS_NORM_X(K, fwd, bf16)
#define RMS_NORM_BACKWARD_KERNELS(K, REDUCE)                                                      \
  RMS_NORM_X(K, bwd, f32) RMS_NORM_X(K, bwd, f16) RMS_NORM_X(K, bwd, bf16) REDUCE(bwd, reduce, f32) \
  REDUCE(bwd, reduce, f16) REDUCE(bwd, reduce, bf16)
#define RMS_NORM_X(K, dir, x) RMS_NORM_W(K, dir, x, f32) RMS_NORM_W(K, dir, x, f16) RMS_NORM_W(K, dir, x, bf16)
#define RMS_NORM_W(K, dir, x, w) RMS_NORM_VARIANTS_##dir(K, x, w, ) RMS_NORM_VARIANTS_##dir(K, x, w, cast_after_weight)
#define RMS_NORM_VARIANTS_bwd(K, x, w, mode)                                                             \
  K(bwd, x, w, k1, mode) K(bwd, x, w, k2, mode) K(bwd, x, w, k4, mode) K(bwd, x, w, k8, mode)             \
  K(bwd, x, w, vstream, mode) K(bwd, x, w, sstream, mode)
#define RMS_NORM_VARIANTS_fwd(K, x, w, mode)                                                             \
  K(fwd, x, w, k1, mode) K(fwd, x, w, k2, mode) K(fwd, x, w, k4, mode) K(fwd, x, w, k8, mode)             \
  K(fwd, x, w, vstream, mode) K(fwd, x, w, sstream, mode) K(fwd, x, w, k1r2, mode) K(fwd, x, w, k2r2, mode) \
  K(fwd, x, w, k4r2, mode)
