// RMSNorm with HF semantics: y = w * to_x_dtype(x * rsqrt(mean(x^2) + eps)), statistics in f32.
//
// A row is handled by `group` threads (geometry from Rust). With per_thread = K > 0 each thread keeps
// its K vectors of the row in registers, so x is read once; K = 0 streams the row twice (huge or
// unaligned rows). The backward keeps its share of the weight gradient in registers across all rows
// the block visits and writes one f32 partial per block; a second tiny kernel folds the partials.
#include "common.cuh"

using namespace bastile;

namespace {

// Rows the block's groups take in turn; the loop bound is uniform across the block, so every thread
// reaches each group_sum.
#define FOR_EACH_ROW_GROUP(base, rows_per_block)                                      \
  for (int64_t base = (int64_t)blockIdx.x * (rows_per_block); base < p.rows;          \
       base += (int64_t)gridDim.x * (rows_per_block))

template <class X, class W, int V, int K>
__device__ __forceinline__ void forward(const RmsNormForward &p) {
  using Y = typename Promote<X, W>::type;
  constexpr int R = K > 0 ? K : 1;  // vectors held in registers
  const X *x = static_cast<const X *>(p.x);
  const W *w = static_cast<const W *>(p.weight);
  Y *y = static_cast<Y *>(p.y);
  float *rstd = static_cast<float *>(p.rstd);
  const int G = p.geo.group, rows_per_block = blockDim.x / G;
  const int lane = threadIdx.x % G, grp = threadIdx.x / G;
  const int64_t cols = p.cols, nvec = cols / V;
  const float eps = (float)p.eps, inv_cols = 1.f / (float)cols;

  Pack<W, V> wv[R];
  if constexpr (K > 0) {
#pragma unroll
    for (int k = 0; k < K; ++k)
      if (lane + k * G < nvec) wv[k] = load<V>(w + (lane + k * G) * V);
  }

  FOR_EACH_ROW_GROUP(base, rows_per_block) {
    const int64_t row = base + grp;
    const bool live = row < p.rows;
    const X *xr = x + row * cols;
    Y *yr = y + row * cols;
    Pack<X, V> xv[R];
    float ss = 0.f;
    if constexpr (K > 0) {
#pragma unroll
      for (int k = 0; k < K; ++k) {
        const int64_t j = lane + k * G;
        if (live && j < nvec) {
          xv[k] = load<V>(xr + j * V);
#pragma unroll
          for (int i = 0; i < V; ++i) ss += to_f32(xv[k].v[i]) * to_f32(xv[k].v[i]);
        }
      }
    } else if (live) {
      for (int64_t j = lane; j < nvec; j += G) {
        xv[0] = load<V>(xr + j * V);
#pragma unroll
        for (int i = 0; i < V; ++i) ss += to_f32(xv[0].v[i]) * to_f32(xv[0].v[i]);
      }
    }
    ss = group_sum(ss, G);
    if (!live) continue;
    const float r = rsqrtf(ss * inv_cols + eps);
    if (rstd && lane == 0) rstd[row] = r;
    for (int64_t j = lane, k = 0; K > 0 ? k < K : j < nvec; j += G, ++k) {
      if (K > 0 && j >= nvec) continue;
      const int s = K > 0 ? (int)k : 0;
      if constexpr (K == 0) {
        xv[0] = load<V>(xr + j * V);
        wv[0] = load<V>(w + j * V);
      }
      float o[V];
#pragma unroll
      for (int i = 0; i < V; ++i) o[i] = to_f32(wv[s].v[i]) * round_to<X>(to_f32(xv[s].v[i]) * r);
      store<V>(yr + j * V, o);
    }
  }
}

// dx = r * (g - n * mean(g * n)) with g = dy * w and n = x * r; dw = sum over rows of dy * to_x_dtype(n).
template <class X, class W, int V, int K>
__device__ __forceinline__ void backward(const RmsNormBackward &p) {
  using Y = typename Promote<X, W>::type;
  constexpr int R = K > 0 ? K : 1;
  const Y *gy = static_cast<const Y *>(p.grad_y);
  const X *x = static_cast<const X *>(p.x);
  const W *w = static_cast<const W *>(p.weight);
  const float *rstd = static_cast<const float *>(p.rstd);
  X *gx = static_cast<X *>(p.grad_x);
  const int G = p.geo.group, rows_per_block = blockDim.x / G;
  const int lane = threadIdx.x % G, grp = threadIdx.x / G;
  const int64_t cols = p.cols, nvec = cols / V;
  const float inv_cols = 1.f / (float)cols;

  Pack<W, V> wv[R];
  float acc[R][V];
  // Streaming keeps its weight-gradient share in a partial row of its own instead of registers.
  float *own = p.partial + ((int64_t)blockIdx.x * rows_per_block + grp) * cols;
  if constexpr (K > 0) {
#pragma unroll
    for (int k = 0; k < K; ++k) {
#pragma unroll
      for (int i = 0; i < V; ++i) acc[k][i] = 0.f;
      if (lane + k * G < nvec) wv[k] = load<V>(w + (lane + k * G) * V);
    }
  } else {
    for (int64_t c = lane; c < cols; c += G) own[c] = 0.f;
  }

  FOR_EACH_ROW_GROUP(base, rows_per_block) {
    const int64_t row = base + grp;
    const bool live = row < p.rows;
    const X *xr = x + row * cols;
    const Y *gr = gy + row * cols;
    Pack<X, V> xv[R];
    Pack<Y, V> gv[R];
    float dot = 0.f;  // sum of dy * w * x over the row
    for (int64_t j = lane, k = 0; K > 0 ? k < K : j < nvec; j += G, ++k) {
      if (!live || j >= nvec) continue;
      const int s = K > 0 ? (int)k : 0;
      xv[s] = load<V>(xr + j * V);
      gv[s] = load<V>(gr + j * V);
      if constexpr (K == 0) wv[0] = load<V>(w + j * V);
#pragma unroll
      for (int i = 0; i < V; ++i) dot += to_f32(gv[s].v[i]) * to_f32(wv[s].v[i]) * to_f32(xv[s].v[i]);
    }
    dot = group_sum(dot, G);
    if (!live) continue;
    const float r = rstd[row];
    const float c = r * r * r * dot * inv_cols;
    for (int64_t j = lane, k = 0; K > 0 ? k < K : j < nvec; j += G, ++k) {
      if (K > 0 && j >= nvec) continue;
      const int s = K > 0 ? (int)k : 0;
      if constexpr (K == 0) {
        xv[0] = load<V>(xr + j * V);
        gv[0] = load<V>(gr + j * V);
        wv[0] = load<V>(w + j * V);
      }
      float o[V];
#pragma unroll
      for (int i = 0; i < V; ++i) {
        const float xf = to_f32(xv[s].v[i]), g = to_f32(gv[s].v[i]);
        o[i] = r * g * to_f32(wv[s].v[i]) - xf * c;
        const float dw = g * round_to<X>(xf * r);
        if constexpr (K > 0) acc[s][i] += dw; else own[j * V + i] += dw;
      }
      store<V>(gx + row * cols + j * V, o);
    }
  }

  if constexpr (K > 0) {
    float *out = p.partial + (int64_t)blockIdx.x * cols;
    if (rows_per_block == 1) {
#pragma unroll
      for (int k = 0; k < K; ++k)
        if (lane + k * G < nvec) store<V>(out + (lane + k * G) * V, acc[k]);
      return;
    }
    // Several rows per block: fold the groups' shares in shared memory first.
    extern __shared__ float fold[];
#pragma unroll
    for (int k = 0; k < K; ++k)
      if (lane + k * G < nvec)
#pragma unroll
        for (int i = 0; i < V; ++i) fold[grp * cols + (lane + k * G) * V + i] = acc[k][i];
    __syncthreads();
    for (int64_t c = threadIdx.x; c < cols; c += blockDim.x) {
      float s = 0.f;
      for (int g = 0; g < rows_per_block; ++g) s += fold[g * cols + c];
      out[c] = s;
    }
  }
}

}  // namespace

