// Hopper (sm_90a) building blocks for our own GEMMs: mbarriers, TMA tile loads, WGMMA, register
// reallocation between warp groups, and the persistent GEMM mainloop that a kernel gives its epilogue
// (gemm_bf16_tn). Only code compiled for sm_90a may call the instructions (the callers check BASTILE_SM90 and
// trap elsewhere); Rust launches those kernels on compute capability 9.0 only.
#pragma once
#include <cuda_bf16.h>
#include <stdint.h>

#include "bastile.h"

#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ == 900 && defined(__CUDA_ARCH_FEAT_SM90_ALL)
#define BASTILE_SM90 1
#else
#define BASTILE_SM90 0
#endif

namespace bastile::sm90 {

__device__ __forceinline__ uint32_t shared_address(const void *p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}

// An mbarrier in shared memory: `count` arrivals (plus the bytes a TMA load announces) complete a phase.
__device__ __forceinline__ void barrier_init(uint64_t *bar, uint32_t count) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;" ::"r"(shared_address(bar)), "r"(count));
}
// Makes initialised barriers visible to the async proxy (TMA) before the block's __syncthreads.
__device__ __forceinline__ void barrier_init_fence() { asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory"); }
__device__ __forceinline__ void arrive(uint64_t *bar) {
  asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];" ::"r"(shared_address(bar)) : "memory");
}
// One arrival that also announces `bytes` of TMA data to come.
__device__ __forceinline__ void arrive_expect(uint64_t *bar, uint32_t bytes) {
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(shared_address(bar)), "r"(bytes) : "memory");
}
// Waits until the phase of parity `parity` has completed (a fresh barrier counts parity 1 as complete).
__device__ __forceinline__ void wait(uint64_t *bar, uint32_t parity) {
  asm volatile(
      "{\n .reg .pred done;\n"
      "WAIT_%=:\n mbarrier.try_wait.parity.shared::cta.b64 done, [%0], %1;\n"
      " @!done bra WAIT_%=;\n}" ::"r"(shared_address(bar)),
      "r"(parity)
      : "memory");
}

// The 2-D box at (x, y) (x the contiguous dimension) of the tensor map into shared memory; completes on bar.
__device__ __forceinline__ void tma_load(void *dst, const void *map, uint64_t *bar, int32_t x, int32_t y) {
  asm volatile(
      "cp.async.bulk.tensor.2d.shared::cluster.global.tile.mbarrier::complete_tx::bytes [%0], [%1, {%3, %4}], [%2];" ::"r"(
          shared_address(dst)),
      "l"(map), "r"(shared_address(bar)), "r"(x), "r"(y)
      : "memory");
}

template <uint32_t N> __device__ __forceinline__ void set_registers() {
  asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;" ::"n"(N));
}
template <uint32_t N> __device__ __forceinline__ void release_registers() {
  asm volatile("setmaxnreg.dec.sync.aligned.u32 %0;" ::"n"(N));
}

// Descriptor of a K-major operand tile in shared memory as TMA writes it with 128-byte swizzling: rows of
// 64 16-bit elements (128 bytes), 8-row swizzle atoms 1024 bytes apart; `p` 1024-aligned plus the byte
// offset of the k-slice (multiples of 32 within the 128-byte row).
__device__ __forceinline__ uint64_t descriptor(const void *p) {
  const uint64_t start = (shared_address(p) & 0x3FFFF) >> 4;
  return start | (1ull << 16) | (uint64_t(1024 >> 4) << 32) | (1ull << 62);
}

__device__ __forceinline__ void mma_fence() { asm volatile("wgmma.fence.sync.aligned;" ::: "memory"); }
__device__ __forceinline__ void mma_commit() { asm volatile("wgmma.commit_group.sync.aligned;" ::: "memory"); }
template <int N> __device__ __forceinline__ void mma_wait() {
  asm volatile("wgmma.wait_group.sync.aligned %0;" ::"n"(N) : "memory");
}
// Keeps the compiler from moving accesses of accumulators across WGMMA issue and wait.
template <int N> __device__ __forceinline__ void fence_operands(float (&d)[N]) {
#pragma unroll
  for (int i = 0; i < N; ++i) asm volatile("" : "+f"(d[i])::"memory");
}

