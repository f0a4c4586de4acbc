/* Parameter blocks shared by the CUDA kernels, the C++ torch layer and Rust (through bindgen).
 * Every kernel takes exactly one of these by value, so adding a field never changes a launch. */
#pragma once
#include <stdint.h>

/* Element types. The C++ layer maps at::ScalarType onto these; Rust picks kernels by them. */
typedef enum BastileDType {
  BASTILE_F32 = 0,
  BASTILE_F16 = 1,
  BASTILE_BF16 = 2,
  BASTILE_F64 = 3, /* CPU only: lets torch.autograd.gradcheck run */
} BastileDType;

/* How a row-wise kernel is laid out on the GPU; chosen by Rust (src/geometry.rs). */
typedef struct RowGeometry {
  int32_t vec;   /* elements per vector access: 16 bytes of x, or 1 */
  int32_t per_thread; /* vectors each thread keeps in registers; 0 = stream the row twice */
  int32_t group; /* threads that share one row */
  int32_t block; /* threads per block = group * rows per block */
} RowGeometry;

typedef struct RmsNormForward {
  const void *x;      /* [rows, cols], x_dtype, contiguous */
  const void *weight; /* [cols], w_dtype */
  void *y;            /* [rows, cols], y_dtype = promote(x_dtype, w_dtype) */
  void *rstd;         /* [rows], f32 (f64 for f64 input); may be null when nothing will need it */
  int64_t rows;
  int64_t cols;
  double eps;
  int32_t x_dtype;
  int32_t w_dtype;
  int32_t y_dtype;
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
  RowGeometry geo;
} RmsNormBackward;
