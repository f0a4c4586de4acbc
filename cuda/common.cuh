// Helpers every op's kernels use: element conversion, vector access, group reductions.
#pragma once
#include <cstdio>
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <stdint.h>

#include <type_traits>

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

// An index from the caller's tensor: one outside 0..n stops the kernel, as torch's indexing does, rather than
// read or write outside the tensor it indexes.
__device__ __forceinline__ int64_t checked_index(int64_t i, int64_t n, const char *op, const char *what) {
  if (i < 0 || i >= n) {
    printf("bastile.%s: %s holds %lld, outside 0..%lld\n", op, what, (long long)i, (long long)n);
    __trap();
  }
  return i;
}

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

// Element pair (2i, 2i + 1) of a pack of 16-bit values as one bf16x2/half2 register, for packed math.
// Where torch computes in f32 and rounds to the 16-bit dtype, the packed op gives the same value when
// the f32 result is exact or rounds only bits the 16-bit rounding drops anyway: the product or the
// sum/difference of two 16-bit values (the _rn forms keep the compiler from fusing them into FMAs).
template <class T> struct PairOf;
template <> struct PairOf<bf16> { using type = __nv_bfloat162; };
template <> struct PairOf<f16> { using type = __half2; };
template <class T> using pair_t = typename PairOf<T>::type;

template <class T, int N> __device__ __forceinline__ pair_t<T> &pair(Pack<T, N> &pk, int i) {
  return reinterpret_cast<pair_t<T> *>(pk.v)[i];
}
template <class T, int N> __device__ __forceinline__ const pair_t<T> &pair(const Pack<T, N> &pk, int i) {
  return reinterpret_cast<const pair_t<T> *>(pk.v)[i];
}

// (a, b) rounded to T.
template <class T> __device__ __forceinline__ pair_t<T> to_pair(float a, float b);
template <> __device__ __forceinline__ __nv_bfloat162 to_pair<bf16>(float a, float b) { return __floats2bfloat162_rn(a, b); }
template <> __device__ __forceinline__ __half2 to_pair<f16>(float a, float b) { return __floats2half2_rn(a, b); }

// Whether packed math on pairs applies to these dtypes: all one 16-bit type.
template <class T, class... U> constexpr bool kPairable = sizeof(T) == 2 && (std::is_same_v<T, U> && ...);

// A 16-byte pack that is read once: fetched into L2 256 bytes at a time, not kept in L1. Short rows
// (a few hundred bytes a thread group) gain from the wider L2 fetch.
template <int N, class T> __device__ __forceinline__ Pack<T, N> load_once(const T *p) {
  static_assert(sizeof(Pack<T, N>) == 16, "16-byte packs only");
  Pack<T, N> pk;
  uint32_t *w = reinterpret_cast<uint32_t *>(&pk);
  asm volatile("ld.global.nc.L1::no_allocate.L2::256B.v4.u32 {%0, %1, %2, %3}, [%4];"
               : "=r"(w[0]), "=r"(w[1]), "=r"(w[2]), "=r"(w[3])
               : "l"(p));
  return pk;
}

template <int N, class T> __device__ __forceinline__ void store(T *p, const float (&in)[N]) {
  Pack<T, N> pk;
#pragma unroll
  for (int i = 0; i < N; ++i) pk.v[i] = from_f32<T>(in[i]);
  *reinterpret_cast<Pack<T, N> *>(p) = pk;
}

// Stores pk as one access. A plain struct copy came out as 2- or 4-byte stores for the second pack
// of a thread (nvcc 13.0), which halves the store throughput.
template <class T, int V> __device__ __forceinline__ void store_pack(T *p, const Pack<T, V> &pk) {
  uint32_t w[(sizeof(pk) + 3) / 4] = {};
  memcpy(w, &pk, sizeof(pk));
  if constexpr (sizeof(pk) == 16)
    asm volatile("st.global.v4.b32 [%0], {%1, %2, %3, %4};" ::"l"(p), "r"(w[0]), "r"(w[1]), "r"(w[2]), "r"(w[3]) : "memory");
  else if constexpr (sizeof(pk) == 8)
    asm volatile("st.global.v2.b32 [%0], {%1, %2};" ::"l"(p), "r"(w[0]), "r"(w[1]) : "memory");
  else
    *reinterpret_cast<Pack<T, V> *>(p) = pk;
}

// Sum of v over the `group` consecutive threads of a warp that share a row; group is a power of two
// up to 32.
__device__ __forceinline__ float warp_group_sum(float v, int group) {
  // Unrolled with a uniform predicate: a loop here sat on every row's critical path.
#pragma unroll
  for (int o = 16; o > 0; o /= 2)
    if (o < group) v += __shfl_xor_sync(0xffffffffu, v, o, group);
  return v;
}

// Sum of v over the `group` consecutive threads that share a row. group is a power of two below 32,
// or a multiple of 32 (then the block holds blockDim.x / group such rows). Every thread of the block
// must call it: it synchronises when a row spans several warps.
__device__ __forceinline__ float group_sum(float v, int group) {
  v = warp_group_sum(v, group < 32 ? group : 32);
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
// Block (32, BASTILE_FOLD_ROWS): 32 columns, that many partial rows at a time, each thread keeping four
// loads in flight; folded in shared memory. (Few blocks run it: a wave's worth of partials is read by
// ceil(cols / 32) blocks, so each needs many loads in flight.)
template <class W>
__device__ __forceinline__ void column_sum(const float *partial, int64_t partials, int64_t cols, W *out) {
  constexpr int R = BASTILE_FOLD_ROWS;
  __shared__ float fold[R][33];
  const int64_t c = (int64_t)blockIdx.x * 32 + threadIdx.x;
  float s[4] = {0.f, 0.f, 0.f, 0.f};
  if (c < cols) {
    int64_t p = threadIdx.y;
    for (; p + 3 * R < partials; p += 4 * R)
#pragma unroll
      for (int i = 0; i < 4; ++i) s[i] += partial[(p + i * R) * cols + c];
    for (; p < partials; p += R) s[0] += partial[p * cols + c];
  }
  fold[threadIdx.y][threadIdx.x] = (s[0] + s[1]) + (s[2] + s[3]);
  __syncthreads();
  if (threadIdx.y == 0 && c < cols) {
    float t = fold[0][threadIdx.x];
#pragma unroll
    for (int i = 1; i < R; ++i) t += fold[i][threadIdx.x];
    out[c] = from_f32<W>(t);
  }
}

}  // namespace bastile

// Rows (or groups of rows) a block takes in turn, grid-stride: base runs over multiples of `per_block` below
// `rows`. The bound is uniform across the block, so every thread reaches the reductions in the body.
#define FOR_EACH_ROW_GROUP(base, rows, per_block) \
  for (int64_t base = (int64_t)blockIdx.x * (per_block); base < (rows); base += (int64_t)gridDim.x * (per_block))

// Template arguments of the dtype and access tags of the kernel lists (include/bastile.h).
#define BASTILE_TYPE_f32 float
#define BASTILE_TYPE_f16 bastile::f16
#define BASTILE_TYPE_bf16 bastile::bf16
#define BASTILE_WIDTH_vec(T) 16 / sizeof(T)
#define BASTILE_WIDTH_scalar(T) 1

// Pastes a and b after expanding them: a kernel name whose last tag may be empty.
#define BASTILE_CAT_(a, b) a##b
#define BASTILE_CAT(a, b) BASTILE_CAT_(a, b)
