/* Parameter blocks of cuda/swiglu.cu: y = silu(gate) * up elementwise, over n elements of one dtype
 * (every tensor contiguous, same dtype; f64 on CPU only). */
#pragma once
#include "bastile.h"

/* Threads per block, and vectors (16 bytes, or single elements when a pointer is not 16-byte
 * aligned) each thread loads per grid-stride step: Rust sizes the grid from these. */
#define SWIGLU_BLOCK 256
#define SWIGLU_UNROLL 2

typedef struct SwigluForward {
  const void *gate; /* [n] */
  const void *up;   /* [n] */
  void *y;          /* [n] */
  int64_t n;
  int32_t dtype;
} SwigluForward;

typedef struct SwigluBackward {
  const void *grad_y; /* [n] */
  const void *gate;   /* [n] as given to the forward */
  const void *up;     /* [n] */
  void *grad_gate;    /* [n] */
  void *grad_up;      /* [n] */
  int64_t n;
  int32_t dtype;
} SwigluBackward;
