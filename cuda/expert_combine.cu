// A mixture of experts' pairs joined into their tokens and the gradient sent back (include/expert_combine.h):
// memory-bound passes in which `group` threads share a row, each taking its vectors l, l + group, ...; a token's
// k rows are summed side by side in registers, so the result is the same on every run. And the pairs grouped by
// expert before: a counting sort of three launches, each expert's count in shared memory.
#include "elementwise.cuh"
#include "expert_combine.h"

using namespace bastile;

namespace {

constexpr int BLOCK = EXPERT_COMBINE_BLOCK;

__device__ __forceinline__ int64_t checked(int64_t i, int64_t n, const char *what) {
  return checked_index(i, n, "expert_combine", what);
}

// One pair's row (plus its expert's bias where `biased`) into acc, times its weight w where `weighted`.
template <class T, class P, int V>
__device__ __forceinline__ void add_pair(float (&acc)[V], const Pack<T, V> &row, const Pack<T, V> &b, bool biased,
                                         bool weighted, float w) {
  float x[V];
#pragma unroll
  for (int i = 0; i < V; ++i) x[i] = biased ? round_to<T>(to_f32(row.v[i]) + to_f32(b.v[i])) : to_f32(row.v[i]);
  // __fmul_rn: the product is rounded to P before the sum, as torch rounds it (never fused into an FMA).
#pragma unroll
  for (int i = 0; i < V; ++i) acc[i] += weighted ? round_to<P>(__fmul_rn(w, x[i])) : x[i];
}

// Pairs a token's lanes hold found (their rows, biases and weights in registers) before reading any vector: the
// k <= H rows (and biases) of each vector are then loaded side by side, not each after its index. Larger k: one
// by one.
template <class T, class W, int V, int H, bool kBias>
__device__ __forceinline__ void forward(const ExpertCombineForward &p) {
  using P = typename Promote<T, W>::type;
  const T *__restrict__ rows = static_cast<const T *>(p.rows);
  const T *__restrict__ bias = static_cast<const T *>(p.bias);
  const W *weights = static_cast<const W *>(p.weights);
  P *__restrict__ out = static_cast<P *>(p.out);
  const int lane = threadIdx.x % p.group;
  const bool weighted = weights != nullptr;
  const int64_t pairs = p.tokens * p.k, vectors = p.dim / V;
  // pair's row and bias (as row-start pointers) and weight
  const auto row_of = [&](int64_t pair) { return rows + checked(p.position[pair], pairs, "position") * p.dim; };
  const auto bias_of = [&](int64_t pair) { return bias + checked(p.expert[pair], p.experts, "expert") * p.dim; };
  const auto weight_of = [&](int64_t pair) { return weighted ? to_f32(weights[pair]) : 1.f; };
  FOR_EACH_ROW_GROUP(base, p.tokens, BLOCK / p.group) {
    const int64_t t = base + threadIdx.x / p.group;
    if (t >= p.tokens) continue;
    if (p.k <= H) {
      const T *src[H], *add[H];
      float w[H];
#pragma unroll
      for (int j = 0; j < H; ++j)
        if (j < p.k) {
          src[j] = row_of(t * p.k + j), w[j] = weight_of(t * p.k + j);
          if constexpr (kBias) add[j] = bias_of(t * p.k + j);
        }
      for (int64_t c = lane; c < vectors; c += p.group) {
        Pack<T, V> x[H], b[H];
#pragma unroll
        for (int j = 0; j < H; ++j)
          if (j < p.k) {
            x[j] = load_nc<V>(src[j] + c * V);
            if constexpr (kBias) b[j] = load_nc<V>(add[j] + c * V);
          }
        float acc[V] = {};
#pragma unroll
        for (int j = 0; j < H; ++j)
          if (j < p.k) add_pair<T, P, V>(acc, x[j], b[j], kBias, weighted, w[j]);
        store<V>(out + t * p.dim + c * V, acc);
      }
      continue;
    }
    for (int64_t c = lane; c < vectors; c += p.group) {
      float acc[V] = {};
#pragma unroll 4
      for (int64_t j = 0; j < p.k; ++j) {
        const int64_t pair = t * p.k + j;
        Pack<T, V> b;
        if constexpr (kBias) b = load_nc<V>(bias_of(pair) + c * V);
        add_pair<T, P, V>(acc, load_nc<V>(row_of(pair) + c * V), b, kBias, weighted, weight_of(pair));
      }
      store<V>(out + t * p.dim + c * V, acc);
    }
  }
}

template <class T, class W, int V> __device__ __forceinline__ void backward(const ExpertCombineBackward &p) {
  using P = typename Promote<T, W>::type;
  const P *__restrict__ grad = static_cast<const P *>(p.grad);
  const T *__restrict__ rows = static_cast<const T *>(p.rows);
  const W *weights = static_cast<const W *>(p.weights);
  T *__restrict__ grad_rows = static_cast<T *>(p.grad_rows);
  W *grad_weights = static_cast<W *>(p.grad_weights);
  const int lane = threadIdx.x % p.group;
  const int64_t pairs = p.tokens * p.k, vectors = p.dim / V;
  // Rows past the last run the shuffles too (every lane of a warp must reach them), as not `real`.
  FOR_EACH_ROW_GROUP(base, pairs, BLOCK / p.group) {
    const int64_t r = base + threadIdx.x / p.group;
    const bool real = r < pairs;
    float d = 0.f;
    int64_t pair = 0;
    if (real) {
      pair = checked(p.order[r], pairs, "order");
      const float w = weights == nullptr ? 1.f : to_f32(weights[pair]);
      const P *g = grad + pair / p.k * p.dim;
      for (int64_t c = lane; c < vectors; c += p.group) {
        const Pack<P, V> gv = load_nc<V>(g + c * V);
        float y[V];
#pragma unroll
        for (int i = 0; i < V; ++i) y[i] = __fmul_rn(w, to_f32(gv.v[i]));
        store<V>(grad_rows + r * p.dim + c * V, y);
        if (rows != nullptr) {
          const Pack<T, V> x = load_nc<V>(rows + r * p.dim + c * V);
#pragma unroll
          for (int i = 0; i < V; ++i) d += to_f32(gv.v[i]) * to_f32(x.v[i]);
        }
      }
    }
    if (rows == nullptr) continue;
    d = warp_group_sum(d, p.group);
    if (real && lane == 0) grad_weights[pair] = from_f32<W>(d);
  }
}

// The grouping's per-expert counts and starts, in shared memory ([experts] int32).
__device__ __forceinline__ int32_t *expert_slots() {
  extern __shared__ int32_t expert_slots_raw[];
  return expert_slots_raw;
}

__device__ __forceinline__ int64_t span_end(const ExpertGroup &p) { return min((blockIdx.x + 1) * p.span, p.pairs); }

// Each block's count of each expert over its span of pairs.
__device__ __forceinline__ void group_count(const ExpertGroup &p) {
  int32_t *count = expert_slots();
  for (int64_t e = threadIdx.x; e < p.experts; e += BLOCK) count[e] = 0;
  __syncthreads();
  for (int64_t i = blockIdx.x * p.span + threadIdx.x; i < span_end(p); i += BLOCK)
    atomicAdd(&count[checked_index(p.chosen[i], p.experts, "expert_group", "chosen")], 1);
  __syncthreads();
  for (int64_t e = threadIdx.x; e < p.experts; e += BLOCK) p.counts[blockIdx.x * p.experts + e] = count[e];
}

// One block: each expert's total, their running sum (each thread a run of consecutive experts, the runs' sums
// scanned across the block) for the offsets and each expert's first row, then each span's first row of each expert
// in place of its count.
__device__ __forceinline__ void group_scan(const ExpertGroup &p) {
  int32_t *start = expert_slots();
  __shared__ int32_t warp_total[BLOCK / 32];
  for (int64_t e = threadIdx.x; e < p.experts; e += BLOCK) {
    int32_t total = 0;
#pragma unroll 8
    for (int b = 0; b < p.blocks; ++b) total += p.counts[b * p.experts + e];
    start[e] = total;
  }
  __syncthreads();
  const int64_t run = (p.experts + BLOCK - 1) / BLOCK, first = threadIdx.x * run, last = min(first + run, p.experts);
  int32_t mine = 0;
  for (int64_t e = first; e < last; ++e) mine += start[e];
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  int32_t upto = mine;  // the running sum over the warp's threads, this one's included
  for (int d = 1; d < 32; d *= 2) {
    const int32_t v = __shfl_up_sync(0xffffffffu, upto, d);
    if (lane >= d) upto += v;
  }
  if (lane == 31) warp_total[warp] = upto;
  __syncthreads();
  int32_t row = upto - mine;
  for (int w = 0; w < warp; ++w) row += warp_total[w];
  for (int64_t e = first; e < last; ++e) {
    const int32_t total = start[e];
    start[e] = row;
    row += total;
    p.offsets[e] = row;
  }
  __syncthreads();
  for (int64_t e = threadIdx.x; e < p.experts; e += BLOCK) {
    int32_t next = start[e];
    for (int b = 0; b < p.blocks; ++b) {
      const int32_t count = p.counts[b * p.experts + e];
      p.counts[b * p.experts + e] = next;
      next += count;
    }
  }
}

// Each pair's row: its span's next row of its expert plus the pairs of that expert before it in its warp; the warps
// of a block take their rows in turn, so the order within an expert is the pairs'.
__device__ __forceinline__ void group_scatter(const ExpertGroup &p) {
  int32_t *next = expert_slots();
  for (int64_t e = threadIdx.x; e < p.experts; e += BLOCK) next[e] = p.counts[blockIdx.x * p.experts + e];
  __syncthreads();
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  const int64_t end = span_end(p);
  for (int64_t i = blockIdx.x * p.span + threadIdx.x; i - threadIdx.x < end; i += BLOCK) {
    const bool real = i < end;
    const int64_t e = real ? p.chosen[i] : -1;
    const unsigned peers = __match_any_sync(0xffffffffu, static_cast<long long>(e));
    const int rank = __popc(peers & ((1u << lane) - 1));
    for (int w = 0; w < BLOCK / 32; ++w) {
      if (warp == w) {
        const int32_t row = real ? next[e] + rank : 0;
        __syncwarp();
        if (real) {
          if (rank == __popc(peers) - 1) next[e] = row + 1;
          p.order[row] = i;
          p.expert[row] = e;
          p.position[i] = row;
        }
      }
      __syncthreads();
    }
  }
}

}  // namespace

