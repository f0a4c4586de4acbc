// Qwen3.5's depthwise causal conv (HF causal_conv1d_fn: nn.Conv1d over x.transpose(1, 2), then SiLU) on
// channels-last rows x [batch, seq, channels], per channel with W <= 4 taps counted back from the token:
//   pre[t] = bias + sum_{k < W} w[W-1-k] x[t-k]      (x before the token's sequence starts is 0)
//   y[t]   = silu(pre[t]), or pre[t]
// and the backward, which recomputes pre from x:
//   dpre[t]   = dy[t] silu'(pre[t]),  silu'(p) = s (1 + p (1 - s)), s = sigmoid(p)
//   dx[t]     = sum_{k < W} w[W-1-k] dpre[t+k]      over the t + k of t's sequence
//   dw[W-1-k] = sum_t dpre[t] x[t-k],  dbias = sum_t dpre[t]
// Math in f32, each result rounded once to its dtype (HF rounds after the conv and again after SiLU).
//
// A thread takes V channels (a vector of x, or one) over a tile of consecutive tokens, walking them
// in order with the last W-1 inputs in registers: x is read once, but for the W-1 tokens before each tile
// (which the previous tile's thread has just brought into L2). blockDim.x lanes take neighbouring channel
// vectors, blockDim.y tiles at a time, grid-stride over the tiles. The backward walks W-1 tokens past its
// tile for the dpre its last tokens' dx need; it keeps dw and dbias of its own tiles in registers across
// every tile it visits (one resident wave of blocks), folds them over the block's rows in shared memory
// into one f32 partial row per block row of the grid, and a second kernel folds those: deterministic sums,
// no atomics. Packed rows find their sequence starts in cu_seqlens on the device, with no host sync: a
// binary search where a tile starts, then each next offset as the walk reaches it.
#include "causal_conv1d.h"
#include "elementwise.cuh"

using namespace bastile;

namespace {

constexpr int MAX_W = CAUSAL_CONV1D_MAX_WIDTH;
// Tokens whose loads a thread issues before it uses any: bytes in flight.
constexpr int AHEAD = 4;

// The sequence starts of a row as a thread walks its tokens in order. Offsets are clamped into [0, seq], so
// that whatever cu_seqlens holds every token read lies in the row, at or before the token walked.
struct Sequences {
  const void *cu;    // null: the row is one sequence
  int64_t offsets;   // entries of cu
  bool wide;         // int64 entries
  int64_t seq;
  int64_t next_i = 0, next = INT64_MAX;  // the first offset above the walk, and its index

  __device__ __forceinline__ int64_t offset(int64_t i) const {
    const int64_t v = wide ? static_cast<const int64_t *>(cu)[i] : static_cast<const int32_t *>(cu)[i];
    return min(max(v, (int64_t)0), seq);
  }

  // Starts the walk at token t; returns how many tokens of its sequence precede it, at most MAX_W - 1.
  __device__ __forceinline__ int seek(int64_t t) {
    if (!cu) return (int)min(t, (int64_t)MAX_W - 1);
    int64_t lo = 0, hi = offsets;
    while (lo < hi) {
      const int64_t mid = (lo + hi) / 2;
      if (offset(mid) <= t) lo = mid + 1;
      else hi = mid;
    }
    const int64_t start = lo > 0 ? offset(lo - 1) : 0;
    next_i = lo;
    next = lo < offsets ? offset(lo) : INT64_MAX;
    return (int)min(max(t - start, (int64_t)0), (int64_t)MAX_W - 1);
  }