// d[64x256] += a[64x16] b[256x16]^T, bf16 operands from shared memory, f32 accumulators in the
// m64nNk16 register layout: thread t of the warp group holds rows 16 (t / 32) + (t % 32) / 4 (+ 8) and
// columns 8 j + 2 (t % 4) (+ 1), element d[4 j + 2 (row half) + column].
// TransB 1: b is N-major (descriptor_n_major's layout).
template <int TransB = 0> __device__ __forceinline__ void mma_bf16_m64n256k16(float (&d)[128], uint64_t a, uint64_t b) {
  asm volatile(
      "{\n .reg .pred accumulate;\n setp.ne.b32 accumulate, %130, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n256k16.f32.bf16.bf16 {%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, %48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63, %64, %65, %66, %67, %68, %69, %70, %71, %72, %73, %74, %75, %76, %77, %78, %79, %80, %81, %82, %83, %84, %85, %86, %87, %88, %89, %90, %91, %92, %93, %94, %95, %96, %97, %98, %99, %100, %101, %102, %103, %104, %105, %106, %107, %108, %109, %110, %111, %112, %113, %114, %115, %116, %117, %118, %119, %120, %121, %122, %123, %124, %125, %126, %127}, %128, %129, accumulate, 1, 1, 0, %131;\n}"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]), "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35]), "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]), "+f"(d[40]), "+f"(d[41]), "+f"(d[42]), "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]), "+f"(d[48]), "+f"(d[49]), "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), "+f"(d[53]), "+f"(d[54]), "+f"(d[55]), "+f"(d[56]), "+f"(d[57]), "+f"(d[58]), "+f"(d[59]), "+f"(d[60]), "+f"(d[61]), "+f"(d[62]), "+f"(d[63]), "+f"(d[64]), "+f"(d[65]), "+f"(d[66]), "+f"(d[67]), "+f"(d[68]), "+f"(d[69]), "+f"(d[70]), "+f"(d[71]), "+f"(d[72]), "+f"(d[73]), "+f"(d[74]), "+f"(d[75]), "+f"(d[76]), "+f"(d[77]), "+f"(d[78]), "+f"(d[79]), "+f"(d[80]), "+f"(d[81]), "+f"(d[82]), "+f"(d[83]), "+f"(d[84]), "+f"(d[85]), "+f"(d[86]), "+f"(d[87]), "+f"(d[88]), "+f"(d[89]), "+f"(d[90]), "+f"(d[91]), "+f"(d[92]), "+f"(d[93]), "+f"(d[94]), "+f"(d[95]), "+f"(d[96]), "+f"(d[97]), "+f"(d[98]), "+f"(d[99]), "+f"(d[100]), "+f"(d[101]), "+f"(d[102]), "+f"(d[103]), "+f"(d[104]), "+f"(d[105]), "+f"(d[106]), "+f"(d[107]), "+f"(d[108]), "+f"(d[109]), "+f"(d[110]), "+f"(d[111]), "+f"(d[112]), "+f"(d[113]), "+f"(d[114]), "+f"(d[115]), "+f"(d[116]), "+f"(d[117]), "+f"(d[118]), "+f"(d[119]), "+f"(d[120]), "+f"(d[121]), "+f"(d[122]), "+f"(d[123]), "+f"(d[124]), "+f"(d[125]), "+f"(d[126]), "+f"(d[127])
      : "l"(a), "l"(b), "r"(1), "n"(TransB));
}

// Descriptor of an N-major operand tile as TMA writes it in boxes of 64 columns (128 bytes, swizzled) by the
// stage's kGemmTileK rows: 8-row groups 1024 bytes apart (SBO), the next 64 columns a box (kGemmTileK * 128 bytes)
// further (LBO); `p` the box's start plus the k-slice's rows (16 a slice, 2048 bytes).
__device__ __forceinline__ uint64_t descriptor_n_major(const void *p) {
  const uint64_t start = (shared_address(p) & 0x3FFFF) >> 4;
  return start | (uint64_t(64 * 128 >> 4) << 16) | (uint64_t(1024 >> 4) << 32) | (1ull << 62);
}

// gemm_bf16_tn's output tile, rows and columns, and the K step of one pipeline stage (64 bf16 are one
// 128-byte swizzle row); a stage holds an A box and two B boxes of half the tile's columns each.
constexpr int kGemmTileM = BASTILE_GEMM_TILE_M, kGemmTileN = BASTILE_GEMM_TILE_N, kGemmTileK = BASTILE_GEMM_TILE_K;
constexpr uint32_t kGemmBytesHalfB = kGemmTileN / 2 * kGemmTileK * 2;
constexpr uint32_t kGemmBytesA = kGemmTileM * kGemmTileK * 2;
constexpr uint32_t kGemmStageBytes = kGemmBytesA + kGemmTileN * kGemmTileK * 2;
constexpr int kGemmThreads = BASTILE_GEMM_THREADS, kWarpGroup = 128;  // a warp group: WGMMA's threads

// How gemm_bf16_tn's B is stored: K-major, B [N, k] row-major (a weight as F.linear takes it), or N-major, B^T
// [k, N] row-major (the same weight read for the input's gradient).
enum class Major { K, N };

