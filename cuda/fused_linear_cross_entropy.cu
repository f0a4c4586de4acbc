// Cross-entropy over one chunk of logits, for the fused linear cross-entropy (the GEMMs around it are
// cuBLAS, called by src/torch/fused_linear_cross_entropy.cpp). One block per row:
//   pass 1 reads the row once, keeping an online max and sum of exp (f32, base-2 units) per thread, and
//   in the stats kernels the moments TRL's per-token heads report (entropy, sum of p^2, mean, top-1);
//   pass 2 reads it again and writes the gradient softmax - onehot (times the reduction's scale, the
//   z-loss factor, the entropy's term and the derivative of the scaled softcap) over the logits, in place.
// A row of Qwen3's vocabulary is 304 KB (bf16), more than an SM holds, so pass 2 re-reads part of it.
// Pass 1 parks what it can on chip: each thread's first kCached vectors in registers, the next
// p.shared_vecs per thread in shared memory (as much as two blocks per SM leave: ~47% of that row on
// an H100, which cut the pass from 2.20 to 1.97 ms over 8192 rows). Pass 2 walks the rest backwards,
// so that the part read last in pass 1 is read first, while it is still in L2.
#include <math_constants.h>

#include "elementwise.cuh"
#include "fused_linear_cross_entropy.h"

using namespace bastile;

