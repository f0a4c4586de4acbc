/* Parameter blocks of cuda/gated_delta_rule.cu: the gated delta rule of Qwen3.5's Gated DeltaNet layers
 * (HF `torch_chunk_gated_delta_rule`, fla's `chunk_gated_delta_rule`). For each sequence and value head, a
 * state S [K, V] starts from the initial state (or zeros) and each token updates it and reads it:
 *   S_t = a_t S_{t-1} + b_t k_t (v_t - a_t S_{t-1}^T k_t)^T,   o_t = S_t^T (scale q_t),   a_t = exp(g_t)
 * with q_t and k_t first normalized to x * rsqrt(sum(x^2) + 1e-6) where l2norm_qk is set (HF's and fla's
 * `use_qk_l2norm_in_kernel`). Value head h reads query/key head h / (v_heads / k_heads), as HF's
 * repeat_interleave of q and k gives it. A sequence is a batch row or, with cu_seqlens (batch 1), the tokens
 * [cu[n], cu[n + 1]) of the one row: each starts from its own initial state. The state, g, beta and their
 * gradients are f32 (f64 for f64 input, CPU only); q, k, v, o and their gradients share one dtype. */
#pragma once
#include "bastile.h"

/* Element strides of a [batch, tokens, heads, dim] tensor whose last dim has unit stride. */
typedef struct TokenStrides {
  int64_t batch;
  int64_t token;
  int64_t head;
} TokenStrides;

/* The shapes every block of the op shares. */
typedef struct DeltaShape {
  int64_t batch;
  int64_t tokens;    /* per batch row */
  int64_t sequences; /* N: batch, or cu_seqlens' length - 1 */
  int64_t k_heads;
  int64_t v_heads;   /* a multiple of k_heads */
  int64_t k_dim;
  int64_t v_dim;
  double scale;      /* of q, after its normalization */
  int32_t l2norm_qk;
  int32_t dtype;       /* q, k, v, o */
  int32_t state_dtype; /* S, g, beta: f32, or f64 for f64 input */
} DeltaShape;

typedef struct GatedDeltaRuleForward {
  const void *q;             /* [B, T, Hk, K], strides q_st */
  const void *k;             /* [B, T, Hk, K], strides k_st */
  const void *v;             /* [B, T, Hv, V], strides v_st */
  const void *g;             /* [B, T, Hv] contiguous: the log of the decay a_t, <= 0 */
  const void *beta;          /* [B, T, Hv] contiguous */
  const void *initial_state; /* [N, Hv, K, V] contiguous, or null for zeros */
  const int64_t *cu_seqlens; /* [N + 1], or null: sequence n is batch row n. The CPU kernel checks
                                0 = cu[0] <= ... <= cu[N] = T; CUDA kernels clamp to the row. */
  void *o;                   /* [B, T, Hv, V] contiguous */
  void *final_state;         /* [N, Hv, K, V] contiguous */
  /* What the backward reads, in q's dtype, or null (no backward), by chunk (its slot: distinct for every
     chunk of every sequence; slots = T / C + N packed, N ceil(T / C) otherwise), value head and slice of
     GDR_V_SLICE columns of V (zeros past V), rows past a sequence's end zero (the caller zeroes slots that hold no
     chunk): */
  void *states; /* [slots, Hv, ceil(V / VS), K, VS]: the state at the chunk's start */
  void *v_new;  /* [slots, Hv, ceil(V / VS), C, VS]: v' = beta_t (v_t - a_t S_{t-1}^T k_t) */
  /* CUDA scratch, f32, by chunk and value head: */
  float *w;      /* [slots, Hv, C, GDR_MAX_DIM]: W, zero past K */
  float *kt;     /* [slots, Hv, C, GDR_MAX_DIM]: exp(gamma_last - gamma) k, zero past K */
  float *u;      /* [slots, Hv, C, V]: U, or null (the backward's key side, which needs none) */
  float *gamma;  /* [slots, Hv, C]: the running sum of g from the chunk's start */
  float *x;      /* [slots, Hv, C, C]: X */
  float *qg;     /* [slots, Hv, C, GDR_MAX_DIM]: G q (q normalized and scaled), zero past K */
  float *m;      /* [slots, Hv, C, C]: M = lower(q k^T) * D */
  TokenStrides q_st;
  TokenStrides k_st;
  TokenStrides v_st;
  DeltaShape shape;
} GatedDeltaRuleForward;

