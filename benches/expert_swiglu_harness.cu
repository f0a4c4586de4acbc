// expert_swiglu's Hopper kernel alone, launched as Rust launches it (the same parameter block, TMA maps, grid and
// stages), for trying changes to cuda/expert_swiglu.cu, expert_tiles.cuh or hopper.cuh without a Rust build: the
// GPU machine has nvcc but no cargo. A changed copy of those files goes in a folder of its own, named first on -I
// (the kernel file's quoted includes look beside it first):
//
//   nvcc -O3 -std=c++17 -I<copy> -Iinclude -Icuda -gencode=arch=compute_90a,code=sm_90a \
//        benches/expert_swiglu_harness.cu -lcuda -o harness
//   ./harness TOKENS TOP_K EXPERTS IN INTER ROUTING [STAGES [LAUNCHES]]
//   ./harness 4096 8 128 2048 768 0          # Qwen3-30B-A3B's shape, routed evenly at random
//
// ROUTING: 0 each pair to an expert at random, 1 skewed (expert weights u^4: a few experts many rows, some none),
// 2 exactly even (every expert a multiple of the tile's rows where the shape allows: no partial tiles). Prints the
// fastest and median of LAUNCHES L2-flushed launches, TFLOP/s of the useful products, and the share of the tiles'
// rows that are real. DUMP=file writes gate_up and h; CMP=file counts the elements that differ from such a dump
// (a change that keeps the rounding keeps every bit). -DTIMED=name times another build of the kernel.
#include <cuda.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <random>
#include <vector>

#include "expert_swiglu.cu"

#ifndef TIMED
#define TIMED expert_swiglu_gemm_bf16_silu
#endif

