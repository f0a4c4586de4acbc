// Qwen3.5's gated RMSNorm, the output norm of its Gated DeltaNet layers (HF Qwen3_5RMSNormGated), over rows
// x gated by rows z: with r = rsqrt(mean(x^2) + eps) in f32, n = round_X(x * r), s = sig(z):
//   y      = round_X(w * n * z * s)                        the products in f32
//   grad_x = r * g - x * r^3 * sum(g * x) / cols           g = dy * z * s * w
//   grad_z = dy * w * n * s * (1 + z * (1 - s))
//   grad_w = sum over rows of dy * z * s * n
// n rounded as HF rounds it (to x's dtype before the weight), every result rounded once.
//
// Layout as rms_norm's (cuda/rows.cuh, src/geometry.rs): a row belongs to `group` threads. With
// per_thread = K > 0 each keeps its K vectors of the row's x and z (and in the backward dy) in registers
// from the reduction to the outputs; K = 0 streams the rows twice (huge or unaligned rows). The forward's
// grid gives every row group a block. The backward's is one wave that loads a row ahead (K <= 2), keeps
// its share of the weight gradient in registers across its rows and writes one f32 partial per block,
// which a second kernel folds; streaming groups own a partial row each.
#include "elementwise.cuh"
#include "rms_norm_gated.h"
#include "rows.cuh"

using namespace bastile;

namespace {

// The backward loads the next row's x, z and dy while it finishes the current one where the registers
// allow: a row is three tensors here, rms_norm's two, so up to two vectors of each (bf16 on sm_90a: 121
// registers at K = 2; K = 4, without it, 128).
template <int K> constexpr bool kLookahead = K <= 2;

template <class X, class W, int V, int K>
__device__ __forceinline__ void forward_cached(const RmsNormGatedForward &p) {
  const X *x = static_cast<const X *>(p.x), *z = static_cast<const X *>(p.z);
  const W *w = static_cast<const W *>(p.weight);
  X *y = static_cast<X *>(p.y);
  float *rstd = static_cast<float *>(p.rstd);
  const int G = p.geo.group, rows_per_block = blockDim.x / G;
  const int lane = threadIdx.x % G, grp = threadIdx.x / G;
  const int64_t cols = p.cols, nvec = cols / V;
  const float eps = (float)p.eps, inv_cols = 1.f / (float)cols;

  FOR_EACH_ROW_GROUP(base, rows_per_block) {
    const int64_t row = base + grp;
    const bool live = row < p.rows;
    Pack<X, V> xv[K], zv[K];
    load_share<V>(xv, x, row, p.rows, cols, cols, lane, G);
    load_share<V>(zv, z, row, p.rows, cols, p.z_stride, lane, G);
    float ss = 0.f;
#pragma unroll
    for (int k = 0; k < K; ++k)
      if (live && lane + k * G < nvec)
#pragma unroll
        for (int i = 0; i < V; ++i) ss += to_f32(xv[k].v[i]) * to_f32(xv[k].v[i]);
    ss = group_sum(ss, G);
    if (!live) continue;
    const float r = rsqrtf(ss * inv_cols + eps);
    if (rstd && lane == 0) rstd[row] = r;
#pragma unroll
    for (int k = 0; k < K; ++k) keep_packed(xv[k], zv[k]);
#pragma unroll
    for (int k = 0; k < K; ++k) {
      const int64_t j = lane + k * G;
      if (j >= nvec) continue;
      const Pack<W, V> wv = load<V>(w + j * V);
      float o[V];
#pragma unroll
      for (int i = 0; i < V; ++i) {
        const float zf = to_f32(zv[k].v[i]);
        o[i] = to_f32(wv.v[i]) * round_to<X>(to_f32(xv[k].v[i]) * r) * (zf * sigmoid(zf));
      }
      store<V>(y + row * cols + j * V, o);
    }
  }
}

// Rows too long for registers, or not aligned for vectors: x is read twice (the second time from cache).
template <class X, class W, int V>
__device__ __forceinline__ void forward_stream(const RmsNormGatedForward &p) {
  const X *x = static_cast<const X *>(p.x), *z = static_cast<const X *>(p.z);
  const W *w = static_cast<const W *>(p.weight);
  X *y = static_cast<X *>(p.y);
  float *rstd = static_cast<float *>(p.rstd);
  const int G = p.geo.group, rows_per_block = blockDim.x / G;
  const int lane = threadIdx.x % G, grp = threadIdx.x / G;
  const int64_t cols = p.cols, nvec = cols / V;
  const float eps = (float)p.eps, inv_cols = 1.f / (float)cols;

  FOR_EACH_ROW_GROUP(base, rows_per_block) {
    const int64_t row = base + grp;
    const bool live = row < p.rows;
    const X *xr = x + row * cols, *zr = z + row * p.z_stride;
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
      const Pack<X, V> xv = load<V>(xr + j * V), zv = load<V>(zr + j * V);
      const Pack<W, V> wv = load<V>(w + j * V);
      float o[V];
#pragma unroll
      for (int i = 0; i < V; ++i) {
        const float zf = to_f32(zv.v[i]);
        o[i] = to_f32(wv.v[i]) * round_to<X>(to_f32(xv.v[i]) * r) * (zf * sigmoid(zf));
      }
      store<V>(y + row * cols + j * V, o);
    }
  }
}

