/* Parameter block of cuda/rope.cu. */
#pragma once
#include "bastile.h"

/* One operand seen as [batch, seq, heads, head_dim]: element strides of the first three (a size-1
 * dimension has stride 0); head_dim has stride 1. cos and sin use batch and seq only (batch stride 0
 * when broadcast). */
typedef struct RopeTensor {
  void *data;
  int64_t batch_stride;
  int64_t seq_stride;
  int64_t head_stride;
} RopeTensor;

/* Forward: q, k -> q_out, k_out in promote(in_dtype, cs_dtype). Backward: q, k are the gradients of
 * the outputs and q_out, k_out the gradients of the inputs, all in in_dtype. The C++ layer fills the
 * tensors, shapes and dtypes; Rust the launch geometry. */
typedef struct Rope {
  RopeTensor q;
  RopeTensor k;
  RopeTensor q_out;
  RopeTensor k_out;
  RopeTensor cos;
  RopeTensor sin;
  int64_t batch;
  int64_t seq;
  int64_t q_heads;
  int64_t k_heads;
  int64_t head_dim; /* even */
  /* Each head's first rot elements (cos and sin's width: even, 0 < rot <= head_dim) are rotated, the
   * rest pass through in the output dtype (HF's partial rotary). The rotated pairs: (i, i + rot / 2)
   * with cos and sin at i and i + rot / 2 (rotate_half), or where interleaved is nonzero (2j, 2j + 1),
   * both with cos and sin at j (GLM). */
  int64_t rot;
  int32_t interleaved;
  int32_t in_dtype;
  int32_t cs_dtype;  /* of cos and sin */
  int32_t out_dtype;
  /* Launch geometry, chosen by Rust: vec elements per access; pair_threads x head_lanes threads per
   * token, each taking every pair_threads-th item of a head (rot / (2 vec) items of vec pairs, then
   * (head_dim - rot) / (2 vec) items of 2 vec passed elements) in every head_lanes-th head;
   * block / (pair_threads * head_lanes) tokens per block. */
  int32_t vec;
  int32_t pair_threads;
  int32_t head_lanes;
  int32_t block;
  int32_t backward; /* nonzero: the backward, rope_bwd_* (the kernels' direction is in their names) */
} Rope;

/* Most threads of a block (the kernels' __launch_bounds__), and heads a thread loads before it stores
 * any: bytes in flight, and one load of the cos/sin vectors serves them all. */
#define ROPE_BLOCK 256
#define ROPE_HEADS_AT_ONCE 4

/* rope_<fwd|bwd>_<in>_<cos>_v<elements per access>: 16-byte accesses at most, so v8 only where every
 * dtype is one 16-bit type. */
#define ROPE_KERNELS(K) ROPE_DIRECTION(K, fwd) ROPE_DIRECTION(K, bwd)
#define ROPE_DIRECTION(K, dir)                                                                            \
  ROPE_NARROW(K, dir, f32, f32) ROPE_NARROW(K, dir, f32, f16) ROPE_NARROW(K, dir, f32, bf16)             \
  ROPE_NARROW(K, dir, f16, f32) ROPE_NARROW(K, dir, f16, f16) ROPE_NARROW(K, dir, f16, bf16)             \
  ROPE_NARROW(K, dir, bf16, f32) ROPE_NARROW(K, dir, bf16, f16) ROPE_NARROW(K, dir, bf16, bf16)          \
  K(dir, f16, f16, v8) K(dir, bf16, bf16, v8)
#define ROPE_NARROW(K, dir, in, cs) K(dir, in, cs, v1) K(dir, in, cs, v2) K(dir, in, cs, v4)
