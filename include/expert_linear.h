/* Parameter blocks of cuda/expert_linear.cu: a mixture of experts' grouped product of rows with each row's expert's
 * weight, as torch.nn.functional.linear takes it. The rows of x [pairs, in] are grouped by expert, expert e's rows
 * ending at offsets[e] (int32, non-decreasing, the last pairs); weight [experts, out, in] (transformers' stored
 * down_proj, or gate_up_proj), or its transpose contiguous (N-major: the stored weight read for the inputs'
 * gradient, or GPT-OSS's stored [experts, in, out]). Optionally a low-rank product summed in (an expert LoRA's,
 * no delta formed): lora_x [pairs, rank] and lora_weight [experts, out, rank]. For row r of expert e, in the inputs'
 * dtype T:
 *   y[r] = T(x[r] @ weight[e]^T + lora_x[r] @ lora_weight[e]^T)   (f32 sums; f64 on the CPU)
 * (bf16 on CUDA off the Hopper kernel: each product rounded to T, then their sum).
 * The CPU refuses other offsets than the experts' path makes (non-decreasing, the last pairs); the CUDA kernels,
 * which cannot check them without a host sync, read each end as the running maximum of the offsets clamped to
 * 0..pairs and write zeros in rows past the last end, as expert_swiglu does. */
#pragma once
#include "bastile.h"
#include "expert_gemm.h"

/* The Hopper path (bf16, compute capability 9.0): cuda/hopper.cuh's gemm_bf16_tn with tiles of 128 rows of one
 * expert by 256 columns (expert_tiles.cuh's walk), its two warp groups writing the tile's rows of y; the weight
 * K-major or N-major (the nmajor kernel, in a multiple of BASTILE_GEMM_TILE_K: its boxes of the weight run
 * along the experts' stacked rows, and one past an expert's last would read the next's). out a multiple of 8, the
 * columns of its last tile past out (computed, not stored) at most an eighth of out (GPT-OSS's 2880: 192); at most
 * EXPERT_LINEAR_MAX_EXPERTS experts. The low-rank product as one more pipeline stage (hopper.cuh's TailProduct):
 * rank a multiple of 8 up to BASTILE_GEMM_TILE_K (a stage's k), both operands contiguous. */
#define EXPERT_LINEAR_TILE_COLS 256
#define EXPERT_LINEAR_MAX_EXPERTS 1024
#define EXPERT_LINEAR_MAX_STAGES 8

/* Elsewhere on CUDA (other dtypes, shapes torch's grouped GEMM does not take), a thread an element of y: its sum
 * in f32 over the row, a plain correct fallback. */
#define EXPERT_LINEAR_ROWS_BLOCK 256

#define EXPERT_LINEAR_KERNELS(K) K(gemm, bf16, kmajor) K(gemm, bf16, nmajor) K(rows, f32) K(rows, f16) K(rows, bf16)

typedef struct ExpertLinear {
  const void *x;          /* [pairs, in] */
  const void *weight;     /* [experts, out, in]; N-major: [experts, in, out] */
  const int32_t *offsets; /* [experts] */
  const void *lora_x;     /* [pairs, rank], or null */
  const void *lora_weight; /* [experts, out, rank], or null */
  void *y;                /* [pairs, out] */
  int64_t pairs;
  int64_t in;
  int64_t out;
  int64_t rank;           /* 0 without the low-rank product */
  int32_t experts;
  int32_t dtype;
  int32_t hopper;         /* the Hopper kernel (ExpertLinearPlan's answer), else the rows kernel */
  int32_t n_major;        /* the weight's layout, for the Hopper kernel (the others take it K-major) */
  ExpertGemm gemm;        /* the Hopper kernel's launch, chosen by Rust */
} ExpertLinear;

/* Whether the Hopper path takes a call: the C++ layer asks before it allocates anything, and computes the
 * other bf16 calls that torch's grouped GEMM takes with it. */
typedef struct ExpertLinearPlan {
  int64_t in;
  int64_t out;
  int32_t experts;
  int32_t device;  /* CUDA device index; -1: CPU */
  int64_t rank;    /* 0 without the low-rank product */
  int32_t fits;    /* bf16 x and weight, 16-byte aligned, in a multiple of 8 */
  int32_t n_major; /* the weight's transpose is contiguous, not the weight */
  /* Chosen by Rust: */
  int32_t hopper;
} ExpertLinearPlan;
#define EXPERT_LINEAR_PLAN_DECISION
