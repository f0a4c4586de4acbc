// RMSNorm with HF semantics, statistics in f32, n = x * rsqrt(mean(x^2) + eps):
//   Llama/Qwen3 (CW = false): y = w * to_x_dtype(n), y in promote(x, w)
//   GPT-OSS (CW = true, "cast after weight"): y = to_x_dtype(w * n), the product in f32
//   Gemma (CW = true, weight_offset 1): y = to_x_dtype((1 + w) * n), the sum and product in f32
// Both have the same grad_x; the weight gradient sums dy * n with n rounded as the forward used it.
//
// A row is handled by `group` threads (geometry from Rust). With per_thread = K > 0 each thread keeps
// its K vectors of the row in registers, so x is read once; the forward takes R rows per group at a
// time (R = 2 for short rows), the backward loads its share of the next row before reducing the
// current one; K = 0 streams the row twice (huge or unaligned rows). The weight is read from L1
// where it is used. The forward's grid gives every row group a block; the backward's is one wave:
// it keeps its share of the weight gradient in registers across all rows the block visits and
// writes one f32 partial per block, which a second tiny kernel folds.
#include "rms_norm.h"
#include "rows.cuh"

using namespace bastile;

namespace {

// Dtype of y (and grad_y): promote(x, w), or x's when the cast comes after the weight.
template <class X, class W, bool CW> struct Out { using type = typename Promote<X, W>::type; };
template <class X, class W> struct Out<X, W, true> { using type = X; };

// x * r as the weight multiplies it: rounded to x's dtype (Llama), or kept in f32 (GPT-OSS).
template <class X, bool CW> __device__ __forceinline__ float normed(float x, float r) {
  if constexpr (CW) return x * r;
  else return round_to<X>(x * r);
}

// Whether a backward variant loads the next row while it finishes the current one. The K = 8
// variants would run out of registers.
template <int K> constexpr bool kLookahead = K <= 4;

// One row share: y = w * n for the K packs this lane holds, n = x * r rounded as the weight multiplies it.
template <class X, class W, class Y, int V, int K, bool CW>
__device__ __forceinline__ void scale_share(const Pack<X, V> (&xv)[K], const W *w, float offset, Y *yr, float r,
                                            int lane, int G, int64_t nvec) {
#pragma unroll
  for (int k = 0; k < K; ++k) {
    const int64_t j = lane + k * G;
    if (j >= nvec) continue;
    // The weight comes from L1 each row: registers go to rows in flight instead. (A build loading all K
    // packs before the first store measured 8192x1024 17.8 us against 15.7 us, in two calls on two H100s:
    // not conclusive, as calls differ by up to 12%.)
    const Pack<W, V> wv = load<V>(w + j * V);
    if constexpr (!CW && kPairable<X, W> && V % 2 == 0) {
      Pack<Y, V> o;
#pragma unroll
      for (int i = 0; i < V / 2; ++i)
        pair(o, i) = __hmul2_rn(to_pair<X>(to_f32(xv[k].v[2 * i]) * r, to_f32(xv[k].v[2 * i + 1]) * r), pair(wv, i));
      store_pack(yr + j * V, o);
    } else {
      float o[V];
#pragma unroll
      for (int i = 0; i < V; ++i) o[i] = (to_f32(wv.v[i]) + offset) * normed<X, CW>(to_f32(xv[k].v[i]), r);
      store<V>(yr + j * V, o);
    }
  }
}

// R rows per group at a time, all loaded before any is reduced (bytes in flight for short rows; their
// loads go through load_once).
template <class X, class W, int V, int K, int R, bool CW>
__device__ __forceinline__ void forward_cached(const RmsNormForward &p) {
  using Y = typename Out<X, W, CW>::type;
  const X *x = static_cast<const X *>(p.x);
  const W *w = static_cast<const W *>(p.weight);
  Y *y = static_cast<Y *>(p.y);
  float *rstd = static_cast<float *>(p.rstd);
  const int G = p.geo.group, rows_per_block = blockDim.x / G;
  const int lane = threadIdx.x % G;
  const int64_t grp = threadIdx.x / G;
  const int64_t cols = p.cols, nvec = cols / V;
  const float eps = (float)p.eps, inv_cols = 1.f / (float)cols;

  FOR_EACH_ROW_GROUP(base, rows_per_block * R) {
    Pack<X, V> xv[R][K];
#pragma unroll
    for (int q = 0; q < R; ++q)
      load_share<V, K, (R > 1)>(xv[q], x, base + q * rows_per_block + grp, p.rows, cols, cols, lane, G);
#pragma unroll
    for (int q = 0; q < R; ++q) {
      const int64_t row = base + q * rows_per_block + grp;
      const bool live = row < p.rows;
      float ss = 0.f;
#pragma unroll
      for (int k = 0; k < K; ++k)
        if (live && lane + k * G < nvec)
#pragma unroll
          for (int i = 0; i < V; ++i) ss += to_f32(xv[q][k].v[i]) * to_f32(xv[q][k].v[i]);
      // Rows taken two at a time are a warp or less (geometry): no block-wide fold.
      ss = R > 1 ? warp_group_sum(ss, G) : group_sum(ss, G);
      if (!live) continue;
      const float r = rsqrtf(ss * inv_cols + eps);
      if (rstd && lane == 0) rstd[row] = r;
#pragma unroll
      for (int k = 0; k < K; ++k) opaque(xv[q][k]);
      scale_share<X, W, Y, V, K, CW>(xv[q], w, p.weight_offset, y + row * cols, r, lane, G, nvec);
    }
  }
}

// Rows too long for registers, or not aligned for vectors: read x twice (the second time from cache).
template <class X, class W, int V, bool CW>
__device__ __forceinline__ void forward_stream(const RmsNormForward &p) {
  using Y = typename Out<X, W, CW>::type;
  const X *x = static_cast<const X *>(p.x);
  const W *w = static_cast<const W *>(p.weight);
  Y *y = static_cast<Y *>(p.y);
  float *rstd = static_cast<float *>(p.rstd);
  const int G = p.geo.group, rows_per_block = blockDim.x / G;
  const int lane = threadIdx.x % G, grp = threadIdx.x / G;
  const int64_t cols = p.cols, nvec = cols / V;
  const float eps = (float)p.eps, inv_cols = 1.f / (float)cols;

  FOR_EACH_ROW_GROUP(base, rows_per_block) {
    const int64_t row = base + grp;
    const bool live = row < p.rows;
    const X *xr = x + row * cols;
    float ss = 0.f;
    for (int64_t j = lane; live && j < nvec; j += G) {
      const Pack<X, V> xv = load<V>(xr + j * V);
#pragma unroll
      for (int i = 0; i < V; ++i) ss += to_f32(xv.v[i]) * to_f32(xv.v[i]);
    }
    ss = group_sum(ss, G);
    if (!live) continue;
    const float r = rsqrtf(ss * inv_cols + eps);
    if (rstd && lane == 0) rstd[row] = r;
    for (int64_t j = lane; j < nvec; j += G) {
      const Pack<X, V> xv = load<V>(xr + j * V);
      const Pack<W, V> wv = load<V>(w + j * V);
      float o[V];
#pragma unroll
      for (int i = 0; i < V; ++i) o[i] = (to_f32(wv.v[i]) + p.weight_offset) * normed<X, CW>(to_f32(xv.v[i]), r);
      store<V>(y + row * cols + j * V, o);
    }
  }
}

// dx = r * (g - n * mean(g * n)) with g = dy * w and n = x * r, which is r * g * w - x * r^3 * sum(dy * w * x) / cols;
// dw = sum over rows of dy * n (rounded as the forward's), kept in registers and written as one f32 partial per block.
template <class X, class W, int V, int K, bool CW>
__device__ __forceinline__ void backward_cached(const RmsNormBackward &p) {
  using Y = typename Out<X, W, CW>::type;
  const Y *gy = static_cast<const Y *>(p.grad_y);
  const X *x = static_cast<const X *>(p.x);
  const float *rstd = static_cast<const float *>(p.rstd);
  X *gx = static_cast<X *>(p.grad_x);
  const int G = p.geo.group, rows_per_block = blockDim.x / G;
  const int lane = threadIdx.x % G, grp = threadIdx.x / G;
  const int64_t cols = p.cols, nvec = cols / V, stride = (int64_t)gridDim.x * rows_per_block;
  const float inv_cols = 1.f / (float)cols;
  const W *w = static_cast<const W *>(p.weight);  // read from L1 where used, as in the forward

  float acc[K][V];
#pragma unroll
  for (int k = 0; k < K; ++k)
#pragma unroll
    for (int i = 0; i < V; ++i) acc[k][i] = 0.f;
  Pack<X, V> xv[K], x_next[K];
  Pack<Y, V> gv[K], g_next[K];
  // The row's rstd comes with its x and grad_y: loaded when the row is used, its latency sat on every
  // row's critical path (H100, bf16, 8192x1152 backward at 96 threads a row: 23.3 us against 26.8 us).
  // Selects, not branches, around these loads: with `if`s nvcc 13.0 scheduled them later, and the gain
  // was gone (27.2 us).
  float r_cur = 0.f, r_next = 0.f;
  if constexpr (kLookahead<K>) {
    const int64_t first = (int64_t)blockIdx.x * rows_per_block + grp;
    load_share<V>(xv, x, first, p.rows, cols, cols, lane, G);
    load_share<V>(gv, gy, first, p.rows, cols, cols, lane, G);
    if (first < p.rows) r_cur = rstd[first];
  }

  FOR_EACH_ROW_GROUP(base, rows_per_block) {
    const int64_t row = base + grp;
    const bool live = row < p.rows;
    if constexpr (kLookahead<K>) {
      load_share<V>(x_next, x, row + stride, p.rows, cols, cols, lane, G);
      load_share<V>(g_next, gy, row + stride, p.rows, cols, cols, lane, G);
      r_next = row + stride < p.rows ? rstd[row + stride] : 0.f;
    } else {
      load_share<V>(xv, x, row, p.rows, cols, cols, lane, G);
      load_share<V>(gv, gy, row, p.rows, cols, cols, lane, G);
    }
    const float r = kLookahead<K> ? r_cur : (live ? rstd[row] : 0.f);
    float dot = 0.f;
#pragma unroll
    for (int k = 0; k < K; ++k)
      if (live && lane + k * G < nvec) {
        const Pack<W, V> wv = load<V>(w + (lane + k * G) * V);
#pragma unroll
        for (int i = 0; i < V; ++i) dot += to_f32(gv[k].v[i]) * (to_f32(wv.v[i]) + p.weight_offset) * to_f32(xv[k].v[i]);
      }
    dot = group_sum(dot, G);
    if (live) {
      const float c = r * r * r * dot * inv_cols;
#pragma unroll
      for (int k = 0; k < K; ++k) {
        opaque(xv[k]);
        opaque(gv[k]);
      }
#pragma unroll
      for (int k = 0; k < K; ++k) {
        const int64_t j = lane + k * G;
        if (j >= nvec) continue;
        const Pack<W, V> wv = load<V>(w + j * V);
        float o[V];
#pragma unroll
        for (int i = 0; i < V; ++i) {
          const float xf = to_f32(xv[k].v[i]), g = to_f32(gv[k].v[i]);
          o[i] = r * g * (to_f32(wv.v[i]) + p.weight_offset) - xf * c;
          acc[k][i] += g * normed<X, CW>(xf, r);
        }
        store<V>(gx + row * cols + j * V, o);
      }
    }
    if constexpr (kLookahead<K>) {
#pragma unroll
      for (int k = 0; k < K; ++k) {
        xv[k] = x_next[k];
        gv[k] = g_next[k];
      }
      r_cur = r_next;
    }
  }

  store_partial(acc, p.partial + (int64_t)blockIdx.x * cols, cols, lane, G);
}

// Streaming backward: each group owns a partial row of the weight gradient in global memory.
template <class X, class W, int V, bool CW>
__device__ __forceinline__ void backward_stream(const RmsNormBackward &p) {
  using Y = typename Out<X, W, CW>::type;
  const Y *gy = static_cast<const Y *>(p.grad_y);
  const X *x = static_cast<const X *>(p.x);
  const W *w = static_cast<const W *>(p.weight);
  const float *rstd = static_cast<const float *>(p.rstd);
  X *gx = static_cast<X *>(p.grad_x);
  const int G = p.geo.group, rows_per_block = blockDim.x / G;
  const int lane = threadIdx.x % G, grp = threadIdx.x / G;
  const int64_t cols = p.cols, nvec = cols / V;
  const float inv_cols = 1.f / (float)cols;
  float *own = p.partial + ((int64_t)blockIdx.x * rows_per_block + grp) * cols;
  for (int64_t c = lane; c < cols; c += G) own[c] = 0.f;

  FOR_EACH_ROW_GROUP(base, rows_per_block) {
    const int64_t row = base + grp;
    const bool live = row < p.rows;
    const X *xr = x + row * cols;
    const Y *gr = gy + row * cols;
    float dot = 0.f;
    for (int64_t j = lane; live && j < nvec; j += G) {
      const Pack<X, V> xv = load<V>(xr + j * V);
      const Pack<Y, V> gv = load<V>(gr + j * V);
      const Pack<W, V> wv = load<V>(w + j * V);
#pragma unroll
      for (int i = 0; i < V; ++i) dot += to_f32(gv.v[i]) * (to_f32(wv.v[i]) + p.weight_offset) * to_f32(xv.v[i]);
    }
    dot = group_sum(dot, G);
    if (!live) continue;
    const float r = rstd[row];
    const float c = r * r * r * dot * inv_cols;
    for (int64_t j = lane; j < nvec; j += G) {
      const Pack<X, V> xv = load<V>(xr + j * V);
      const Pack<Y, V> gv = load<V>(gr + j * V);
      const Pack<W, V> wv = load<V>(w + j * V);
      float o[V];
#pragma unroll
      for (int i = 0; i < V; ++i) {
        const float xf = to_f32(xv.v[i]), g = to_f32(gv.v[i]);
        o[i] = r * g * (to_f32(wv.v[i]) + p.weight_offset) - xf * c;
        own[j * V + i] += g * normed<X, CW>(xf, r);
      }
      store<V>(gx + row * cols + j * V, o);
    }
  }
}

template <class X, class W, int V, int K, int R, bool CW>
__device__ __forceinline__ void forward(const RmsNormForward &p) {
  if constexpr (K > 0) forward_cached<X, W, V, K, R, CW>(p); else forward_stream<X, W, V, CW>(p);
}

// R: the backward takes one row a step.
template <class X, class W, int V, int K, int R, bool CW>
__device__ __forceinline__ void backward(const RmsNormBackward &p) {
  static_assert(R == 1);
  if constexpr (K > 0) backward_cached<X, W, V, K, CW>(p); else backward_stream<X, W, V, CW>(p);
}

}  // namespace

