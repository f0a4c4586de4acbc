/* What the experts' grouped GEMMs (expert_swiglu, expert_linear) take from Rust for their Hopper kernel
 * (src/experts.rs, the launch of cuda/expert_tiles.cuh's walk over cuda/hopper.cuh's gemm_bf16_tn): the TMA maps
 * of the product's operands and of a low-rank product's (zeros without one), the pipeline's stages and an
 * expert's column tiles. */
#pragma once
#include "bastile.h"

typedef struct ExpertGemm {
  int32_t stages;                   /* pipeline stages in shared memory */
  int32_t col_tiles;                /* the GEMM's column tiles of an expert */
  BastileTensorMap x_map;           /* x [pairs, in], boxes of 64 x 128 */
  BastileTensorMap weight_map;      /* K-major [experts * rows, in], boxes of 64 x 128; N-major [experts * in, out], 64 x 64 */
  BastileTensorMap lora_x_map;      /* lora_x [pairs, rank], boxes of 64 x 128 */
  BastileTensorMap lora_weight_map; /* lora_weight in the weight's layout and boxes */
} ExpertGemm;