// An element of the backward in f32, with s = sig(z).
struct Term {
  float x, z, dy, w, s;
  __device__ __forceinline__ Term(float x, float z, float dy, float w) : x(x), z(z), dy(dy), w(w), s(sigmoid(z)) {}
  // The gradient of w * n, and of n.
  __device__ __forceinline__ float gated() const { return dy * (z * s); }
  __device__ __forceinline__ float g() const { return gated() * w; }
  // grad_z, with n as the forward rounded it.
  __device__ __forceinline__ float grad_z(float n) const { return dy * w * n * (s * (1.f + z * (1.f - s))); }
};

// The lane's vectors of one row for the backward, and the row's rstd.
template <class X, int V, int K> struct RowShare {
  Pack<X, V> x[K], z[K], dy[K];
  float r;
  __device__ __forceinline__ void load(const RmsNormGatedBackward &p, int64_t row, int lane, int G) {
    load_share<V>(x, static_cast<const X *>(p.x), row, p.rows, p.cols, p.cols, lane, G);
    load_share<V>(z, static_cast<const X *>(p.z), row, p.rows, p.cols, p.z_stride, lane, G);
    load_share<V>(dy, static_cast<const X *>(p.grad_y), row, p.rows, p.cols, p.cols, lane, G);
    r = row < p.rows ? static_cast<const float *>(p.rstd)[row] : 0.f;
  }
};

template <class X, class W, int V, int K>
__device__ __forceinline__ void backward_cached(const RmsNormGatedBackward &p) {
  const W *w = static_cast<const W *>(p.weight);
  X *gx = static_cast<X *>(p.grad_x), *gz = static_cast<X *>(p.grad_z);
  const int G = p.geo.group, rows_per_block = blockDim.x / G;
  const int lane = threadIdx.x % G, grp = threadIdx.x / G;
  const int64_t cols = p.cols, nvec = cols / V, stride = (int64_t)gridDim.x * rows_per_block;
  const float inv_cols = 1.f / (float)cols;

  float acc[K][V];
#pragma unroll
  for (int k = 0; k < K; ++k)
#pragma unroll
    for (int i = 0; i < V; ++i) acc[k][i] = 0.f;
  RowShare<X, V, K> cur, next;
  if constexpr (kLookahead<K>) cur.load(p, (int64_t)blockIdx.x * rows_per_block + grp, lane, G);

  FOR_EACH_ROW_GROUP(base, rows_per_block) {
    const int64_t row = base + grp;
    const bool live = row < p.rows;
    if constexpr (kLookahead<K>) next.load(p, row + stride, lane, G);
    else cur.load(p, row, lane, G);
    float dot = 0.f;
#pragma unroll
    for (int k = 0; k < K; ++k)
      if (live && lane + k * G < nvec) {
        const Pack<W, V> wv = load<V>(w + (lane + k * G) * V);
#pragma unroll
        for (int i = 0; i < V; ++i) {
          const Term t(to_f32(cur.x[k].v[i]), to_f32(cur.z[k].v[i]), to_f32(cur.dy[k].v[i]), to_f32(wv.v[i]));
          dot += t.g() * t.x;
        }
      }
    dot = group_sum(dot, G);
    if (live) {
      const float r = cur.r, c = r * r * r * dot * inv_cols;
#pragma unroll
      for (int k = 0; k < K; ++k) keep_packed(cur.x[k], cur.z[k], cur.dy[k]);
#pragma unroll
      for (int k = 0; k < K; ++k) {
        const int64_t j = lane + k * G;
        if (j >= nvec) continue;
        const Pack<W, V> wv = load<V>(w + j * V);
        float dx[V], dz[V];
#pragma unroll
        for (int i = 0; i < V; ++i) {
          const Term t(to_f32(cur.x[k].v[i]), to_f32(cur.z[k].v[i]), to_f32(cur.dy[k].v[i]), to_f32(wv.v[i]));
          const float n = round_to<X>(t.x * r);
          dx[i] = r * t.g() - t.x * c;
          dz[i] = t.grad_z(n);
          acc[k][i] += t.gated() * n;
        }
        store<V>(gx + row * cols + j * V, dx);
        store<V>(gz + row * cols + j * V, dz);
      }
    }
    if constexpr (kLookahead<K>) cur = next;
  }
  store_partial(acc, p.partial + (int64_t)blockIdx.x * cols, cols, lane, G);
}

