// bitsandbytes' 4-bit weights to a dense dtype T with bitsandbytes' arithmetic, so that the result equals
// its dequantize_4bit bit for bit:
//   scale_b = absmax[b], or with nested scales f32(f32(nested_code[absmax[b]] * nested_absmax[b / nb]) + offset)
//   w_i     = T(f32(code[q_i] * scale_(i / blocksize)))
// bitsandbytes dequantizes the nested scales into an f32 tensor and adds the offset in a second op, so the
// _rn intrinsics keep the two from being fused into one FMA.
//
// Memory-bound: half a byte read and sizeof(T) written per element. A `vec` unit is 8 elements (4 packed
// bytes in, one 16-byte store of bf16/f16 out), under one scale: Rust picks `vec` only where sizes and
// blocksizes are multiples of 8. Consecutive threads take consecutive units, so a warp's loads and stores
// are contiguous; each thread loads UNITS units (codes and scales) before it converts and stores any. The
// code tables, nested scale codes and offsets sit in shared memory. `scalar` units are single elements, for
// any size, blocksize or alignment. One grid-stride loop covers the parts in order, with 64-bit indices; the
// block is __grid_constant__, so a part is read where it lies in parameter space, by its index.
#include "common.cuh"
#include "dequantize_4bit.h"

using namespace bastile;

namespace {

constexpr int PARTS = DEQUANTIZE_4BIT_PARTS;
constexpr int UNITS = DEQUANTIZE_4BIT_UNITS;

struct Tables {
  float code[PARTS][16];
  float nested_code[PARTS][256];
  float offset[PARTS];
};

__device__ __forceinline__ void load_tables(const Dequantize4bit &p, Tables &t) {
  for (int i = threadIdx.x; i < p.count * 256; i += blockDim.x) {
    const int j = i / 256, k = i % 256;
    const Quantized4bit &q = p.parts[j];
    if (k < 16) t.code[j][k] = q.code[k];
    if (q.nested_absmax != nullptr) {
      t.nested_code[j][k] = q.nested_code[k];
      if (k == 0) t.offset[j] = *q.offset;
    }
  }
  __syncthreads();
}

__device__ __forceinline__ float scale(const Quantized4bit &q, const Tables &t, int j, int64_t block) {
  if (q.nested_absmax == nullptr) return static_cast<const float *>(q.absmax)[block];
  const uint8_t c = static_cast<const uint8_t *>(q.absmax)[block];
  return __fadd_rn(__fmul_rn(t.nested_code[j][c], q.nested_absmax[block / q.nested_blocksize]), t.offset[j]);
}

// E elements a unit: 8 for `vec`, 1 for `scalar`.
template <class T, int E> __device__ __forceinline__ void dequantize(const Dequantize4bit &p) {
  __shared__ Tables t;
  load_tables(p, t);
  int64_t units[PARTS], total = 0;
#pragma unroll
  for (int j = 0; j < PARTS; ++j) {
    units[j] = j < p.count ? (p.parts[j].n + E - 1) / E : 0;
    total += units[j];
  }
  T *__restrict__ out = static_cast<T *>(p.out);
  const int64_t step = (int64_t)gridDim.x * blockDim.x * UNITS;
  for (int64_t base = (int64_t)blockIdx.x * blockDim.x * UNITS + threadIdx.x; base < total; base += step) {
    uint32_t codes[UNITS];
    float scales[UNITS];
    int part[UNITS];
    int64_t at[UNITS];  // the unit's first element in out
#pragma unroll
    for (int u = 0; u < UNITS; ++u) {
      int64_t local = base + u * blockDim.x, before = 0;
      part[u] = -1;
      if (local >= total) continue;
      int j = 0;
#pragma unroll
      for (int k = 0; k + 1 < PARTS; ++k)
        if (j == k && local >= units[k]) {
          local -= units[k];
          before += p.parts[k].n;
          j = k + 1;
        }
      const Quantized4bit &q = p.parts[j];
      const int64_t first = local * E;
      part[u] = j;
      at[u] = before + first;
      codes[u] = E == 1 ? q.packed[first / 2] >> (first % 2 == 0 ? 4 : 0) & 15
                        : __ldg(reinterpret_cast<const uint32_t *>(q.packed) + local);
      scales[u] = scale(q, t, j, first / q.blocksize);
    }
#pragma unroll
    for (int u = 0; u < UNITS; ++u) {
      if (part[u] < 0) continue;
      const float *code = t.code[part[u]];
      if constexpr (E == 1) {
        out[at[u]] = from_f32<T>(__fmul_rn(code[codes[u]], scales[u]));
      } else {
        float v[8];
#pragma unroll
        for (int i = 0; i < 4; ++i) {  // byte i: elements 2i (high nibble) and 2i + 1
          const uint32_t b = codes[u] >> (8 * i) & 0xff;
          v[2 * i] = __fmul_rn(code[b >> 4], scales[u]);
          v[2 * i + 1] = __fmul_rn(code[b & 15], scales[u]);
        }
        store<8>(out + at[u], v);
      }
    }
  }
}

}  // namespace

#define UNIT_vec 8
#define UNIT_scalar 1
#define KERNEL(dt, access)                                                                                \
  extern "C" __global__ void __launch_bounds__(DEQUANTIZE_4BIT_BLOCK)                                     \
      dequantize_4bit_##dt##_##access(const __grid_constant__ Dequantize4bit p) {                         \
    dequantize<BASTILE_TYPE_##dt, UNIT_##access>(p);                                                      \
  }
DEQUANTIZE_4BIT_KERNELS(KERNEL)
