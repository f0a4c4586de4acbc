// A mixture of experts' pairs joined into their tokens and the gradient sent back (include/expert_combine.h):
// memory-bound passes in which `group` threads share a row, each taking its vectors l, l + group, ...; a token's
// k rows are summed side by side in registers, so the result is the same on every run.
#include "elementwise.cuh"
#include "expert_combine.h"

using namespace bastile;

namespace {

constexpr int BLOCK = EXPERT_COMBINE_BLOCK;

__device__ __forceinline__ int64_t checked(int64_t i, int64_t n, const char *what) {
  return checked_index(i, n, "expert_combine", what);
}

template <class T, class W, int V> __device__ __forceinline__ void forward(const ExpertCombineForward &p) {
  using P = typename Promote<T, W>::type;
  const T *__restrict__ rows = static_cast<const T *>(p.rows);
  const W *weights = static_cast<const W *>(p.weights);
  P *__restrict__ out = static_cast<P *>(p.out);
  const int lane = threadIdx.x % p.group;
  const int64_t pairs = p.tokens * p.k, vectors = p.dim / V;
  FOR_EACH_ROW_GROUP(base, p.tokens, BLOCK / p.group) {
    const int64_t t = base + threadIdx.x / p.group;
    if (t >= p.tokens) continue;
    for (int64_t c = lane; c < vectors; c += p.group) {
      float acc[V] = {};
#pragma unroll 4
      for (int64_t j = 0; j < p.k; ++j) {
        const int64_t pair = t * p.k + j, r = checked(p.position[pair], pairs, "position");
        const Pack<T, V> x = load_nc<V>(rows + r * p.dim + c * V);
        if (weights == nullptr) {
#pragma unroll
          for (int i = 0; i < V; ++i) acc[i] += to_f32(x.v[i]);
        } else {
          const float w = to_f32(weights[pair]);
          // __fmul_rn: the product is rounded to P before the sum, as torch rounds it (never fused into an FMA).
#pragma unroll
          for (int i = 0; i < V; ++i) acc[i] += round_to<P>(__fmul_rn(w, to_f32(x.v[i])));
        }
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

}  // namespace

#define KERNEL(dir, t, w, access)                                                                              \
  extern "C" __global__ void __launch_bounds__(BLOCK) expert_combine_##dir##_##t##_##w##_##access(             \
      const BASTILE_CAT(ExpertCombine, DIR_##dir) p) {                                                         \
    RUN_##dir<BASTILE_TYPE_##t, BASTILE_TYPE_##w, BASTILE_WIDTH_##access(BASTILE_TYPE_##t)>(p);                \
  }
#define DIR_fwd Forward
#define DIR_bwd Backward
#define RUN_fwd forward
#define RUN_bwd backward
EXPERT_COMBINE_FORWARD_KERNELS(KERNEL)
EXPERT_COMBINE_BACKWARD_KERNELS(KERNEL)
