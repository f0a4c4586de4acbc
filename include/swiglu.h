/* Parameter blocks of cuda/swiglu.cu: y = act(gate) * up elementwise, over n elements of one dtype
 * (f64 on CPU only), act SiLU (SwiGLU) or GELU with the tanh approximation (Gemma's GEGLU, HF's
 * gelu_pytorch_tanh). gate and up are rows of `cols` elements `ld` apart (the halves of a concatenated
 * gate/up projection, read where they lie), and so are the backward's grad_gate and grad_up, `grad_ld` apart (the
 * halves of one gradient of gate/up); the other tensors are contiguous. The vector kernels take rows at a stride
 * only where the rows and strides are whole 16-byte vectors, so that no vector spans two rows. */
#pragma once
#include "bastile.h"

/* Threads per block, and vectors (16 bytes, or single elements when a pointer is not 16-byte
 * aligned) each thread loads per grid-stride step: Rust sizes the grid from these. One vector a
 * thread: the finer grid ends a little more evenly (H100, bf16, benches/bench_swiglu.py, this and the
 * two-vector build alternately: forward 0.2032 ms against 0.2042-0.2043 at 16384x6144, 0.4005 against
 * 0.4016 at 16384x12288, level at 8192x3072; forward+backward 0.1420 / 0.5376 / 1.0663 ms against
 * 0.1422-0.1425 / 0.5388-0.5390 / 1.0676-1.0678). */
#define SWIGLU_BLOCK 256
#define SWIGLU_UNROLL 1

/* The gate's activation (`activation` of the blocks). */
#define SWIGLU_SILU 0
#define SWIGLU_GELU_TANH 1

/* swiglu_<fwd|bwd>_<dtype>_<vec|scalar>. */
#define SWIGLU_FORWARD_KERNELS(K) BASTILE_ELEMENTWISE_KERNELS(K, fwd)
#define SWIGLU_BACKWARD_KERNELS(K) BASTILE_ELEMENTWISE_KERNELS(K, bwd)

typedef struct SwigluForward {
  const void *gate; /* [n / cols rows at stride ld] */
  const void *up;   /* [n / cols rows at stride ld] */
  void *y;          /* [n] */
  int64_t n;
  int64_t cols;
  int64_t ld;
  int32_t dtype;
  int32_t activation; /* SWIGLU_SILU or SWIGLU_GELU_TANH */
} SwigluForward;

/* With `dot` (not NULL), the backward also gives each row's <grad_y, y> (y as the forward rounds it, made
 * again): the products summed in f32 (f64 on CPU for f64) in an order fixed by the shape, one warp a row, into
 * dot [n / cols] of f32 (f64 for f64); the vector kernels then take rows of whole vectors. (The experts' routing
 * weights' gradient, without y made again in a pass of its own.) */
typedef struct SwigluBackward {
  const void *grad_y; /* [n] */
  const void *gate;   /* [n / cols rows at stride ld], as given to the forward */
  const void *up;     /* [n / cols rows at stride ld] */
  void *grad_gate;    /* [n / cols rows at stride grad_ld] */
  void *grad_up;      /* [n / cols rows at stride grad_ld] */
  void *dot;          /* [n / cols] or NULL */
  int64_t n;
  int64_t cols;
  int64_t ld;
  int64_t grad_ld;    /* grad_gate's and grad_up's rows (cols: contiguous), which do not overlap */
  int32_t dtype;
  int32_t activation;
} SwigluBackward;
