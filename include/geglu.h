/* Parameter blocks of cuda/geglu.cu, GPT-OSS's clamped GLU over n (gate, up) pairs interleaved in one
 * tensor: gate_up[2k] is gate k, gate_up[2k + 1] is up k (every tensor contiguous, one dtype; f64 on
 * CPU only). The pairs are flat: a row boundary of gate_up [..., 2 * I] falls between two pairs. */
#pragma once
#include "bastile.h"

/* Threads per block, and units of 16 output bytes (or single pairs when a pointer is not 16-byte
 * aligned) each thread loads per grid-stride step: Rust sizes the grid from these. */
#define GEGLU_BLOCK 256
#define GEGLU_UNROLL 2

/* geglu_<fwd|bwd>_<dtype>_<vec|scalar>. */
#define GEGLU_FORWARD_KERNELS(K) BASTILE_ELEMENTWISE_KERNELS(K, fwd)
#define GEGLU_BACKWARD_KERNELS(K) BASTILE_ELEMENTWISE_KERNELS(K, bwd)

typedef struct GegluForward {
  const void *gate_up; /* [2n] */
  void *y;             /* [n] */
  int64_t n;           /* pairs */
  double alpha;        /* sigmoid slope: y = (clamp(u) + 1) * g * sigmoid(alpha * g), g clamped */
  double limit;        /* gate <= limit, -limit <= up <= limit */
  int32_t dtype;
} GegluForward;

typedef struct GegluBackward {
  const void *grad_y;  /* [n] */
  const void *gate_up; /* [2n] as given to the forward */
  void *grad_gate_up;  /* [2n], interleaved as gate_up */
  int64_t n;
  double alpha;
  double limit;
  int32_t dtype;
  int32_t at_limit;    /* nonzero: the gradient passes where gate or up equals a limit (torch's clamp through
                          2.11); zero: it stops there too (newer torch: the minimum-norm subgradient) */
} GegluBackward;
