/* Parameter blocks of cuda/fused_linear_divergence.cu: the divergence between a student's and a teacher's
 * next-token distributions over one chunk of both models' logits (cuBLAS makes them, in f32, around it: the
 * driver is src/torch/fused_linear_divergence.cpp), and the plan of a call.
 *
 * Per row, z_s = softcap_s(student_scale * s) / temperature and z_t likewise from the teacher's logits t
 * (softcap(x) = softcap * tanh(x / softcap), or x when it is 0); p_s = softmax(z_s), p_t = softmax(z_t).
 *   beta = 0 (forward KL):  D = KL(p_t || p_s),          dD/dz_s = p_s - p_t
 *   beta = 1 (reverse KL):  D = KL(p_s || p_t),          dD/dz_s = p_s (log p_s - log p_t - D)
 *   0 < beta < 1 (JSD):     m = (1 - beta) p_s + beta p_t,
 *                           D = beta KL(p_t || m) + (1 - beta) KL(p_s || m),
 *                           dD/dz_s = (1 - beta) p_s (log p_s - log m - KL(p_s || m))
 * (TRL's generalized JSD), and the student's entropy H(p_s). Rows whose mask is 0 give D = H = 0 and no
 * gradient. */
#pragma once
#include "bastile.h"

/* The rows kernel: at most this many threads a block, one block a row. */
#define DIVERGENCE_BLOCK 512

/* The plan of one call, decided by Rust (src/fused_linear_divergence.rs): the rows of each chunk of logits,
 * and of each group of chunks whose gradient rows fold into the student's gradients together (fewer, larger
 * weight-gradient GEMMs: each fold reads and writes the whole f32 sum). The caller fills the call's fields. */
typedef struct DivergencePlan {
  int64_t rows;
  int64_t vocab;
  int64_t logit_bytes; /* a chunk's buffers per row: both logits rows */
  int64_t grad_bytes;  /* a group's gradient buffer per row; 0 where the gradient is written over the student's
                          logits or not made (a group is then one chunk) */
  int64_t chunk_bytes; /* the op's budget for the buffers of a chunk and of a group; 0: Rust's default */
  /* Chosen by Rust: */
  int64_t step;        /* rows of each chunk but the last */
  int64_t group;       /* rows of each group but the last: a multiple of step */
} DivergencePlan;
#define DIVERGENCE_PLAN_DECISION

/* fused_linear_divergence_<fkl|rkl|jsd>_<grad dtype>_<vec|scalar>: the divergence of beta 0, 1 or between,
 * the gradient written in its dtype; 4-element vectors of the logits where vocab and ld allow. */
#define DIVERGENCE_CHUNK_KERNELS(K) DIVERGENCE_MODE(K, fkl) DIVERGENCE_MODE(K, rkl) DIVERGENCE_MODE(K, jsd)
#define DIVERGENCE_MODE(K, mode) \
  K(mode, f32, vec) K(mode, f32, scalar) K(mode, f16, vec) K(mode, f16, scalar) K(mode, bf16, vec) K(mode, bf16, scalar)

typedef struct DivergenceChunk {
  const void *student;   /* [rows, vocab] logits at row stride ld, f32 (f64 on the CPU) */
  const void *teacher;   /* [rows, vocab] likewise */
  const uint8_t *mask;   /* [rows], 0: the row is skipped; null: every row counts */
  void *grad;            /* [rows, vocab] at row stride ld, `grad_dtype`: dD/ds (s the student's logits);
                            may be `student` itself when the dtypes agree; null: no gradient */
  void *divergence;      /* [rows] D, the logits' dtype */
  void *entropy;         /* [rows] H(p_s), the logits' dtype */
  int64_t rows;
  int64_t vocab;
  int64_t ld;
  double beta;
  double temperature;
  double student_scale;
  double student_softcap; /* > 0: on; 0: off */
  double teacher_scale;
  double teacher_softcap;
  int32_t dtype;         /* of the logits, divergence and entropy */
  int32_t grad_dtype;
} DivergenceChunk;
