// GPT-OSS's expert activation (HF GptOssExperts._apply_gate) on gate_up, whose last dim interleaves
// gate (even positions) and up (odd): with L = limit rounded to T (as torch's clamp rounds its bound),
//   g = min(gate, L), u = clamp(up, -L, L), s = sig(alpha * g)
//   y         = (u + 1) * g * s
//   grad_gate = dy * (u + 1) * s * (1 + alpha * g * (1 - s))   where gate <= L, else 0
//   grad_up   = dy * g * s                                      where -L <= up <= L, else 0
// with the bounds themselves inside where the running torch's clamp backward passes the gradient there
// (p.at_limit), outside where it stops it. Math in f32, every result
// rounded once to T: HF rounds after each op in T, so these are closer to the exact values. The
// backward recomputes s from the saved gate_up instead of saving an activation.
//
// The pairs are flat, row boundaries fall between pairs: the `vec` variants take V = 16 / sizeof(T)
// pairs per access, two 16-byte vectors of gate_up for one 16-byte vector of y (or of grad_y), and
// need every pointer 16-byte aligned; the last n % V pairs take scalar accesses. The `scalar`
// variants take any alignment. With a bias (the experts'), gate and up are each gate_up + bias of the
// row's expert rounded to T first; the vec variants read the bias as vectors too, so Rust launches them
// with a bias only where a row is whole vectors. Asked (p.dot), the backward also sums each row's
// dy * y (the experts' routing weights' gradient), a warp a row, over rows of whole vectors likewise.
#include "elementwise.cuh"
#include "geglu.h"

using namespace bastile;

namespace {

constexpr int U = GEGLU_UNROLL;

struct Gate {
  float alpha, limit;
  bool at_limit;  // the gradient passes at the bounds

  // NaN passes through both clamps, as in torch.
  __device__ __forceinline__ float gate(float g) const { return g > limit ? limit : g; }
  __device__ __forceinline__ float up(float u) const {
    u = u < -limit ? -limit : u;
    return u > limit ? limit : u;
  }

  __device__ __forceinline__ float forward(float g, float u) const {
    g = gate(g);
    return (up(u) + 1.f) * (g * sigmoid(alpha * g));
  }

