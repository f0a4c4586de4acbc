// The experts' gate/up grouped GEMM with the gated activation in its epilogue (include/expert_swiglu.h). On
// Hopper (the gemm kernel): gemm_bf16_tn over tiles of one expert's rows, whose 256 columns are 128 of gate and
// the same 128 of up, so that each thread holds both halves of its h elements; its two warp groups write a tile's
// gate_up and h from the accumulators, and nothing reads gate_up back. Elsewhere on CUDA, the rows kernel.
#include "elementwise.cuh"
#include "expert_swiglu.h"
#include "hopper.cuh"
#include "swiglu.h"

using namespace bastile;
using namespace bastile::sm90;

namespace {

constexpr int kCols = EXPERT_SWIGLU_TILE_COLS;
static_assert(2 * kCols == kGemmTileN, "a tile is 128 gate and 128 up columns");

// The walk over the experts' tiles: expert e's rows are ends[e - 1] .. ends[e] (0 before the first), its tiles
// first[e] .. first[e + 1], column tiles outer, row tiles inner (the blocks in flight share a weight tile; the
// expert's rows of x stay in L2 across its columns).
struct ExpertTiles {
  const int32_t *first, *ends;
  int experts;
  int64_t inter, count;

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
    int64_t row, col;  // the tile's first row of x, and its first column of gate (and of up, past inter)
    int64_t end;       // the expert's end
  };
  __device__ Place place(int64_t tile) const {
    const int e = expert(tile);
    const int64_t s = start(e), row_tiles = (ends[e] - s + kGemmTileM - 1) / kGemmTileM, local = tile - first[e];
    return {e, s + local % row_tiles * kGemmTileM, local / row_tiles * kCols, ends[e]};
  }
  __device__ int32_t a_row(int64_t tile) const { return (int32_t)place(tile).row; }
  __device__ int32_t b_row(int64_t tile, int half) const {
    const Place at = place(tile);
    return (int32_t)(at.e * 2 * inter + half * inter + at.col);
  }
};

__device__ __forceinline__ int64_t clamp(int64_t v, int64_t lo, int64_t hi) { return v < lo ? lo : v > hi ? hi : v; }

// ends[e], the running maximum of the offsets clamped to 0..pairs, and first[e] for every expert and
// first[experts] (the tiles' count): scans by the block's first warp in chunks of 32 experts.
__device__ void groups(const ExpertSwiglu &p, int32_t *first, int32_t *ends, int col_tiles) {
  if (threadIdx.x >= 32) return;
  const int lane = threadIdx.x;
  int32_t top = 0, tiles = 0;
  if (lane == 0) first[0] = 0;
  for (int base = 0; base < p.experts; base += 32) {
    const int e = base + lane;
    int32_t end = e < p.experts ? (int32_t)clamp(p.offsets[e], 0, p.pairs) : 0;
    int32_t v = 0;
#pragma unroll
    for (int o = 1; o < 32; o *= 2) {
      const int32_t u = __shfl_up_sync(0xffffffffu, end, o);
      if (lane >= o) end = max(end, u);
    }
    end = max(end, top);
    const int32_t before = __shfl_up_sync(0xffffffffu, end, 1), start = lane == 0 ? top : before;
    if (e < p.experts) v = (end - start + kGemmTileM - 1) / kGemmTileM * col_tiles;
#pragma unroll
    for (int o = 1; o < 32; o *= 2) {
      const int32_t u = __shfl_up_sync(0xffffffffu, v, o);
      if (lane >= o) v += u;
    }
    if (e < p.experts) first[e + 1] = tiles + v, ends[e] = end;
    top = __shfl_sync(0xffffffffu, end, 31);
    tiles += __shfl_sync(0xffffffffu, v, 31);
  }
}

// Rows past the last end belong to no expert: zeros, by the blocks in turn (none where the offsets end at pairs).
__device__ void zero_rest(const ExpertSwiglu &p, int64_t from) {
  bf16 *gate_up = static_cast<bf16 *>(p.gate_up), *h = static_cast<bf16 *>(p.h);
  const bf16 zero = from_f32<bf16>(0.f);
  for (int64_t r = from + blockIdx.x; r < p.pairs; r += gridDim.x)
    for (int64_t c = threadIdx.x; c < 3 * p.inter; c += blockDim.x) {
      if (c < 2 * p.inter) gate_up[r * 2 * p.inter + c] = zero;
      else h[r * p.inter + c - 2 * p.inter] = zero;
    }
}