// Template arguments of the list's tags (src/geometry.rs; the residency's are in rows.cuh): elements per
// access, rows a step, the rounding mode.
#define ACCESS_vec(X) 16 / sizeof(X)
#define ACCESS_scalar(X) 1
#define ROWS_ 1
#define ROWS_two_rows 2
#define CAST_AFTER_WEIGHT_ false
#define CAST_AFTER_WEIGHT_cast_after_weight true
#define SUFFIX_
#define SUFFIX_two_rows _two_rows
#define SUFFIX_cast_after_weight _cast_after_weight
#define PARAMS_fwd RmsNormForward
#define PARAMS_bwd RmsNormBackward
#define RUN_fwd forward
#define RUN_bwd backward

// Register-cached kernels run at most 256 threads a block (src/geometry.rs), which leaves the compiler room
// to keep a whole row share in registers; streaming ones take up to 1024.
#define KERNEL(dir, x, w, access, residency, rows, mode)                                                         \
  extern "C" __global__ void __launch_bounds__(BASTILE_CACHED_##residency > 0 ? 256 : 1024) BASTILE_CAT(         \
      BASTILE_CAT(rms_norm_##dir##_##x##_##w##_##access##_##residency, SUFFIX_##rows), SUFFIX_##mode)(           \
      const PARAMS_##dir p) {                                                                                    \
    RUN_##dir<BASTILE_TYPE_##x, BASTILE_TYPE_##w, ACCESS_##access(BASTILE_TYPE_##x), BASTILE_CACHED_##residency, \
              ROWS_##rows, CAST_AFTER_WEIGHT_##mode>(p);                                                         \
  }
#define REDUCE(dir, reduce, w)                                                                   \
  extern "C" __global__ void rms_norm_##dir##_##reduce##_##w(const RmsNormBackward p) {         \
    column_sum<BASTILE_TYPE_##w>(p.partial, p.partials, p.cols, static_cast<BASTILE_TYPE_##w *>(p.grad_w)); \
  }
RMS_NORM_FORWARD_KERNELS(KERNEL)
RMS_NORM_BACKWARD_KERNELS(KERNEL, REDUCE)
