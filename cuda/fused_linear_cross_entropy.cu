// Cross-entropy over one chunk of logits, for the fused linear cross-entropy (the GEMMs around it are
// cuBLAS, called by src/torch/fused_linear_cross_entropy.cpp). One block per row:
//   pass 1 reads the row once, keeping an online max and sum of exp (f32, base-2 units) per thread;
//   pass 2 reads it again and writes the gradient softmax - onehot (times the reduction's scale, the
//   z-loss factor and the softcap derivative) over the logits, in place.
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

// Vectors per thread kept in registers between the passes; tanhf's registers crowd out two.
template <bool CAP> constexpr int kCached = CAP ? FLCE_CACHED_SOFTCAP : FLCE_CACHED;
constexpr int kInFlight = 4;   // vectors per thread loaded before any is used (memory parallelism)
constexpr float kLog2e = 1.4426950408889634f;
constexpr float kLn2 = 0.6931471805599453f;

// Max and sum of exp2(u - max) over the logits seen so far, u = logit * log2(e).
struct Softmax {
  float max;
  float sum;
};

__device__ __forceinline__ Softmax merge(Softmax a, Softmax b) {
  const float m = fmaxf(a.max, b.max);
  if (m == -CUDART_INF_F) return {m, 0.f};  // neither has seen a logit
  return {m, a.sum * exp2f(a.max - m) + b.sum * exp2f(b.max - m)};
}

// Every thread gets the row's total. One row per block, so the shared array is used once.
__device__ __forceinline__ Softmax block_merge(Softmax s) {
#pragma unroll
  for (int o = 16; o > 0; o /= 2)
    s = merge(s, {__shfl_xor_sync(0xffffffffu, s.max, o), __shfl_xor_sync(0xffffffffu, s.sum, o)});
  __shared__ Softmax warp_total[32];
  if (threadIdx.x % 32 == 0) warp_total[threadIdx.x / 32] = s;
  __syncthreads();
  Softmax total = warp_total[0];
  for (int w = 1; w < (int)(blockDim.x / 32); ++w) total = merge(total, warp_total[w]);
  return total;
}

template <bool CAP> struct Logit {
  float cap, inv_cap;
  // The logit the loss sees: softcapped when CAP.
  __device__ __forceinline__ float operator()(float z) const { return CAP ? cap * tanhf(z * inv_cap) : z; }
};

template <int V, class T, bool CAP>
__device__ __forceinline__ void fold(Softmax &s, const Pack<T, V> &pk, const Logit<CAP> &logit) {
  float u[V];
  float m = s.max;
#pragma unroll
  for (int i = 0; i < V; ++i) {
    u[i] = logit(to_f32(pk.v[i])) * kLog2e;
    m = fmaxf(m, u[i]);
  }
  float sum = s.sum * exp2f(s.max - m);  // exp2f(-inf) = 0 on the first vector
#pragma unroll
  for (int i = 0; i < V; ++i) sum += exp2f(u[i] - m);
  s = {m, sum};
}

// What pass 2 needs of the row's statistics.
struct RowGrad {
  float lse2;    // log-sum-exp in base-2 units
  float coef;    // scale * (1 + 2 z_loss lse): the softmax's factor
  float scale;   // the one-hot's factor
  int64_t tpack; // the vector holding the target, and its lane
  int tlane;
};

template <int V, class T, bool CAP>
__device__ __forceinline__ void write_grad(T *dst, const Pack<T, V> &pk, int64_t j, const RowGrad &g,
                                           const Logit<CAP> &logit) {
  float o[V];
#pragma unroll
  for (int i = 0; i < V; ++i) {
    const float s = logit(to_f32(pk.v[i]));
    float d = exp2f(s * kLog2e - g.lse2) * g.coef;
    if (j == g.tpack && i == g.tlane) d -= g.scale;
    if (CAP) {
      const float t = s * logit.inv_cap;  // tanh(z / cap)
      d *= 1.f - t * t;
    }
    o[i] = d;
  }
  store<V>(dst, o);
}