  // Whether a sequence starts at t, the token after the last one walked.
  __device__ __forceinline__ bool starts(int64_t t) {
    if (t < next) return false;
    while (next_i < offsets && offset(next_i) <= t) ++next_i;  // empty sequences start here too
    next = next_i < offsets ? offset(next_i) : INT64_MAX;
    return true;
  }
};

template <class X, int V> __device__ __forceinline__ Pack<X, V> zeros() {
  Pack<X, V> z;
#pragma unroll
  for (int j = 0; j < V; ++j) z.v[j] = from_f32<X>(0.f);
  return z;
}

// The inputs of a walk: x[k] holds x[t - k] of the token t walked (x[0] once it is loaded), 0 before
// the sequence's start.
template <class X, int V> struct Window {
  Pack<X, V> x[MAX_W];

  // At token t of row x, with `before` tokens of its sequence before it.
  __device__ __forceinline__ void open(const X *row, int64_t stride, int64_t t, int before, int width) {
#pragma unroll
    for (int k = 1; k < MAX_W; ++k) x[k] = k <= before && k < width ? load<V>(row + (t - k) * stride) : zeros<X, V>();
  }
  __device__ __forceinline__ void clear() {
#pragma unroll
    for (int k = 1; k < MAX_W; ++k) x[k] = zeros<X, V>();
  }
  __device__ __forceinline__ void advance() {
#pragma unroll
    for (int k = MAX_W - 1; k > 0; --k) x[k] = x[k - 1];
  }
  __device__ __forceinline__ float operator()(int k, int j) const { return to_f32(x[k].v[j]); }
};

// A thread's taps, wk[k][j] = weight[c + j][W-1-k] (the tap k tokens back), and bias, in f32.
template <class W, int V> struct Taps {
  float wk[MAX_W][V], bias[V];
  int width;

  __device__ __forceinline__ Taps(const CausalConv1dInputs &p, int64_t c) : width(p.width) {
    const W *w = static_cast<const W *>(p.weight), *b = static_cast<const W *>(p.bias);
#pragma unroll
    for (int j = 0; j < V; ++j) {
      bias[j] = b ? to_f32(b[c + j]) : 0.f;
#pragma unroll
      for (int k = 0; k < MAX_W; ++k) wk[k][j] = k < width ? to_f32(w[(c + j) * width + width - 1 - k]) : 0.f;
    }
  }

  template <class X> __device__ __forceinline__ float pre(const Window<X, V> &x, int j) const {
    float s = bias[j];
#pragma unroll
    for (int k = 0; k < MAX_W; ++k)
      if (k < width) s += wk[k][j] * x(k, j);
    return s;
  }
};

// The token tiles of the rows, batch * ceil(seq / tile) of them: a thread takes first(), first() + step(), ...
struct Tiles {
  int64_t per_row, count, tile, seq;