namespace {

// Vectors per thread kept in registers between the passes; tanhf's registers crowd out two, the stats'
// accumulators half.
template <bool CAP, bool ST>
constexpr int kCached = ST ? (CAP ? FLCE_CACHED_SOFTCAP_STATS : FLCE_CACHED_STATS) : CAP ? FLCE_CACHED_SOFTCAP : FLCE_CACHED;
constexpr int kInFlight = 4;   // vectors per thread loaded before any is used (memory parallelism)
constexpr float kLog2e = 1.4426950408889634f;
constexpr float kLn2 = 0.6931471805599453f;

// Over the scaled logits s seen so far, u = s * log2(e): max of u and sum of e = exp2(u - max); with ST
// also sum of e * s and of e^2 (against the same max), sum of s, max of s, and max of s before the target.
// (Plain data, no initialisers: block_merge keeps an array of them in shared memory.)
template <bool ST> struct Softmax {
  float max, sum;
};
template <> struct Softmax<true> {
  float max, sum;
  float es, ee, total, top, before;
};

template <bool ST> __device__ __forceinline__ Softmax<ST> empty() {
  if constexpr (ST) return {-CUDART_INF_F, 0.f, 0.f, 0.f, 0.f, -CUDART_INF_F, -CUDART_INF_F};
  else return {-CUDART_INF_F, 0.f};
}

template <bool ST> __device__ __forceinline__ Softmax<ST> merge(const Softmax<ST> &a, const Softmax<ST> &b) {
  Softmax<ST> r = empty<ST>();
  r.max = fmaxf(a.max, b.max);
  if constexpr (ST) {
    r.total = a.total + b.total;
    r.top = fmaxf(a.top, b.top);
    r.before = fmaxf(a.before, b.before);
  }
  if (r.max == -CUDART_INF_F) return r;  // neither has seen a logit
  const float fa = exp2f(a.max - r.max), fb = exp2f(b.max - r.max);
  r.sum = a.sum * fa + b.sum * fb;
  if constexpr (ST) {
    r.es = a.es * fa + b.es * fb;
    r.ee = a.ee * fa * fa + b.ee * fb * fb;
  }
  return r;
}

template <bool ST> __device__ __forceinline__ Softmax<ST> shuffle(const Softmax<ST> &s, int o) {
  Softmax<ST> r = empty<ST>();
  r.max = __shfl_xor_sync(0xffffffffu, s.max, o);
  r.sum = __shfl_xor_sync(0xffffffffu, s.sum, o);
  if constexpr (ST) {
    r.es = __shfl_xor_sync(0xffffffffu, s.es, o);
    r.ee = __shfl_xor_sync(0xffffffffu, s.ee, o);
    r.total = __shfl_xor_sync(0xffffffffu, s.total, o);
    r.top = __shfl_xor_sync(0xffffffffu, s.top, o);
    r.before = __shfl_xor_sync(0xffffffffu, s.before, o);
  }
  return r;
}

// Every thread gets the row's total, merged in a fixed order. One row per block, so the shared array is
// used once.
template <bool ST> __device__ __forceinline__ Softmax<ST> block_merge(Softmax<ST> s) {
#pragma unroll
  for (int o = 16; o > 0; o /= 2) s = merge(s, shuffle(s, o));
  __shared__ Softmax<ST> warp_total[32];
  if (threadIdx.x % 32 == 0) warp_total[threadIdx.x / 32] = s;
  __syncthreads();
  Softmax<ST> total = warp_total[0];
  for (int w = 1; w < (int)(blockDim.x / 32); ++w) total = merge(total, warp_total[w]);
  return total;
}

// s = softcap(logit_scale * z) / temperature. Without softcap and at scale 1 (HF's loss) the product
// by mul = 1 is exact, so the loss is that of the plain logits.
template <bool CAP> struct Logit {
  float mul;       // logit_scale / temperature: ds/dz without softcap
  float pre, post; // softcap: s = post * tanh(pre * z), pre = logit_scale / softcap, post = softcap / temperature
  float inv_post;
  __device__ Logit(const CrossEntropyChunk &p)
      : mul((float)(p.logit_scale / p.temperature)),
        pre(CAP ? (float)(p.logit_scale / p.softcap) : 0.f),
        post(CAP ? (float)(p.softcap / p.temperature) : 0.f),
        inv_post(CAP ? (float)(p.temperature / p.softcap) : 0.f) {}
  __device__ __forceinline__ float operator()(float z) const { return CAP ? post * tanhf(z * pre) : z * mul; }
  // ds/dz at s: mul * (1 - tanh^2) with softcap.
  __device__ __forceinline__ float slope(float s) const {
    if (!CAP) return mul;
    const float t = s * inv_post;
    return mul * (1.f - t * t);
  }
};

// Folds the vector of logits j (elements j * V + i) into s.
template <bool ST, int V, class T, bool CAP>
__device__ __forceinline__ void fold(Softmax<ST> &s, const Pack<T, V> &pk, int64_t j, int64_t target,
                                     const Logit<CAP> &logit) {
  float x[V], u[V];
  float m = s.max;
#pragma unroll
  for (int i = 0; i < V; ++i) {
    x[i] = logit(to_f32(pk.v[i]));
    u[i] = x[i] * kLog2e;
    m = fmaxf(m, u[i]);
  }
  const float f = exp2f(s.max - m);  // exp2f(-inf) = 0 on the first vector
  s.sum *= f;
  if constexpr (ST) {
    s.es *= f;
    s.ee *= f * f;
  }
  s.max = m;
  const int64_t before = target - j * V;  // elements of this vector before the target
#pragma unroll
  for (int i = 0; i < V; ++i) {
    const float e = exp2f(u[i] - m);
    s.sum += e;
    if constexpr (ST) {
      s.es += e * x[i];
      s.ee += e * e;
      s.total += x[i];
      s.top = fmaxf(s.top, x[i]);
      if (i < before) s.before = fmaxf(s.before, x[i]);
    }
  }
}

// What pass 2 needs of the row's statistics.
struct RowGrad {
  float lse2;    // log-sum-exp in base-2 units
  float coef;    // scale * (1 + 2 z_loss lse): the softmax's factor
  float scale;   // the one-hot's factor: scale * (1 - label_smoothing)
  float smooth;  // ST: scale * label_smoothing / vocab, every logit's
  float ecoef;   // ST: minus the entropy's upstream gradient; p_j (log p_j + entropy) is its factor
  float entropy;
  int64_t tpack; // the vector holding the target, and its lane
  int tlane;
};

template <bool ST, int V, class T, bool CAP>
__device__ __forceinline__ void write_grad(T *dst, const Pack<T, V> &pk, int64_t j, const RowGrad &g,
                                           const Logit<CAP> &logit) {
  float o[V];
#pragma unroll
  for (int i = 0; i < V; ++i) {
    const float s = logit(to_f32(pk.v[i]));
    const float l2 = s * kLog2e - g.lse2;  // log2 p
    float d = exp2f(l2) * (ST ? g.coef + g.ecoef * (l2 * kLn2 + g.entropy) : g.coef);
    if (j == g.tpack && i == g.tlane) d -= g.scale;
    if (ST) d -= g.smooth;
    o[i] = d * logit.slope(s);
  }
  store<V>(dst, o);
}

template <class T, int V, bool CAP, bool ST>
__device__ __forceinline__ void rows(const CrossEntropyChunk &p) {
  const int64_t row = blockIdx.x;
  T *x = static_cast<T *>(p.logits) + row * p.ld;
  float *loss = static_cast<float *>(p.loss);
  const int64_t target = p.target[row];
  const int64_t npack = p.vocab / V;
  const int tid = threadIdx.x, nt = blockDim.x;
  const bool counted = target != p.ignore_index && target >= 0 && target < p.vocab;
  float *stats = ST && p.stats ? static_cast<float *>(p.stats) + row * 4 : nullptr;
  if (!counted) {  // uniform across the block
    if (tid == 0) loss[row] = 0.f;
    if (stats && tid < 4) stats[tid] = 0.f;
    if (p.grad) {
      const float zero[V] = {};
      for (int64_t j = tid; j < npack; j += nt) store<V>(x + j * V, zero);
    }
    return;
  }
  const Logit<CAP> logit(p);
  // Read before the gradient overwrites it (every thread is past block_merge's barrier by then).
  const float target_logit = tid == 0 ? logit(to_f32(x[target])) : 0.f;

  Softmax<ST> s = empty<ST>();
  Pack<T, V> cache[kCached<CAP, ST>];
#pragma unroll
  for (int k = 0; k < kCached<CAP, ST>; ++k) {
    const int64_t j = tid + (int64_t)k * nt;
    if (j < npack) {
      cache[k] = load<V>(x + j * V);
      fold(s, cache[k], j, target, logit);
    }
  }
  // Vectors [first, streamed) stay in shared memory, slot j - first; the rest are read again in pass 2.
  extern __shared__ __align__(16) unsigned char shared_cache[];
  Pack<T, V> *parked = reinterpret_cast<Pack<T, V> *>(shared_cache);
  const int64_t first = (int64_t)kCached<CAP, ST> * nt;
  const int64_t streamed = min(npack, first + (int64_t)p.shared_vecs * nt);
  for (int64_t j0 = first + tid; j0 < npack; j0 += (int64_t)kInFlight * nt) {
    Pack<T, V> pk[kInFlight];
#pragma unroll
    for (int u = 0; u < kInFlight; ++u)
      if (j0 + u * nt < npack) pk[u] = load<V>(x + (j0 + u * nt) * V);
#pragma unroll
    for (int u = 0; u < kInFlight; ++u) keep_packed(pk[u]);
#pragma unroll
    for (int u = 0; u < kInFlight; ++u) {
      const int64_t j = j0 + u * nt;
      if (j >= npack) continue;
      fold(s, pk[u], j, target, logit);
      if (j < streamed) parked[j - first] = pk[u];
    }
  }
  // Keep the cached vectors packed until pass 2 widens them again.
#pragma unroll
  for (int k = 0; k < kCached<CAP, ST>; ++k) keep_packed(cache[k]);
  s = block_merge(s);
  const float lse2 = s.max + log2f(s.sum);
  const float lse = lse2 * kLn2;
  const float z = (float)p.z_loss;
  float entropy = 0.f;
  const float eps = (float)p.label_smoothing;
  if constexpr (ST) {
    if (tid == 0) loss[row] = lse - (1.f - eps) * target_logit - eps * (s.total / (float)p.vocab) + z * lse * lse;
  } else {
    if (tid == 0) loss[row] = lse - target_logit + z * lse * lse;
  }
  if constexpr (ST) {
    entropy = lse - s.es / s.sum;
    if (tid == 0 && stats) {
      stats[0] = entropy;
      stats[1] = logf(s.ee) - 2.f * logf(s.sum);
      stats[2] = s.total / (float)p.vocab;
      stats[3] = target_logit >= s.top && target_logit > s.before ? 1.f : 0.f;
    }
  }
  if (!p.grad) return;

  float scale = 1.f;
  if (p.count) {
    const int64_t c = *p.count;
    scale = c > 0 ? 1.f / (float)c : 0.f;
  }
  if (p.row_scale) scale *= static_cast<const float *>(p.row_scale)[row];
  const float ecoef = ST && p.entropy_scale ? -static_cast<const float *>(p.entropy_scale)[row] : 0.f;
  const RowGrad g{lse2, scale * (1.f + 2.f * z * lse), scale * (1.f - eps), scale * eps / (float)p.vocab,
                  ecoef, entropy, target / V, (int)(target % V)};
  // This thread's streamed vectors, last first.
  if (streamed + tid < npack) {
    const int64_t last = streamed + tid + (npack - 1 - streamed - tid) / nt * nt;
    for (int64_t j0 = last; j0 >= streamed; j0 -= (int64_t)kInFlight * nt) {
      Pack<T, V> pk[kInFlight];
#pragma unroll
      for (int u = 0; u < kInFlight; ++u)
        if (j0 - u * nt >= streamed) pk[u] = load<V>(x + (j0 - u * nt) * V);
#pragma unroll
      for (int u = 0; u < kInFlight; ++u) keep_packed(pk[u]);
#pragma unroll
      for (int u = 0; u < kInFlight; ++u)
        if (j0 - u * nt >= streamed) write_grad<ST>(x + (j0 - u * nt) * V, pk[u], j0 - u * nt, g, logit);
    }
  }
  for (int64_t j = first + tid; j < streamed; j += nt) write_grad<ST>(x + j * V, parked[j - first], j, g, logit);
#pragma unroll
  for (int k = 0; k < kCached<CAP, ST>; ++k) {
    const int64_t j = tid + (int64_t)k * nt;
    if (j < npack) write_grad<ST>(x + j * V, cache[k], j, g, logit);
  }
}

// dst = src * factor, each element in f32 and rounded once. Plain loads: dst may be src.
template <class T, int V> __device__ __forceinline__ void scale(const GradScale &p) {
  const T *src = static_cast<const T *>(p.src);
  T *dst = static_cast<T *>(p.dst);
  const float f = *p.factor;
  Pack<T, V> v[FLCE_SCALE_UNROLL];
  for_each_vector<V, FLCE_SCALE_UNROLL>(
      p.n, [&](int k, int64_t i) { v[k] = load<V>(src + i * V); },
      [&](int k, int64_t i) {
        float o[V];
#pragma unroll
        for (int j = 0; j < V; ++j) o[j] = to_f32(v[k].v[j]) * f;
        store<V>(dst + i * V, o);
      });
  const int64_t t = tail_index<V>(p.n);
  if (t >= 0) dst[t] = from_f32<T>(to_f32(src[t]) * f);
}

}  // namespace