template <class T, int V, bool CAP>
__device__ __forceinline__ void rows(const CrossEntropyChunk &p) {
  const int64_t row = blockIdx.x;
  T *x = static_cast<T *>(p.logits) + row * p.ld;
  float *loss = static_cast<float *>(p.loss);
  const int64_t target = p.target[row];
  const int64_t npack = p.vocab / V;
  const int tid = threadIdx.x, nt = blockDim.x;
  const bool counted = target != p.ignore_index && target >= 0 && target < p.vocab;
  if (!counted) {  // uniform across the block
    if (tid == 0) loss[row] = 0.f;
    if (p.grad) {
      const float zero[V] = {};
      for (int64_t j = tid; j < npack; j += nt) store<V>(x + j * V, zero);
    }
    return;
  }
  const Logit<CAP> logit{(float)p.softcap, CAP ? (float)(1.0 / p.softcap) : 0.f};
  // Read before the gradient overwrites it (every thread is past block_merge's barrier by then).
  const float target_logit = tid == 0 ? logit(to_f32(x[target])) : 0.f;

  Softmax s{-CUDART_INF_F, 0.f};
  Pack<T, V> cache[kCached<CAP>];
#pragma unroll
  for (int k = 0; k < kCached<CAP>; ++k) {
    const int64_t j = tid + (int64_t)k * nt;
    if (j < npack) {
      cache[k] = load<V>(x + j * V);
      fold(s, cache[k], logit);
    }
  }
  // Vectors [first, streamed) stay in shared memory, slot j - first; the rest are read again in pass 2.
  extern __shared__ __align__(16) unsigned char shared_cache[];
  Pack<T, V> *parked = reinterpret_cast<Pack<T, V> *>(shared_cache);
  const int64_t first = (int64_t)kCached<CAP> * nt;
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
      fold(s, pk[u], logit);
      if (j < streamed) parked[j - first] = pk[u];
    }
  }
  // Keep the cached vectors packed until pass 2 widens them again.
#pragma unroll
  for (int k = 0; k < kCached<CAP>; ++k) keep_packed(cache[k]);
  s = block_merge(s);
  const float lse2 = s.max + log2f(s.sum);
  const float lse = lse2 * kLn2;
  const float z = (float)p.z_loss;
  if (tid == 0) loss[row] = lse - target_logit + z * lse * lse;
  if (!p.grad) return;

  float scale = 1.f;
  if (p.count) {
    const int64_t c = *p.count;
    scale = c > 0 ? 1.f / (float)c : 0.f;
  }
  if (p.row_scale) scale *= static_cast<const float *>(p.row_scale)[row];
  const RowGrad g{lse2, scale * (1.f + 2.f * z * lse), scale, target / V, (int)(target % V)};
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
        if (j0 - u * nt >= streamed) write_grad(x + (j0 - u * nt) * V, pk[u], j0 - u * nt, g, logit);
    }
  }
  for (int64_t j = first + tid; j < streamed; j += nt) write_grad(x + j * V, parked[j - first], j, g, logit);
#pragma unroll
  for (int k = 0; k < kCached<CAP>; ++k) {
    const int64_t j = tid + (int64_t)k * nt;
    if (j < npack) write_grad(x + j * V, cache[k], j, g, logit);
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
#define ROWS(dir, dt, access, cap)                                                                \
  extern "C" __global__ void __launch_bounds__(FLCE_BLOCK, FLCE_BLOCKS_PER_SM)                      \
      BASTILE_CAT(fused_linear_cross_entropy_##dir##_##dt##_##access, FLCE_SUFFIX_##cap)(const CrossEntropyChunk p) { \
    rows<BASTILE_TYPE_##dt, BASTILE_WIDTH_##access(BASTILE_TYPE_##dt), FLCE_SOFTCAP_##cap>(p);    \
  }
#define SCALE(...) ELEMENTWISE_KERNEL(fused_linear_cross_entropy, FLCE_SCALE_BLOCK, GradScale, scale, __VA_ARGS__)
CROSS_ENTROPY_CHUNK_KERNELS(ROWS)
GRAD_SCALE_KERNELS(SCALE)
