/* Parameter block of cuda/fused_linear_cross_entropy.cu: the cross-entropy pass over one chunk of
 * logits. The GEMMs around it (logits = hidden @ weight^T + bias, and the gradients) are ATen's. */
#pragma once
#include "bastile.h"

typedef struct CrossEntropyChunk {
  void *logits;          /* [rows, vocab] with row stride ld, `dtype`; overwritten with the gradient
                            d(loss)/d(logits) when `grad` is set */
  const int64_t *target; /* [rows]; rows whose target is ignore_index, or outside [0, vocab), are ignored */
  void *loss;            /* [rows] per-row loss, f32 (f64 for f64 logits); 0 for ignored rows */
  const int64_t *count;  /* reduction "mean": the number of counted targets of the whole batch (the
                            gradient is scaled by 1 / count, or 0 when it is 0); null for "sum" */
  const void *row_scale; /* reduction "none": [rows] upstream gradients of the row losses, in the loss's
                            dtype, each multiplying its row's gradient; null: 1 */
  void *stats;           /* [rows, 4] in the loss's dtype: the entropy of softmax(s), log(sum softmax(s)^2), the
                            mean of s, and 1 if the target is the first maximum of s (argmax's rule) else 0;
                            0 for ignored rows. Null: not computed */
  const void *entropy_scale; /* [rows] upstream gradients of the entropies, in the loss's dtype, added to the
                                gradient (d entropy / d s = -softmax(s) (log softmax(s) + entropy)); null: 0 */
  int64_t rows;
  int64_t vocab;
  int64_t ld;
  int64_t ignore_index;
  double logit_scale;    /* s = softcap(logit_scale * logit) / temperature: the scaled logits TRL's heads see */
  double temperature;
  double softcap;        /* > 0: softcap(x) = softcap * tanh(x / softcap); 0: off (softcap(x) = x) */
  double z_loss;         /* adds z_loss * lse^2 to each counted row's loss */
  double label_smoothing; /* eps: the loss is lse - (1 - eps) s[target] - eps mean(s), F.cross_entropy's
                             label_smoothing; > 0 takes a stats kernel (the mean) */
  int32_t dtype;         /* of the logits */
  int32_t grad;          /* nonzero: write the gradient over the logits */
  int32_t vec;           /* elements per vector access; chosen by Rust */
  int32_t shared_vecs;   /* vectors per thread parked in dynamic shared memory between the kernel's two
                            passes (shared_vecs * blockDim.x vectors); chosen by Rust */
} CrossEntropyChunk;

/* The rows kernel: at most FLCE_BLOCK threads a block, FLCE_BLOCKS_PER_SM blocks sharing an SM (and
 * its shared memory), FLCE_CACHED vectors per thread in registers (FLCE_CACHED_SOFTCAP with softcap;
 * the stats kernels' accumulators take half of those registers: ..._STATS). */
#define FLCE_BLOCK 512
#define FLCE_BLOCKS_PER_SM 2
#define FLCE_CACHED 4
#define FLCE_CACHED_SOFTCAP 2
#define FLCE_CACHED_STATS 2
#define FLCE_CACHED_SOFTCAP_STATS 1

/* Threads per block and vectors per thread per grid-stride step of the gradient scaling. */
#define FLCE_SCALE_BLOCK 256
#define FLCE_SCALE_UNROLL 4

/* fused_linear_cross_entropy_rows_<dtype>_<vec|scalar>[_softcap][_stats] and ..._scale_<dtype>_<vec|scalar>.
 * The stats kernels also fill `stats` and take `entropy_scale`. */
#define CROSS_ENTROPY_CHUNK_KERNELS(K) FLCE_ROWS(K, f32) FLCE_ROWS(K, f16) FLCE_ROWS(K, bf16)
#define FLCE_ROWS(K, dt) FLCE_ROWS_(K, dt, ) FLCE_ROWS_(K, dt, stats)
#define FLCE_ROWS_(K, dt, st) \
  K(rows, dt, vec, , st) K(rows, dt, vec, softcap, st) K(rows, dt, scalar, , st) K(rows, dt, scalar, softcap, st)
#define GRAD_SCALE_KERNELS(K) BASTILE_ELEMENTWISE_KERNELS(K, scale)

/* The backward: dst = src * factor[0] over n contiguous elements of `dtype`, in f32 and rounded once
 * (torch's grad * grad_loss for an f32 grad_loss), with the factor read on the device: no host sync.
 * dst may be src. */
typedef struct GradScale {
  const void *src;
  void *dst;
  const float *factor;
  int64_t n;
  int32_t dtype;
} GradScale;
