// The divergence over one chunk of f32 logits (include/fused_linear_divergence.h), one block a row:
//   pass 1 reads both rows once, each thread keeping online log-sum-exp statistics of z_s and z_t and the
//   sums the two KLs need against them (merged across the block in a fixed order);
//   the JSD reads them again for its sums against the mixture, whose normalisers pass 1 gave;
//   the last pass writes dD/ds over the gradient row (which may be the student's row: each element is
//   read before it is written, by the same thread).
// Math in f32 (the exps and logs the SFU's approximations, ~2 units of f32), natural-log units; the gradient
// is rounded once to its dtype.
#include <math_constants.h>

#include "common.cuh"
#include "fused_linear_divergence.h"

using namespace bastile;

namespace {

enum Mode { kForward, kReverse, kJsd };

// Over a row's elements seen so far, against the maxima ms, mt: ss = sum e_s, xs = sum e_s z_s,
// gs = sum e_s (z_s - z_t), with e_s = exp(z_s - ms); st = sum e_t, gt = sum e_t (z_t - z_s).
struct Stats {
  float ms, ss, xs, gs;
  float mt, st, gt;
};

__device__ __forceinline__ Stats empty() { return {-CUDART_INF_F, 0.f, 0.f, 0.f, -CUDART_INF_F, 0.f, 0.f}; }

// exp(a - m) for a running maximum a of a side that may have seen nothing yet.
__device__ __forceinline__ float rescale(float a, float m) { return a == -CUDART_INF_F ? 0.f : expf(a - m); }

__device__ __forceinline__ Stats merge(const Stats &a, const Stats &b) {
  Stats r;
  r.ms = fmaxf(a.ms, b.ms);
  const float fa = rescale(a.ms, r.ms), fb = rescale(b.ms, r.ms);
  r.ss = a.ss * fa + b.ss * fb, r.xs = a.xs * fa + b.xs * fb, r.gs = a.gs * fa + b.gs * fb;
  r.mt = fmaxf(a.mt, b.mt);
  const float ga = rescale(a.mt, r.mt), gb = rescale(b.mt, r.mt);
  r.st = a.st * ga + b.st * gb, r.gt = a.gt * ga + b.gt * gb;
  return r;
}

__device__ __forceinline__ Stats shuffle(const Stats &s, int o) {
  const auto x = [&](float v) { return __shfl_xor_sync(0xffffffffu, v, o); };
  return {x(s.ms), x(s.ss), x(s.xs), x(s.gs), x(s.mt), x(s.st), x(s.gt)};
}

// Every thread gets the row's total.
__device__ __forceinline__ Stats block_merge(Stats s) {
#pragma unroll
  for (int o = 16; o > 0; o /= 2) s = merge(s, shuffle(s, o));
  __shared__ Stats warp_total[DIVERGENCE_BLOCK / 32];
  if (threadIdx.x % 32 == 0) warp_total[threadIdx.x / 32] = s;
  __syncthreads();
  Stats total = warp_total[0];
  for (int w = 1; w < (int)(blockDim.x / 32); ++w) total = merge(total, warp_total[w]);
  return total;
}

// z = softcap(scale * x) / temperature, and dz/dx at z.
struct Logit {
  float mul;        // scale / temperature
  float pre, post;  // softcap: z = post * tanh(pre * x), pre = scale / softcap, post = softcap / temperature
  bool cap;
  __device__ Logit(double scale, double softcap, double temperature)
      : mul((float)(scale / temperature)),
        pre(softcap > 0 ? (float)(scale / softcap) : 0.f),
        post(softcap > 0 ? (float)(softcap / temperature) : 0.f),
        cap(softcap > 0) {}
  __device__ __forceinline__ float operator()(float x) const { return cap ? post * tanhf(pre * x) : x * mul; }
  __device__ __forceinline__ float slope(float z) const {
    if (!cap) return mul;
    const float t = z / post;
    return mul * (1.f - t * t);
  }
};

template <int V> __device__ __forceinline__ void load4(const float *p, float (&v)[V]) {
  if constexpr (V == 4) {
    const float4 q = __ldg(reinterpret_cast<const float4 *>(p));
    v[0] = q.x, v[1] = q.y, v[2] = q.z, v[3] = q.w;
  } else {
    v[0] = __ldg(p);
  }
}

// log m, m = (1 - beta) p_s + beta p_t, from the probabilities: one log where logaddexp of the
// log-probabilities costs an exp and a log1p (the pass's bottleneck). Where m underflows, so do both
// p * log terms it enters: callers give them 0.
__device__ __forceinline__ float log_mix(float ps, float pt, float beta) { return __logf((1.f - beta) * ps + beta * pt); }

template <int M, class G, int V> __device__ __forceinline__ void rows(const DivergenceChunk &p) {
  const float *student = static_cast<const float *>(p.student), *teacher = static_cast<const float *>(p.teacher);
  G *grad = static_cast<G *>(p.grad);
  float *divergence = static_cast<float *>(p.divergence), *entropy = static_cast<float *>(p.entropy);
  const Logit zs_of(p.student_scale, p.student_softcap, p.temperature), zt_of(p.teacher_scale, p.teacher_softcap, p.temperature);
  const float beta = (float)p.beta;
  const int64_t vectors = p.vocab / V;
  FOR_EACH_ROW_GROUP(row, p.rows, 1) {
    const float *s = student + row * p.ld, *t = teacher + row * p.ld;
    G *g = grad ? grad + row * p.ld : nullptr;
    if (p.mask && !p.mask[row]) {
      if (threadIdx.x == 0) divergence[row] = 0.f, entropy[row] = 0.f;
      if (g)
        for (int64_t j = threadIdx.x; j < p.vocab; j += blockDim.x) g[j] = from_f32<G>(0.f);
      continue;
    }
    Stats st = empty();
    for (int64_t c = threadIdx.x; c < vectors; c += blockDim.x) {
      float a[V], b[V];
      load4<V>(s + c * V, a);
      load4<V>(t + c * V, b);
      float ms = st.ms, mt = st.mt;
#pragma unroll
      for (int i = 0; i < V; ++i) {
        a[i] = zs_of(a[i]), b[i] = zt_of(b[i]);
        ms = fmaxf(ms, a[i]), mt = fmaxf(mt, b[i]);
      }
      const float fs = rescale(st.ms, ms), ft = rescale(st.mt, mt);
      st.ss *= fs, st.xs *= fs, st.gs *= fs, st.st *= ft, st.gt *= ft;
      st.ms = ms, st.mt = mt;
#pragma unroll
      for (int i = 0; i < V; ++i) {
        const float es = __expf(a[i] - ms), et = __expf(b[i] - mt), gap = b[i] - a[i];
        st.ss += es, st.xs += es * a[i], st.gs -= es * gap;
        st.st += et, st.gt += et * gap;
      }
    }
    st = block_merge(st);
    const float lzs = st.ms + logf(st.ss), lzt = st.mt + logf(st.st);
    float d, aux;  // the divergence, and what the gradient subtracts (D, or KL(p_s || m))
    if constexpr (M == kForward) d = aux = st.gt / st.st - lzt + lzs;
    if constexpr (M == kReverse) d = aux = st.gs / st.ss - lzs + lzt;
    if constexpr (M == kJsd) {
      float jsd = 0.f, kl = 0.f;
      // Backwards: what pass 1 read last is read first, while it may still be in L2.
      for (int64_t c = vectors - 1 - threadIdx.x; c >= 0; c -= blockDim.x) {
        float a[V], b[V];
        load4<V>(s + c * V, a);
        load4<V>(t + c * V, b);
#pragma unroll
        for (int i = 0; i < V; ++i) {
          const float ls = zs_of(a[i]) - lzs, lt = zt_of(b[i]) - lzt, ps = __expf(ls), pt = __expf(lt);
          const float lm = log_mix(ps, pt, beta);
          if (lm == -CUDART_INF_F) continue;
          const float ks = ps * (ls - lm);
          kl += ks;
          jsd += beta * pt * (lt - lm) + (1.f - beta) * ks;
        }
      }
      d = group_sum(jsd, blockDim.x);
      aux = group_sum(kl, blockDim.x);
    }
    if (threadIdx.x == 0) divergence[row] = d, entropy[row] = lzs - st.xs / st.ss;
    if (!g) {
      __syncthreads();  // the next row's merge reuses the shared array
      continue;
    }
    for (int64_t c = threadIdx.x; c < vectors; c += blockDim.x) {
      float a[V], b[V], w[V];
      load4<V>(s + c * V, a);
      load4<V>(t + c * V, b);
#pragma unroll
      for (int i = 0; i < V; ++i) {
        const float z = zs_of(a[i]), ls = z - lzs, lt = zt_of(b[i]) - lzt, ps = __expf(ls);
        float dz;
        if constexpr (M == kForward) dz = ps - __expf(lt);
        if constexpr (M == kReverse) dz = ps * (ls - lt - aux);
        if constexpr (M == kJsd) {
          const float lm = log_mix(ps, __expf(lt), beta);
          dz = lm == -CUDART_INF_F ? 0.f : (1.f - beta) * ps * (ls - lm - aux);
        }
        w[i] = dz * zs_of.slope(z);
      }
      store<V>(g + c * V, w);
    }
    __syncthreads();
  }
}

}  // namespace

#define DIVERGENCE_KERNEL(mode, dt, access)                                                                 \
  extern "C" __global__ void __launch_bounds__(DIVERGENCE_BLOCK)                                            \
      fused_linear_divergence_##mode##_##dt##_##access(const DivergenceChunk p) {                           \
    rows<BASTILE_CAT(kMode_, mode), BASTILE_TYPE_##dt, BASTILE_CAT(kWidth_, access)>(p);                    \
  }
constexpr int kMode_fkl = kForward, kMode_rkl = kReverse, kMode_jsd = kJsd;
constexpr int kWidth_vec = 4, kWidth_scalar = 1;
DIVERGENCE_CHUNK_KERNELS(DIVERGENCE_KERNEL)
