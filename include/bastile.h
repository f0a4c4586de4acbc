/* What every op's parameter header (include/<op>.h) shares: element types and row
 * geometry. Parameter blocks are shared by the CUDA kernels, the C++ torch layer and Rust (through
 * bindgen); every kernel takes exactly one by value, so adding a field never changes a launch. */
#pragma once
#include <stdint.h>

/* Element types. The C++ layer maps at::ScalarType onto these; Rust picks kernels by them. */
typedef enum BastileDType {
  BASTILE_F32 = 0,
  BASTILE_F16 = 1,
  BASTILE_BF16 = 2,
  BASTILE_F64 = 3, /* CPU only: lets torch.autograd.gradcheck run */
} BastileDType;

/* How a row-wise kernel is laid out on the GPU; chosen by Rust (src/geometry.rs). */
typedef struct RowGeometry {
  int32_t vec;   /* elements per vector access: 16 bytes of x, or 1 */
  int32_t per_thread; /* vectors each thread keeps in registers; 0 = stream the row twice */
  int32_t group; /* threads that share one row */
  int32_t block; /* threads per block = group * rows per block */
} RowGeometry;

/* Kernel lists. include/<op>.h declares the kernels of cuda/<op>.cu by the parameter block they take:
 * `#define <BLOCK>_KERNELS(K)` (BLOCK: the struct's name in capitals and underscores, SwigluForward ->
 * SWIGLU_FORWARD) expands to one K(tags...) per kernel, named <op>_<tag>_<tag>...; a tag left empty is no
 * part of the name. The .cu instantiates exactly its lists (cuda/common.cuh maps dtype and access tags to
 * template arguments), and build.rs turns them into the Rust tables that launchers look kernels up in by
 * tags (src/kernels.rs). A list may take several K (a block whose kernels differ in shape of tags). */

/* A flat elementwise op's kernels of `dir`: each dtype, with 16-byte vectors or single elements. */
#define BASTILE_ELEMENTWISE_KERNELS(K, dir) \
  K(dir, f32, vec) K(dir, f32, scalar) K(dir, f16, vec) K(dir, f16, scalar) K(dir, bf16, vec) K(dir, bf16, scalar)

/* The fold of per-block column partials (cuda/common.cuh column_sum): blocks of 32 columns by this many
 * partial rows at a time. */
#define BASTILE_FOLD_ROWS 32

/* The geometry of cuda/hopper.cuh's gemm_bf16_tn, which the launches read: a block's output tile, rows and
 * columns, and the K step of one pipeline stage (64 bf16 are one 128-byte swizzle row); a block is one producer
 * warp group and two consumers, each taking 64 rows of the tile (one m64n256k16 WGMMA a k16 step), the producer
 * running on into the next tile during their epilogue. 128 x 256 reads 48 KiB of operands per 4.2 MFLOP: 128 x
 * 128 tiles (half the reuse) ran the cross-entropy's GEMM at ~360 TFLOP/s on an H100, bound by L2 bandwidth. */
#define BASTILE_GEMM_TILE_M 128
#define BASTILE_GEMM_TILE_N 256
#define BASTILE_GEMM_TILE_K 64
#define BASTILE_GEMM_THREADS 384

/* A TMA descriptor (CUtensorMap: 128 bytes, 64-aligned), filled by Rust through the driver
 * (cuTensorMapEncodeTiled) and passed inside a parameter block that its kernel takes as __grid_constant__. */
typedef struct BastileTensorMap {
  uint64_t opaque[16];
} __attribute__((aligned(64))) BastileTensorMap;