// A second product summed into each tile's, A2 B2^T, as one more stage after the k-steps (gemm_bf16_tn's Tail):
// A2 [M, k2] K-major, k2 <= kGemmTileK, through a map with A's boxes, whose columns past k2 TMA fills with zeros;
// B2 in B's layout and boxes, K-major at B's rows (`b_row(tile, h)`), N-major at `b_tail_k(tile)` (its rows past
// k2 multiply A2's zeros). None where the maps are null.
struct TailProduct {
  const void *a_map = nullptr, *b_map = nullptr;
};

// The persistent, warp-specialised GEMM A B^T of bf16 operands, A [M, k] K-major and B as `B` says (row-major,
// through TMA maps with boxes of kGemmTileK x kGemmTileM for A, kGemmTileK x kGemmTileN / 2 for K-major B), by
// blocks of kGemmThreads: warp group 0's first thread loads the stages of every tile of its block, groups 1 and 2
// each multiply 64 rows of the tile and hand their f32 accumulators (mma_bf16_m64n256k16's layout) to
// `epilogue(acc, tile, group (0 or 1), thread in group)`, while the producer runs on into the next tile.
// `walk` says which output tiles a launch computes: tiles 0 to `count`, skipping `skip(tile)`, none at all where
// `none()`; a tile's rows of A start at `a_row(tile)`, K-major B's two halves at rows `b_row(tile, 0)` and
// `b_row(tile, 1)`. N-major B loads as four boxes of 64 columns (128 bytes) by kGemmTileK rows at
// (`b_col(tile)` + 64 j, `b_k(tile)` + k), and k_size must be a multiple of kGemmTileK (a box past the end of an
// expert's rows would read the next one's, not zeros). Tail: the kernel takes `tail`, a second product
// (TailProduct). Dynamic shared memory: `stages` (2 to MaxStages) stages of kGemmStageBytes, plus 1 KiB to align
// them.
template <int MaxStages, Major B = Major::K, bool Tail = false, class Walk, class Epilogue>
__device__ __forceinline__ void gemm_bf16_tn(const void *a_map, const void *b_map, int64_t k_size, int stages,
                                             const Walk &walk, Epilogue &&epilogue, TailProduct tail = {}) {
#if BASTILE_SM90
  if (walk.none()) return;
  __shared__ uint64_t full[MaxStages], empty[MaxStages];
  extern __shared__ unsigned char gemm_shared[];
  // 128-byte swizzling repeats every 1024 bytes: stages start on such a boundary.
  unsigned char *base = gemm_shared + ((1024 - shared_address(gemm_shared) % 1024) % 1024);
  if (threadIdx.x == 0) {
    for (int s = 0; s < stages; ++s) {
      barrier_init(&full[s], 1);
      barrier_init(&empty[s], 2);  // both consumers
    }
    barrier_init_fence();
  }
  __syncthreads();
  const int steps = (int)((k_size + kGemmTileK - 1) / kGemmTileK), loads = steps + (Tail && tail.a_map != nullptr);
  const int group = threadIdx.x / kWarpGroup, t = threadIdx.x % kWarpGroup;
  int s = 0;
  uint32_t phase = 0;
  if (group == 0) {
    // The producer: one thread loads every stage of every tile of this block, in the walk's order.
    release_registers<40>();
    if (t != 0) return;
    for (int64_t tile = blockIdx.x; tile < walk.count; tile += gridDim.x) {
      if (walk.skip(tile)) continue;
      const int32_t y_a = walk.a_row(tile);
      int32_t b0, b1;  // K-major: B's two halves' rows; N-major: B's first column and row
      if constexpr (B == Major::K) b0 = walk.b_row(tile, 0), b1 = walk.b_row(tile, 1);
      else b0 = walk.b_col(tile), b1 = walk.b_k(tile);
      for (int k = 0; k < loads; ++k) {
        wait(&empty[s], phase ^ 1);
        unsigned char *stage = base + s * kGemmStageBytes;
        arrive_expect(&full[s], kGemmStageBytes);
        const bool second = Tail && k == steps;
        const void *am = second ? tail.a_map : a_map, *bm = second ? tail.b_map : b_map;
        const int32_t x = second ? 0 : k * kGemmTileK;
        tma_load(stage, am, &full[s], x, y_a);
        if constexpr (B == Major::K) {
          tma_load(stage + kGemmBytesA, bm, &full[s], x, b0);
          tma_load(stage + kGemmBytesA + kGemmBytesHalfB, bm, &full[s], x, b1);
        } else {
          const int32_t y = second ? walk.b_tail_k(tile) : b1 + x;
#pragma unroll
          for (int j = 0; j < kGemmTileN / 64; ++j)
            tma_load(stage + kGemmBytesA + j * 64 * kGemmTileK * 2, bm, &full[s], b0 + 64 * j, y);
        }
        if (++s == stages) s = 0, phase ^= 1;
      }
    }
    return;
  }
  // The consumers: warp group 1 takes the tile's rows 0-63, group 2 rows 64-127.
  set_registers<232>();
  const int me = group - 1;
  for (int64_t tile = blockIdx.x; tile < walk.count; tile += gridDim.x) {
    if (walk.skip(tile)) continue;
    float acc[128];
#pragma unroll
    for (int i = 0; i < 128; ++i) acc[i] = 0.f;
    int last = -1;
    for (int k = 0; k < loads; ++k) {
      wait(&full[s], phase);
      const unsigned char *stage = base + s * kGemmStageBytes;
      mma_fence();
#pragma unroll
      for (int kk = 0; kk < kGemmTileK / 16; ++kk)
        if constexpr (B == Major::K)
          mma_bf16_m64n256k16(acc, descriptor(stage + me * 64 * 128 + kk * 32), descriptor(stage + kGemmBytesA + kk * 32));
        else
          mma_bf16_m64n256k16<1>(acc, descriptor(stage + me * 64 * 128 + kk * 32),
                                 descriptor_n_major(stage + kGemmBytesA + kk * 16 * 128));
      mma_commit();
      // The previous stage's products are done: its buffers go back to the producer.
      mma_wait<1>();
      if (last >= 0 && t == 0) arrive(&empty[last]);
      last = s;
      if (++s == stages) s = 0, phase ^= 1;
    }
    mma_wait<0>();
    fence_operands(acc);
    if (t == 0) arrive(&empty[last]);
    epilogue(acc, tile, me, t);
  }
#else
  __trap();
#endif
}

