// The experts' grouped GEMMs (expert_swiglu, expert_linear) as hopper.cuh's gemm_bf16_tn walks them: rows of x
// grouped by expert, each expert's ceil(rows / 128) row tiles times the weight's column tiles, found from the
// offsets by every block with no host sync.
#pragma once
#include <stdint.h>

#include "hopper.cuh"

namespace bastile {

__device__ __forceinline__ int64_t clamp(int64_t v, int64_t lo, int64_t hi) { return v < lo ? lo : v > hi ? hi : v; }

// Expert e's rows are ends[e - 1] .. ends[e] (0 before the first), its tiles first[e] .. first[e + 1], column tiles
// outer, row tiles inner (the blocks in flight share a weight tile; the expert's rows of x stay in L2 across its
// columns). A K-major weight has `rows` rows an expert, an N-major one `k_rows` (and a tail product's N-major B2
// `tail_k_rows`); a tile takes Cols of the output's columns, its two halves of K-major B `half` rows apart.
template <int Cols> struct ExpertTiles {
  const int32_t *first, *ends;
  int experts;
  int64_t rows, k_rows, tail_k_rows, half, count;

  __device__ bool none() const { return count == 0; }
  __device__ bool skip(int64_t) const { return false; }
  __device__ int64_t start(int e) const { return e == 0 ? 0 : ends[e - 1]; }
  // The expert of a tile: the last e with first[e] <= tile (experts without rows have first[e] == first[e + 1]).
  __device__ int expert(int64_t tile) const {
    int lo = 0, hi = experts - 1;
    while (lo < hi) {
      const int mid = (lo + hi + 1) / 2;
      if (first[mid] <= tile) lo = mid;
      else hi = mid - 1;
    }
    return lo;
  }
  struct Place {
    int e;
    int64_t row, col;  // the tile's first row of x and first column
    int64_t end;       // the expert's end
  };
  __device__ Place place(int64_t tile) const {
    const int e = expert(tile);
    const int64_t m = sm90::kGemmTileM, s = start(e), row_tiles = (ends[e] - s + m - 1) / m, local = tile - first[e];
    return {e, s + local % row_tiles * m, local / row_tiles * Cols, ends[e]};
  }
  __device__ int32_t a_row(int64_t tile) const { return (int32_t)place(tile).row; }
  __device__ int32_t b_row(int64_t tile, int h) const {
    const Place at = place(tile);
    return (int32_t)(at.e * rows + h * half + at.col);
  }
  // An N-major weight [experts * rows, out]: the tile's first column, and its expert's first row.
  __device__ int32_t b_col(int64_t tile) const { return (int32_t)place(tile).col; }
  __device__ int32_t b_k(int64_t tile) const { return (int32_t)(place(tile).e * k_rows); }
  __device__ int32_t b_tail_k(int64_t tile) const { return (int32_t)(place(tile).e * tail_k_rows); }
};

// ends[e], the running maximum of the offsets clamped to 0..pairs, and first[e] for every expert and
// first[experts] (the tiles' count, `col_tiles` a row tile): scans by the block's first warp in chunks of 32
// experts.
__device__ __forceinline__ void expert_groups(const int32_t *offsets, int experts, int64_t pairs, int col_tiles,
                                              int32_t *first, int32_t *ends) {
  if (threadIdx.x >= 32) return;
  const int lane = threadIdx.x;
  int32_t top = 0, tiles = 0;
  if (lane == 0) first[0] = 0;
#pragma unroll 1
  for (int base = 0; base < experts; base += 32) {
    const int e = base + lane;
    int32_t end = e < experts ? (int32_t)clamp(offsets[e], 0, pairs) : 0;
    int32_t v = 0;
#pragma unroll
    for (int o = 1; o < 32; o *= 2) {
      const int32_t u = __shfl_up_sync(0xffffffffu, end, o);
      if (lane >= o) end = max(end, u);
    }
    end = max(end, top);
    const int32_t before = __shfl_up_sync(0xffffffffu, end, 1), start = lane == 0 ? top : before;
    if (e < experts) v = (end - start + sm90::kGemmTileM - 1) / sm90::kGemmTileM * col_tiles;
#pragma unroll
    for (int o = 1; o < 32; o *= 2) {
      const int32_t u = __shfl_up_sync(0xffffffffu, v, o);
      if (lane >= o) v += u;
    }
    if (e < experts) first[e + 1] = tiles + v, ends[e] = end;
    top = __shfl_sync(0xffffffffu, end, 31);
    tiles += __shfl_sync(0xffffffffu, v, 31);
  }
}

// Rows from..pairs of out [pairs, width] belong to no expert: zeros, by the blocks in turn (none where the offsets
// end at pairs).
__device__ __forceinline__ void zero_rows(__nv_bfloat16 *out, int64_t width, int64_t from, int64_t pairs) {
  const __nv_bfloat16 zero = __float2bfloat16(0.f);
  for (int64_t r = from + blockIdx.x; r < pairs; r += gridDim.x)
    for (int64_t c = threadIdx.x; c < width; c += blockDim.x) out[r * width + c] = zero;
}

// The expert of row r as the GEMM's walk reads the offsets (the first whose end passes r), or `experts` past the
// last end: the fallback kernels' scan.
__device__ __forceinline__ int expert_of(const int32_t *offsets, int experts, int64_t pairs, int64_t r) {
  int e = 0;
  for (int64_t top = 0; e < experts; ++e) {
    top = clamp(offsets[e], top, pairs);
    if (top > r) break;
  }
  return e;
}

}  // namespace bastile
