// The loops of the row norms (rms_norm.cu, rms_norm_gated.cu): r = rsqrt(mean(x^2) + eps) per row in f32, then
// what the norm N says of each element. A row belongs to `group` threads (geometry from Rust, rows.cuh). With
// per_thread = K > 0 each thread keeps its K vectors of the row (and of the gate, and in the backward of
// grad_y) in registers, so each is read once; the forward takes R rows per group at a time (R = 2 for short
// rows), the backward loads its share of the next row before reducing the current one where the registers
// allow; K = 0 streams the row twice (huge or unaligned rows). The weight is read from L1 where it is used. The
// forward's grid gives every row group a block; the backward's is one wave: it keeps its share of the weight
// gradient in registers across all rows the block visits and writes one f32 partial per block, which a second
// tiny kernel folds (column_sum); streaming groups own a partial row each.
//
// A norm N:
//   X, W, Y                                    dtypes of x (and the gate z), the weight, y (and grad_y)
//   kGated                                     a gate z of x's shape comes with x (rows z_stride apart) and gets
//                                              a gradient (the param blocks' z, z_stride, grad_z)
//   kPairs                                     y = round_Y(round_X(x * r) * w): packed 16-bit products
//   kLookahead<K>                              the backward loads the next row while it finishes the current one
//   N(p)                                       from the param block (its constants)
//   y(x, z, w, r)                              an element of the forward, in f32
//   dot(x, z, dy, w)                           an element's term of the row's sum in the backward
//   grads(x, z, dy, w, r, c, dx, dz, dw)       an element's gradients, c = r^3 * sum(dot) / cols; dw the
//                                              element's term of the weight gradient
#pragma once
#include "rows.cuh"

