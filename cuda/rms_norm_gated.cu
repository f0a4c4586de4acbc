// Qwen3.5's gated RMSNorm, the output norm of its Gated DeltaNet layers (HF Qwen3_5RMSNormGated), over rows
// x gated by rows z: with r = rsqrt(mean(x^2) + eps) in f32, n = round_X(x * r), s = sig(z):
//   y      = round_X(w * n * z * s)                        the products in f32
//   grad_x = r * g - x * r^3 * sum(g * x) / cols           g = dy * z * s * w
//   grad_z = dy * w * n * s * (1 + z * (1 - s))
//   grad_w = sum over rows of dy * z * s * n
// n rounded as HF rounds it (to x's dtype before the weight), every result rounded once.
//
// The loops and the launch geometry are rms_norm's (row_norm.cuh), with the gate z loaded beside x.
#include "elementwise.cuh"
#include "rms_norm_gated.h"
#include "row_norm.cuh"

using namespace bastile;

namespace {

// An element of the backward in f32, with s = sig(z).
struct Term {
  float x, z, dy, w, s;
  __device__ __forceinline__ Term(float x, float z, float dy, float w) : x(x), z(z), dy(dy), w(w), s(sigmoid(z)) {}
  // The gradient of w * n, and of n.
  __device__ __forceinline__ float gated() const { return dy * (z * s); }
  __device__ __forceinline__ float g() const { return gated() * w; }
  // grad_z, with n as the forward rounded it.
  __device__ __forceinline__ float grad_z(float n) const { return dy * w * n * (s * (1.f + z * (1.f - s))); }
};

// The norm (row_norm.cuh).
template <class X_, class W_> struct GatedNorm {
  using X = X_;
  using W = W_;
  using Y = X;
  static constexpr bool kGated = true, kPairs = false;
  // A row is three tensors here, rms_norm's two: the next row is loaded ahead for up to two vectors of each
  // (bf16 on sm_90a: 121 registers at K = 2; K = 4, without it, 128).
  template <int K> static constexpr bool kLookahead = K <= 2;
  template <class P> __device__ __forceinline__ explicit GatedNorm(const P &) {}
  __device__ __forceinline__ float y(float x, float z, float w, float r) const {
    return w * round_to<X>(x * r) * (z * sigmoid(z));
  }
  __device__ __forceinline__ float dot(float x, float z, float dy, float w) const { return Term(x, z, dy, w).g() * x; }
  __device__ __forceinline__ void grads(float x, float z, float dy, float w, float r, float c, float &dx, float &dz,
                                        float &dw) const {
    const Term t(x, z, dy, w);
    const float n = round_to<X>(x * r);
    dx = r * t.g() - x * c;
    dz = t.grad_z(n);
    dw = t.gated() * n;
  }
};

}  // namespace

#define PARAMS_fwd RmsNormGatedForward
#define PARAMS_bwd RmsNormGatedBackward
#define RUN_fwd forward
#define RUN_bwd backward

// Register-cached kernels run at most 256 threads a block (src/geometry.rs), streaming ones up to 1024.
#define KERNEL(dir, x, w, access, residency)                                                                     \
  extern "C" __global__ void __launch_bounds__(BASTILE_CACHED_##residency > 0 ? 256 : 1024)                     \
      rms_norm_gated_##dir##_##x##_##w##_##access##_##residency(const PARAMS_##dir p) {                          \
    RUN_##dir<GatedNorm<BASTILE_TYPE_##x, BASTILE_TYPE_##w>, BASTILE_WIDTH_##access(BASTILE_TYPE_##x),           \
              BASTILE_CACHED_##residency, 1>(p);                                                                 \
  }
#define REDUCE(dir, reduce, w)                                                                                   \
  extern "C" __global__ void rms_norm_gated_##dir##_##reduce##_##w(const RmsNormGatedBackward p) {               \
    column_sum<BASTILE_TYPE_##w>(p.partial, p.partials, p.cols, static_cast<BASTILE_TYPE_##w *>(p.grad_w));       \
  }
RMS_NORM_GATED_FORWARD_KERNELS(KERNEL)
RMS_NORM_GATED_BACKWARD_KERNELS(KERNEL, REDUCE)
