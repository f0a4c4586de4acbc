// Rotary position embedding with HF semantics (apply_rotary_pos_emb), q and k in one launch.
//
// A head's first rot elements (rot: cos and sin's width) form h = rot/2 pairs (x1, x2), rotated with
// tables (c1, c2, s1, s2):
//   half-split (rotate_half):  x1 = x[i],  x2 = x[i+h],  c1 = cos[i], c2 = cos[i+h], s alike,  i < h
//   interleaved (GLM-4):       x1 = x[2j], x2 = x[2j+1], c1 = c2 = cos[j], s1 = s2 = sin[j],  j < h
// Forward:                    out1 = x1*c1 - x2*s1,  out2 = x2*c2 + x1*s2
// Backward (the transposed rotation):
//                             out1 = g1*c1 + g2*s2,  out2 = g2*c2 - g1*s1
// The other head_dim - rot elements pass through in the output dtype (HF's partial rotary
// concatenates them), backward as forward. Each product is rounded to promote(in, cos) and then to the
// output dtype, and the sum to the output dtype, as HF's eager ops (and their autograd) round; products
// are never fused into FMAs. With one 16-bit dtype throughout, that is packed math on element pairs
// (common.cuh: pair_t).
//
// A token (b, s) is handled by pair_threads x head_lanes threads: a thread takes items of a head, each
// two V-element vectors: V pairs (x[i..] and x[i+h..], or interleaved the 2V elements x[2j..] split
// into their even and odd elements) or, past the pairs, 2V passed elements. It loads an item's cos/sin
// vectors once and does that item in every head_lanes-th head of q and k (one index space), loading up
// to ROPE_HEADS_AT_ONCE heads before it stores any. Strides are int64 and arbitrary (HF's q and k are
// transposed views); Rust picks vec so that every access is aligned.
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

// The even and the odd elements of the 2V consecutive elements (a, b), in place: an interleaved item's
// pairs as rotate_pair's (x1, x2). Register moves only, as every index is known after unrolling.
template <class T, int V> __device__ __forceinline__ void deinterleave(Pack<T, V> &a, Pack<T, V> &b) {
  Pack<T, V> even, odd;
#pragma unroll
  for (int e = 0; e < V; ++e) {
    even.v[e] = 2 * e < V ? a.v[2 * e] : b.v[2 * e - V];
    odd.v[e] = 2 * e + 1 < V ? a.v[2 * e + 1] : b.v[2 * e + 1 - V];
  }
  a = even;
  b = odd;
}

// The inverse of deinterleave.
template <class T, int V> __device__ __forceinline__ void interleave(Pack<T, V> &even, Pack<T, V> &odd) {
  Pack<T, V> a, b;
#pragma unroll
  for (int k = 0; k < 2 * V; ++k) (k < V ? a.v[k] : b.v[k - V]) = (k % 2 ? odd : even).v[k / 2];
  even = a;
  odd = b;
}

// x in O: exact, as O is I or wider.
template <class O, class I, int V> __device__ __forceinline__ Pack<O, V> convert(const Pack<I, V> &x) {
  if constexpr (std::is_same_v<I, O>) {
    return x;
  } else {
    Pack<O, V> y;
#pragma unroll
    for (int e = 0; e < V; ++e) y.v[e] = from_f32<O>(to_f32(x.v[e]));
    return y;
  }
}

template <class I, class C, class O, bool kBackward, int V>
__device__ __forceinline__ void rotate(const Rope &p) {
  const int per_token = p.pair_threads * p.head_lanes, tokens_per_block = blockDim.x / per_token;
  const int t = threadIdx.x % per_token, slot = threadIdx.x / per_token;
  const int first_item = t % p.pair_threads, lane = t / p.pair_threads, lanes = p.head_lanes;
  // A token's heads are q's then k's, one index space; lane takes heads lane, lane + lanes, ...
  // Head counts fit in 32 bits (src/rope.rs checks).
  const int q_heads = (int)p.q_heads, heads = q_heads + (int)p.k_heads;
  const int64_t half = p.rot / 2, pairs = half / V, items = pairs + (p.head_dim - p.rot) / (2 * V);
  const int64_t tokens = p.batch * p.seq;

  for (int64_t tok = (int64_t)blockIdx.x * tokens_per_block + slot; tok < tokens;
       tok += (int64_t)gridDim.x * tokens_per_block) {
    int64_t b, s;
    split_token(tok, p.seq, b, s);
    const C *ct = token_of<const C>(p.cos, b, s), *st = token_of<const C>(p.sin, b, s);
    const I *qx = token_of<const I>(p.q, b, s), *kx = token_of<const I>(p.k, b, s);
    O *qy = token_of<O>(p.q_out, b, s), *ky = token_of<O>(p.k_out, b, s);
    for (int64_t j = first_item; j < items; j += p.pair_threads) {
      // Item j: pairs j*V.. of the head, or past them 2V passed elements. Both kinds load and store with the
      // same instructions, so a warp that holds both does not run them one after the other (a loop of their
      // own for the passed elements made half-rotated heads 1.3x slower on an H100). Below, the offsets of
      // the item's two vectors and of the pairs' tables, which are loaded unconditionally (loads under a
      // branch were issued late: 5-8% slower) and by a passed item too, unused.
      const bool rotated = j < pairs;
      const int64_t i = rotated ? j * V : 0, t2 = p.interleaved ? i : i + half;
      const int64_t e1 = !rotated ? p.rot + (j - pairs) * 2 * V : p.interleaved ? 2 * i : i;
      const int64_t e2 = rotated && !p.interleaved ? i + half : e1 + V;
      const Tables<C, V> tab{load<V>(ct + i), load<V>(ct + t2), load<V>(st + i), load<V>(st + t2)};
      for (int h0 = lane; h0 < heads; h0 += lanes * ROPE_HEADS_AT_ONCE) {
        Pack<I, V> x1[ROPE_HEADS_AT_ONCE], x2[ROPE_HEADS_AT_ONCE];
#pragma unroll
        for (int u = 0; u < ROPE_HEADS_AT_ONCE; ++u) {
          const int h = h0 + u * lanes;
          if (h >= heads) break;
          const I *x = head(h, q_heads, qx, p.q.head_stride, kx, p.k.head_stride);
          x1[u] = load<V>(x + e1);
          x2[u] = load<V>(x + e2);
        }
#pragma unroll
        for (int u = 0; u < ROPE_HEADS_AT_ONCE; ++u) {
          const int h = h0 + u * lanes;
          if (h >= heads) break;
          O *y = head(h, q_heads, qy, p.q_out.head_stride, ky, p.k_out.head_stride);
          Pack<O, V> o1, o2;
          if (rotated) {
            if (p.interleaved) deinterleave(x1[u], x2[u]);
            rotate_pair<I, C, O, kBackward, V>(x1[u], x2[u], tab, o1, o2);
            if (p.interleaved) interleave(o1, o2);
          } else {
            o1 = convert<O>(x1[u]);
            o2 = convert<O>(x2[u]);
          }
          store_pack(y + e1, o1);
          store_pack(y + e2, o2);
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
