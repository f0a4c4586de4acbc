// Helpers of the flat elementwise kernels (swiglu, geglu): memory-bound, so each thread loads U
// 16-byte vectors of every input before it computes and stores any (bytes in flight), in a
// grid-stride loop with 64-bit indices; the last n % V elements take scalar accesses. Where a sum
// over each row is wanted too, a warp takes a row (for_each_row).
#pragma once
#include "common.cuh"

namespace bastile {

// 1 / (1 + e^-x) in two MUFU instructions, as Triton's exp and division compile: a few f32 ulps off,
// far below the 16-bit rounding that follows. Flushing denormals saturates it to exactly 1 for
// x > 87 and 0 for x < -87; inf and NaN propagate as in torch.
__device__ __forceinline__ float sigmoid(float x) {
  float e, s;
  asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(e) : "f"(x * -1.44269504088896341f));
  asm("rcp.approx.ftz.f32 %0, %1;" : "=f"(s) : "f"(1.f + e));
  return s;
}

// The gate activations of the gated MLPs (swiglu.h's SWIGLU_*): SiLU, g * sig(g), or GELU with the tanh
// approximation, g/2 * (1 + tanh(b * (g + k g^3))), b = sqrt(2/pi), k = 0.044715; in f32.
constexpr float kGeluBeta = 0.7978845608028654f;
constexpr float kGeluKappa = 0.044715f;
__device__ __forceinline__ float gate_act(float g, bool gelu_tanh) {
  if (gelu_tanh) return 0.5f * g * (1.f + tanhf(kGeluBeta * (g + kGeluKappa * (g * g * g))));
  return g * sigmoid(g);
}

// A vector through the read-only (non-coherent) path: the inputs never alias the fresh outputs.
// keep_packed's barriers would otherwise stop the compiler from proving that by itself.
template <int V, class T> __device__ __forceinline__ Pack<T, V> load_nc(const T *p) {
  if constexpr (sizeof(Pack<T, V>) == 16) {
    const uint4 w = __ldg(reinterpret_cast<const uint4 *>(p));
    return *reinterpret_cast<const Pack<T, V> *>(&w);
  } else {
    return load<V>(p);
  }
}

// Visits the n / V vectors of a flat range, U per thread per grid-stride step: load(k, i) for every
// k before finish(k, i) for any, so that all of a thread's loads are in flight at once.
template <int V, int U, class Load, class Finish>
__device__ __forceinline__ void for_each_vector(int64_t n, Load load, Finish finish) {
  const int64_t nvec = n / V, step = (int64_t)gridDim.x * blockDim.x * U;
  for (int64_t base = (int64_t)blockIdx.x * blockDim.x * U + threadIdx.x; base < nvec; base += step) {
#pragma unroll
    for (int k = 0; k < U; ++k)
      if (base + k * blockDim.x < nvec) load(k, base + k * blockDim.x);
#pragma unroll
    for (int k = 0; k < U; ++k)
      if (base + k * blockDim.x < nvec) finish(k, base + k * blockDim.x);
  }
}

// Visits the vectors of rows of `cols` elements, cols a multiple of V: one warp a row in a grid-stride loop over
// rows, U vectors a lane per step, load(k, i) for every k before finish(k, i) for any (i a vector's index in the
// flat range). finish returns its vector's share of a row's sum, which done(row, sum) gets on lane 0, summed in
// an order fixed by the shape (deterministic, no atomics).
template <int V, int U, class Load, class Finish, class Done>
__device__ __forceinline__ void for_each_row(int64_t n, int64_t cols, Load load, Finish finish, Done done) {
  const int lane = threadIdx.x % 32;
  const int64_t rows = n / cols, per_row = cols / V, warps = (int64_t)gridDim.x * (blockDim.x / 32);
  for (int64_t r = ((int64_t)blockIdx.x * blockDim.x + threadIdx.x) / 32; r < rows; r += warps) {
    float sum = 0.f;
    for (int64_t c = lane; c < per_row; c += 32 * U) {
#pragma unroll
      for (int k = 0; k < U; ++k)
        if (c + k * 32 < per_row) load(k, r * per_row + c + k * 32);
#pragma unroll
      for (int k = 0; k < U; ++k)
        if (c + k * 32 < per_row) sum += finish(k, r * per_row + c + k * 32);
    }
    sum = warp_group_sum(sum, 32);
    if (lane == 0) done(r, sum);
  }
}

// A backward's visit: where `dot` is set, by rows (for_each_row), each row's sum of finish's values into dot[row];
// else flat (for_each_vector). finish(kDot, k, i) gets kDot as std::true_type or std::false_type. Whether it went by
// rows: a flat visit leaves the elements past the last vector (tail_index) to the caller.
template <int V, int U, class Load, class Finish>
__device__ __forceinline__ bool for_each_vector_or_row(int64_t n, int64_t cols, void *dot, Load load, Finish finish) {
  if (dot != nullptr) {
    float *__restrict__ out = static_cast<float *>(dot);
    for_each_row<V, U>(
        n, cols, load, [&](int k, int64_t i) { return finish(std::true_type{}, k, i); },
        [&](int64_t r, float sum) { out[r] = sum; });
    return true;
  }
  for_each_vector<V, U>(n, load, [&](int k, int64_t i) { finish(std::false_type{}, k, i); });
  return false;
}

// Widens loaded vectors where they are used, not right after the load: bf16 would otherwise be
// unpacked early into twice the registers, which cuts the blocks an SM holds.
template <class... P> __device__ __forceinline__ void keep_packed(P &...pk) {
  if constexpr (((sizeof(P) % 4 == 0) && ...)) (opaque(pk), ...);
}

// Index of the element past the vectors that this thread finishes, or -1: the first n % V threads
// of the grid take one each.
template <int V> __device__ __forceinline__ int64_t tail_index(int64_t n) {
  const int64_t t = (int64_t)blockIdx.x * blockDim.x + threadIdx.x, first = n / V * V;
  return t < n - first ? first + t : -1;
}

}  // namespace bastile

// The kernel of an elementwise list's K(dir, dtype, access) (include/bastile.h), named op_dir_dtype_access:
// the including file's fn<T, V>(p) for a parameter block Params, at most BLOCK threads a block.
#define ELEMENTWISE_KERNEL(op, BLOCK, Params, fn, dir, dt, access)                                  \
  extern "C" __global__ void __launch_bounds__(BLOCK) op##_##dir##_##dt##_##access(const Params p) { \
    fn<BASTILE_TYPE_##dt, BASTILE_WIDTH_##access(BASTILE_TYPE_##dt)>(p);                           \
  }
