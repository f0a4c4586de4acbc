// A gated activation with the roundings of HF's `act_fn(gate_proj(x)) * up_proj(x)` in the inputs' dtype T:
//   y         = T(s * u)                  with s = T(act(g)), math in f32
//   grad_up   = T(dy * s)
//   grad_gate = T(T(dy * u) * act'(g))    as torch's silu_backward / gelu_backward(approximate="tanh")
// act is SiLU, g * sig(g), or GELU-tanh, g/2 * (1 + tanh(b * (g + k g^3))) with b = sqrt(2/pi), k = 0.044715.
// The backward recomputes act(g) from the saved inputs instead of saving an activation; asked (p.dot), it also
// sums each row's dy * y (the experts' routing weights' gradient), a warp a row.
//
// Memory-bound and elementwise: each thread loads SWIGLU_UNROLL 16-byte vectors of every input
// before it computes and stores any (bytes in flight), in a grid-stride loop with 64-bit indices.
// The `vec` variants need every pointer 16-byte aligned and finish the last n % V elements with
// scalar accesses; the `scalar` variants take any alignment.
#include "elementwise.cuh"
#include "swiglu.h"

using namespace bastile;

namespace {

constexpr int U = SWIGLU_UNROLL;

constexpr float kBeta = kGeluBeta, kKappa = kGeluKappa;

__device__ __forceinline__ float act(float g, int32_t kind) { return gate_act(g, kind == SWIGLU_GELU_TANH); }

template <class T> __device__ __forceinline__ float forward_value(float g, float u, int32_t kind) {
  return round_to<T>(act(g, kind)) * u;
}

// dy is the product's gradient rounded to T, d = dy * act'(g) in the order torch's backward kernels take.
__device__ __forceinline__ float act_grad(float dy, float g, int32_t kind) {
  if (kind == SWIGLU_GELU_TANH) {
    const float g2 = g * g, t = tanhf(kBeta * (g + kKappa * (g2 * g)));
    const float left = 0.5f * g, right = 1.f + t;
    return dy * (0.5f * right + left * (1.f - t * t) * (kBeta * (1.f + 3.f * kKappa * g2)));
  }
  const float sig = sigmoid(g);
  return dy * sig * (1.f + g * (1.f - sig));
}

// The gradients of one element; with kDot, also dy times its y as the forward rounds it (the row's dot).
template <class T, bool kDot>
__device__ __forceinline__ float backward_value(float dy, float g, float u, int32_t kind, float &dg, float &du) {
  const float s = round_to<T>(act(g, kind));
  du = dy * s;
  dg = act_grad(round_to<T>(dy * u), g, kind);
  return kDot ? dy * round_to<T>(s * u) : 0.f;
}

// Where element e of the contiguous tensors lies in rows of cols at stride ld (gate and up's; the backward's
// gradients'). A vector's elements share a row (swiglu.h).
__device__ __forceinline__ int64_t at_row(int64_t e, int64_t cols, int64_t ld) {
  return ld == cols ? e : e + e / cols * (ld - cols);
}
template <class P> __device__ __forceinline__ int64_t at_row(const P &p, int64_t e) { return at_row(e, p.cols, p.ld); }

template <class T, int V> __device__ __forceinline__ void forward(const SwigluForward &p) {
  const T *__restrict__ gate = static_cast<const T *>(p.gate);
  const T *__restrict__ up = static_cast<const T *>(p.up);
  T *__restrict__ y = static_cast<T *>(p.y);
  Pack<T, V> g[U], u[U];
  for_each_vector<V, U>(
      p.n,
      [&](int k, int64_t i) {
        const int64_t e = at_row(p, i * V);
        g[k] = load_nc<V>(gate + e);
        u[k] = load_nc<V>(up + e);
      },
      [&](int k, int64_t i) {
        keep_packed(g[k], u[k]);
        if constexpr (kPairable<T> && V % 2 == 0) {
          // s rounded to T two at a time, times u in one packed multiply (exact product, one rounding).
          Pack<T, V> o;
#pragma unroll
          for (int j = 0; j < V / 2; ++j) {
            const float a = to_f32(g[k].v[2 * j]), b = to_f32(g[k].v[2 * j + 1]);
            pair(o, j) = __hmul2_rn(to_pair<T>(act(a, p.activation), act(b, p.activation)), pair(u[k], j));
          }
          store_pack(y + i * V, o);
        } else {
          float o[V];
#pragma unroll
          for (int j = 0; j < V; ++j) o[j] = forward_value<T>(to_f32(g[k].v[j]), to_f32(u[k].v[j]), p.activation);
          store<V>(y + i * V, o);
        }
      });
  const int64_t t = tail_index<V>(p.n);
  if (t >= 0) y[t] = from_f32<T>(forward_value<T>(to_f32(gate[at_row(p, t)]), to_f32(up[at_row(p, t)]), p.activation));
}

template <class T, int V> __device__ __forceinline__ void backward(const SwigluBackward &p) {
  const T *__restrict__ grad_y = static_cast<const T *>(p.grad_y);
  const T *__restrict__ gate = static_cast<const T *>(p.gate);
  const T *__restrict__ up = static_cast<const T *>(p.up);
  T *__restrict__ grad_gate = static_cast<T *>(p.grad_gate);
  T *__restrict__ grad_up = static_cast<T *>(p.grad_up);
  Pack<T, V> dy[U], g[U], u[U];
  const auto load = [&](int k, int64_t i) {
    const int64_t e = at_row(p, i * V);
    dy[k] = load_nc<V>(grad_y + i * V);
    g[k] = load_nc<V>(gate + e);
    u[k] = load_nc<V>(up + e);
  };
  // Stores vector i's gradients; returns its share of the row's dot (kDot).
  const auto finish = [&](auto dot, int k, int64_t i) {
    keep_packed(dy[k], g[k], u[k]);
    float dg[V], du[V], sum = 0.f;
#pragma unroll
    for (int j = 0; j < V; ++j)
      sum += backward_value<T, decltype(dot)::value>(to_f32(dy[k].v[j]), to_f32(g[k].v[j]), to_f32(u[k].v[j]),
                                                      p.activation, dg[j], du[j]);
    const int64_t o = at_row(i * V, p.cols, p.grad_ld);
    store<V>(grad_gate + o, dg);
    store<V>(grad_up + o, du);
    return sum;
  };
  if (for_each_vector_or_row<V, U>(p.n, p.cols, p.dot, load, finish)) return;
  const int64_t t = tail_index<V>(p.n);
  if (t >= 0) {
    float dg, du;
    const int64_t e = at_row(p, t);
    backward_value<T, false>(to_f32(grad_y[t]), to_f32(gate[e]), to_f32(up[e]), p.activation, dg, du);
    const int64_t o = at_row(t, p.cols, p.grad_ld);
    grad_gate[o] = from_f32<T>(dg);
    grad_up[o] = from_f32<T>(du);
  }
}

}  // namespace

#define FORWARD(...) ELEMENTWISE_KERNEL(swiglu, SWIGLU_BLOCK, SwigluForward, forward, __VA_ARGS__)
#define BACKWARD(...) ELEMENTWISE_KERNEL(swiglu, SWIGLU_BLOCK, SwigluBackward, backward, __VA_ARGS__)
SWIGLU_FORWARD_KERNELS(FORWARD)
SWIGLU_BACKWARD_KERNELS(BACKWARD)