  __device__ __forceinline__ explicit Tiles(const CausalConv1dInputs &p)
      : per_row((p.seq + p.tile - 1) / p.tile), count(p.batch * per_row), tile(p.tile), seq(p.seq) {}
  static __device__ __forceinline__ int64_t first() { return (int64_t)blockIdx.y * blockDim.y + threadIdx.y; }
  static __device__ __forceinline__ int64_t step() { return (int64_t)gridDim.y * blockDim.y; }
  __device__ __forceinline__ int64_t row(int64_t i) const { return i / per_row; }
  __device__ __forceinline__ int64_t begin(int64_t i) const { return i % per_row * tile; }
  __device__ __forceinline__ int64_t end(int64_t i) const { return min(begin(i) + tile, seq); }
};

template <class X, class W, int V> __device__ __forceinline__ void forward(const CausalConv1dForward &f) {
  const CausalConv1dInputs &p = f.inputs;
  const int64_t c = ((int64_t)blockIdx.x * blockDim.x + threadIdx.x) * V;
  if (c >= p.channels) return;
  const Taps<W, V> taps(p, c);
  Sequences seqs{p.cu_seqlens, p.sequences + 1, p.cu_int64 != 0, p.seq};
  const Tiles tiles(p);
  for (int64_t i = Tiles::first(); i < tiles.count; i += Tiles::step()) {
    const int64_t b = tiles.row(i), t0 = tiles.begin(i), t1 = tiles.end(i);
    const X *x = static_cast<const X *>(p.x) + b * p.x_batch_stride + c;
    X *y = static_cast<X *>(f.y) + b * p.seq * p.channels + c;
    Window<X, V> win;
    win.open(x, p.x_seq_stride, t0, seqs.seek(t0), p.width);
    for (int64_t s = t0; s < t1; s += AHEAD) {
      Pack<X, V> in[AHEAD];
#pragma unroll
      for (int u = 0; u < AHEAD; ++u)
        if (s + u < t1) in[u] = load<V>(x + (s + u) * p.x_seq_stride);
#pragma unroll
      for (int u = 0; u < AHEAD; ++u) {
        const int64_t t = s + u;
        if (t >= t1) break;
        if (seqs.starts(t)) win.clear();
        win.x[0] = in[u];
        float o[V];
#pragma unroll
        for (int j = 0; j < V; ++j) {
          const float pre = taps.pre(win, j);
          o[j] = p.silu ? pre * sigmoid(pre) : pre;
        }
        store<V>(y + t * p.channels, o);
        win.advance();
      }
    }
  }
}

template <class X, class W, int V> __device__ __forceinline__ void backward(const CausalConv1dBackward &g) {
  static_assert(V <= CAUSAL_CONV1D_BACKWARD_VEC);
  const CausalConv1dInputs &p = g.inputs;
  const int64_t c = ((int64_t)blockIdx.x * blockDim.x + threadIdx.x) * V;
  const bool live = c < p.channels;
  const int width = p.width;
  // sums[k]: the weight gradient of the tap k tokens back over this thread's tiles; sums[MAX_W]: the bias's.
  float sums[MAX_W + 1][V];
#pragma unroll
  for (int k = 0; k <= MAX_W; ++k)
#pragma unroll
    for (int j = 0; j < V; ++j) sums[k][j] = 0.f;

  if (live) {
    const Taps<W, V> taps(p, c);
    Sequences seqs{p.cu_seqlens, p.sequences + 1, p.cu_int64 != 0, p.seq};
    const Tiles tiles(p);
    for (int64_t i = Tiles::first(); i < tiles.count; i += Tiles::step()) {
      const int64_t b = tiles.row(i), t0 = tiles.begin(i), t1 = tiles.end(i);
      const X *x = static_cast<const X *>(p.x) + b * p.x_batch_stride + c;
      const X *dy = static_cast<const X *>(g.grad_y) + b * g.grad_y_batch_stride + c;
      X *dx = static_cast<X *>(g.grad_x) + b * p.seq * p.channels + c;
      const int64_t end = min(t1 + width - 1, p.seq);  // the walk: the tile, and the dpre its dx need
      int before = seqs.seek(t0);
      Window<X, V> win;
      win.open(x, p.x_seq_stride, t0, before, width);
      // pending[k]: dx so far of the token k back from the one walked.
      float pending[MAX_W][V];
#pragma unroll
      for (int k = 0; k < MAX_W; ++k)
#pragma unroll
        for (int j = 0; j < V; ++j) pending[k][j] = 0.f;
      for (int64_t s = t0; s < end; s += AHEAD) {
        Pack<X, V> in[AHEAD], gy[AHEAD];
#pragma unroll
        for (int u = 0; u < AHEAD; ++u)
          if (s + u < end) {
            in[u] = load<V>(x + (s + u) * p.x_seq_stride);
            gy[u] = load<V>(dy + (s + u) * g.grad_y_seq_stride);
          }
#pragma unroll
        for (int u = 0; u < AHEAD; ++u) {
          const int64_t t = s + u;
          if (t >= end) break;
          if (seqs.starts(t)) {
            before = 0;
            win.clear();
          } else if (t > t0) {
            before = min(before + 1, MAX_W - 1);
          }
          win.x[0] = in[u];
          float dpre[V];
#pragma unroll
          for (int j = 0; j < V; ++j) {
            const float pre = taps.pre(win, j), dyj = to_f32(gy[u].v[j]);
            if (p.silu) {
              const float sg = sigmoid(pre);
              dpre[j] = dyj * (sg * (1.f + pre * (1.f - sg)));
            } else {
              dpre[j] = dyj;
            }
          }
          if (t < t1)  // the tokens past the tile are the next tile's to sum
#pragma unroll
            for (int j = 0; j < V; ++j) {
              sums[MAX_W][j] += dpre[j];
#pragma unroll
              for (int k = 0; k < MAX_W; ++k)
                if (k < width) sums[k][j] += dpre[j] * win(k, j);
            }
#pragma unroll
          for (int k = MAX_W - 1; k > 0; --k)
#pragma unroll
            for (int j = 0; j < V; ++j) pending[k][j] = pending[k - 1][j];
          // dpre[t] reaches the dx of t - k for the taps that stay in t's sequence.
#pragma unroll
          for (int j = 0; j < V; ++j) pending[0][j] = taps.wk[0][j] * dpre[j];
#pragma unroll
          for (int k = 1; k < MAX_W; ++k)
            if (k < width && k <= before)
#pragma unroll
              for (int j = 0; j < V; ++j) pending[k][j] += taps.wk[k][j] * dpre[j];
          // No later token reaches t - (MAX_W - 1).
          if (t - (MAX_W - 1) >= t0) store<V>(dx + (t - (MAX_W - 1)) * p.channels, pending[MAX_W - 1]);
          win.advance();
        }
      }
      // The tile's last tokens, complete: the walk went W - 1 past them, or to the row's end.
#pragma unroll
      for (int k = 0; k < MAX_W - 1; ++k) {
        const int64_t t = end - 1 - k;
        if (t >= t0 && t < t1) store<V>(dx + t * p.channels, pending[k]);
      }
    }
  }

  // Fold the block's rows in shared memory, one sum at a time, into partial row blockIdx.y.
  __shared__ float fold[CAUSAL_CONV1D_BACKWARD_VEC][CAUSAL_CONV1D_BLOCK];
  const int lane = threadIdx.x, slot = threadIdx.y * blockDim.x + threadIdx.x;
  float *w_part = g.partial + (int64_t)blockIdx.y * p.channels * width;
  float *b_part = g.partial + g.partials * p.channels * width + (int64_t)blockIdx.y * p.channels;
#pragma unroll
  for (int k = 0; k <= MAX_W; ++k) {
    if (k < MAX_W && k >= width) continue;  // uniform: no barrier is skipped by part of the block
#pragma unroll
    for (int j = 0; j < V; ++j) fold[j][slot] = sums[k][j];
    __syncthreads();
    if (threadIdx.y == 0 && live)
#pragma unroll
      for (int j = 0; j < V; ++j) {
        float s = 0.f;
        for (int r = 0; r < (int)blockDim.y; ++r) s += fold[j][r * blockDim.x + lane];
        if (k < MAX_W) w_part[(c + j) * width + width - 1 - k] = s;
        else b_part[c + j] = s;
      }
    __syncthreads();
  }
}

template <class W> __device__ __forceinline__ void fold_partials(const CausalConv1dBackward &g) {
  const int64_t taps = g.inputs.channels * g.inputs.width;
  if (blockIdx.y == 0) column_sum<W>(g.partial, g.partials, taps, static_cast<W *>(g.grad_weight));
  else column_sum<W>(g.partial + g.partials * taps, g.partials, g.inputs.channels, static_cast<W *>(g.grad_bias));
}

}  // namespace