// Streaming backward: each group owns a partial row of the weight gradient in global memory.
template <class X, class W, int V>
__device__ __forceinline__ void backward_stream(const RmsNormGatedBackward &p) {
  const X *gy = static_cast<const X *>(p.grad_y), *x = static_cast<const X *>(p.x), *z = static_cast<const X *>(p.z);
  const W *w = static_cast<const W *>(p.weight);
  const float *rstd = static_cast<const float *>(p.rstd);
  X *gx = static_cast<X *>(p.grad_x), *gz = static_cast<X *>(p.grad_z);
  const int G = p.geo.group, rows_per_block = blockDim.x / G;
  const int lane = threadIdx.x % G, grp = threadIdx.x / G;
  const int64_t cols = p.cols, nvec = cols / V;
  const float inv_cols = 1.f / (float)cols;
  float *own = p.partial + ((int64_t)blockIdx.x * rows_per_block + grp) * cols;
  for (int64_t j = lane; j < nvec; j += G)  // each lane the elements it adds to
#pragma unroll
    for (int i = 0; i < V; ++i) own[j * V + i] = 0.f;

  FOR_EACH_ROW_GROUP(base, rows_per_block) {
    const int64_t row = base + grp;
    const bool live = row < p.rows;
    const X *xr = x + row * cols, *zr = z + row * p.z_stride, *gr = gy + row * cols;
    float dot = 0.f;
    for (int64_t j = lane; live && j < nvec; j += G) {
      const Pack<X, V> xv = load<V>(xr + j * V), zv = load<V>(zr + j * V), gv = load<V>(gr + j * V);
      const Pack<W, V> wv = load<V>(w + j * V);
#pragma unroll
      for (int i = 0; i < V; ++i) {
        const Term t(to_f32(xv.v[i]), to_f32(zv.v[i]), to_f32(gv.v[i]), to_f32(wv.v[i]));
        dot += t.g() * t.x;
      }
    }
    dot = group_sum(dot, G);
    if (!live) continue;
    const float r = rstd[row], c = r * r * r * dot * inv_cols;
    for (int64_t j = lane; j < nvec; j += G) {
      const Pack<X, V> xv = load<V>(xr + j * V), zv = load<V>(zr + j * V), gv = load<V>(gr + j * V);
      const Pack<W, V> wv = load<V>(w + j * V);
      float dx[V], dz[V];
#pragma unroll
      for (int i = 0; i < V; ++i) {
        const Term t(to_f32(xv.v[i]), to_f32(zv.v[i]), to_f32(gv.v[i]), to_f32(wv.v[i]));
        const float n = round_to<X>(t.x * r);
        dx[i] = r * t.g() - t.x * c;
        dz[i] = t.grad_z(n);
        own[j * V + i] += t.gated() * n;
      }
      store<V>(gx + row * cols + j * V, dx);
      store<V>(gz + row * cols + j * V, dz);
    }
  }
}

template <class X, class W, int V, int K>
__device__ __forceinline__ void forward(const RmsNormGatedForward &p) {
  if constexpr (K > 0) forward_cached<X, W, V, K>(p); else forward_stream<X, W, V>(p);
}

template <class X, class W, int V, int K>
__device__ __forceinline__ void backward(const RmsNormGatedBackward &p) {
  if constexpr (K > 0) backward_cached<X, W, V, K>(p); else backward_stream<X, W, V>(p);
}

}  // namespace

#define PARAMS_fwd RmsNormGatedForward
#define PARAMS_bwd RmsNormGatedBackward
#define RUN_fwd forward
#define RUN_bwd backward

// Register-cached kernels run at most 256 threads a block (src/geometry.rs), streaming ones up to 1024.
#define KERNEL(dir, x, w, access, residency)                                                                     \
  extern "C" __global__ void __launch_bounds__(BASTILE_CACHED_##residency > 0 ? 256 : 1024)                     \
      rms_norm_gated_##dir##_##x##_##w##_##access##_##residency(const PARAMS_##dir p) {                          \
    RUN_##dir<BASTILE_TYPE_##x, BASTILE_TYPE_##w, BASTILE_WIDTH_##access(BASTILE_TYPE_##x), BASTILE_CACHED_##residency>( \
        p);                                                                                                      \
  }
#define REDUCE(dir, reduce, w)                                                                                   \
  extern "C" __global__ void rms_norm_gated_##dir##_##reduce##_##w(const RmsNormGatedBackward p) {               \
    column_sum<BASTILE_TYPE_##w>(p.partial, p.partials, p.cols, static_cast<BASTILE_TYPE_##w *>(p.grad_w));       \
  }
RMS_NORM_GATED_FORWARD_KERNELS(KERNEL)
RMS_NORM_GATED_BACKWARD_KERNELS(KERNEL, REDUCE)
