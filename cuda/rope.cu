// Rotary position embedding with HF semantics (apply_rotary_pos_emb), q and k in one launch.
//
// Forward, i < D/2, h = D/2:  out[i]   = x[i]*cos[i]     - x[i+h]*sin[i]
//                             out[i+h] = x[i+h]*cos[i+h] + x[i]*sin[i+h]
// Backward (the transposed rotation):
//                             out[i]   = g[i]*cos[i]     + g[i+h]*sin[i+h]
//                             out[i+h] = g[i+h]*cos[i+h] - g[i]*sin[i]
// Each product is rounded to promote(in, cos) and then to the output dtype, and the sum to the output
// dtype, as HF's eager ops (and their autograd) round; products are never fused into FMAs. With one
// 16-bit dtype throughout, that is packed math on element pairs (common.cuh: pair_t).
//
// A token (b, s) is handled by pair_threads x head_lanes threads: a thread loads the cos/sin vectors
// of its pair (i, i+h) once and rotates that pair in every head_lanes-th head of q and k (one index
// space), loading up to ROPE_HEADS_AT_ONCE heads before it stores any. Strides are int64 and arbitrary
// (HF's q and k are transposed views); Rust picks vec so that every access is aligned.
#include "common.cuh"
#include "rope.h"

using namespace bastile;