#define CHECK(x)                                                                 \
  do {                                                                           \
    const cudaError_t err = (x);                                                 \
    if (err != cudaSuccess) {                                                    \
      fprintf(stderr, "%s: %s\n", #x, cudaGetErrorString(err));                  \
      exit(1);                                                                   \
    }                                                                            \
  } while (0)

// Uniform values in [-scale / 2, scale / 2) from a hash of the index.
__global__ void fill(bf16 *p, int64_t n, uint32_t seed, float scale) {
  for (int64_t i = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; i < n; i += (int64_t)gridDim.x * blockDim.x) {
    uint32_t h = (uint32_t)i * 2654435761u ^ seed;
    h ^= h >> 13, h *= 0x5bd1e995u, h ^= h >> 15;
    p[i] = __float2bfloat16(((h & 0xffff) / 65536.f - 0.5f) * scale);
  }
}

// As src/driver.rs's tensor_map_bf16: boxes of 64 columns (128 bytes, swizzled) by `box_rows`.
static BastileTensorMap tensor_map(const void *data, int64_t rows, int64_t cols, uint32_t box_rows) {
  BastileTensorMap m;
  cuuint64_t dims[2] = {(cuuint64_t)cols, (cuuint64_t)rows}, strides[1] = {(cuuint64_t)cols * 2};
  cuuint32_t box[2] = {BASTILE_GEMM_TILE_K, box_rows}, steps[2] = {1, 1};
  const CUresult r = cuTensorMapEncodeTiled(
      (CUtensorMap *)&m, CU_TENSOR_MAP_DATA_TYPE_BFLOAT16, 2, (void *)data, dims, strides, box, steps, CU_TENSOR_MAP_INTERLEAVE_NONE,
      CU_TENSOR_MAP_SWIZZLE_128B, CU_TENSOR_MAP_L2_PROMOTION_L2_256B, CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE);
  if (r != CUDA_SUCCESS) fprintf(stderr, "cuTensorMapEncodeTiled: %d\n", r), exit(1);
  return m;
}

// Each expert's rows: TOKENS x TOP_K pairs routed as ROUTING says.
static std::vector<int> route(int64_t pairs, int experts, int routing) {
  std::vector<int> counts(experts, 0);
  if (routing == 2) {
    for (int e = 0; e < experts; ++e) counts[e] = (int)(pairs / experts);
    counts[experts - 1] += (int)(pairs % experts);
    return counts;
  }
  std::mt19937 rng(0);
  std::uniform_real_distribution<double> u(0, 1);
  std::vector<double> weight(experts);
  for (auto &w : weight) w = routing ? std::pow(u(rng), 4) : 1.0;
  std::discrete_distribution<int> pick(weight.begin(), weight.end());
  for (int64_t i = 0; i < pairs; ++i) counts[pick(rng)]++;
  return counts;
}

// The elements of gate_up and h (in that order) that differ from the dump at `path`.
static int64_t differences(const std::vector<char> &out, const char *path) {
  std::vector<char> ref(out.size());
  FILE *f = fopen(path, "rb");
  if (!f || fread(ref.data(), 1, ref.size(), f) != ref.size()) fprintf(stderr, "%s: not a dump of this shape\n", path), exit(1);
  fclose(f);
  int64_t n = 0;
  for (size_t i = 0; i < out.size(); i += 2) n += memcmp(&out[i], &ref[i], 2) != 0;
  return n;
}

int main(int argc, char **argv) {
  if (argc < 7) fprintf(stderr, "usage: %s TOKENS TOP_K EXPERTS IN INTER ROUTING [STAGES [LAUNCHES]]\n", argv[0]), exit(2);
  const int tokens = atoi(argv[1]), k = atoi(argv[2]), experts = atoi(argv[3]), in = atoi(argv[4]), inter = atoi(argv[5]);
  const int routing = atoi(argv[6]), stages = argc > 7 ? atoi(argv[7]) : 4, launches = argc > 8 ? atoi(argv[8]) : 20;
  const int64_t pairs = (int64_t)tokens * k, col_tiles = inter / EXPERT_SWIGLU_TILE_COLS;
  const std::vector<int> counts = route(pairs, experts, routing);
  std::vector<int32_t> offsets(experts);
  int64_t row_tiles = 0;
  for (int e = 0, end = 0; e < experts; ++e) {
    offsets[e] = end += counts[e];
    row_tiles += (counts[e] + BASTILE_GEMM_TILE_M - 1) / BASTILE_GEMM_TILE_M;
  }

  bf16 *x, *w, *gate_up, *h;
  int32_t *offsets_d;
  char *flush;
  const int64_t weight_rows = (int64_t)experts * 2 * inter, flush_bytes = 512 << 20;
  CHECK(cudaMalloc(&x, pairs * in * 2));
  CHECK(cudaMalloc(&w, weight_rows * in * 2));
  CHECK(cudaMalloc(&gate_up, pairs * 2 * inter * 2));
  CHECK(cudaMalloc(&h, pairs * inter * 2));
  CHECK(cudaMalloc(&offsets_d, experts * 4));
  CHECK(cudaMalloc(&flush, flush_bytes));
  CHECK(cudaMemcpy(offsets_d, offsets.data(), experts * 4, cudaMemcpyHostToDevice));
  fill<<<1024, 256>>>(x, pairs * in, 1, 2.f);
  fill<<<1024, 256>>>(w, weight_rows * in, 2, 2.f / std::sqrt((float)in));

  ExpertSwiglu p{};
  p.x = x, p.weight = w, p.offsets = offsets_d, p.gate_up = gate_up, p.h = h;
  p.pairs = pairs, p.in = in, p.inter = inter, p.experts = experts;
  p.dtype = BASTILE_BF16, p.activation = SWIGLU_SILU, p.hopper = 1, p.gemm.stages = stages;
  p.gemm.col_tiles = (int32_t)col_tiles;
  p.gemm.x_map = tensor_map(x, pairs, in, BASTILE_GEMM_TILE_M);
  p.gemm.weight_map = tensor_map(w, weight_rows, in, EXPERT_SWIGLU_TILE_COLS);
  int sms;
  CHECK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0));
  const int shared = stages * (BASTILE_GEMM_TILE_M + 2 * EXPERT_SWIGLU_TILE_COLS) * BASTILE_GEMM_TILE_K * 2 + 1024;
  CHECK(cudaFuncSetAttribute(TIMED, cudaFuncAttributeMaxDynamicSharedMemorySize, shared));
  const int grid = (int)std::min<int64_t>(((pairs + BASTILE_GEMM_TILE_M - 1) / BASTILE_GEMM_TILE_M + experts) * col_tiles, sms);

  cudaEvent_t start, stop;
  CHECK(cudaEventCreate(&start));
  CHECK(cudaEventCreate(&stop));
  std::vector<float> ms;
  for (int r = 0; r < launches + 2; ++r) {  // two to warm up
    CHECK(cudaMemsetAsync(flush, r, flush_bytes));
    CHECK(cudaEventRecord(start));
    TIMED<<<grid, kGemmThreads, shared>>>(p);
    CHECK(cudaEventRecord(stop));
    CHECK(cudaEventSynchronize(stop));
    float t;
    CHECK(cudaEventElapsedTime(&t, start, stop));
    if (r >= 2) ms.push_back(t);
  }
  CHECK(cudaGetLastError());
  std::sort(ms.begin(), ms.end());

  std::vector<char> out(pairs * 3 * inter * 2);
  CHECK(cudaMemcpy(out.data(), gate_up, pairs * 4 * inter, cudaMemcpyDeviceToHost));
  CHECK(cudaMemcpy(out.data() + pairs * 4 * inter, h, pairs * 2 * inter, cudaMemcpyDeviceToHost));
  if (const char *path = getenv("DUMP")) {
    FILE *f = fopen(path, "wb");
    if (!f || fwrite(out.data(), 1, out.size(), f) != out.size()) fprintf(stderr, "%s: not written\n", path), exit(1);
    fclose(f);
  }
  if (const char *path = getenv("CMP")) printf("%lld elements differ from %s; ", (long long)differences(out, path), path);
  const double flop = 2.0 * pairs * in * 2 * inter;
  printf("min %.4f ms, median %.4f ms, %.0f TFLOP/s; %lld tiles, %.3f of their rows real; grid %d, stages %d\n", ms[0],
         ms[ms.size() / 2], flop / ms[0] / 1e9, (long long)(row_tiles * col_tiles),
         (double)pairs / (row_tiles * BASTILE_GEMM_TILE_M), grid, stages);
  return 0;
}
