// Qwen3 attention's per-head RMSNorm of q and k followed by rotary embedding, with HF's rounding:
//   n   = round_N(w * round_X(x * rsqrt(mean(x^2) + eps)))            N = promote(x, w), stats in f32
//   out = round_R(round_R(n * cos) + round_R(rotate_half(n) * sin))   R = promote(N, cos)
// With CW ("cast after weight", Gemma 3 and 4), n = round_X((w + offset) * x * rsqrt(...)) in f32 and N = X.
// One launch handles every (token, head) row of q and of k.
//
// A row of D elements belongs to a group of G threads. The "vec" variant gives lane l the V-element
// vectors at l*V and at D/2 + l*V, so both members of each rotation pair (i, i + D/2) sit in one
// thread and the row stays in registers between the reduction and the output. The "scalar" variant
// (rows not aligned for vectors, or too long for one vector pair per lane) walks the pairs twice,
// the second time from cache. Products and sums go through __fmul_rn/__fadd_rn: in f32 the compiler
// would otherwise fuse them, which rounds differently from torch's separate multiply and add.
//
// The backward's grid is one resident wave. It takes q's rows, then k's: each block keeps its share
// of one weight's gradient in registers (vec) or in a per-group partial row in global memory (scalar),
// writes one f32 partial per block (per group), and a second kernel folds the partials.
#include "common.cuh"
#include "qk_norm_rope.h"

using namespace bastile;