// Epilogue helpers, for 16-byte stores of bf16 results: a pair of bf16 as one register, and the regrouping of a
// row's columns. The four threads of a row each hold columns 2q, 2q + 1 (q = lane % 4) of four 8-column groups
// (v[i]: group i); stmatrix writes the warp's four 8 x 8 bf16 matrices to its scratch as 8 rows of 80 bytes (64
// and 16 of padding, so that no phase of the writes meets a bank twice), and thread q of a row reads group q's 8
// columns back (load_group, after a __syncwarp): `regroup`, or its steps for several sets of matrices at once
// (expert_swiglu's three, each in its own scratch, one __syncwarp between). Fewer instructions than a transpose
// over the quad by shuffles (its selects and moves): 2-6% of the experts' gate/up GEMM (H200).
__device__ __forceinline__ uint32_t bits(__nv_bfloat162 v) { return *reinterpret_cast<uint32_t *>(&v); }

constexpr int kRegroupRow = 80, kRegroupBytes = 8 * kRegroupRow;
__device__ __forceinline__ void store_matrices(unsigned char *scratch, int lane, const uint32_t (&v)[4]) {
  const uint32_t at = shared_address(scratch + lane % 8 * kRegroupRow + lane / 8 * 16);
  asm volatile("stmatrix.sync.aligned.m8n8.x4.shared.b16 [%0], {%1, %2, %3, %4};" ::"r"(at), "r"(v[0]), "r"(v[1]), "r"(v[2]),
               "r"(v[3])
               : "memory");
}
__device__ __forceinline__ uint4 load_group(const unsigned char *scratch, int lane) {
  return *reinterpret_cast<const uint4 *>(scratch + lane / 4 * kRegroupRow + lane % 4 * 16);
}
// The scratch of consumer warp `t / 32` of warp group `group` (gemm_bf16_tn's epilogue arguments), room for `Sets`
// sets of four matrices: a static array for each Sets, in the kernels whose epilogue asks for it.
template <int Sets> __device__ __forceinline__ unsigned char *regroup_scratch(int group, int t) {
  constexpr int warps = kWarpGroup / 32;
  __shared__ alignas(16) unsigned char scratch[(kGemmThreads / kWarpGroup - 1) * warps][Sets * kRegroupBytes];
  return scratch[group * warps + t / 32];
}
// (A uint4 array or struct of the sets, returned or written through a reference, made nvcc 13.0 split some of the
// callers' 16-byte stores in four: hence one set a call.)
__device__ __forceinline__ uint4 regroup(unsigned char *scratch, int lane, const uint32_t (&v)[4]) {
  store_matrices(scratch, lane, v);
  __syncwarp();
  const uint4 w = load_group(scratch, lane);
  __syncwarp();  // read before the next call's matrices overwrite them
  return w;
}

}  // namespace bastile::sm90
