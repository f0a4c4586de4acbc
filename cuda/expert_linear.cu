// The experts' grouped product of rows with their expert's weight (include/expert_linear.h). On Hopper (the gemm
// kernels, the weight K-major or N-major): gemm_bf16_tn over tiles of 128 of one expert's rows by 256 columns, its
// two warp groups writing the tile's y from the accumulators, a low-rank product as one more stage of its
// pipeline. Elsewhere on CUDA, the rows kernel.
#include "elementwise.cuh"
#include "expert_linear.h"
#include "expert_tiles.cuh"
#include "hopper.cuh"

using namespace bastile;
using namespace bastile::sm90;

namespace {

constexpr int kCols = EXPERT_LINEAR_TILE_COLS;
static_assert(kCols == kGemmTileN, "a tile is gemm_bf16_tn's");

// One warp group's 64 rows of a tile as bf16, 16-byte stores (the accumulators' columns regrouped per thread by
// hopper.cuh's regroup); in the last tile of an out that is not a multiple of
// kCols, the columns up to out (a multiple of 8).
__device__ __forceinline__ void epilogue(const ExpertLinear &p, float (&acc)[128], const ExpertTiles<kCols>::Place &at,
                                         int group, int t) {
  const int warp = t / 32, lane = t % 32, q = lane % 4;
  unsigned char *mine = regroup_scratch<1>(group, t);
  bf16 *y = static_cast<bf16 *>(p.y);
#pragma unroll
  for (int half = 0; half < 2; ++half) {
    const int64_t row = at.row + group * 64 + warp * 16 + lane / 4 + half * 8;
    const bool in = row < at.end;
    bf16 *out = y + row * p.out + at.col;
    const int64_t width = p.out - at.col;
#pragma unroll
    for (int j = 0; j < kCols / 8; j += 4) {
      uint32_t v[4];
#pragma unroll
      for (int i = 0; i < 4; ++i) {
        const int a = 4 * (j + i) + 2 * half;
        v[i] = bits(__floats2bfloat162_rn(acc[a], acc[a + 1]));
      }
      const uint4 w = regroup(mine, lane, v);
      if (in && 8 * (j + q) < width) *reinterpret_cast<uint4 *>(out + 8 * (j + q)) = w;
    }
  }
}

template <Major B> __device__ __forceinline__ void run(const ExpertLinear &p) {
  __shared__ int32_t first[EXPERT_LINEAR_MAX_EXPERTS + 1], ends[EXPERT_LINEAR_MAX_EXPERTS];
  expert_groups(p.offsets, p.experts, p.pairs, p.gemm.col_tiles, first, ends);
  __syncthreads();
  zero_rows(static_cast<bf16 *>(p.y), p.out, ends[p.experts - 1], p.pairs);
  // An expert's rows of the weight as stored: out K-major, in N-major (rank of lora_weight, in the weight's layout).
  // A K-major tail tile reads the next expert's rows (or TMA's zeros past the last) for columns it drops; an
  // N-major one, TMA's zeros.
  const ExpertTiles<kCols> walk{first, ends, p.experts, p.out, p.in, p.rank, kCols / 2, first[p.experts]};
  const TailProduct lora = p.rank ? TailProduct{&p.gemm.lora_x_map, &p.gemm.lora_weight_map} : TailProduct{};
  gemm_bf16_tn<EXPERT_LINEAR_MAX_STAGES, B, true>(
      &p.gemm.x_map, &p.gemm.weight_map, p.in, p.gemm.stages, walk,
      [&](float (&acc)[128], int64_t tile, int group, int t) { epilogue(p, acc, walk.place(tile), group, t); }, lora);
}

// The fallback: a thread an element (r, c) of y (with its low-rank product's); rows past the last end are zeros.
template <class T> __device__ __forceinline__ void rows(const ExpertLinear &p) {
  const T *x = static_cast<const T *>(p.x), *w = static_cast<const T *>(p.weight);
  T *y = static_cast<T *>(p.y);
  const int64_t n = p.pairs * p.out, step = (int64_t)gridDim.x * blockDim.x;
  for (int64_t i = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += step) {
    const int64_t r = i / p.out, c = i % p.out;
    const int e = expert_of(p.offsets, p.experts, p.pairs, r);
    float sum = 0.f;
    if (e < p.experts) {
      const T *xr = x + r * p.in, *wr = w + ((int64_t)e * p.out + c) * p.in;
      for (int64_t k = 0; k < p.in; ++k) sum = fmaf(to_f32(xr[k]), to_f32(wr[k]), sum);
      const T *lr = static_cast<const T *>(p.lora_x) + r * p.rank;
      const T *lw = static_cast<const T *>(p.lora_weight) + ((int64_t)e * p.out + c) * p.rank;
      for (int64_t k = 0; k < p.rank; ++k) sum = fmaf(to_f32(lr[k]), to_f32(lw[k]), sum);
    }
    y[i] = from_f32<T>(sum);
  }
}

}  // namespace

constexpr Major kMajor_kmajor = Major::K, kMajor_nmajor = Major::N;
#define EXPERT_LINEAR_gemm(dt, major)                                                                              \
  extern "C" __global__ void __launch_bounds__(kGemmThreads, 1) expert_linear_gemm_##dt##_##major(const __grid_constant__ ExpertLinear p) { \
    run<kMajor_##major>(p);                                                                                        \
  }
#define EXPERT_LINEAR_rows(dt)                                                                                     \
  extern "C" __global__ void __launch_bounds__(EXPERT_LINEAR_ROWS_BLOCK) expert_linear_rows_##dt(const __grid_constant__ ExpertLinear p) { \
    rows<BASTILE_TYPE_##dt>(p);                                                                                    \
  }
#define KERNEL(kind, ...) EXPERT_LINEAR_##kind(__VA_ARGS__)
EXPERT_LINEAR_KERNELS(KERNEL)