#define GROUP_KERNEL(group, step)                                                                          \
  extern "C" __global__ void __launch_bounds__(BLOCK) expert_combine_group_##step(const ExpertGroup p) { \
    group_##step(p);                                                                                      \
  }
EXPERT_GROUP_KERNELS(GROUP_KERNEL)

// A kernel of the lists (include/expert_combine.h): the forward's held and bias tags pick its template arguments
// and its blocks an SM. It holds its pairs' pointers and vectors in registers, and more blocks keep more loads in
// flight: two where their registers fit in half the SM's without many spills (H200: 1.1-1.6x the one-block kernel
// that held both kinds at once).
#define KERNEL(dir, t, w, access, held, bias)                                                                    \
  extern "C" __global__ void __launch_bounds__(BLOCK, BLOCKS_##dir##held##bias)                                 \
      BASTILE_CAT(expert_combine_##dir##_##t##_##w##_##access, SUFFIX_##held##bias)(                             \
          const BASTILE_CAT(ExpertCombine, DIR_##dir) p) {                                                       \
    RUN_##dir<BASTILE_TYPE_##t, BASTILE_TYPE_##w, BASTILE_WIDTH_##access(BASTILE_TYPE_##t) ARGS_##held##bias>(p); \
  }
#define DIR_fwd Forward
#define DIR_bwd Backward
#define RUN_fwd forward
#define RUN_bwd backward
#define SUFFIX_
#define ARGS_
#define BLOCKS_bwd 1
#define SUFFIX_held4plain _held4_plain
#define ARGS_held4plain , 4, false
#define BLOCKS_fwdheld4plain 2
#define SUFFIX_held4bias _held4_bias
#define ARGS_held4bias , 4, true
#define BLOCKS_fwdheld4bias 2
#define SUFFIX_held8plain _held8_plain
#define ARGS_held8plain , 8, false
#define BLOCKS_fwdheld8plain 2
#define SUFFIX_held8bias _held8_bias
#define ARGS_held8bias , 8, true
#define BLOCKS_fwdheld8bias 1
EXPERT_COMBINE_FORWARD_KERNELS(KERNEL)
EXPERT_COMBINE_BACKWARD_KERNELS(KERNEL)
