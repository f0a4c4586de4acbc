/* Parameter blocks of cuda/geglu.cu, GPT-OSS's clamped GLU over n (gate, up) pairs interleaved in one
 * tensor: gate_up[2k] is gate k, gate_up[2k + 1] is up k (every tensor contiguous, one dtype; f64 on
 * CPU only). The pairs are flat: a row boundary of gate_up [..., 2 * I] falls between two pairs.
 * With a bias (the experts' gate/up bias, folded in rather than added in a pass of its own), row r of
 * inter pairs first gets row expert[r] of bias [experts, 2 * inter], the sum rounded once to the dtype
 * (HF's `gate_up + bias`), in the forward and in the backward's recompute alike; the vector kernels take a
 * bias only where inter is a whole number of vectors, so that no vector spans two rows. */
#pragma once
#include "bastile.h"

/* Threads per block, and units of 16 output bytes (or single pairs when a pointer is not 16-byte
 * aligned) each thread loads per grid-stride step: Rust sizes the grid from these. */
#define GEGLU_BLOCK 256
#define GEGLU_UNROLL 2

/* geglu_<fwd|bwd>_<dtype>_<vec|scalar>. */
#define GEGLU_FORWARD_KERNELS(K) BASTILE_ELEMENTWISE_KERNELS(K, fwd)
#define GEGLU_BACKWARD_KERNELS(K) BASTILE_ELEMENTWISE_KERNELS(K, bwd)

/* The bias of each row's expert: bias NULL for none. */
typedef struct GegluBias {
  const void *bias;      /* [experts, 2 * inter] */
  const int64_t *expert; /* [n / inter], each in 0..experts (another stops the kernel) */
  int64_t experts;
} GegluBias;

typedef struct GegluForward {
  const void *gate_up; /* [2n] */
  void *y;             /* [n] */
  GegluBias bias;
  int64_t n;           /* pairs */
  int64_t inter;       /* pairs a row (y's last dim), which the bias and the dot read */
  double alpha;        /* sigmoid slope: y = (clamp(u) + 1) * g * sigmoid(alpha * g), g clamped */
  double limit;        /* gate <= limit, -limit <= up <= limit */
  int32_t dtype;
} GegluForward;

/* With `dot` (not NULL), the backward also gives each row's <grad_y, y> as swiglu.h's SwigluBackward does: the
 * vector kernels then take rows of whole vectors too. */
typedef struct GegluBackward {
  const void *grad_y;  /* [n] */
  const void *gate_up; /* [2n] as given to the forward */
  void *grad_gate_up;  /* [2n], interleaved as gate_up: the gradient of gate_up + bias too */
  void *dot;           /* [n / inter] or NULL */
  GegluBias bias;
  int64_t n;
  int64_t inter;
  double alpha;
  double limit;
  int32_t dtype;
  int32_t at_limit;    /* nonzero: the gradient passes where gate or up equals a limit (torch's clamp through
                          2.11); zero: it stops there too (newer torch: the minimum-norm subgradient) */
} GegluBackward;
