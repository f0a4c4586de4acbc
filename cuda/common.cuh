// Helpers every kernel family uses: element conversion, vector access, group reductions.
#pragma once
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <stdint.h>

#include "bastile.h"

namespace bastile {

using bf16 = __nv_bfloat16;
using f16 = __half;

__device__ __forceinline__ float to_f32(float v) { return v; }
__device__ __forceinline__ float to_f32(f16 v) { return __half2float(v); }
__device__ __forceinline__ float to_f32(bf16 v) { return __bfloat162float(v); }

template <class T> __device__ __forceinline__ T from_f32(float v);
template <> __device__ __forceinline__ float from_f32<float>(float v) { return v; }
template <> __device__ __forceinline__ f16 from_f32<f16>(float v) { return __float2half_rn(v); }
template <> __device__ __forceinline__ bf16 from_f32<bf16>(float v) { return __float2bfloat16_rn(v); }

// Rounds through T, as torch does when it stores an intermediate in T.
template <class T> __device__ __forceinline__ float round_to(float v) { return to_f32(from_f32<T>(v)); }

// torch.result_type for two floating types: equal types stay, any other pair widens to f32.
template <class A, class B> struct Promote { using type = float; };
template <class A> struct Promote<A, A> { using type = A; };

template <class T, int N> struct alignas(sizeof(T) * N) Pack { T v[N]; };

// N consecutive elements at p, aligned to N elements. Kept packed in registers (half the registers
// of f32 for 16-bit types) and widened with to_f32 where used.
template <int N, class T> __device__ __forceinline__ Pack<T, N> load(const T *p) {
  return *reinterpret_cast<const Pack<T, N> *>(p);
}

// Hides pk's value from the optimiser, so that elements are widened again where they are used next
// instead of widened copies staying live in registers (which halves the rows a kernel keeps in flight).
template <int N, class T> __device__ __forceinline__ void opaque(Pack<T, N> &pk) {
  static_assert(sizeof(pk) % 4 == 0, "packs are whole 32-bit words");
  uint32_t *words = reinterpret_cast<uint32_t *>(&pk);
#pragma unroll
  for (int i = 0; i < (int)(sizeof(pk) / 4); ++i) asm volatile("" : "+r"(words[i]));
}

template <int N, class T> __device__ __forceinline__ void store(T *p, const float (&in)[N]) {
  Pack<T, N> pk;
#pragma unroll
  for (int i = 0; i < N; ++i) pk.v[i] = from_f32<T>(in[i]);
  *reinterpret_cast<Pack<T, N> *>(p) = pk;
}

// Sum of v over the `group` consecutive threads that share a row. group is a power of two below 32,
// or a multiple of 32 (then the block holds blockDim.x / group such rows). Every thread of the block
// must call it: it synchronises when a row spans several warps.
__device__ __forceinline__ float group_sum(float v, int group) {
  const int width = group < 32 ? group : 32;
  // Unrolled with a uniform predicate: a loop here sat on every row's critical path.
#pragma unroll
  for (int o = 16; o > 0; o /= 2)
    if (o < width) v += __shfl_xor_sync(0xffffffffu, v, o, width);
  if (group <= 32) return v;
  __shared__ float warp_total[32];
  const int warp = threadIdx.x / 32, warps_per_row = group / 32;
  if (threadIdx.x % 32 == 0) warp_total[warp] = v;
  __syncthreads();
  const int first = warp - warp % warps_per_row;
  float s = 0.f;
  for (int i = 0; i < warps_per_row; ++i) s += warp_total[first + i];
  __syncthreads();  // warp_total is reused by the next call
  return s;
}

// out[c] = sum over p of partial[p][c], for the per-block partial sums of a column reduction.
// Block (32, 8): 32 columns, 8 partial rows at a time, folded in shared memory.
template <class W>
__device__ __forceinline__ void column_sum(const float *partial, int64_t partials, int64_t cols, W *out) {
  __shared__ float fold[8][33];
  const int64_t c = (int64_t)blockIdx.x * 32 + threadIdx.x;
  float s = 0.f;
  if (c < cols)
    for (int64_t p = threadIdx.y; p < partials; p += 8) s += partial[p * cols + c];
  fold[threadIdx.y][threadIdx.x] = s;
  __syncthreads();
  if (threadIdx.y == 0 && c < cols) {
#pragma unroll
    for (int i = 1; i < 8; ++i) s += fold[i][threadIdx.x];
    out[c] = from_f32<W>(s);
  }
}

}  // namespace bastile