// One warp group's 64 rows of a tile: gate_up and h as bf16, 16-byte stores (columns 8 j + 2 q of the
// accumulators' layout, gathered per thread through the warp's scratch by stmatrix).
template <int Act>
__device__ __forceinline__ void epilogue(const ExpertSwiglu &p, float (&acc)[128], const ExpertTiles::Place &at,
                                         int group, int t) {
  const int warp = t / 32, lane = t % 32, q = lane % 4;
  constexpr bool gelu = Act == SWIGLU_GELU_TANH;
  unsigned char *mine = regroup_scratch<3>(group, t);  // g, u and y
  bf16 *gate_up = static_cast<bf16 *>(p.gate_up), *h = static_cast<bf16 *>(p.h);
#pragma unroll
  for (int half = 0; half < 2; ++half) {
    const int64_t row = at.row + group * 64 + warp * 16 + lane / 4 + half * 8;
    const bool in = row < at.end;
    bf16 *g_out = gate_up + row * 2 * p.inter + at.col, *u_out = g_out + p.inter, *h_out = h + row * p.inter + at.col;
#pragma unroll
    for (int j = 0; j < kCols / 8; j += 4) {
      uint32_t g[4], u[4], y[4];
#pragma unroll
      for (int i = 0; i < 4; ++i) {
        const int a = 4 * (j + i) + 2 * half, b = a + 4 * (kCols / 8);
        const __nv_bfloat162 gv = __floats2bfloat162_rn(acc[a], acc[a + 1]);
        const __nv_bfloat162 uv = __floats2bfloat162_rn(acc[b], acc[b + 1]);
        const float2 gf = __bfloat1622float2(gv), uf = __bfloat1622float2(uv);
        const float y0 = round_to<bf16>(gate_act(gf.x, gelu)) * uf.x, y1 = round_to<bf16>(gate_act(gf.y, gelu)) * uf.y;
        g[i] = bits(gv), u[i] = bits(uv), y[i] = bits(__floats2bfloat162_rn(y0, y1));
      }
      store_matrices(mine, lane, g), store_matrices(mine + kRegroupBytes, lane, u);
      store_matrices(mine + 2 * kRegroupBytes, lane, y);
      __syncwarp();
      const uint4 gw = load_group(mine, lane), uw = load_group(mine + kRegroupBytes, lane);
      const uint4 yw = load_group(mine + 2 * kRegroupBytes, lane);
      __syncwarp();  // read before the next j's matrices overwrite them
      if (in) {
        *reinterpret_cast<uint4 *>(g_out + 8 * (j + q)) = gw;
        *reinterpret_cast<uint4 *>(u_out + 8 * (j + q)) = uw;
        *reinterpret_cast<uint4 *>(h_out + 8 * (j + q)) = yw;
      }
    }
  }
}

template <int Act> __device__ __forceinline__ void run(const ExpertSwiglu &p) {
  __shared__ int32_t first[EXPERT_SWIGLU_MAX_EXPERTS + 1], ends[EXPERT_SWIGLU_MAX_EXPERTS];
  groups(p, first, ends, (int)(p.inter / kCols));
  __syncthreads();
  zero_rest(p, ends[p.experts - 1]);
  const ExpertTiles walk{first, ends, p.experts, p.inter, first[p.experts]};
  gemm_bf16_tn<EXPERT_SWIGLU_MAX_STAGES>(&p.x_map, &p.weight_map, p.in, p.stages, walk,
                                         [&](float (&acc)[128], int64_t tile, int group, int t) {
                                           epilogue<Act>(p, acc, walk.place(tile), group, t);
                                         });
}

// The fallback: a thread an element (r, c) of h, r's expert the first whose end (as the GEMM's walk reads the
// offsets) passes r; rows past the last end are zeros.
template <class T> __device__ __forceinline__ void rows(const ExpertSwiglu &p) {
  const T *x = static_cast<const T *>(p.x), *w = static_cast<const T *>(p.weight);
  T *gate_up = static_cast<T *>(p.gate_up), *h = static_cast<T *>(p.h);
  const bool gelu = p.activation == SWIGLU_GELU_TANH;
  const int64_t n = p.pairs * p.inter, step = (int64_t)gridDim.x * blockDim.x;
  for (int64_t i = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += step) {
    const int64_t r = i / p.inter, c = i % p.inter;
    int e = 0;
    for (int64_t top = 0; e < p.experts; ++e) {
      top = clamp(p.offsets[e], top, p.pairs);
      if (top > r) break;
    }
    if (e == p.experts) {
      gate_up[r * 2 * p.inter + c] = gate_up[r * 2 * p.inter + p.inter + c] = h[r * p.inter + c] = from_f32<T>(0.f);
      continue;
    }
    const T *xr = x + r * p.in, *wg = w + ((int64_t)e * 2 * p.inter + c) * p.in, *wu = wg + p.inter * p.in;
    float g = 0.f, u = 0.f;
    for (int64_t k = 0; k < p.in; ++k) {
      const float a = to_f32(xr[k]);
      g = fmaf(a, to_f32(wg[k]), g);
      u = fmaf(a, to_f32(wu[k]), u);
    }
    const T gt = from_f32<T>(g), ut = from_f32<T>(u);
    gate_up[r * 2 * p.inter + c] = gt;
    gate_up[r * 2 * p.inter + p.inter + c] = ut;
    h[r * p.inter + c] = from_f32<T>(round_to<T>(gate_act(to_f32(gt), gelu)) * to_f32(ut));
  }
}

}  // namespace

constexpr int kAct_silu = SWIGLU_SILU, kAct_gelu_tanh = SWIGLU_GELU_TANH;
#define EXPERT_SWIGLU_gemm(dt, act)                                                                                \
  extern "C" __global__ void __launch_bounds__(kGemmThreads, 1) expert_swiglu_gemm_##dt##_##act(const __grid_constant__ ExpertSwiglu p) { \
    run<kAct_##act>(p);                                                                                            \
  }
#define EXPERT_SWIGLU_rows(dt)                                                                                     \
  extern "C" __global__ void __launch_bounds__(EXPERT_SWIGLU_ROWS_BLOCK) expert_swiglu_rows_##dt(const __grid_constant__ ExpertSwiglu p) { \
    rows<BASTILE_TYPE_##dt>(p);                                                                                    \
  }
#define KERNEL(kind, ...) EXPERT_SWIGLU_##kind(__VA_ARGS__)
EXPERT_SWIGLU_KERNELS(KERNEL)
