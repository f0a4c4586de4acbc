// The experts' gate/up grouped GEMM with the gated activation in its epilogue (include/expert_swiglu.h). On
// Hopper (the gemm kernel): gemm_bf16_tn over tiles of one expert's rows, whose 256 columns are 128 of gate and
// the same 128 of up, so that each thread holds both halves of its h elements; its two warp groups write a tile's
// gate_up and h from the accumulators, and nothing reads gate_up back; a low-rank product as one more stage of its
// pipeline. Elsewhere on CUDA (f32, f16), the rows kernel.
#include "elementwise.cuh"
#include "expert_swiglu.h"
#include "expert_tiles.cuh"
#include "hopper.cuh"
#include "swiglu.h"

using namespace bastile;
using namespace bastile::sm90;

namespace {

constexpr int kCols = EXPERT_SWIGLU_TILE_COLS;
static_assert(2 * kCols == kGemmTileN, "a tile is 128 gate and 128 up columns");

// One warp group's 64 rows of a tile: gate_up and h as bf16, 16-byte stores (columns 8 j + 2 q of the
// accumulators' layout, gathered per thread through the warp's scratch by stmatrix).
template <int Act>
__device__ __forceinline__ void epilogue(const ExpertSwiglu &p, float (&acc)[128], const ExpertTiles<kCols>::Place &at,
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
  expert_groups(p.offsets, p.experts, p.pairs, p.gemm.col_tiles, first, ends);
  __syncthreads();
  zero_rows(static_cast<bf16 *>(p.gate_up), 2 * p.inter, ends[p.experts - 1], p.pairs);
  zero_rows(static_cast<bf16 *>(p.h), p.inter, ends[p.experts - 1], p.pairs);
  // a tile's 256 columns of B: 128 of gate, the same 128 of up (of lora_weight too: it has the weight's rows)
  const ExpertTiles<kCols> walk{first, ends, p.experts, 2 * p.inter, p.in, 0, p.inter, first[p.experts]};
  const TailProduct lora = p.rank ? TailProduct{&p.gemm.lora_x_map, &p.gemm.lora_weight_map} : TailProduct{};
  gemm_bf16_tn<EXPERT_SWIGLU_MAX_STAGES, Major::K, true>(
      &p.gemm.x_map, &p.gemm.weight_map, p.in, p.gemm.stages, walk,
      [&](float (&acc)[128], int64_t tile, int group, int t) { epilogue<Act>(p, acc, walk.place(tile), group, t); },
      lora);
}

// The fallback: a thread an element (r, c) of h (gate and up with their low-rank products'), r's expert the first
// whose end (as the GEMM's walk reads the offsets) passes r; rows past the last end are zeros.
template <class T> __device__ __forceinline__ void rows(const ExpertSwiglu &p) {
  const T *x = static_cast<const T *>(p.x), *w = static_cast<const T *>(p.weight);
  T *gate_up = static_cast<T *>(p.gate_up), *h = static_cast<T *>(p.h);
  const bool gelu = p.activation == SWIGLU_GELU_TANH;
  const int64_t n = p.pairs * p.inter, step = (int64_t)gridDim.x * blockDim.x;
  for (int64_t i = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += step) {
    const int64_t r = i / p.inter, c = i % p.inter;
    const int e = expert_of(p.offsets, p.experts, p.pairs, r);
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
    const T *lr = static_cast<const T *>(p.lora_x) + r * p.rank;
    const T *lg = static_cast<const T *>(p.lora_weight) + ((int64_t)e * 2 * p.inter + c) * p.rank, *lu = lg + p.inter * p.rank;
    for (int64_t k = 0; k < p.rank; ++k) {
      const float a = to_f32(lr[k]);
      g = fmaf(a, to_f32(lg[k]), g);
      u = fmaf(a, to_f32(lu[k]), u);
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