// Up to FLCE_BLOCK threads, FLCE_BLOCKS_PER_SM blocks per SM: 64 registers a thread hold the cached
// vectors and the vectors in flight without spilling.
#define FLCE_SOFTCAP_ false
#define FLCE_SOFTCAP_softcap true
#define FLCE_SUFFIX_
#define FLCE_SUFFIX_softcap _softcap
#define FLCE_STATS_ false
#define FLCE_STATS_stats true
#define FLCE_SUFFIX_stats _stats
#define ROWS(dir, dt, access, cap, st)                                                             \
  extern "C" __global__ void __launch_bounds__(FLCE_BLOCK, FLCE_BLOCKS_PER_SM) BASTILE_CAT(         \
      BASTILE_CAT(fused_linear_cross_entropy_##dir##_##dt##_##access, FLCE_SUFFIX_##cap),           \
      FLCE_SUFFIX_##st)(const CrossEntropyChunk p) {                                                \
    rows<BASTILE_TYPE_##dt, BASTILE_WIDTH_##access(BASTILE_TYPE_##dt), FLCE_SOFTCAP_##cap, FLCE_STATS_##st>(p); \
  }
#define SCALE(...) ELEMENTWISE_KERNEL(fused_linear_cross_entropy, FLCE_SCALE_BLOCK, GradScale, scale, __VA_ARGS__)
CROSS_ENTROPY_CHUNK_KERNELS(ROWS)
GRAD_SCALE_KERNELS(SCALE)

// ---------------------------------------------------------------------------------------------------------
// The Hopper path (include/fused_linear_cross_entropy.h: CrossEntropyGemm). Per chunk, Rust launches
// target (the reference) -> gemm -> check -> gemm again over flagged row tiles (none: its blocks exit) ->
// finish; after the C++ layer's exps @ weight, rescale. Every reduction runs in a fixed order.
#include "hopper.cuh"

namespace {

using namespace bastile::sm90;

constexpr int kTileM = kGemmTileM, kTileN = kGemmTileN;
constexpr float kFlushSum = 18446744073709551616.f;                  // 2^64: a row at or above is repaired

__device__ __forceinline__ int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }

__device__ __forceinline__ float warp_max(float v) {
#pragma unroll
  for (int o = 16; o > 0; o /= 2) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
  return v;
}

__device__ __forceinline__ bool counted(int64_t t, const CrossEntropyGemm &p) {
  return t != p.ignore_index && t >= 0 && t < p.vocab;
}

// The blocks' walk over output tiles: row tiles fastest, so that the blocks in flight share a weight
// tile (read from DRAM about once) and the chunk's hidden stays in L2. With `repair`, only tiles of
// flagged row tiles. Producer and consumers walk it alike.
struct Tiles {
  int64_t row_tiles, count;
  const int32_t *flags;
  __device__ Tiles(const CrossEntropyGemm &p)
      : row_tiles(ceil_div(p.rows, kTileM)), count(ceil_div(p.rows, kTileM) * ceil_div(p.vocab, kTileN)),
        flags(p.repair ? p.tile_flags : nullptr) {}
  __device__ bool skip(int64_t tile) const { return flags && !flags[tile % row_tiles]; }
  // A repair launch with nothing flagged (flags[row_tiles]: any row tile) has nothing to do.
  __device__ bool none() const { return flags && !flags[row_tiles]; }
  __device__ int32_t a_row(int64_t tile) const { return (int32_t)(tile % row_tiles * kTileM); }
  __device__ int32_t b_row(int64_t tile, int half) const { return (int32_t)(tile / row_tiles * kTileN + half * kTileN / 2); }
};

__device__ __forceinline__ float fast_exp2(float x) {  // subnormal results flush to 0 (see the header)
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
  return y;
}

// exps of one warp group's 64 x 256 part of a tile, and per row its {max u, sum of 2^(u - r)}.
template <bool CAP>
__device__ __forceinline__ void epilogue(const CrossEntropyGemm &p, float (&acc)[128], int64_t m, int64_t n,
                                         int group, int t) {
  const float mul = (float)(p.logit_scale / p.temperature) * kLog2e;  // u = z * mul without softcap
  const float pre = CAP ? (float)(p.logit_scale / p.softcap) : 0.f;
  const float post = CAP ? (float)(p.softcap / p.temperature) : 0.f, inv_post = CAP ? 1.f / post : 0.f;
  const int warp = t / 32, lane = t % 32, q = lane % 4;
  unsigned char *mine = regroup_scratch<1>(group, t);  // the exps
  const int64_t tiles = ceil_div(p.vocab, kTileN);
  const bool whole = (n + 1) * kTileN <= p.vocab;
  float2 *partial = reinterpret_cast<float2 *>(p.partial);
#pragma unroll
  for (int half = 0; half < 2; ++half) {
    const int64_t row = m * kTileM + group * 64 + warp * 16 + lane / 4 + half * 8;
    const bool in = row < p.rows;
    const float r = in ? p.reference[row] : -CUDART_INF_F;
    const bool live = r > -CUDART_INF_F;  // -inf: an ignored row (or none), whose exps are 0
    float top = -CUDART_INF_F, sum = 0.f;
    // The exps of the thread's columns, as bf16 pairs: group j, columns 8 j + 2 q (+ 1).
    uint32_t e[kTileN / 8];
    if (live && whole && !CAP) {
      // u is monotonic in z (mul > 0): the max of z gives the max of u.
      float zmax = -CUDART_INF_F;
#pragma unroll
      for (int j = 0; j < kTileN / 8; ++j) {
        const float z0 = acc[4 * j + 2 * half], z1 = acc[4 * j + 2 * half + 1];
        zmax = fmaxf(zmax, fmaxf(z0, z1));
        const float x0 = fast_exp2(fmaf(z0, mul, -r)), x1 = fast_exp2(fmaf(z1, mul, -r));
        sum += x0 + x1;
        e[j] = bits(__floats2bfloat162_rn(x0, x1));
      }
      top = zmax * mul;
    } else {
#pragma unroll
      for (int j = 0; j < kTileN / 8; ++j) {
        float x[2] = {0.f, 0.f};
#pragma unroll
        for (int c = 0; c < 2; ++c) {
          const float z = acc[4 * j + 2 * half + c];
          if (live && (whole || n * kTileN + 8 * j + 2 * q + c < p.vocab)) {
            const float s = CAP ? post * tanhf(z * pre) : 0.f;
            const float u = CAP ? s * kLog2e : z * mul;
            const float y = fast_exp2(u - r);
            top = fmaxf(top, u);
            sum += y;
            x[c] = CAP ? y * (1.f - (s * inv_post) * (s * inv_post)) : y;
          }
        }
        e[j] = bits(__floats2bfloat162_rn(x[0], x[1]));
      }
    }
    if (p.grad) {
      bf16 *out = static_cast<bf16 *>(p.exps) + row * p.ld + n * kTileN;
#pragma unroll
      for (int j = 0; j < kTileN / 8; j += 4) {
        const uint32_t v[4] = {e[j], e[j + 1], e[j + 2], e[j + 3]};
        const uint4 w = regroup(mine, lane, v);
        if (in && (whole || n * kTileN + 8 * (j + q) < p.ld)) *reinterpret_cast<uint4 *>(out + 8 * (j + q)) = w;
      }
    }
    // The row's four threads, in a fixed order.
#pragma unroll
    for (int o = 1; o < 4; o *= 2) {
      top = fmaxf(top, __shfl_xor_sync(0xffffffffu, top, o));
      sum += __shfl_xor_sync(0xffffffffu, sum, o);
    }
    if (in && q == 0) partial[row * tiles + n] = make_float2(top, sum);
  }
}

template <bool CAP> __device__ __forceinline__ void logits_gemm(const CrossEntropyGemm &p) {
  const Tiles tiles(p);
  gemm_bf16_tn<FLCE_GEMM_MAX_STAGES>(&p.hidden_map, &p.weight_map, p.cols, p.stages, tiles,
                                     [&](float (&acc)[128], int64_t tile, int group, int t) {
                                       epilogue<CAP>(p, acc, tile % tiles.row_tiles, tile / tiles.row_tiles, group, t);
                                     });
}

// Per row: s_t = softcap(logit_scale * <hidden, weight[t]>) / temperature (f32 products and sums) and the
// reference u_t + margin; -inf for ignored rows. Also clears the repair flags.
__device__ __forceinline__ void target_logits(const CrossEntropyGemm &p) {
  const int64_t row = (int64_t)blockIdx.x * (FLCE_GEMM_ROW_BLOCK / 32) + threadIdx.x / 32;
  const int lane = threadIdx.x % 32;
  if (row >= p.rows) return;
  if (lane == 0 && row % kTileM == 0) p.tile_flags[row / kTileM] = 0;
  if (lane == 0 && row == 0) p.tile_flags[ceil_div(p.rows, kTileM)] = 0;
  const int64_t t = p.target[row];
  if (!counted(t, p)) {
    if (lane == 0) p.target_logit[row] = 0.f, p.reference[row] = -CUDART_INF_F;
    return;
  }
  const bf16 *h = static_cast<const bf16 *>(p.hidden) + row * p.cols;
  const bf16 *w = static_cast<const bf16 *>(p.weight) + t * p.cols;
  float dot = 0.f;
  for (int64_t c = lane * 8; c < p.cols; c += 32 * 8) {
    const Pack<bf16, 8> a = load<8>(h + c), b = load<8>(w + c);
#pragma unroll
    for (int i = 0; i < 8; ++i) dot = fmaf(to_f32(a.v[i]), to_f32(b.v[i]), dot);
  }
  dot = warp_group_sum(dot, 32);
  if (lane == 0) {
    const float s = p.softcap > 0 ? (float)(p.softcap / p.temperature) * tanhf(dot * (float)(p.logit_scale / p.softcap))
                                  : dot * (float)(p.logit_scale / p.temperature);
    p.target_logit[row] = s;
    p.reference[row] = s * kLog2e + FLCE_GEMM_MARGIN;
  }
}

// The row's {max u, sum} over its column tiles (in a fixed order).
__device__ __forceinline__ float2 row_total(const CrossEntropyGemm &p, int64_t row, int lane) {
  const int64_t tiles = ceil_div(p.vocab, kTileN);
  const float2 *partial = reinterpret_cast<const float2 *>(p.partial) + row * tiles;
  float top = -CUDART_INF_F, sum = 0.f;
  for (int64_t k = lane; k < tiles; k += 32) {
    const float2 v = partial[k];
    top = fmaxf(top, v.x);
    sum += v.y;
  }
  return make_float2(warp_max(top), warp_group_sum(sum, 32));
}

// Rows whose sum reached 2^64 (or is not finite) take their max as the reference and flag their tile.
__device__ __forceinline__ void check(const CrossEntropyGemm &p) {
  const int64_t row = (int64_t)blockIdx.x * (FLCE_GEMM_ROW_BLOCK / 32) + threadIdx.x / 32;
  if (row >= p.rows) return;
  const int lane = threadIdx.x % 32;
  if (p.reference[row] == -CUDART_INF_F) return;
  const float2 total = row_total(p, row, lane);
  if (lane != 0) return;
  if (total.y < kFlushSum) {
    p.row_sum[row] = total.y;
  } else {
    p.reference[row] = total.x;
    p.row_sum[row] = CUDART_NAN_F;
    atomicOr(&p.tile_flags[row / kTileM], 1);  // an OR: the same flags in any order
    atomicOr(&p.tile_flags[ceil_div(p.rows, kTileM)], 1);
  }
}

// Per row: the loss, the factor, and the target's element of exps (see the header).
__device__ __forceinline__ void finish(const CrossEntropyGemm &p) {
  const int64_t row = (int64_t)blockIdx.x * (FLCE_GEMM_ROW_BLOCK / 32) + threadIdx.x / 32;
  if (row >= p.rows) return;
  const int lane = threadIdx.x % 32;
  float *loss = static_cast<float *>(p.loss);
  const float r = p.reference[row];
  if (r == -CUDART_INF_F) {
    if (lane == 0) loss[row] = 0.f, p.factor[row] = 0.f;
    return;
  }
  float sum = p.row_sum[row];
  if (isnan(sum)) sum = row_total(p, row, lane).y;  // repaired: its tiles ran again
  if (lane != 0) return;
  const float lse2 = r + log2f(sum), lse = lse2 * kLn2, z = (float)p.z_loss;
  const float st = p.target_logit[row];
  loss[row] = lse - st + z * lse * lse;
  float w = 1.f;
  if (p.count) {
    const int64_t c = *p.count;
    w = c > 0 ? 1.f / (float)c : 0.f;
  }
  if (p.row_scale) w *= p.row_scale[row];
  const float g = w * (1.f + 2.f * z * lse);
  const float mul = (float)(p.logit_scale / p.temperature);
  const float factor = g * mul / sum;
  p.factor[row] = factor;
  if (!p.grad) return;
  // d(loss)/dz_t = (g p_t - w) ds_t/dz_t, written as factor * exps[t].
  const float pt = exp2f(st * kLog2e - lse2);
  float slope = mul;
  if (p.softcap > 0) {
    const float x = st * (float)(p.temperature / p.softcap);
    slope *= 1.f - x * x;
  }
  const int64_t t = p.target[row];
  static_cast<bf16 *>(p.exps)[row * p.ld + t] = __float2bfloat16_rn(factor != 0.f ? (g * pt - w) * slope / factor : 0.f);
}

// grad_hidden = factor * product and scaled = factor * hidden, a block a row, rounded once.
__device__ __forceinline__ void rescale(const CrossEntropyGemm &p) {
  const int64_t row = blockIdx.x;
  const float f = p.factor[row];
  for (int64_t c = threadIdx.x * 8; c < p.cols; c += (int64_t)blockDim.x * 8) {
    float o[8];
    if (p.grad_hidden) {
      const float4 *src = reinterpret_cast<const float4 *>(p.product + row * p.cols + c);
      const float4 a = src[0], b = src[1];
      const float v[8] = {a.x, a.y, a.z, a.w, b.x, b.y, b.z, b.w};
#pragma unroll
      for (int i = 0; i < 8; ++i) o[i] = v[i] * f;
      store<8>(static_cast<bf16 *>(p.grad_hidden) + row * p.cols + c, o);
    }
    if (p.scaled) {
      const Pack<bf16, 8> h = load<8>(static_cast<const bf16 *>(p.hidden) + row * p.cols + c);
#pragma unroll
      for (int i = 0; i < 8; ++i) o[i] = to_f32(h.v[i]) * f;
      store<8>(static_cast<bf16 *>(p.scaled) + row * p.cols + c, o);
    }
  }
}

}  // namespace

