// A mixture of experts' router after its logits (include/expert_route.h), softmax or sigmoid: a warp a token. The
// forward picks the k largest logits (scores; ERNIE's softmax plus its bias) in k rounds, each the warp's largest
// key below the last pick's (so it keeps nothing but the last key), the key ordering them as torch.topk picks them;
// the row is read again from L1 each round (a row of Qwen3-MoE's 128 experts is 256 bytes). The backward finds
// the slots choosing each expert through the warp's shuffles. Math in f32 with every sum reduced in one fixed
// order, each result rounded once.
#include "common.cuh"
#include "expert_route.h"

using namespace bastile;

namespace {

constexpr int BLOCK = EXPERT_ROUTE_BLOCK;
constexpr unsigned FULL = 0xffffffffu;

// A logit's place in the picking order: larger values first (-0 as +0, NaN above everything), then the lower
// index. Its high word orders the values as unsigned integers, its low word the indices, reversed.
__device__ __forceinline__ uint64_t rank_key(float v, int64_t j) {
  const uint32_t bits = __float_as_uint(v == 0.f ? 0.f : v);
  const uint32_t ordered = isnan(v) ? FULL : (bits & 0x80000000u) ? ~bits : bits | 0x80000000u;
  return (static_cast<uint64_t>(ordered) << 32) | (FULL - static_cast<uint32_t>(j));
}

__device__ __forceinline__ float key_value(uint64_t key) {
  const uint32_t ordered = static_cast<uint32_t>(key >> 32);
  if (ordered == FULL) return __uint_as_float(0x7fc00000u);
  return __uint_as_float((ordered & 0x80000000u) ? ordered & 0x7fffffffu : ~ordered);
}

__device__ __forceinline__ int64_t key_index(uint64_t key) { return FULL - static_cast<uint32_t>(key); }

__device__ __forceinline__ uint64_t warp_max(uint64_t v) {
#pragma unroll
  for (int o = 16; o > 0; o /= 2) {
    const uint64_t u = __shfl_xor_sync(FULL, v, o);
    v = u > v ? u : v;
  }
  return v;
}

// The butterfly leaves every lane the same sum, whatever the row.
__device__ __forceinline__ float warp_sum(float v) {
#pragma unroll
  for (int o = 16; o > 0; o /= 2) v += __shfl_xor_sync(FULL, v, o);
  return v;
}

// G_j and n_j of a row's slots (include/expert_route.h) for each lane's expert j: the slots are passed round the warp.
template <class W>
__device__ __forceinline__ float2 chosen_grad(int64_t j, const int64_t *pick, const W *g, int64_t k, int lane) {
  float chose = 0.f, times = 0.f;
  for (int64_t s0 = 0; s0 < k; s0 += 32) {
    const int64_t s = s0 + lane;
    const int64_t c = s < k ? pick[s] : -1;
    const float gs = s < k ? to_f32(g[s]) : 0.f;
    const int slots = static_cast<int>(k - s0 < 32 ? k - s0 : 32);
    for (int i = 0; i < slots; ++i) {
      const int64_t ci = __shfl_sync(FULL, c, i);
      const float gi = __shfl_sync(FULL, gs, i);
      if (ci == j) {
        chose += gi;
        times += 1.f;
      }
    }
  }
  return make_float2(chose, times);
}

// Each warp takes its token (a row of logits) in turn; the test is the warp's own, so uniform.
template <class Body> __device__ __forceinline__ void for_each_token(int64_t tokens, const Body &body) {
  FOR_EACH_ROW_GROUP(base, tokens, BLOCK / 32) {
    const int64_t t = base + threadIdx.x / 32;
    if (t < tokens) body(t);
  }
}

// The k largest choice(j) of a row in k rounds, each the warp's largest key below the last pick's (so it keeps
// nothing but the last key); lane r % 32 writes pick r, and every lane sees each pick's key through seen(r, key).
template <class Choice, class Seen>
__device__ __forceinline__ void pick_top_k(const Choice &choice, int64_t experts, int64_t k, int64_t *pick, int lane,
                                           const Seen &seen) {
  uint64_t last = ~0ull;
  for (int64_t r = 0; r < k; ++r) {
    uint64_t best = 0;  // below every key
    for (int64_t j = lane; j < experts; j += 32) {
      const uint64_t key = rank_key(choice(j), j);
      if (key < last && key > best) best = key;
    }
    last = warp_max(best);
    seen(r, last);
    if (r % 32 == lane) pick[r] = key_index(last);
  }
}

// The row's largest logit, as the forward's first pick has it.
template <class T> __device__ __forceinline__ float row_max(const T *row, int64_t experts, int lane) {
  uint64_t best = 0;  // below every key
  for (int64_t j = lane; j < experts; j += 32) {
    const uint64_t key = rank_key(to_f32(row[j]), j);
    best = key > best ? key : best;
  }
  return key_value(warp_max(best));
}

template <class T> __device__ __forceinline__ float softmax_sum(const T *row, int64_t experts, float top, int lane) {
  float sum = 0.f;
  for (int64_t j = lane; j < experts; j += 32) sum += expf(to_f32(row[j]) - top);
  return warp_sum(sum);
}

template <class T, class W> __device__ __forceinline__ void forward(const ExpertRouteForward &p) {
  const T *__restrict__ logits = static_cast<const T *>(p.logits);
  W *__restrict__ weights = static_cast<W *>(p.weights);
  const int lane = threadIdx.x % 32;
  const bool clamps = p.renorm && p.norm_min > 0.f;
  for_each_token(p.tokens, [&](int64_t t) {
    const T *row = logits + t * p.experts;
    int64_t *pick = p.chosen + t * p.k;
    float top = 0.f, total = 0.f, picked_sum = 0.f;
    if (p.bias) {
      // chosen by the float32 softmax plus the bias: the softmax's total first
      top = row_max(row, p.experts, lane);
      total = softmax_sum(row, p.experts, top, lane);
      pick_top_k([&](int64_t j) { return expf(to_f32(row[j]) - top) / total + p.bias[j]; }, p.experts, p.k, pick,
                 lane, [&](int64_t, uint64_t key) { picked_sum += expf(to_f32(row[key_index(key)]) - top); });
    } else {
      pick_top_k([&](int64_t j) { return to_f32(row[j]); }, p.experts, p.k, pick, lane, [&](int64_t r, uint64_t key) {
        const float v = key_value(key);
        if (r == 0) top = v;
        picked_sum += expf(v - top);
      });
      if (!p.renorm || clamps) total = softmax_sum(row, p.experts, top, lane);
    }
    const float sum = !p.renorm ? total : clamps && picked_sum < p.norm_min * total ? p.norm_min * total : picked_sum;
    // each lane reads back the picks it wrote
    for (int64_t s = lane; s < p.k; s += 32) weights[t * p.k + s] = from_f32<W>(expf(to_f32(row[pick[s]]) - top) / sum);
  });
}

template <class T, class W> __device__ __forceinline__ void backward(const ExpertRouteBackward &p) {
  const T *__restrict__ logits = static_cast<const T *>(p.logits);
  const W *__restrict__ grad = static_cast<const W *>(p.grad);
  T *__restrict__ out = static_cast<T *>(p.grad_logits);
  const int lane = threadIdx.x % 32;
  for_each_token(p.tokens, [&](int64_t t) {
    const T *row = logits + t * p.experts;
    const int64_t *pick = p.chosen + t * p.k;
    const W *g = grad + t * p.k;
    const float top = row_max(row, p.experts, lane);
    const auto picked = [&](int64_t s) {
      return expf(to_f32(row[checked_index(pick[s], p.experts, "expert_route", "chosen")]) - top);
    };
    float sum = 0.f, scale = 1.f;
    bool renorm = p.renorm;
    if (p.renorm) {
      for (int64_t s = lane; s < p.k; s += 32) sum += picked(s);
      sum = warp_sum(sum);
      if (p.norm_min > 0.f) {
        // the forward's clamp: the weights P_s / norm_min, the softmax over all scaled
        const float total = softmax_sum(row, p.experts, top, lane);
        if (sum < p.norm_min * total) {
          renorm = false;
          sum = total;
          scale = 1.f / p.norm_min;
        }
      }
    } else {
      sum = softmax_sum(row, p.experts, top, lane);
    }
    float dot = 0.f;
    for (int64_t s = lane; s < p.k; s += 32) dot += to_f32(g[s]) * (picked(s) / sum);
    dot = warp_sum(dot);
    for (int64_t j0 = 0; j0 < p.experts; j0 += 32) {
      const int64_t j = j0 + lane;
      const auto [chose, times] = chosen_grad(j, pick, g, p.k, lane);
      if (j >= p.experts) continue;
      const float pj = expf(to_f32(row[j]) - top) / sum;
      const float value = renorm ? (times > 0.f ? pj * (chose - times * dot) : 0.f) : pj * (chose - dot) * scale;
      out[t * p.experts + j] = from_f32<T>(value);
    }
  });
}

// The sigmoid router's score of expert j, rounded to the logits' dtype as HF's sigmoid rounds it.
template <class T> __device__ __forceinline__ float score(const T *row, int64_t j) {
  return round_to<T>(1.f / (1.f + expf(-to_f32(row[j]))));
}

// The groups whose experts may be chosen, a bit each: every group, or the group_k whose two largest choice values
// sum highest (lane g holds group g's sum; the groups picked in rounds as the experts are).
template <class Choice>
__device__ __forceinline__ uint32_t allowed_groups(const ExpertRouteSigmoidForward &p, const Choice &choice, int lane) {
  if (p.group_k >= p.groups) return FULL;
  const int64_t size = p.experts / p.groups;
  float mine = -INFINITY;
  for (int64_t g = 0; g < p.groups; ++g) {
    uint64_t top[2] = {0, 0};
    for (int i = 0; i < 2; ++i) {
      const uint64_t above = i ? top[0] : ~0ull;
      for (int64_t j = g * size + lane; j < (g + 1) * size; j += 32) {
        const uint64_t key = rank_key(choice(j), j);
        if (key < above && key > top[i]) top[i] = key;
      }
      top[i] = warp_max(top[i]);
    }
    if (lane == g) mine = key_value(top[0]) + key_value(top[1]);
  }
  uint32_t allowed = 0;
  uint64_t last = ~0ull;
  for (int64_t r = 0; r < p.group_k; ++r) {
    const uint64_t key = lane < p.groups ? rank_key(mine, lane) : 0;
    last = warp_max(key < last ? key : 0);
    allowed |= 1u << key_index(last);
  }
  return allowed;
}

template <class T, class W> __device__ __forceinline__ void sigmoid_forward(const ExpertRouteSigmoidForward &p) {
  const T *__restrict__ logits = static_cast<const T *>(p.logits);
  W *__restrict__ weights = static_cast<W *>(p.weights);
  const int lane = threadIdx.x % 32;
  for_each_token(p.tokens, [&](int64_t t) {
    const T *row = logits + t * p.experts;
    int64_t *pick = p.chosen + t * p.k;
    const auto choice = [&](int64_t j) {
      if (!p.bias) return score(row, j);
      const float c = score(row, j) + p.bias[j];
      return p.round_choice ? round_to<T>(c) : c;
    };
    const uint32_t allowed = allowed_groups(p, choice, lane);
    const int64_t size = p.experts / p.groups;
    float picked_sum = 0.f;
    pick_top_k([&](int64_t j) { return (allowed >> (j / size)) & 1u ? choice(j) : -INFINITY; }, p.experts, p.k, pick,
               lane, [&](int64_t, uint64_t key) { picked_sum += score(row, key_index(key)); });
    const float denominator = p.renorm ? picked_sum + p.eps : 1.f;
    for (int64_t s = lane; s < p.k; s += 32)
      weights[t * p.k + s] = from_f32<W>(score(row, pick[s]) / denominator * p.scale);
  });
}

template <class T, class W> __device__ __forceinline__ void sigmoid_backward(const ExpertRouteSigmoidBackward &p) {
  const T *__restrict__ logits = static_cast<const T *>(p.logits);
  const W *__restrict__ grad = static_cast<const W *>(p.grad);
  T *__restrict__ out = static_cast<T *>(p.grad_logits);
  const int lane = threadIdx.x % 32;
  for_each_token(p.tokens, [&](int64_t t) {
    const T *row = logits + t * p.experts;
    const int64_t *pick = p.chosen + t * p.k;
    const W *g = grad + t * p.k;
    const auto picked = [&](int64_t s) {
      return score(row, checked_index(pick[s], p.experts, "expert_route_sigmoid", "chosen"));
    };
    float sum = 0.f, dot = 0.f;
    for (int64_t s = lane; s < p.k; s += 32) {
      const float v = picked(s);
      sum += v;
      dot += to_f32(g[s]) * v;
    }
    const float denominator = p.renorm ? warp_sum(sum) + p.eps : 1.f;
    dot = p.renorm ? warp_sum(dot) / denominator : 0.f;
    for (int64_t j0 = 0; j0 < p.experts; j0 += 32) {
      const int64_t j = j0 + lane;
      const auto [chose, times] = chosen_grad(j, pick, g, p.k, lane);
      if (j >= p.experts) continue;
      const float v = score(row, j);
      const float value = times > 0.f ? v * (1.f - v) * (p.scale * (chose - times * dot) / denominator) : 0.f;
      out[t * p.experts + j] = from_f32<T>(value);
    }
  });
}

}  // namespace

#define KERNEL(dir, t, w)                                                                                   \
  extern "C" __global__ void __launch_bounds__(BLOCK)                                                        \
      expert_route_##dir##_##t##_##w(const BASTILE_CAT(ExpertRoute, DIR_##dir) p) {                          \
    RUN_##dir<BASTILE_TYPE_##t, BASTILE_TYPE_##w>(p);                                                        \
  }
#define DIR_fwd Forward
#define DIR_bwd Backward
#define DIR_sigmoid_fwd SigmoidForward
#define DIR_sigmoid_bwd SigmoidBackward
#define RUN_fwd forward
#define RUN_bwd backward
#define RUN_sigmoid_fwd sigmoid_forward
#define RUN_sigmoid_bwd sigmoid_backward
EXPERT_ROUTE_FORWARD_KERNELS(KERNEL)
EXPERT_ROUTE_BACKWARD_KERNELS(KERNEL)
EXPERT_ROUTE_SIGMOID_FORWARD_KERNELS(KERNEL)
EXPERT_ROUTE_SIGMOID_BACKWARD_KERNELS(KERNEL)
