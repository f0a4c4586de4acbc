/* Parameter blocks of cuda/fused_linear_cross_entropy.cu: the cross-entropy pass over one chunk of
 * logits, with ATen's GEMMs around it (logits = hidden @ weight^T + bias, and the gradients), or on Hopper
 * the logits GEMM of our own whose epilogue does the pass; and the plan of a fused head's call. */
#pragma once
#include "bastile.h"

/* The plan of one call of a fused head (fused_linear_cross_entropy, fused_linear_log_probs: the driver in
 * src/torch/fused_head.cpp), decided by Rust (src/fused_linear_cross_entropy.rs): which path runs, the
 * rows of each chunk and the size of the chunk's buffers. The caller fills the call's fields. */
typedef struct HeadPlan {
  int64_t rows;
  int64_t cols;
  int64_t vocab;
  int64_t element_bytes; /* of hidden, in which the GEMMs run */
  int64_t cast_bytes;    /* of the weight gradient's final cast copy (an f32 sum to the weight's dtype); 0: none */
  int64_t chunk_bytes;   /* the op's budget for a chunk's logits; 0: Rust's default */
  int32_t device;        /* CUDA device index; -1: CPU */
  int32_t grad;          /* some gradient is formed */
  int32_t f32_sum;       /* the weight gradient is summed in f32 */
  int32_t gemm_fits;     /* what the Hopper path computes (CrossEntropyGemm: bf16, no bias, statistics, label
                            smoothing or entropy gradient) with 16-byte aligned hidden and weight */
  /* Chosen by Rust: */
  int32_t gemm;          /* the Hopper path runs; else cuBLAS logits and the rows kernel (CrossEntropyChunk) */
  int64_t ld;            /* row stride of a chunk's logits (exps on the Hopper path) */
  int64_t step;          /* rows of each chunk but the last */
  int64_t buffer_rows;   /* rows of the Hopper path's chunk buffers (exps, factor, product, scaled) */
} HeadPlan;
#define HEAD_PLAN_DECISION

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

/* The Hopper path (sm_90a, bf16, no bias, statistics or label smoothing): the logits GEMM of a chunk is our
 * own (TMA + WGMMA, warp specialised, persistent; cuda/hopper.cuh), and its epilogue does the softmax's work
 * in registers, so that no pass reads the logits. Per row it needs a reference r (base-2 units) before the
 * GEMM: u_t + FLCE_GEMM_MARGIN, with u_t = s_t log2(e) the target's scaled logit (one dot product a row).
 * The epilogue writes
 *   exps[i, j] = 2^(u_j - r_i) * ds_j/dz_j / (logit_scale / temperature)
 * (bf16) and per BASTILE_GEMM_TILE_N-column tile each row's max u and sum of 2^(u - r) (f32). The sums fix the
 * row's log-sum-exp, so d(loss)/d(logits) = factor_i * exps[i, j] for every j but the target, whose element
 * the finish kernel overwrites so that the same holds there too. The gradient GEMMs thus take exps as they
 * are: grad_hidden = factor * (exps @ weight) (an f32 product, rounded once), grad_weight = exps^T @ (factor
 * * hidden): its terms carry two bf16 roundings (exps and the scaled hidden) where the cuBLAS path's carry one.
 * Range: a row's exps sum to less than 2^64 while its loss is below (64 + margin) ln 2 (~66); a row beyond
 * (or with a non-finite sum) is repaired: its reference becomes its max u and its row tile runs the GEMM
 * again (`tile_flags`), so that its exps are at most 1. Elements below 2^-126 (u_j < u_t - 94) flush to
 * zero (ex2.approx.ftz): their probabilities are below 2^-94. Reductions run in a fixed order. */
typedef struct CrossEntropyGemm {
  BastileTensorMap hidden_map; /* TMA: hidden [rows, cols], boxes of BASTILE_GEMM_TILE_K x BASTILE_GEMM_TILE_M */
  BastileTensorMap weight_map; /* TMA: weight [vocab, cols], boxes of BASTILE_GEMM_TILE_K x BASTILE_GEMM_TILE_N / 2 */
  const void *hidden;          /* [rows, cols] */
  const void *weight;          /* [vocab, cols] */
  const int64_t *target;       /* [rows] */
  void *exps;                  /* [rows, ld] */
  void *loss;                  /* [rows] f32: each row's loss (0 for ignored rows) */
  float *factor;               /* [rows]: d(loss)/d(logits) = factor * exps */
  const int64_t *count;        /* as CrossEntropyChunk's */
  const float *row_scale;      /* as CrossEntropyChunk's (f32) */
  /* The scaling stage: grad_hidden = factor * product (f32, exps @ weight) and scaled = factor * hidden;
   * either may be null. */
  const float *product;
  void *grad_hidden;
  void *scaled;
  /* Scratch (set by Rust): per row and column tile {max u, sum}, per row the target's logit s_t, the
   * reference, the sum of its tiles (NaN: repaired, sum again), and per row tile whether to repair (one
   * more: whether any is). */
  float *partial;
  float *target_logit;
  float *reference;
  float *row_sum;
  int32_t *tile_flags;
  int64_t rows;
  int64_t cols;
  int64_t vocab;
  int64_t ld;
  int64_t ignore_index;
  double logit_scale;
  double temperature;
  double softcap;
  double z_loss;
  int32_t grad;   /* nonzero: write exps (and patch the targets) */
  int32_t stage;  /* FLCE_GEMM_LOGITS or FLCE_GEMM_SCALE */
  int32_t stages; /* pipeline stages in shared memory; chosen by Rust */
  int32_t repair; /* set by Rust for the second GEMM launch: only tiles of flagged row tiles */
} CrossEntropyGemm;

#define FLCE_GEMM_LOGITS 0
#define FLCE_GEMM_SCALE 1
/* The GEMM is cuda/hopper.cuh's gemm_bf16_tn (its geometry: BASTILE_GEMM_* in bastile.h), running the epilogue
 * above; at most this many pipeline stages. */
#define FLCE_GEMM_MAX_STAGES 8
/* exps = 2^(u - u_t - 32): the target's element 2^-32, a confident row's others far smaller, a row's sum
 * reaching 2^64 only at a loss near 66. */
#define FLCE_GEMM_MARGIN 32.0f
/* Threads of the row kernels (target dot, check, finish: a warp a row; scaling: a block a row). */
#define FLCE_GEMM_ROW_BLOCK 256

#define CROSS_ENTROPY_GEMM_KERNELS(K) \
  K(gemm, bf16, ) K(gemm, bf16, softcap) K(target, bf16) K(check) K(finish, bf16) K(rescale, bf16)