#define FLCE_GEMM_gemm(dt, cap)                                                                                    \
  extern "C" __global__ void __launch_bounds__(kGemmThreads, 1)                                           \
      BASTILE_CAT(fused_linear_cross_entropy_gemm_##dt, FLCE_SUFFIX_##cap)(const __grid_constant__ CrossEntropyGemm p) { \
    logits_gemm<FLCE_SOFTCAP_##cap>(p);                                                                        \
  }
#define FLCE_GEMM_ROWS(name, fn)                                                                               \
  extern "C" __global__ void __launch_bounds__(FLCE_GEMM_ROW_BLOCK) name(const __grid_constant__ CrossEntropyGemm p) { \
    fn(p);                                                                                                     \
  }
#define GEMM_KERNEL(kind, ...) FLCE_GEMM_##kind(__VA_ARGS__)
#define FLCE_GEMM_target(dt) FLCE_GEMM_ROWS(fused_linear_cross_entropy_target_##dt, target_logits)
#define FLCE_GEMM_check() FLCE_GEMM_ROWS(fused_linear_cross_entropy_check, check)
#define FLCE_GEMM_finish(dt) FLCE_GEMM_ROWS(fused_linear_cross_entropy_finish_##dt, finish)
#define FLCE_GEMM_rescale(dt) FLCE_GEMM_ROWS(fused_linear_cross_entropy_rescale_##dt, rescale)
CROSS_ENTROPY_GEMM_KERNELS(GEMM_KERNEL)