namespace {

// Where row r (token-major, heads of one tensor) lies; only asked for live rows (a tensor with no heads
// has none). Rust keeps row counts below 2^31, so 32-bit division suffices; element offsets are 64-bit.
struct Row {
  uint32_t b, s, head;
  int64_t index;  // the row's place in the contiguous outputs and statistics
};

__device__ __forceinline__ Row row_of(int64_t r, int64_t heads, int64_t seq) {
  const uint32_t token = (uint32_t)r / (uint32_t)heads;
  const uint32_t b = token / (uint32_t)seq;
  return Row{b, token - b * (uint32_t)seq, (uint32_t)r - token * (uint32_t)heads, r};
}

__device__ __forceinline__ int64_t offset(const Row &row, int64_t s0, int64_t s1, int64_t s2) {
  return (int64_t)row.b * s0 + (int64_t)row.s * s1 + (int64_t)row.head * s2;
}

__device__ __forceinline__ int64_t cs_offset(const Row &row, const int64_t (&st)[2]) {
  return (int64_t)row.b * st[0] + (int64_t)row.s * st[1];
}

// Dtype of the normalised q and k: promote(x, w), or x's when the cast comes after the weight.
template <class X, class W, bool CW> struct Normed { using type = typename Promote<X, W>::type; };
template <class X, class W> struct Normed<X, W, true> { using type = X; };

// x * rstd as the weight multiplies it: rounded to X (Qwen3), or kept in f32 (CW).
template <class X, bool CW> __device__ __forceinline__ float scaled(float x, float r) {
  if constexpr (CW) return __fmul_rn(x, r);
  else return round_to<X>(__fmul_rn(x, r));
}

// HF's normalised element, to N of (w * scaled(x)); w is the weight plus the offset (0 unless CW).
template <class X, class N, bool CW> __device__ __forceinline__ float normed(float x, float w, float r) {
  return round_to<N>(__fmul_rn(w, scaled<X, CW>(x, r)));
}

// The weight as it multiplies, plus the offset in f32 (Gemma's 1 + w).
template <int V, class W> __device__ __forceinline__ void weight_of(const Pack<W, V> &w, float offset, float (&out)[V]) {
#pragma unroll
  for (int i = 0; i < V; ++i) out[i] = __fadd_rn(to_f32(w.v[i]), offset);
}

// HF's rotation of the pair (lo, hi) = (n[i], n[i + D/2]), each product and the sum rounded to R.
template <class R>
__device__ __forceinline__ void rotate(float lo, float hi, float c_lo, float c_hi, float s_lo, float s_hi,
                                       float &o_lo, float &o_hi) {
  o_lo = round_to<R>(__fadd_rn(round_to<R>(__fmul_rn(lo, c_lo)), round_to<R>(__fmul_rn(-hi, s_lo))));
  o_hi = round_to<R>(__fadd_rn(round_to<R>(__fmul_rn(hi, c_hi)), round_to<R>(__fmul_rn(lo, s_hi))));
}

// The gradient with respect to the pair before rotation (the rotation's transpose), in f32.
__device__ __forceinline__ void unrotate(float g_lo, float g_hi, float c_lo, float c_hi, float s_lo, float s_hi,
                                         float &n_lo, float &n_hi) {
  n_lo = g_lo * c_lo + g_hi * s_hi;
  n_hi = g_hi * c_hi - g_lo * s_lo;
}

// store<V> with explicit 16-byte stores: through a Pack copy, the compiler split the second of a row's
// two output vectors into 2- or 4-byte stores (it could not prove that vector's alignment).
template <int V, class T> __device__ __forceinline__ void store_words(T *p, const float (&in)[V]) {
  Pack<T, V> pk;
#pragma unroll
  for (int i = 0; i < V; ++i) pk.v[i] = from_f32<T>(in[i]);
  static_assert(sizeof(pk) % 16 == 0, "whole 16-byte vectors");
  const uint32_t *w = reinterpret_cast<const uint32_t *>(&pk);
#pragma unroll
  for (int i = 0; i < (int)(sizeof(pk) / 16); ++i)
    asm volatile("st.global.v4.b32 [%0], {%1, %2, %3, %4};" ::"l"(reinterpret_cast<char *>(p) + 16 * i),
                 "r"(w[4 * i]), "r"(w[4 * i + 1]), "r"(w[4 * i + 2]), "r"(w[4 * i + 3])
                 : "memory");
}

// The forward's view of one tensor (q or k).
template <class X, class W, class R> struct Side {
  const X *x;
  const W *w;
  R *out;
  float *rstd;
  int64_t heads, s0, s1, s2;
};

template <class X, class W, class R> __device__ __forceinline__ Side<X, W, R> side(const QkNormRopeForward &p, bool k) {
  return k ? Side<X, W, R>{static_cast<const X *>(p.k), static_cast<const W *>(p.k_weight), static_cast<R *>(p.k_out),
                           static_cast<float *>(p.k_rstd), p.shape.k_heads, p.shape.k_stride[0],
                           p.shape.k_stride[1], p.shape.k_stride[2]}
           : Side<X, W, R>{static_cast<const X *>(p.q), static_cast<const W *>(p.q_weight), static_cast<R *>(p.q_out),
                           static_cast<float *>(p.q_rstd), p.shape.q_heads, p.shape.q_stride[0],
                           p.shape.q_stride[1], p.shape.q_stride[2]};
}

// Rows of q then of k in one index space.
template <class P> __device__ __forceinline__ int64_t all_rows(const P &p) {
  return p.shape.batch * p.shape.seq * (p.shape.q_heads + p.shape.k_heads);
}

// Row r of that space: whether it exists, its tensor, its place there.
template <class X, class W, class R> struct ForwardRow {
  bool live;
  Side<X, W, R> t;
  Row row;
};
template <class X, class W, class R>
__device__ __forceinline__ ForwardRow<X, W, R> forward_row(const QkNormRopeForward &p, int64_t r, int64_t rows) {
  const int64_t q_rows = p.shape.batch * p.shape.seq * p.shape.q_heads;
  const bool live = r < rows, is_k = r >= q_rows;
  const auto t = side<X, W, R>(p, is_k);
  return {live, t, live ? row_of(is_k ? r - q_rows : r, t.heads, p.shape.seq) : Row{}};
}

// A thread's place: a row belongs to G lanes, a block holds `slots` rows; the thread's lane and slot; the
// head's width D; cos and sin, typed.
template <class C> struct Slots {
  int G, slots, lane, slot;
  int64_t D;
  const C *cos, *sin;
  template <class P>
  __device__ __forceinline__ explicit Slots(const P &p)
      : G(p.geo.group), slots(blockDim.x / p.geo.group), lane(threadIdx.x % p.geo.group),
        slot(threadIdx.x / p.geo.group), D(p.shape.head_dim), cos(static_cast<const C *>(p.cos)), sin(static_cast<const C *>(p.sin)) {}
};

template <class X, class W, class C, int V, bool CW>
__device__ __forceinline__ void forward_vec(const QkNormRopeForward &p) {
  using N = typename Normed<X, W, CW>::type;
  using R = typename Promote<N, C>::type;
  const auto [G, slots, lane, slot, D, cos, sin] = Slots<C>(p);
  const int64_t lo = (int64_t)lane * V, hi = D / 2 + lo;
  const bool active = lo < D / 2;  // G is a power of two: lanes past the half's vectors idle
  const int64_t rows = all_rows(p);
  const float eps = (float)p.eps, inv_d = 1.f / (float)D;

  FOR_EACH_ROW_GROUP(base, rows, slots) {
    const auto [live, t, row] = forward_row<X, W, R>(p, base + slot, rows);
    Pack<X, V> xl, xh;
    float ss = 0.f;
    if (live && active) {
      const X *x = t.x + offset(row, t.s0, t.s1, t.s2);
      xl = load<V>(x + lo);
      xh = load<V>(x + hi);
#pragma unroll
      for (int i = 0; i < V; ++i) ss += to_f32(xl.v[i]) * to_f32(xl.v[i]) + to_f32(xh.v[i]) * to_f32(xh.v[i]);
    }
    ss = group_sum(ss, G);
    if (!live) continue;
    const float rs = rsqrtf(ss * inv_d + eps);
    if (t.rstd && lane == 0) t.rstd[row.index] = rs;
    if (!active) continue;
    float wl[V], wh[V];
    weight_of<V>(load<V>(t.w + lo), p.weight_offset, wl);
    weight_of<V>(load<V>(t.w + hi), p.weight_offset, wh);
    const C *c = cos + cs_offset(row, p.shape.cos_stride), *s = sin + cs_offset(row, p.shape.sin_stride);
    const Pack<C, V> cl = load<V>(c + lo), ch = load<V>(c + hi), sl = load<V>(s + lo), sh = load<V>(s + hi);
    float ol[V], oh[V];
#pragma unroll
    for (int i = 0; i < V; ++i)
      rotate<R>(normed<X, N, CW>(to_f32(xl.v[i]), wl[i], rs), normed<X, N, CW>(to_f32(xh.v[i]), wh[i], rs),
                to_f32(cl.v[i]), to_f32(ch.v[i]), to_f32(sl.v[i]), to_f32(sh.v[i]), ol[i], oh[i]);
    R *out = t.out + row.index * D;
    store_words<V>(out + lo, ol);
    store_words<V>(out + hi, oh);
  }
}

template <class X, class W, class C, bool CW> __device__ __forceinline__ void forward_scalar(const QkNormRopeForward &p) {
  using N = typename Normed<X, W, CW>::type;
  using R = typename Promote<N, C>::type;
  const auto [G, slots, lane, slot, D, cos, sin] = Slots<C>(p);
  const int64_t half = D / 2, rows = all_rows(p);
  const float eps = (float)p.eps, inv_d = 1.f / (float)D;

  FOR_EACH_ROW_GROUP(base, rows, slots) {
    const auto [live, t, row] = forward_row<X, W, R>(p, base + slot, rows);
    const X *x = t.x + (live ? offset(row, t.s0, t.s1, t.s2) : 0);
    float ss = 0.f;
    for (int64_t j = lane; live && j < half; j += G) {
      const float a = to_f32(x[j]), b = to_f32(x[j + half]);
      ss += a * a + b * b;
    }
    ss = group_sum(ss, G);
    if (!live) continue;
    const float rs = rsqrtf(ss * inv_d + eps);
    if (t.rstd && lane == 0) t.rstd[row.index] = rs;
    const C *c = cos + cs_offset(row, p.shape.cos_stride), *s = sin + cs_offset(row, p.shape.sin_stride);
    R *out = t.out + row.index * D;
    for (int64_t j = lane; j < half; j += G) {
      float o_lo, o_hi;
      const float w_lo = __fadd_rn(to_f32(t.w[j]), p.weight_offset), w_hi = __fadd_rn(to_f32(t.w[j + half]), p.weight_offset);
      rotate<R>(normed<X, N, CW>(to_f32(x[j]), w_lo, rs), normed<X, N, CW>(to_f32(x[j + half]), w_hi, rs),
                to_f32(c[j]), to_f32(c[j + half]), to_f32(s[j]), to_f32(s[j + half]), o_lo, o_hi);
      out[j] = from_f32<R>(o_lo);
      out[j + half] = from_f32<R>(o_hi);
    }
  }
}

// The backward's view of one tensor.
template <class X, class W, class R> struct BackSide {
  const R *g;
  const X *x;
  const W *w;
  const float *rstd;
  X *gx;
  int64_t heads, s0, s1, s2, g0, g1, g2;
};

template <class X, class W, class R>
__device__ __forceinline__ BackSide<X, W, R> back_side(const QkNormRopeBackward &p, bool k) {
  const auto &sh = p.shape;
  return k ? BackSide<X, W, R>{static_cast<const R *>(p.grad_k), static_cast<const X *>(p.k),
                               static_cast<const W *>(p.k_weight), static_cast<const float *>(p.k_rstd),
                               static_cast<X *>(p.grad_k_in), sh.k_heads, sh.k_stride[0], sh.k_stride[1],
                               sh.k_stride[2], p.grad_k_stride[0], p.grad_k_stride[1], p.grad_k_stride[2]}
           : BackSide<X, W, R>{static_cast<const R *>(p.grad_q), static_cast<const X *>(p.q),
                               static_cast<const W *>(p.q_weight), static_cast<const float *>(p.q_rstd),
                               static_cast<X *>(p.grad_q_in), sh.q_heads, sh.q_stride[0], sh.q_stride[1],
                               sh.q_stride[2], p.grad_q_stride[0], p.grad_q_stride[1], p.grad_q_stride[2]};
}

// grad_x = r * gn * w - x * r^3 * dot(gn * w, x) / D, with gn the unrotated gradient and w plus the offset;
// grad_w = sum over rows of gn * scaled(x, r), kept in registers and folded per block.
template <class X, class W, class C, int V, bool CW>
__device__ __forceinline__ void backward_vec_side(const QkNormRopeBackward &p, bool is_k, float *fold) {
  using N = typename Normed<X, W, CW>::type;
  using R = typename Promote<N, C>::type;
  const auto [G, slots, lane, slot, D, cos, sin] = Slots<C>(p);
  const int64_t lo = (int64_t)lane * V, hi = D / 2 + lo;
  const bool active = lo < D / 2;
  const auto t = back_side<X, W, R>(p, is_k);
  const int64_t rows = p.shape.batch * p.shape.seq * t.heads;
  const float inv_d = 1.f / (float)D;
  float wl[V], wh[V];
  if (active) {
    weight_of<V>(load<V>(t.w + lo), p.weight_offset, wl);
    weight_of<V>(load<V>(t.w + hi), p.weight_offset, wh);
  }
  float acc_l[V], acc_h[V];
#pragma unroll
  for (int i = 0; i < V; ++i) acc_l[i] = acc_h[i] = 0.f;

  FOR_EACH_ROW_GROUP(base, rows, slots) {
    const int64_t r = base + slot;
    const bool live = r < rows;
    const Row row = live ? row_of(r, t.heads, p.shape.seq) : Row{};
    Pack<X, V> xl, xh;
    float nl[V], nh[V];  // the unrotated gradient
    float dot = 0.f, rs = 0.f;
    if (live && active) {
      rs = t.rstd[row.index];
      const X *x = t.x + offset(row, t.s0, t.s1, t.s2);
      const R *g = t.g + offset(row, t.g0, t.g1, t.g2);
      xl = load<V>(x + lo);
      xh = load<V>(x + hi);
      const Pack<R, V> gl = load<V>(g + lo), gh = load<V>(g + hi);
      const C *c = cos + cs_offset(row, p.shape.cos_stride), *s = sin + cs_offset(row, p.shape.sin_stride);
      const Pack<C, V> cl = load<V>(c + lo), ch = load<V>(c + hi), sl = load<V>(s + lo), sh = load<V>(s + hi);
#pragma unroll
      for (int i = 0; i < V; ++i) {
        unrotate(to_f32(gl.v[i]), to_f32(gh.v[i]), to_f32(cl.v[i]), to_f32(ch.v[i]), to_f32(sl.v[i]), to_f32(sh.v[i]),
                 nl[i], nh[i]);
        dot += nl[i] * wl[i] * to_f32(xl.v[i]) + nh[i] * wh[i] * to_f32(xh.v[i]);
      }
    }
    dot = group_sum(dot, G);
    if (!live || !active) continue;
    const float c3 = rs * rs * rs * dot * inv_d;
    float ol[V], oh[V];
#pragma unroll
    for (int i = 0; i < V; ++i) {
      const float a = to_f32(xl.v[i]), b = to_f32(xh.v[i]);
      ol[i] = rs * nl[i] * wl[i] - a * c3;
      oh[i] = rs * nh[i] * wh[i] - b * c3;
      acc_l[i] += nl[i] * scaled<X, CW>(a, rs);
      acc_h[i] += nh[i] * scaled<X, CW>(b, rs);
    }
    X *gx = t.gx + row.index * D;
    store_words<V>(gx + lo, ol);
    store_words<V>(gx + hi, oh);
  }

  // Fold the block's groups in shared memory ([slots][D]) into this block's partial row.
  if (active) {
#pragma unroll
    for (int i = 0; i < V; ++i) {
      fold[slot * D + lo + i] = acc_l[i];
      fold[slot * D + hi + i] = acc_h[i];
    }
  }
  __syncthreads();
  float *out = p.partial + ((is_k ? p.partials : 0) + blockIdx.x) * D;
  for (int64_t c = threadIdx.x; c < D; c += blockDim.x) {
    float s = 0.f;
    for (int g = 0; g < slots; ++g) s += fold[g * D + c];
    out[c] = s;
  }
  __syncthreads();  // fold is reused by k's rows
}

template <class X, class W, class C, int V, bool CW>
__device__ __forceinline__ void backward_vec(const QkNormRopeBackward &p) {
  extern __shared__ float fold[];
  backward_vec_side<X, W, C, V, CW>(p, false, fold);
  backward_vec_side<X, W, C, V, CW>(p, true, fold);
}

// Scalar backward: each group owns a partial row of the weight gradient in global memory.
template <class X, class W, class C, bool CW>
__device__ __forceinline__ void backward_scalar_side(const QkNormRopeBackward &p, bool is_k) {
  using N = typename Normed<X, W, CW>::type;
  using R = typename Promote<N, C>::type;
  const auto [G, slots, lane, slot, D, cos, sin] = Slots<C>(p);
  const int64_t half = D / 2;
  const auto t = back_side<X, W, R>(p, is_k);
  const int64_t rows = p.shape.batch * p.shape.seq * t.heads;
  const float inv_d = 1.f / (float)D;
  float *own = p.partial + ((is_k ? p.partials : 0) + (int64_t)blockIdx.x * slots + slot) * D;
  for (int64_t c = lane; c < D; c += G) own[c] = 0.f;

  FOR_EACH_ROW_GROUP(base, rows, slots) {
    const int64_t r = base + slot;
    const bool live = r < rows;
    const Row row = live ? row_of(r, t.heads, p.shape.seq) : Row{};
    const X *x = t.x + (live ? offset(row, t.s0, t.s1, t.s2) : 0);
    const R *g = t.g + (live ? offset(row, t.g0, t.g1, t.g2) : 0);
    const C *c = cos + (live ? cs_offset(row, p.shape.cos_stride) : 0);
    const C *s = sin + (live ? cs_offset(row, p.shape.sin_stride) : 0);
    float dot = 0.f;
    for (int64_t j = lane; live && j < half; j += G) {
      float nl, nh;
      unrotate(to_f32(g[j]), to_f32(g[j + half]), to_f32(c[j]), to_f32(c[j + half]), to_f32(s[j]), to_f32(s[j + half]),
               nl, nh);
      dot += nl * __fadd_rn(to_f32(t.w[j]), p.weight_offset) * to_f32(x[j]) +
             nh * __fadd_rn(to_f32(t.w[j + half]), p.weight_offset) * to_f32(x[j + half]);
    }
    dot = group_sum(dot, G);
    if (!live) continue;
    const float rs = t.rstd[row.index];
    const float c3 = rs * rs * rs * dot * inv_d;
    X *gx = t.gx + row.index * D;
    for (int64_t j = lane; j < half; j += G) {
      float nl, nh;
      unrotate(to_f32(g[j]), to_f32(g[j + half]), to_f32(c[j]), to_f32(c[j + half]), to_f32(s[j]), to_f32(s[j + half]),
               nl, nh);
      const float a = to_f32(x[j]), b = to_f32(x[j + half]);
      const float w_lo = __fadd_rn(to_f32(t.w[j]), p.weight_offset), w_hi = __fadd_rn(to_f32(t.w[j + half]), p.weight_offset);
      gx[j] = from_f32<X>(rs * nl * w_lo - a * c3);
      gx[j + half] = from_f32<X>(rs * nh * w_hi - b * c3);
      own[j] += nl * scaled<X, CW>(a, rs);
      own[j + half] += nh * scaled<X, CW>(b, rs);
    }
  }
}

template <class X, class W, class C, bool CW> __device__ __forceinline__ void backward_scalar(const QkNormRopeBackward &p) {
  backward_scalar_side<X, W, C, CW>(p, false);
  backward_scalar_side<X, W, C, CW>(p, true);
}

}  // namespace

