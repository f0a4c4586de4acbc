// Helpers of the row-wise norms (rms_norm, rms_norm_gated): a row of `cols` elements belongs to a group of
// G threads (src/geometry.rs), lane l holding the row's V-element vectors l, l + G, l + 2G, ...
#pragma once
#include "common.cuh"

namespace bastile {

// The K vectors of row `row` that this lane holds; nothing past the row's end, nothing of a row past the
// last. Rows lie `stride` elements apart. ONCE: through load_once (16-byte packs only).
template <int V, int K, bool ONCE = false, class T>
__device__ __forceinline__ void load_share(Pack<T, V> (&dst)[K], const T *base, int64_t row, int64_t rows,
                                           int64_t cols, int64_t stride, int lane, int G) {
  if (row >= rows) return;
  const T *r = base + row * stride + (int64_t)lane * V;
#pragma unroll
  for (int k = 0; k < K; ++k)
    if (lane + k * G < cols / V) {
      if constexpr (ONCE) dst[k] = load_once<V>(r + (int64_t)k * G * V);
      else dst[k] = load<V>(r + (int64_t)k * G * V);
    }
}

// Writes a block's share of a column sum over its rows, acc[k] being the lane's sums of its vector k, as
// the f32 partial row `out`. With several rows a block, the groups' shares are folded first in dynamic
// shared memory of rows_per_block * cols floats. Every thread of the block must call it.
template <int V, int K>
__device__ __forceinline__ void store_partial(const float (&acc)[K][V], float *out, int64_t cols, int lane, int G) {
  const int rows_per_block = blockDim.x / G, grp = threadIdx.x / G;
  const int64_t nvec = cols / V;
  if (rows_per_block == 1) {
#pragma unroll
    for (int k = 0; k < K; ++k)
      if (lane + k * G < nvec) store<V>(out + (lane + k * G) * V, acc[k]);
    return;
  }
  extern __shared__ float fold[];
#pragma unroll
  for (int k = 0; k < K; ++k)
    if (lane + k * G < nvec)
#pragma unroll
      for (int i = 0; i < V; ++i) fold[grp * cols + (lane + k * G) * V + i] = acc[k][i];
  __syncthreads();
  for (int64_t c = threadIdx.x; c < cols; c += blockDim.x) {
    float s = 0.f;
    for (int g = 0; g < rows_per_block; ++g) s += fold[g * cols + c];
    out[c] = s;
  }
}

}  // namespace bastile

// Template arguments of the residency tags (src/geometry.rs): the vectors of a row a thread keeps in
// registers, 0 where the row is streamed twice.
#define BASTILE_CACHED_cached1 1
#define BASTILE_CACHED_cached2 2
#define BASTILE_CACHED_cached4 4
#define BASTILE_CACHED_cached8 8
#define BASTILE_CACHED_streamed 0