// Register-cached variants run at most 256 threads a block (src/geometry.rs), which leaves the
// compiler room to keep a whole row share in registers; streaming variants take up to 1024.
#define RMS_NORM_KERNELS(xn, X, wn, W, tag, V, K)                                                      \
  extern "C" __global__ void __launch_bounds__(K > 0 ? 256 : 1024)                                    \
      rms_norm_fwd_##xn##_##wn##_##tag(const RmsNormForward p) {                                       \
    forward<X, W, V, K>(p);                                                                             \
  }                                                                                                     \
  extern "C" __global__ void __launch_bounds__(K > 0 ? 256 : 1024)                                    \
      rms_norm_bwd_##xn##_##wn##_##tag(const RmsNormBackward p) {                                      \
    backward<X, W, V, K>(p);                                                                            \
  }

// Kernel names: rms_norm_{fwd,bwd}_<x>_<w>_<k1|k2|k4|k8|vstream|sstream>; src/rms_norm.rs builds the same.
#define RMS_NORM_VARIANTS(xn, X, wn, W)                            \
  RMS_NORM_KERNELS(xn, X, wn, W, k1, 16 / sizeof(X), 1)            \
  RMS_NORM_KERNELS(xn, X, wn, W, k2, 16 / sizeof(X), 2)            \
  RMS_NORM_KERNELS(xn, X, wn, W, k4, 16 / sizeof(X), 4)            \
  RMS_NORM_KERNELS(xn, X, wn, W, k8, 16 / sizeof(X), 8)            \
  RMS_NORM_KERNELS(xn, X, wn, W, vstream, 16 / sizeof(X), 0)       \
  RMS_NORM_KERNELS(xn, X, wn, W, sstream, 1, 0)

#define RMS_NORM_FOR_WEIGHTS(xn, X) \
  RMS_NORM_VARIANTS(xn, X, f32, float) RMS_NORM_VARIANTS(xn, X, f16, f16) RMS_NORM_VARIANTS(xn, X, bf16, bf16)

RMS_NORM_FOR_WEIGHTS(f32, float)
RMS_NORM_FOR_WEIGHTS(f16, f16)
RMS_NORM_FOR_WEIGHTS(bf16, bf16)

#define RMS_NORM_REDUCE(wn, W) \
  extern "C" __global__ void rms_norm_bwd_reduce_##wn(const RmsNormBackward p) { \
    column_sum<W>(p.partial, p.partials, p.cols, static_cast<W *>(p.grad_w));   \
  }
RMS_NORM_REDUCE(f32, float)
RMS_NORM_REDUCE(f16, f16)
RMS_NORM_REDUCE(bf16, bf16)