  // The gradients of a pair; with kDot, also dy times its y as the forward rounds it (the row's dot).
  template <class T, bool kDot>
  __device__ __forceinline__ float backward(float dy, float g, float u, float &dg, float &du) const {
    const float gc = gate(g), s = sigmoid(alpha * gc);
    // Written so that a NaN input fails the test and gets 0, as torch's where(mask, grad, 0) gives.
    const bool g_in = at_limit ? g <= limit : g < limit, u_in = at_limit ? u >= -limit && u <= limit : u > -limit && u < limit;
    dg = g_in ? dy * (up(u) + 1.f) * (s * (1.f + alpha * gc * (1.f - s))) : 0.f;
    du = u_in ? dy * (gc * s) : 0.f;
    return kDot ? dy * round_to<T>((up(u) + 1.f) * (gc * s)) : 0.f;
  }
};

template <class T> __device__ __forceinline__ Gate gate_of(double alpha, double limit, bool at_limit = true) {
  // Through f32 to T, as c10's Scalar conversion goes.
  return Gate{(float)alpha, round_to<T>((float)limit), at_limit};
}

// The 2V elements of gate_up behind V pairs, as the two vectors they are loaded in.
template <class T, int V> struct Pairs {
  Pack<T, V> lo, hi;
  __device__ __forceinline__ void load(const T *p) {
    lo = load_nc<V>(p);
    hi = load_nc<V>(p + V);
  }
  __device__ __forceinline__ float operator[](int m) const { return to_f32(m < V ? lo.v[m] : hi.v[m - V]); }
};

// A row's expert's bias (GegluBias), or none (kBias false).
template <class T, bool kBias> struct Bias {
  const T *bias;
  const int64_t *expert;
  int64_t inter, experts;

  __device__ __forceinline__ Bias(const GegluBias &b, int64_t inter)
      : bias(static_cast<const T *>(b.bias)), expert(b.expert), inter(inter), experts(b.experts) {}

  // The (gate, up) bias of pair i and those after it in its row (a 32-bit division where i allows: 64-bit is many
  // times the instructions, on every vector).
  __device__ __forceinline__ const T *of(int64_t i) const {
    const int64_t r = (i | inter) >> 32 == 0 ? (int64_t)((uint32_t)i / (uint32_t)inter) : i / inter;
    return bias + checked_index(__ldg(expert + r), experts, "geglu", "expert") * 2 * inter + 2 * (i - r * inter);
  }

  // gate_up's element m of the V pairs (as loaded in x) plus the bias's (in b), rounded to T as HF's sum.
  template <int V> __device__ __forceinline__ float add(const Pairs<T, V> &x, const Pairs<T, V> &b, int m) const {
    return kBias ? round_to<T>(x[m] + b[m]) : x[m];
  }
  __device__ __forceinline__ float add(const T *x, int64_t i, int m) const {
    return kBias ? round_to<T>(to_f32(x[2 * i + m]) + to_f32(of(i)[m])) : to_f32(x[2 * i + m]);
  }
};

template <class T, int V, bool kBias> __device__ __forceinline__ void forward(const GegluForward &p) {
  const T *__restrict__ x = static_cast<const T *>(p.gate_up);
  T *__restrict__ y = static_cast<T *>(p.y);
  const Gate f = gate_of<T>(p.alpha, p.limit);
  const Bias<T, kBias> b(p.bias, p.inter);
  Pairs<T, V> in[U], add[U];
  for_each_vector<V, U>(
      p.n,
      [&](int k, int64_t i) {
        in[k].load(x + 2 * V * i);
        if constexpr (kBias) add[k].load(b.of(V * i));
      },
      [&](int k, int64_t i) {
        keep_packed(in[k].lo, in[k].hi);
        if constexpr (kBias) keep_packed(add[k].lo, add[k].hi);
        float o[V];
#pragma unroll
        for (int j = 0; j < V; ++j) o[j] = f.forward(b.add(in[k], add[k], 2 * j), b.add(in[k], add[k], 2 * j + 1));
        store<V>(y + V * i, o);
      });
  const int64_t t = tail_index<V>(p.n);
  if (t >= 0) y[t] = from_f32<T>(f.forward(b.add(x, t, 0), b.add(x, t, 1)));
}

template <class T, int V, bool kBias> __device__ __forceinline__ void backward(const GegluBackward &p) {
  const T *__restrict__ grad_y = static_cast<const T *>(p.grad_y);
  const T *__restrict__ x = static_cast<const T *>(p.gate_up);
  T *__restrict__ dx = static_cast<T *>(p.grad_gate_up);
  const Gate f = gate_of<T>(p.alpha, p.limit, p.at_limit != 0);
  const Bias<T, kBias> b(p.bias, p.inter);
  Pack<T, V> dy[U];
  Pairs<T, V> in[U], add[U];
  const auto load = [&](int k, int64_t i) {
    dy[k] = load_nc<V>(grad_y + V * i);
    in[k].load(x + 2 * V * i);
    if constexpr (kBias) add[k].load(b.of(V * i));
  };
  // Stores vector i's gradients; returns its share of the row's dot (kDot).
  const auto finish = [&](auto dot, int k, int64_t i) {
    keep_packed(dy[k], in[k].lo, in[k].hi);
    if constexpr (kBias) keep_packed(add[k].lo, add[k].hi);
    float d[2][V], sum = 0.f;  // d as lo and hi
#pragma unroll
    for (int j = 0; j < V; ++j) {
      const int m = 2 * j;
      sum += f.backward<T, decltype(dot)::value>(to_f32(dy[k].v[j]), b.add(in[k], add[k], m),
                                                  b.add(in[k], add[k], m + 1), d[m / V][m % V],
                                                  d[(m + 1) / V][(m + 1) % V]);
    }
    store<V>(dx + 2 * V * i, d[0]);
    store<V>(dx + 2 * V * i + V, d[1]);
    return sum;
  };
  if (for_each_vector_or_row<V, U>(p.n, p.inter, p.dot, load, finish)) return;
  const int64_t t = tail_index<V>(p.n);
  if (t >= 0) {
    float dg, du;
    f.backward<T, false>(to_f32(grad_y[t]), b.add(x, t, 0), b.add(x, t, 1), dg, du);
    dx[2 * t] = from_f32<T>(dg);
    dx[2 * t + 1] = from_f32<T>(du);
  }
}

// Each kernel in two forms, by whether a bias is given (the same for every thread).
template <class T, int V> __device__ __forceinline__ void forward(const GegluForward &p) {
  if (p.bias.bias != nullptr) forward<T, V, true>(p);
  else forward<T, V, false>(p);
}

template <class T, int V> __device__ __forceinline__ void backward(const GegluBackward &p) {
  if (p.bias.bias != nullptr) backward<T, V, true>(p);
  else backward<T, V, false>(p);
}

}  // namespace

#define FORWARD(...) ELEMENTWISE_KERNEL(geglu, GEGLU_BLOCK, GegluForward, forward, __VA_ARGS__)
#define BACKWARD(...) ELEMENTWISE_KERNEL(geglu, GEGLU_BLOCK, GegluBackward, backward, __VA_ARGS__)
GEGLU_FORWARD_KERNELS(FORWARD)
GEGLU_BACKWARD_KERNELS(BACKWARD)