namespace bastile {

// A thread's place in the rows' layout: its group's size, the groups of a block, its lane and group, the row's
// length in elements and in V-element vectors, 1 / length.
template <int V> struct Lanes {
  int G, rows_per_block, lane, grp;
  int64_t cols, nvec;
  float inv_cols;
  template <class P>
  __device__ __forceinline__ explicit Lanes(const P &p)
      : G(p.geo.group), rows_per_block(blockDim.x / p.geo.group), lane(threadIdx.x % p.geo.group),
        grp(threadIdx.x / p.geo.group), cols(p.cols), nvec(p.cols / V), inv_cols(1.f / (float)p.cols) {}
};

// The backward's inputs, typed: grad_y, x, the weight (read from L1 where used, as in the forward) and rstd.
template <class N> struct BackwardInputs {
  const typename N::Y *gy;
  const typename N::X *x;
  const typename N::W *w;
  const float *rstd;
  template <class P>
  __device__ __forceinline__ explicit BackwardInputs(const P &p)
      : gy(static_cast<const typename N::Y *>(p.grad_y)), x(static_cast<const typename N::X *>(p.x)),
        w(static_cast<const typename N::W *>(p.weight)), rstd(static_cast<const float *>(p.rstd)) {}
};

// A lane's share of one row's gate, or nothing where the norm has none.
template <class N, int V, int K> struct GateShare {
  Pack<typename N::X, V> v[N::kGated ? K : 1];
  template <bool ONCE = false, class P>
  __device__ __forceinline__ void load(const P &p, int64_t row, int lane, int G) {
    if constexpr (N::kGated) load_share<V, K, ONCE>(v, static_cast<const typename N::X *>(p.z), row, p.rows, p.cols,
                                                     p.z_stride, lane, G);
  }
  __device__ __forceinline__ float at(int k, int i) const {
    if constexpr (N::kGated) return to_f32(v[k].v[i]);
    else return 0.f;
  }
  __device__ __forceinline__ void keep() {
#pragma unroll
    for (int k = 0; k < (N::kGated ? K : 0); ++k) opaque(v[k]);
  }
};

// The gate's element at vector j of a streamed row.
template <class N, int V, class P>
__device__ __forceinline__ Pack<typename N::X, V> gate_at(const P &p, int64_t row, int64_t j) {
  if constexpr (N::kGated) return load<V>(static_cast<const typename N::X *>(p.z) + row * p.z_stride + j * V);
  else return {};
}

template <class N, int V> __device__ __forceinline__ float gate_f32(const Pack<typename N::X, V> &z, int i) {
  if constexpr (N::kGated) return to_f32(z.v[i]);
  else return 0.f;
}

// One row share of the forward: y for the K packs this lane holds.
template <class N, int V, int K>
__device__ __forceinline__ void scale_share(const N &n, const Pack<typename N::X, V> (&xv)[K],
                                            const GateShare<N, V, K> &zv, const typename N::W *w,
                                            typename N::Y *yr, float r, int lane, int G, int64_t nvec) {
  using X = typename N::X;
  using W = typename N::W;
  using Y = typename N::Y;
#pragma unroll
  for (int k = 0; k < K; ++k) {
    const int64_t j = lane + k * G;
    if (j >= nvec) continue;
    // The weight comes from L1 each row: registers go to rows in flight instead. (A build loading all K
    // packs before the first store measured 8192x1024 17.8 us against 15.7 us, in two calls on two H100s:
    // not conclusive, as calls differ by up to 12%.)
    const Pack<W, V> wv = load<V>(w + j * V);
    if constexpr (N::kPairs && kPairable<X, W> && V % 2 == 0) {
      Pack<Y, V> o;
#pragma unroll
      for (int i = 0; i < V / 2; ++i)
        pair(o, i) = __hmul2_rn(to_pair<X>(to_f32(xv[k].v[2 * i]) * r, to_f32(xv[k].v[2 * i + 1]) * r), pair(wv, i));
      store_pack(yr + j * V, o);
    } else {
      float o[V];
#pragma unroll
      for (int i = 0; i < V; ++i) o[i] = n.y(to_f32(xv[k].v[i]), zv.at(k, i), to_f32(wv.v[i]), r);
      store<V>(yr + j * V, o);
    }
  }
}

// R rows per group at a time, all loaded before any is reduced (bytes in flight for short rows; their loads go
// through load_once).
template <class N, int V, int K, int R, class P>
__device__ __forceinline__ void forward_cached(const P &p) {
  using X = typename N::X;
  const N n(p);
  const X *x = static_cast<const X *>(p.x);
  const typename N::W *w = static_cast<const typename N::W *>(p.weight);
  typename N::Y *y = static_cast<typename N::Y *>(p.y);
  float *rstd = static_cast<float *>(p.rstd);
  const int G = p.geo.group, rows_per_block = blockDim.x / G;
  const int lane = threadIdx.x % G;
  const int64_t grp = threadIdx.x / G;
  const int64_t cols = p.cols, nvec = cols / V;
  const float eps = (float)p.eps, inv_cols = 1.f / (float)cols;

  FOR_EACH_ROW_GROUP(base, p.rows, rows_per_block * R) {
    Pack<X, V> xv[R][K];
    GateShare<N, V, K> zv[R];
#pragma unroll
    for (int q = 0; q < R; ++q) {
      load_share<V, K, (R > 1)>(xv[q], x, base + q * rows_per_block + grp, p.rows, cols, cols, lane, G);
      zv[q].template load<(R > 1)>(p, base + q * rows_per_block + grp, lane, G);
    }
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
      zv[q].keep();
      scale_share<N, V, K>(n, xv[q], zv[q], w, y + row * cols, r, lane, G, nvec);
    }
  }
}

// Rows too long for registers, or not aligned for vectors: x is read twice (the second time from cache).
template <class N, int V, class P> __device__ __forceinline__ void forward_stream(const P &p) {
  using X = typename N::X;
  using W = typename N::W;
  const N n(p);
  const X *x = static_cast<const X *>(p.x);
  const W *w = static_cast<const W *>(p.weight);
  typename N::Y *y = static_cast<typename N::Y *>(p.y);
  float *rstd = static_cast<float *>(p.rstd);
  const auto [G, rows_per_block, lane, grp, cols, nvec, inv_cols] = Lanes<V>(p);
  const float eps = (float)p.eps;

  FOR_EACH_ROW_GROUP(base, p.rows, rows_per_block) {
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
      const Pack<X, V> xv = load<V>(xr + j * V), zv = gate_at<N, V>(p, row, j);
      const Pack<W, V> wv = load<V>(w + j * V);
      float o[V];
#pragma unroll
      for (int i = 0; i < V; ++i) o[i] = n.y(to_f32(xv.v[i]), gate_f32<N, V>(zv, i), to_f32(wv.v[i]), r);
      store<V>(y + row * cols + j * V, o);
    }
  }
}

