// RMSNorm with HF semantics, statistics in f32, n = x * rsqrt(mean(x^2) + eps):
//   Llama/Qwen3 (CW = false): y = w * to_x_dtype(n), y in promote(x, w)
//   GPT-OSS (CW = true, "cast after weight"): y = to_x_dtype(w * n), the product in f32
//   Gemma (CW = true, weight_offset 1): y = to_x_dtype((1 + w) * n), the sum and product in f32
// Both have the same grad_x; the weight gradient sums dy * n with n rounded as the forward used it.
// The loops and the launch geometry are row_norm.cuh's.
#include "rms_norm.h"
#include "row_norm.cuh"

using namespace bastile;

namespace {

// Dtype of y (and grad_y): promote(x, w), or x's when the cast comes after the weight.
template <class X, class W, bool CW> struct Out { using type = typename Promote<X, W>::type; };
template <class X, class W> struct Out<X, W, true> { using type = X; };

// x * r as the weight multiplies it: rounded to x's dtype (Llama), or kept in f32 (GPT-OSS).
template <class X, bool CW> __device__ __forceinline__ float normed(float x, float r) {
  if constexpr (CW) return x * r;
  else return round_to<X>(x * r);
}

// The norm (row_norm.cuh): y = (w + offset) * n; dx = r * g * (w + offset) - x * c, dw = g * n.
template <class X_, class W_, bool CW> struct RmsNorm {
  using X = X_;
  using W = W_;
  using Y = typename Out<X, W, CW>::type;
  static constexpr bool kGated = false, kPairs = !CW;
  // The K = 8 variants would run out of registers.
  template <int K> static constexpr bool kLookahead = K <= 4;
  float offset;
  template <class P> __device__ __forceinline__ explicit RmsNorm(const P &p) : offset(p.weight_offset) {}
  __device__ __forceinline__ float y(float x, float, float w, float r) const { return (w + offset) * normed<X, CW>(x, r); }
  __device__ __forceinline__ float dot(float x, float, float g, float w) const { return g * (w + offset) * x; }
  __device__ __forceinline__ void grads(float x, float, float g, float w, float r, float c, float &dx, float &,
                                        float &dw) const {
    dx = r * g * (w + offset) - x * c;
    dw = g * normed<X, CW>(x, r);
  }
};

}  // namespace

// Template arguments of the list's tags (src/geometry.rs; the residency's are in rows.cuh, the access's in
// common.cuh): rows a step, the rounding mode.
#define ROWS_ 1
#define ROWS_two_rows 2
#define CAST_AFTER_WEIGHT_ false
#define CAST_AFTER_WEIGHT_cast_after_weight true
#define SUFFIX_
#define SUFFIX_two_rows _two_rows
#define SUFFIX_cast_after_weight _cast_after_weight
#define PARAMS_fwd RmsNormForward
#define PARAMS_bwd RmsNormBackward
#define RUN_fwd forward
#define RUN_bwd backward

// Register-cached kernels run at most 256 threads a block (src/geometry.rs), which leaves the compiler room
// to keep a whole row share in registers; streaming ones take up to 1024.
#define KERNEL(dir, x, w, access, residency, rows, mode)                                                         \
  extern "C" __global__ void __launch_bounds__(BASTILE_CACHED_##residency > 0 ? 256 : 1024) BASTILE_CAT(         \
      BASTILE_CAT(rms_norm_##dir##_##x##_##w##_##access##_##residency, SUFFIX_##rows), SUFFIX_##mode)(           \
      const PARAMS_##dir p) {                                                                                    \
    RUN_##dir<RmsNorm<BASTILE_TYPE_##x, BASTILE_TYPE_##w, CAST_AFTER_WEIGHT_##mode>,                            \
              BASTILE_WIDTH_##access(BASTILE_TYPE_##x), BASTILE_CACHED_##residency, ROWS_##rows>(p);                     \
  }
#define REDUCE(dir, reduce, w)                                                                   \
  extern "C" __global__ void rms_norm_##dir##_##reduce##_##w(const RmsNormBackward p) {         \
    column_sum<BASTILE_TYPE_##w>(p.partial, p.partials, p.cols, static_cast<BASTILE_TYPE_##w *>(p.grad_w)); \
  }
RMS_NORM_FORWARD_KERNELS(KERNEL)
RMS_NORM_BACKWARD_KERNELS(KERNEL, REDUCE)