// Channels a vector access takes (include/causal_conv1d.h).
#define WIDTH_vec(dir, X) VEC_##dir(X)
#define WIDTH_scalar(dir, X) 1
#define VEC_fwd(X) 16 / sizeof(X)
#define VEC_bwd(X) (16 / sizeof(X) < CAUSAL_CONV1D_BACKWARD_VEC ? 16 / sizeof(X) : CAUSAL_CONV1D_BACKWARD_VEC)
#define PARAMS_fwd CausalConv1dForward
#define PARAMS_bwd CausalConv1dBackward
#define RUN_fwd forward
#define RUN_bwd backward

#define KERNEL(dir, x, w, access)                                                                     \
  extern "C" __global__ void __launch_bounds__(CAUSAL_CONV1D_BLOCK)                                   \
      causal_conv1d_##dir##_##x##_##w##_##access(const PARAMS_##dir p) {                              \
    RUN_##dir<BASTILE_TYPE_##x, BASTILE_TYPE_##w, WIDTH_##access(dir, BASTILE_TYPE_##x)>(p);             \
  }
// The fold's grid: blockIdx.y 0 takes the weight gradient's columns, 1 the bias gradient's.
#define REDUCE(dir, reduce, w)                                                                        \
  extern "C" __global__ void causal_conv1d_##dir##_##reduce##_##w(const CausalConv1dBackward p) {     \
    fold_partials<BASTILE_TYPE_##w>(p);                                                               \
  }
CAUSAL_CONV1D_FORWARD_KERNELS(KERNEL)
CAUSAL_CONV1D_BACKWARD_KERNELS(KERNEL, REDUCE)
