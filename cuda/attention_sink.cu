// The sink's share of each row (include/attention_sink.h): memory-bound passes over [tokens, heads, dim] in
// which `group` threads share a row, each taking its vectors l, l + group, ...; one exp and log per row.
// Math in f32, every result rounded once to T. The row's normaliser is recomputed nowhere else: the flash
// backward reads the one written here.
#include "attention_sink.h"
#include "elementwise.cuh"

using namespace bastile;

namespace {

constexpr int BLOCK = ATTENTION_SINK_BLOCK;

// torch.logaddexp: an infinity that both share is kept as it is (the formula would give NaN).
__device__ __forceinline__ float logaddexp(float a, float b) {
  if (isinf(a) && a == b) return a;
  return fmaxf(a, b) + log1pf(expf(-fabsf(a - b)));
}

template <class T, int V> __device__ __forceinline__ void forward(const AttentionSinkForward &p) {
  const T *__restrict__ out = static_cast<const T *>(p.out);
  T *__restrict__ y = static_cast<T *>(p.y);
  const float *lse = static_cast<const float *>(p.lse), *sinks = static_cast<const float *>(p.sinks);
  float *normaliser = static_cast<float *>(p.normaliser);
  const int lane = threadIdx.x % p.group;
  const int64_t rows = p.tokens * p.heads, vectors = p.dim / V;
  FOR_EACH_ROW_GROUP(base, rows, BLOCK / p.group) {
    const int64_t row = base + threadIdx.x / p.group;
    if (row >= rows) continue;
    const int64_t t = row / p.heads, h = row % p.heads;
    const float x = lse[t * p.lse_strides[0] + h * p.lse_strides[1]], L = logaddexp(x, sinks[h]);
    if (lane == 0) normaliser[t * p.normaliser_strides[0] + h * p.normaliser_strides[1]] = L;
    const float r = expf(x - L);
    const T *o = out + row * p.dim;
    T *dst = y + row * p.dim;
    for (int64_t c = lane; c < vectors; c += p.group) {
      const Pack<T, V> v = load_nc<V>(o + c * V);
      float w[V];
#pragma unroll
      for (int j = 0; j < V; ++j) w[j] = to_f32(v.v[j]) * r;
      store<V>(dst + c * V, w);
    }
  }
}

template <class T, int V> __device__ __forceinline__ void backward(const AttentionSinkBackward &p) {
  const T *__restrict__ grad_y = static_cast<const T *>(p.grad_y);
  const T *__restrict__ y = static_cast<const T *>(p.y);
  T *__restrict__ grad_out = static_cast<T *>(p.grad_out);
  const float *normaliser = static_cast<const float *>(p.normaliser), *sinks = static_cast<const float *>(p.sinks),
              *lse = static_cast<const float *>(p.lse);
  float *grad_lse = static_cast<float *>(p.grad_lse);
  const int lane = threadIdx.x % p.group;
  const int64_t rows = p.tokens * p.heads, vectors = p.dim / V;
  // Rows past the last run the shuffles too (every lane of a warp must reach them), as not `real`.
  FOR_EACH_ROW_GROUP(base, rows, BLOCK / p.group) {
    const int64_t row = base + threadIdx.x / p.group;
    const bool real = row < rows;
    const int64_t offset = real ? row * p.dim : 0;
    float d = 0.f;
    if (real)
      for (int64_t c = lane; c < vectors; c += p.group) {
        const Pack<T, V> dy = load_nc<V>(grad_y + offset + c * V), v = load_nc<V>(y + offset + c * V);
#pragma unroll
        for (int j = 0; j < V; ++j) d += to_f32(dy.v[j]) * to_f32(v.v[j]);
      }
    d = warp_group_sum(d, p.group);
    if (!real) continue;
    const int64_t t = row / p.heads, h = row % p.heads;
    const float L = normaliser[t * p.normaliser_strides[0] + h * p.normaliser_strides[1]];
    if (lane == 0) grad_lse[t * p.grad_lse_strides[0] + h * p.grad_lse_strides[1]] = expf(sinks[h] - L) * d;
    if (lse == nullptr) continue;
    // From lse, not as 1 - exp(sink - L): that loses the factor's relative precision where the sink dominates.
    const float r = expf(lse[t * p.lse_strides[0] + h * p.lse_strides[1]] - L);
    for (int64_t c = lane; c < vectors; c += p.group) {
      const Pack<T, V> dy = load_nc<V>(grad_y + offset + c * V);
      float w[V];
#pragma unroll
      for (int j = 0; j < V; ++j) w[j] = to_f32(dy.v[j]) * r;
      store<V>(grad_out + offset + c * V, w);
    }
  }
}

}  // namespace

#define FORWARD(...) ELEMENTWISE_KERNEL(attention_sink, BLOCK, AttentionSinkForward, forward, __VA_ARGS__)
#define BACKWARD(...) ELEMENTWISE_KERNEL(attention_sink, BLOCK, AttentionSinkBackward, backward, __VA_ARGS__)
ATTENTION_SINK_FORWARD_KERNELS(FORWARD)
ATTENTION_SINK_BACKWARD_KERNELS(BACKWARD)