// The gradients of a row's element vector: dx (and dz) stored, dw added to acc.
template <class N, int V, class P>
__device__ __forceinline__ void element_grads(const N &n, const P &p, const Pack<typename N::X, V> &xv,
                                              const Pack<typename N::X, V> &zv, const Pack<typename N::Y, V> &gv,
                                              const Pack<typename N::W, V> &wv, float r, float c, float *acc,
                                              int64_t at) {
  float dx[V], dz[V];
#pragma unroll
  for (int i = 0; i < V; ++i) {
    float dw;
    n.grads(to_f32(xv.v[i]), gate_f32<N, V>(zv, i), to_f32(gv.v[i]), to_f32(wv.v[i]), r, c, dx[i], dz[i], dw);
    acc[i] += dw;
  }
  store<V>(static_cast<typename N::X *>(p.grad_x) + at, dx);
  if constexpr (N::kGated) store<V>(static_cast<typename N::X *>(p.grad_z) + at, dz);
}

// dx = r * (g - n * mean(g * n)) with g = d(y)/d(n) and n = x * r, which is r * g - x * r^3 * sum(g * x) / cols;
// dw = sum over rows of dy * d(y)/d(w) (n rounded as the forward's), kept in registers and written as one f32
// partial per block.
template <class N, int V, int K, class P>
__device__ __forceinline__ void backward_cached(const P &p) {
  using X = typename N::X;
  using Y = typename N::Y;
  const N n(p);
  const auto [gy, x, w, rstd] = BackwardInputs<N>(p);
  // Copied by name: bound as the other loops bind them, nvcc 13.0 gave some of these kernels 42 more registers.
  const Lanes<V> at(p);
  const int G = at.G, rows_per_block = at.rows_per_block, lane = at.lane, grp = at.grp;
  const int64_t cols = at.cols, nvec = at.nvec;
  const float inv_cols = at.inv_cols;
  const int64_t stride = (int64_t)gridDim.x * rows_per_block;
  constexpr bool ahead = N::template kLookahead<K>;

  float acc[K][V];
#pragma unroll
  for (int k = 0; k < K; ++k)
#pragma unroll
    for (int i = 0; i < V; ++i) acc[k][i] = 0.f;
  Pack<X, V> xv[K], x_next[K];
  Pack<Y, V> gv[K], g_next[K];
  GateShare<N, V, K> zv, z_next;
  // The row's rstd comes with its x and grad_y: loaded when the row is used, its latency sat on every row's
  // critical path (H100, bf16, 8192x1152 rms_norm backward at 96 threads a row: 23.3 us against 26.8 us).
  // Selects, not branches, around these loads: with `if`s nvcc 13.0 scheduled them later, and the gain was
  // gone (27.2 us).
  float r_cur = 0.f, r_next = 0.f;
  if constexpr (ahead) {
    const int64_t first = (int64_t)blockIdx.x * rows_per_block + grp;
    load_share<V>(xv, x, first, p.rows, cols, cols, lane, G);
    load_share<V>(gv, gy, first, p.rows, cols, cols, lane, G);
    zv.load(p, first, lane, G);
    if (first < p.rows) r_cur = rstd[first];
  }

  FOR_EACH_ROW_GROUP(base, p.rows, rows_per_block) {
    const int64_t row = base + grp;
    const bool live = row < p.rows;
    if constexpr (ahead) {
      load_share<V>(x_next, x, row + stride, p.rows, cols, cols, lane, G);
      load_share<V>(g_next, gy, row + stride, p.rows, cols, cols, lane, G);
      z_next.load(p, row + stride, lane, G);
      r_next = row + stride < p.rows ? rstd[row + stride] : 0.f;
    } else {
      load_share<V>(xv, x, row, p.rows, cols, cols, lane, G);
      load_share<V>(gv, gy, row, p.rows, cols, cols, lane, G);
      zv.load(p, row, lane, G);
    }
    const float r = ahead ? r_cur : (live ? rstd[row] : 0.f);
    float dot = 0.f;
#pragma unroll
    for (int k = 0; k < K; ++k)
      if (live && lane + k * G < nvec) {
        const auto wv = load<V>(w + (lane + k * G) * V);
#pragma unroll
        for (int i = 0; i < V; ++i)
          dot += n.dot(to_f32(xv[k].v[i]), zv.at(k, i), to_f32(gv[k].v[i]), to_f32(wv.v[i]));
      }
    dot = group_sum(dot, G);
    if (live) {
      const float c = r * r * r * dot * inv_cols;
#pragma unroll
      for (int k = 0; k < K; ++k) {
        opaque(xv[k]);
        opaque(gv[k]);
      }
      zv.keep();
#pragma unroll
      for (int k = 0; k < K; ++k) {
        const int64_t j = lane + k * G;
        if (j >= nvec) continue;
        const auto wv = load<V>(w + j * V);
        element_grads<N, V>(n, p, xv[k], zv.v[N::kGated ? k : 0], gv[k], wv, r, c, acc[k], row * cols + j * V);
      }
    }
    if constexpr (ahead) {
#pragma unroll
      for (int k = 0; k < K; ++k) {
        xv[k] = x_next[k];
        gv[k] = g_next[k];
      }
      zv = z_next;
      r_cur = r_next;
    }
  }

  store_partial(acc, p.partial + (int64_t)blockIdx.x * cols, cols, lane, G);
}