/* The gradients of the forward's inputs from those of o and of the final state. */
typedef struct GatedDeltaRuleBackward {
  const void *grad_o;           /* [B, T, Hv, V] contiguous */
  const void *grad_final_state; /* [N, Hv, K, V] contiguous, or null for zeros */
  const void *q;
  const void *k;
  const void *v;
  const void *g;
  const void *beta;
  const void *initial_state;
  const int64_t *cu_seqlens;
  void *grad_q;             /* [B, T, Hk, K] contiguous: summed over the value heads that read a key head */
  void *grad_k;             /* [B, T, Hk, K] contiguous */
  void *grad_v;             /* [B, T, Hv, V] contiguous */
  void *grad_g;             /* [B, T, Hv] */
  void *grad_beta;          /* [B, T, Hv] */
  void *grad_initial_state; /* [N, Hv, K, V] */
  const void *states;       /* the forward's (the CPU kernel recomputes them) */
  const void *v_new;
  /* CUDA: the forward's scratch, written by its key side again: */
  const float *w;
  const float *kt;
  const float *gamma;
  const float *x;
  const float *qg;
  const float *m;
  int64_t chunks;   /* slots * Hv: the chunks of the scratch */
  float *dstates;   /* CUDA: dh, the gradient of the state at each chunk's end, and */
  float *dvn;       /* dv', the gradient of v': f32, laid out as states and v_new */
  float *partial;   /* CUDA: [2][B * T * Hk][K] f32: q's and k's gradients summed over a key head's value heads
                       but the last, or null where each key head has one */
  TokenStrides q_st;
  TokenStrides k_st;
  TokenStrides v_st;
  DeltaShape shape;
} GatedDeltaRuleBackward;

/* CUDA: tokens per chunk, the widest head a kernel takes, the value columns of the state a block of a walk (the
 * state pass, the backward's) and of the backward's chunk kernel owns, those of the output kernel, and the warps
 * of a block, and of a walk's. */
#define GDR_CHUNK 32
#define GDR_MAX_DIM 128
#define GDR_V_SLICE 32
#define GDR_WARPS 8
#define GDR_WALK_WARPS 16
/* Bytes of each kernel's tiles (their dynamic shared memory; the kernels assert them; the backward's is its f32
 * instance's, the largest). */
#define GDR_PREP_SHARED \
  (4 * (2 * GDR_CHUNK * (GDR_MAX_DIM + 4) + 3 * GDR_CHUNK * (GDR_CHUNK + 1) + 4 * GDR_CHUNK))
#define GDR_STATE_SHARED                                                                                           \
  (4 * (2 * GDR_CHUNK * (3 * GDR_MAX_DIM + 16) + 2 * GDR_CHUNK * (GDR_CHUNK + 4) + 2 * GDR_CHUNK * (GDR_V_SLICE + 4) + \
        5 * GDR_CHUNK * (GDR_V_SLICE + 8) + GDR_MAX_DIM * (GDR_V_SLICE + 8) + 4))
#define GDR_WALK_SHARED                                                                                            \
  (4 * (2 * GDR_CHUNK * (3 * GDR_MAX_DIM + 20) + 2 * GDR_CHUNK * (GDR_CHUNK + 8) + 6 * GDR_CHUNK * (GDR_V_SLICE + 8) + \
        GDR_MAX_DIM * (GDR_V_SLICE + 8) + 4))
#define GDR_BACKWARD_SHARED                                                                                \
  (4 * (GDR_CHUNK * (GDR_CHUNK + 8) + 6 * GDR_CHUNK + 4 * (GDR_MAX_DIM + GDR_CHUNK) * (GDR_V_SLICE + 4) +      \
        2 * GDR_CHUNK * (GDR_V_SLICE + 4) + 3 * GDR_WARPS * GDR_CHUNK + GDR_V_SLICE / 8 * GDR_CHUNK + 32 * GDR_WARPS + \
        4 * GDR_CHUNK))

/* The forward in two kernels: gated_delta_rule_fwd_prep_<dtype> (every chunk's W, U, kt, gamma, G q and M, the
 * chunks in parallel) and gated_delta_rule_fwd_state_<dtype> (the chunks of a sequence in order: o, and the
 * states and v' where the backward needs them). The backward runs the first again for its key side. */
#define GATED_DELTA_RULE_FORWARD_KERNELS(STAGE)                                                           \
  STAGE(fwd, prep, f32) STAGE(fwd, prep, f16) STAGE(fwd, prep, bf16) STAGE(fwd, state, f32) STAGE(fwd, state, f16) \
      STAGE(fwd, state, bf16)
/* gated_delta_rule_bwd_walk_<dtype> (the chunks of a sequence in reverse: dh and dv') and
 * gated_delta_rule_bwd_<dtype> (the rest, the chunks in parallel, a block per chunk and key head). */
#define GATED_DELTA_RULE_BACKWARD_KERNELS(K, STAGE)                                                          \
  STAGE(bwd, walk, f32) STAGE(bwd, walk, f16) STAGE(bwd, walk, bf16) K(bwd, f32) K(bwd, f16) K(bwd, bf16)
