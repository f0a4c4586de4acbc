/* Parameter blocks of cuda/expert_swiglu.cu: a mixture of experts' gate/up products and their gated activation in
 * one grouped GEMM. The rows of x [pairs, in] are grouped by expert, expert e's rows ending at offsets[e] (int32,
 * non-decreasing, the last pairs); weight [experts, 2 * inter, in] is transformers' stored gate_up_proj, gate's
 * rows then up's. Optionally a low-rank product summed in (an expert LoRA's, no delta formed): lora_x [pairs, rank]
 * and lora_weight [experts, 2 * inter, rank]. For row r of expert e, in the inputs' dtype T:
 *   gate_up[r] = T(x[r] @ weight[e]^T + lora_x[r] @ lora_weight[e]^T)   (f32 sums; f64 on the CPU)
 *   h[r, c]    = T(T(act(g)) * u)                 g = gate_up[r, c], u = gate_up[r, inter + c], in f32
 * as the `swiglu` op computes h from the halves of gate_up (act SiLU or GELU-tanh, SWIGLU_* of swiglu.h), so that
 * a backward that makes h again from gate_up makes the same h. The CPU refuses other offsets than the experts'
 * path makes (non-decreasing, the last pairs); the CUDA kernels, which cannot check them without a host sync, read
 * each end as the running maximum of the offsets clamped to 0..pairs and write zeros in rows past the last end. */
#pragma once
#include "bastile.h"
#include "expert_gemm.h"

/* The Hopper path (bf16, compute capability 9.0): cuda/hopper.cuh's gemm_bf16_tn with tiles of 128 rows of one
 * expert by 128 gate and the same 128 up columns (one 128 x 256 tile), the activation in its epilogue. A block
 * finds its tiles from the offsets (each expert's ceil(rows / 128) row tiles, experts in order, a column's row
 * tiles together so that the blocks in flight share its weight tile) with no host sync. inter a multiple of
 * EXPERT_SWIGLU_TILE_COLS; at most EXPERT_SWIGLU_MAX_EXPERTS experts. The low-rank product as one more pipeline
 * stage (hopper.cuh's TailProduct): rank a multiple of 8 up to BASTILE_GEMM_TILE_K (a stage's k). */
#define EXPERT_SWIGLU_TILE_COLS 128
#define EXPERT_SWIGLU_MAX_EXPERTS 1024
#define EXPERT_SWIGLU_MAX_STAGES 8

/* Elsewhere on CUDA, bf16 through the `expert_linear` op and the `swiglu` op; other dtypes a thread an element of
 * h: its gate and up sums in f32 over the row, a plain correct fallback. */
#define EXPERT_SWIGLU_ROWS_BLOCK 256

/* The Hopper kernel is built once per activation: nothing overlaps its epilogue (the tensor cores wait), and the
 * activation chosen there at run time cost 3-4% of the kernel. */
#define EXPERT_SWIGLU_KERNELS(K) K(gemm, bf16, silu) K(gemm, bf16, gelu_tanh) K(rows, f32) K(rows, f16)

typedef struct ExpertSwiglu {
  const void *x;          /* [pairs, in] */
  const void *weight;     /* [experts, 2 * inter, in] */
  const int32_t *offsets; /* [experts] */
  const void *lora_x;     /* [pairs, rank], or null */
  const void *lora_weight; /* [experts, 2 * inter, rank], or null */
  void *gate_up;          /* [pairs, 2 * inter] */
  void *h;                /* [pairs, inter] */
  int64_t pairs;
  int64_t in;
  int64_t inter;
  int64_t rank;           /* 0 without the low-rank product */
  int32_t experts;
  int32_t dtype;
  int32_t activation;     /* SWIGLU_SILU or SWIGLU_GELU_TANH */
  int32_t hopper;         /* the Hopper kernel (ExpertSwigluPlan's answer), else the rows kernel */
  ExpertGemm gemm;        /* the Hopper kernel's launch, chosen by Rust */
} ExpertSwiglu;

/* Whether the Hopper path takes a call: the C++ layer asks before it allocates anything, and computes the
 * other bf16 calls with the `expert_linear` op and the `swiglu` op. */
typedef struct ExpertSwigluPlan {
  int64_t inter;
  int64_t rank;    /* 0 without the low-rank product */
  int32_t experts;
  int32_t device;  /* CUDA device index; -1: CPU */
  int32_t fits;    /* bf16 x and weight, 16-byte aligned, in a multiple of 8 */
  /* Chosen by Rust: */
  int32_t hopper;
} ExpertSwigluPlan;
#define EXPERT_SWIGLU_PLAN_DECISION
