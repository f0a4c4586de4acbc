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