#define PARAMS_fwd QkNormRopeForward
#define PARAMS_bwd QkNormRopeBackward
#define RUN_fwd_vec(X, W, C, CW) forward_vec<X, W, C, 16 / sizeof(X), CW>(p)
#define RUN_fwd_scalar(X, W, C, CW) forward_scalar<X, W, C, CW>(p)
#define RUN_bwd_vec(X, W, C, CW) backward_vec<X, W, C, 16 / sizeof(X), CW>(p)
#define RUN_bwd_scalar(X, W, C, CW) backward_scalar<X, W, C, CW>(p)
#define CAST_AFTER_WEIGHT_ false
#define CAST_AFTER_WEIGHT_cast_after_weight true
#define SUFFIX_
#define SUFFIX_cast_after_weight _cast_after_weight
#define KERNEL(dir, x, w, c, access, mode)                                                                     \
  extern "C" __global__ void __launch_bounds__(256)                                                            \
      BASTILE_CAT(qk_norm_rope_##dir##_##x##_##w##_##c##_##access, SUFFIX_##mode)(const PARAMS_##dir p) {      \
    RUN_##dir##_##access(BASTILE_TYPE_##x, BASTILE_TYPE_##w, BASTILE_TYPE_##c, CAST_AFTER_WEIGHT_##mode);      \
  }
// Block geometry::FOLD_BLOCK, grid (ceil(D / 32), 2): blockIdx.y picks q's weight or k's.
#define REDUCE(dir, reduce, w)                                                                            \
  extern "C" __global__ void qk_norm_rope_##dir##_##reduce##_##w(const QkNormRopeBackward p) {            \
    const bool k = blockIdx.y == 1;                                                                        \
    column_sum<BASTILE_TYPE_##w>(p.partial + (k ? p.partials * p.shape.head_dim : 0), p.partials,          \
                                 p.shape.head_dim, static_cast<BASTILE_TYPE_##w *>(k ? p.grad_k_weight : p.grad_q_weight)); \
  }
QK_NORM_ROPE_FORWARD_KERNELS(KERNEL)
QK_NORM_ROPE_BACKWARD_KERNELS(KERNEL, REDUCE)
