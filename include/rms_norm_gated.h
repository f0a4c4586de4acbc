/* Parameter blocks of cuda/rms_norm_gated.cu, Qwen3.5's gated RMSNorm (HF Qwen3_5RMSNormGated) of rows x
 * gated by rows z of x's shape and dtype: y = to_x_dtype(w * to_x_dtype(x * rstd) * silu(z)), the products
 * in f32 (f64 for f64 input), of x's dtype whatever the weight's. HF rounds w * n to promote(x_dtype,
 * w_dtype) before the gate (bf16 for a bf16 model): here y is rounded once, after it. */
#pragma once
#include "bastile.h"

typedef struct RmsNormGatedForward {
  const void *x;      /* [rows, cols], dtype, contiguous */
  const void *z;      /* [rows, cols], dtype, rows z_stride elements apart, unit last stride */
  const void *weight; /* [cols], w_dtype */
  void *y;            /* [rows, cols], dtype, contiguous */
  void *rstd;         /* [rows], f32 (f64 for f64 input); may be null when nothing will need it */
  int64_t rows;
  int64_t cols;
  int64_t z_stride;
  double eps;
  int32_t dtype;      /* of x, z and y */
  int32_t w_dtype;
  RowGeometry geo;
} RmsNormGatedForward;

typedef struct RmsNormGatedBackward {
  const void *grad_y; /* [rows, cols], dtype, contiguous */
  const void *x;      /* as given to the forward */
  const void *z;      /* as given to the forward, rows z_stride elements apart */
  const void *weight;
  const void *rstd;   /* [rows] as saved by the forward */
  void *grad_x;       /* [rows, cols], dtype, contiguous */
  void *grad_z;       /* [rows, cols], dtype, contiguous */
  void *grad_w;       /* [cols], w_dtype */
  float *partial;     /* [partials, cols] f32 scratch for the weight gradient (CUDA only) */
  int64_t rows;
  int64_t cols;
  int64_t z_stride;
  int64_t partials;
  int32_t dtype;
  int32_t w_dtype;
  RowGeometry geo;
} RmsNormGatedBackward;

/* rms_norm_gated_<fwd|bwd>_<dtype>_<w_dtype>_<vec|scalar>_<cached1|cached2|cached4|cached8|streamed>: the
 * RowGeometry a kernel runs is in its name (as rms_norm's). rms_norm_gated_bwd_reduce_<w_dtype> folds the
 * weight gradient's partials. */
#define RMS_NORM_GATED_FORWARD_KERNELS(K) RMS_NORM_GATED_X(K, fwd)
#define RMS_NORM_GATED_BACKWARD_KERNELS(K, REDUCE) \
  RMS_NORM_GATED_X(K, bwd) REDUCE(bwd, reduce, f32) REDUCE(bwd, reduce, f16) REDUCE(bwd, reduce, bf16)
#define RMS_NORM_GATED_X(K, dir) \
  RMS_NORM_GATED_W(K, dir, f32) RMS_NORM_GATED_W(K, dir, f16) RMS_NORM_GATED_W(K, dir, bf16)
#define RMS_NORM_GATED_W(K, dir, x) \
  RMS_NORM_GATED_LAYOUTS(K, dir, x, f32) RMS_NORM_GATED_LAYOUTS(K, dir, x, f16) RMS_NORM_GATED_LAYOUTS(K, dir, x, bf16)
#define RMS_NORM_GATED_LAYOUTS(K, dir, x, w)                                                          \
  K(dir, x, w, vec, cached1) K(dir, x, w, vec, cached2) K(dir, x, w, vec, cached4) K(dir, x, w, vec, cached8) \
  K(dir, x, w, vec, streamed) K(dir, x, w, scalar, streamed)
