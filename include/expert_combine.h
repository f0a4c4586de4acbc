/* Parameter blocks of cuda/expert_combine.cu: a mixture of experts' token-expert pairs joined back into their
 * tokens, and the gradient sent back to the pairs. Token t's j-th pair is pair t * k + j; its row (of the experts'
 * outputs, grouped by expert) is position[pair], and order is the inverse map, order[row] = pair. With routing
 * weights w [tokens, k] (null: ones) and P the promoted type of rows and weights:
 *   forward   out[t] = sum_j round_P(w[t, j] * rows[position[t * k + j]])
 * where a bias [experts, dim] of `dtype` is given, the pair's row is round(rows[position[p]] + bias[expert[p]]) first
 * (the experts' down bias, as HF's `out + bias` rounds it; the backward takes the rows with their bias);
 *   backward  grad_rows[r] = w[p] * grad[p / k] and, given rows, grad_weights[p] = <grad[p / k], rows[r]>, p = order[r]
 * summed in f32 (f64 on the CPU), each result rounded once. rows and grad_rows are [tokens * k, dim] of `dtype`;
 * out and grad [tokens, dim] of P; the weights are of `dtype`, or f32 with 16-bit rows. An index outside
 * 0..tokens * k stops the kernel (CUDA) or is an error (CPU). */
#pragma once
#include "bastile.h"

/* Threads per block; Rust chooses the threads a row shares (`group`, a power of two up to 32). The grouping's
 * kernels take as many. */
#define EXPERT_COMBINE_BLOCK 256

/* expert_combine_<fwd|bwd>_<rows' dtype>_<weights' dtype>_<vec|scalar>: 16-byte vectors of the rows where every
 * row pointer allows them. The forward's also by the pairs a token's threads hold in registers, their rows (and
 * biases) read side by side (held8 for 5 to 8 pairs, held4 for the others, which reads pairs past 4 one by one), and
 * by whether a bias is given (plain or bias): each its own kernel, so that each takes only the registers it needs. */
#define EXPERT_COMBINE_DTYPES(K, EACH) \
  EACH(K, f32, f32) EACH(K, f16, f16) EACH(K, f16, f32) EACH(K, bf16, bf16) EACH(K, bf16, f32)
#define EXPERT_COMBINE_FORWARD_OF(K, t, w, access) \
  K(fwd, t, w, access, held4, plain) K(fwd, t, w, access, held4, bias) K(fwd, t, w, access, held8, plain) \
  K(fwd, t, w, access, held8, bias)
#define EXPERT_COMBINE_FORWARD_EACH(K, t, w) EXPERT_COMBINE_FORWARD_OF(K, t, w, vec) EXPERT_COMBINE_FORWARD_OF(K, t, w, scalar)
#define EXPERT_COMBINE_BACKWARD_EACH(K, t, w) K(bwd, t, w, vec, , ) K(bwd, t, w, scalar, , )
#define EXPERT_COMBINE_FORWARD_KERNELS(K) EXPERT_COMBINE_DTYPES(K, EXPERT_COMBINE_FORWARD_EACH)
#define EXPERT_COMBINE_BACKWARD_KERNELS(K) EXPERT_COMBINE_DTYPES(K, EXPERT_COMBINE_BACKWARD_EACH)

typedef struct ExpertCombineForward {
  const void *rows;         /* [tokens * k, dim] */
  const int64_t *position;  /* [tokens, k] */
  const void *weights;      /* [tokens, k], or null */
  void *out;                /* [tokens, dim] */
  const void *bias;         /* [experts, dim], or null */
  const int64_t *expert;    /* [tokens, k]: each pair's expert, in 0..experts (another stops the kernel) */
  int64_t experts;
  int64_t tokens;
  int64_t k;
  int64_t dim;
  int32_t dtype;
  int32_t weights_dtype;
  int32_t group;            /* threads a row: chosen by Rust */
} ExpertCombineForward;

typedef struct ExpertCombineBackward {
  const void *grad;         /* [tokens, dim] */
  const int64_t *order;     /* [tokens * k] */
  const void *weights;      /* [tokens, k], or null */
  const void *rows;         /* [tokens * k, dim], or null: no grad_weights */
  void *grad_rows;          /* [tokens * k, dim] */
  void *grad_weights;       /* [tokens, k], with rows */
  int64_t tokens;
  int64_t k;
  int64_t dim;
  int32_t dtype;
  int32_t weights_dtype;
  int32_t group;
} ExpertCombineBackward;

/* The grouping: the token-expert pairs ordered by expert, stably (a counting sort, no host sync). chosen [pairs]
 * holds each pair's expert (the router's top-k indices, flattened; one outside 0..experts stops the kernel or is an
 * error on the CPU); the results: order [pairs] (the pair of each row), expert [pairs] (each row's expert),
 * position [pairs] (the row of each pair: order's inverse) and offsets [experts] (int32, each expert's end). The
 * pairs are cut into `blocks` spans of `span`; `count` writes each span's count of each expert into `counts`
 * [blocks, experts] (scratch), `scan` turns them into where each span's rows of each expert start (and writes
 * offsets), `scatter` gives each pair its row: its span's start plus the pairs of its expert before it there. */
#define EXPERT_GROUP_KERNELS(K) K(group, count) K(group, scan) K(group, scatter)
/* The most experts the kernels count in shared memory (int32 each). */
#define EXPERT_GROUP_MAX_EXPERTS 8192

typedef struct ExpertGroup {
  const int64_t *chosen;  /* [pairs] */
  int64_t *order;         /* [pairs] */
  int64_t *expert;        /* [pairs] */
  int64_t *position;      /* [pairs] */
  int32_t *offsets;       /* [experts] */
  int32_t *counts;        /* [blocks, experts]: scratch, set by Rust */
  int64_t pairs;
  int64_t experts;
  int64_t span;           /* pairs a block: chosen by Rust */
  int32_t blocks;         /* chosen by Rust */
} ExpertGroup;