// Streaming backward: each group owns a partial row of the weight gradient in global memory.
template <class N, int V, class P> __device__ __forceinline__ void backward_stream(const P &p) {
  using X = typename N::X;
  const N n(p);
  const auto [gy, x, w, rstd] = BackwardInputs<N>(p);
  const auto [G, rows_per_block, lane, grp, cols, nvec, inv_cols] = Lanes<V>(p);
  float *own = p.partial + ((int64_t)blockIdx.x * rows_per_block + grp) * cols;
  for (int64_t j = lane; j < nvec; j += G)  // each lane the elements it adds to
#pragma unroll
    for (int i = 0; i < V; ++i) own[j * V + i] = 0.f;

  FOR_EACH_ROW_GROUP(base, p.rows, rows_per_block) {
    const int64_t row = base + grp;
    const bool live = row < p.rows;
    const X *xr = x + row * cols;
    const auto *gr = gy + row * cols;
    float dot = 0.f;
    for (int64_t j = lane; live && j < nvec; j += G) {
      const Pack<X, V> xv = load<V>(xr + j * V), zv = gate_at<N, V>(p, row, j);
      const auto gv = load<V>(gr + j * V);
      const auto wv = load<V>(w + j * V);
#pragma unroll
      for (int i = 0; i < V; ++i)
        dot += n.dot(to_f32(xv.v[i]), gate_f32<N, V>(zv, i), to_f32(gv.v[i]), to_f32(wv.v[i]));
    }
    dot = group_sum(dot, G);
    if (!live) continue;
    const float r = rstd[row];
    const float c = r * r * r * dot * inv_cols;
    for (int64_t j = lane; j < nvec; j += G)
      element_grads<N, V>(n, p, load<V>(xr + j * V), gate_at<N, V>(p, row, j), load<V>(gr + j * V),
                          load<V>(w + j * V), r, c, own + j * V, row * cols + j * V);
  }
}

template <class N, int V, int K, int R, class P> __device__ __forceinline__ void forward(const P &p) {
  if constexpr (K > 0) forward_cached<N, V, K, R>(p); else forward_stream<N, V>(p);
}

// R: the backward takes one row a step.
template <class N, int V, int K, int R, class P> __device__ __forceinline__ void backward(const P &p) {
  static_assert(R == 1);
  if constexpr (K > 0) backward_cached<N, V, K>(p); else backward_stream<N, V>(p);
}

}  // namespace bastile
