// Helpers of kernels that multiply f32 tiles on tensor cores (gated_delta_rule.cu's forward and backward): the
// m16n8k8 TF32 mma at f32's precision, its fragments, and asynchronous copies into shared memory.
#pragma once
#include "common.cuh"

namespace bastile {

// Products on tensor cores, in m16n8k8 mma: at f32's precision, each operand split into a TF32 part and the
// TF32 of what is left, the three products that matter summed (3xTF32). A lane holds, of a 16 x 8 tile of
// A, rows g and g + 8 at columns t and t + 4; of an 8 x 8 of B, rows t and t + 4 at column g; of the 16 x 8
// result, rows g and g + 8 at columns 2t and 2t + 1 (g = lane / 4, t = lane % 4).
struct Tf32 {
  uint32_t hi, lo;
};
// cvt.rn: one instruction on sm_90 (F2FP), where cvt.rna takes three.
__device__ __forceinline__ Tf32 tf32(float x) {
  uint32_t hi, lo;
  asm("cvt.rn.tf32.f32 %0, %1;" : "=r"(hi) : "f"(x));
  asm("cvt.rn.tf32.f32 %0, %1;" : "=r"(lo) : "f"(x - __uint_as_float(hi)));
  return {hi, lo};
}
struct FragA {
  Tf32 x[4];
};
struct FragB {
  Tf32 x[2];
};
// A's rows [r0, r0 + 16) and columns [k0, k0 + 8), a(r, k) its element.
template <class F> __device__ __forceinline__ FragA frag_a(F a, int r0, int k0) {
  const int g = threadIdx.x % 32 / 4, t = threadIdx.x % 4;
  return {{tf32(a(r0 + g, k0 + t)), tf32(a(r0 + g + 8, k0 + t)), tf32(a(r0 + g, k0 + t + 4)), tf32(a(r0 + g + 8, k0 + t + 4))}};
}
// B's rows [k0, k0 + 8) and columns [n0, n0 + 8), b(k, n) its element.
template <class F> __device__ __forceinline__ FragB frag_b(F b, int k0, int n0) {
  const int g = threadIdx.x % 32 / 4, t = threadIdx.x % 4;
  return {{tf32(b(k0 + t, n0 + g)), tf32(b(k0 + t + 4, n0 + g))}};
}
__device__ __forceinline__ void mma(float (&d)[4], uint32_t a0, uint32_t a1, uint32_t a2, uint32_t a3, uint32_t b0, uint32_t b1) {
  asm volatile("mma.sync.aligned.m16n8k8.row.col.f32.tf32.tf32.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, {%0, %1, %2, %3};"
               : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
               : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
}
// d += a b, for inputs of type T: bf16's carry 8 bits, fewer than TF32's 11, and take one product; f16's and
// f32's take three (the low parts unused by one are never computed).
template <class T> __device__ __forceinline__ void mma_add(float (&d)[4], const FragA &a, const FragB &b) {
  if constexpr (!std::is_same_v<T, bf16>) {
    mma(d, a.x[0].lo, a.x[1].lo, a.x[2].lo, a.x[3].lo, b.x[0].hi, b.x[1].hi);
    mma(d, a.x[0].hi, a.x[1].hi, a.x[2].hi, a.x[3].hi, b.x[0].lo, b.x[1].lo);
  }
  mma(d, a.x[0].hi, a.x[1].hi, a.x[2].hi, a.x[3].hi, b.x[0].hi, b.x[1].hi);
}
// Element e of a lane's share of a 16 x 8 result at (r0, n0): its row and column.
__device__ __forceinline__ int frag_row(int r0, int e) { return r0 + threadIdx.x % 32 / 4 + 8 * (e / 2); }
__device__ __forceinline__ int frag_col(int n0, int e) { return n0 + 2 * (threadIdx.x % 4) + e % 2; }
// The sum over the 4 lanes that hold a row of a result.
__device__ __forceinline__ float quad_sum(float v) {
  v += __shfl_xor_sync(0xffffffffu, v, 1);
  return v + __shfl_xor_sync(0xffffffffu, v, 2);
}

// Asynchronous copies into shared memory (cp.async): 16 bytes, or 16 or 4 (zeros where `valid` is false).
__device__ __forceinline__ void copy16(void *dst, const void *src) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16;" ::"r"((unsigned)__cvta_generic_to_shared(dst)), "l"(src));
}
__device__ __forceinline__ void copy16(void *dst, const void *src, bool valid) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;" ::"r"((unsigned)__cvta_generic_to_shared(dst)), "l"(src),
               "r"(valid ? 16 : 0));
}
__device__ __forceinline__ void copy4(void *dst, const void *src, bool valid) {
  asm volatile("cp.async.ca.shared.global [%0], [%1], 4, %2;" ::"r"((unsigned)__cvta_generic_to_shared(dst)), "l"(src),
               "r"(valid ? 4 : 0));
}
__device__ __forceinline__ void copies_sent() { asm volatile("cp.async.commit_group;"); }
// Waits for all but the last `pending` groups sent.
__device__ __forceinline__ void copies_landed(bool pending) {
  if (pending) asm volatile("cp.async.wait_group 1;");
  else asm volatile("cp.async.wait_group 0;");
}

}  // namespace bastile