namespace {

// a*b rounded to M (the dtype torch multiplies in), then to O (the dtype torch stores the term in).
template <class M, class O> __device__ __forceinline__ float term(float a, float b) {
  return round_to<O>(round_to<M>(__fmul_rn(a, b)));
}

// Element (b, s, 0, 0) of t.
template <class T> __device__ __forceinline__ T *token_of(const RopeTensor &t, int64_t b, int64_t s) {
  return static_cast<T *>(t.data) + b * t.batch_stride + s * t.seq_stride;
}

// cos[i..], cos[i+half..], sin[i..], sin[i+half..] of one token: V elements each.
template <class C, int V> struct Tables {
  Pack<C, V> c1, c2, s1, s2;
};

// The rotation of one vector pair (x1, x2) = (x[i..], x[i+half..]) by the token's tables.
template <class I, class C, class O, bool kBackward, int V>
__device__ __forceinline__ void rotate_pair(const Pack<I, V> &x1, const Pack<I, V> &x2, const Tables<C, V> &t,
                                            Pack<O, V> &o1, Pack<O, V> &o2) {
  using M = typename Promote<I, C>::type;
  if constexpr (kPairable<I, C, O> && V >= 4) {
    // One dtype throughout: each term and each sum is one packed op on two elements (2-element
    // packs would spill: nvcc 13.0 keeps their pairs in local memory).
#pragma unroll
    for (int e = 0; e < V / 2; ++e) {
      const auto lo = pair(x1, e), hi = pair(x2, e);
      if constexpr (kBackward) {
        pair(o1, e) = __hadd2_rn(__hmul2_rn(lo, pair(t.c1, e)), __hmul2_rn(hi, pair(t.s2, e)));
        pair(o2, e) = __hsub2_rn(__hmul2_rn(hi, pair(t.c2, e)), __hmul2_rn(lo, pair(t.s1, e)));
      } else {
        pair(o1, e) = __hsub2_rn(__hmul2_rn(lo, pair(t.c1, e)), __hmul2_rn(hi, pair(t.s1, e)));
        pair(o2, e) = __hadd2_rn(__hmul2_rn(hi, pair(t.c2, e)), __hmul2_rn(lo, pair(t.s2, e)));
      }
    }
  } else {
#pragma unroll
    for (int e = 0; e < V; ++e) {
      const float lo = to_f32(x1.v[e]), hi = to_f32(x2.v[e]);
      const float c1 = to_f32(t.c1.v[e]), c2 = to_f32(t.c2.v[e]), s1 = to_f32(t.s1.v[e]), s2 = to_f32(t.s2.v[e]);
      if constexpr (kBackward) {
        o1.v[e] = from_f32<O>(__fadd_rn(term<M, O>(lo, c1), term<M, O>(hi, s2)));
        o2.v[e] = from_f32<O>(__fsub_rn(term<M, O>(hi, c2), term<M, O>(lo, s1)));
      } else {
        o1.v[e] = from_f32<O>(__fsub_rn(term<M, O>(lo, c1), term<M, O>(hi, s1)));
        o2.v[e] = from_f32<O>(__fadd_rn(term<M, O>(hi, c2), term<M, O>(lo, s2)));
      }
    }
  }
}

// (batch row, position) of a token: 32-bit division where it fits, as a 64-bit one is dozens of
// instructions in a thread that may rotate a single head.
__device__ __forceinline__ void split_token(int64_t tok, int64_t seq, int64_t &b, int64_t &s) {
  if ((tok | seq) <= (int64_t)UINT32_MAX) {
    const uint32_t t = (uint32_t)tok, n = (uint32_t)seq, q = t / n;
    b = q;
    s = t - q * n;
  } else {
    b = tok / seq;
    s = tok % seq;
  }
}

// Head h of a token in the q-then-k index space, given the token's first q and k elements.
template <class T>
__device__ __forceinline__ T *head(int h, int q_heads, T *q, int64_t q_stride, T *k, int64_t k_stride) {
  return h < q_heads ? q + h * q_stride : k + (h - q_heads) * k_stride;
}

template <class I, class C, class O, bool kBackward, int V>
__device__ __forceinline__ void rotate(const Rope &p) {
  const int per_token = p.pair_threads * p.head_lanes, tokens_per_block = blockDim.x / per_token;
  const int t = threadIdx.x % per_token, slot = threadIdx.x / per_token;
  const int first_pair = t % p.pair_threads, lane = t / p.pair_threads, lanes = p.head_lanes;
  // A token's heads are q's then k's, one index space; lane takes heads lane, lane + lanes, ...
  // Head counts fit in 32 bits (src/rope.rs checks).
  const int q_heads = (int)p.q_heads, heads = q_heads + (int)p.k_heads;
  const int64_t half = p.head_dim / 2, pairs = half / V, tokens = p.batch * p.seq;

  for (int64_t tok = (int64_t)blockIdx.x * tokens_per_block + slot; tok < tokens;
       tok += (int64_t)gridDim.x * tokens_per_block) {
    int64_t b, s;
    split_token(tok, p.seq, b, s);
    const C *ct = token_of<const C>(p.cos, b, s), *st = token_of<const C>(p.sin, b, s);
    const I *qx = token_of<const I>(p.q, b, s), *kx = token_of<const I>(p.k, b, s);
    O *qy = token_of<O>(p.q_out, b, s), *ky = token_of<O>(p.k_out, b, s);
    for (int64_t j = first_pair; j < pairs; j += p.pair_threads) {
      const int64_t i = j * V;
      const Tables<C, V> tab{load<V>(ct + i), load<V>(ct + half + i), load<V>(st + i), load<V>(st + half + i)};
      for (int h0 = lane; h0 < heads; h0 += lanes * ROPE_HEADS_AT_ONCE) {
        Pack<I, V> x1[ROPE_HEADS_AT_ONCE], x2[ROPE_HEADS_AT_ONCE];
#pragma unroll
        for (int u = 0; u < ROPE_HEADS_AT_ONCE; ++u) {
          const int h = h0 + u * lanes;
          if (h >= heads) break;
          const I *x = head(h, q_heads, qx, p.q.head_stride, kx, p.k.head_stride) + i;
          x1[u] = load<V>(x);
          x2[u] = load<V>(x + half);
        }
#pragma unroll
        for (int u = 0; u < ROPE_HEADS_AT_ONCE; ++u) {
          const int h = h0 + u * lanes;
          if (h >= heads) break;
          O *y = head(h, q_heads, qy, p.q_out.head_stride, ky, p.k_out.head_stride) + i;
          Pack<O, V> o1, o2;
          rotate_pair<I, C, O, kBackward, V>(x1[u], x2[u], tab, o1, o2);
          store_pack(y, o1);
          store_pack(y + half, o2);
        }
      }
    }
  }
}

}  // namespace

// The forward writes promote(in, cos); the backward writes in's dtype.
#define ROPE_fwd(I, C, V) rotate<I, C, typename Promote<I, C>::type, false, V>(p)
#define ROPE_bwd(I, C, V) rotate<I, C, I, true, V>(p)
#define ROPE_WIDTH_v1 1
#define ROPE_WIDTH_v2 2
#define ROPE_WIDTH_v4 4
#define ROPE_WIDTH_v8 8
#define KERNEL(dir, in, cs, v)                                                                          \
  extern "C" __global__ void __launch_bounds__(ROPE_BLOCK) rope_##dir##_##in##_##cs##_##v(const Rope p) { \
    ROPE_##dir(BASTILE_TYPE_##in, BASTILE_TYPE_##cs, ROPE_WIDTH_##v);                                    \
  }
ROPE_KERNELS(KERNEL)
