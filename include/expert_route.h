/* Parameter blocks of cuda/expert_route.cu: a mixture of experts' router after its logits. For each token t of
 * logits [tokens, experts] the forward picks chosen[t] [k], the k largest logits, largest first, a tie going to the
 * lower index (as torch.topk picks them; -0 equals +0 and NaN is the largest) and gives their weights [k]:
 *   renorm   w_s = e_s / sum_r e_r   (a softmax over the chosen logits)
 *   else     w_s = e_s / sum_j e^(logits[t, j] - m)   (the softmax over all experts, at the chosen)
 * with e_s = e^(logits[t, chosen[s]] - m), m the largest logit. With a `bias` [experts] (ERNIE 4.5's correction)
 * the choice is by P_j + bias[j] instead, P_j the softmax over all experts rounded to f32 (f64 for f64 logits) as
 * HF's float32 softmax; with renorm and `norm_min` > 0 the chosen's probabilities are divided by their sum S clamped
 * below at norm_min (ERNIE's moe_norm_min): where S < norm_min, w_s = P_s / norm_min. The backward gives the logits'
 * gradient for the weights' `grad` [tokens, k]: with dot = sum_s grad_s w_s and G_j = sum over the slots s choosing
 * j of grad_s (n_j of them),
 *   renorm   grad_logits[j] = p_j (G_j - n_j dot), p_j = e_j / sum_s e_s
 *   else     grad_logits[j] = p_j (G_j - dot),     p_j the softmax over all experts
 * and where the clamp holds, p_j (G_j - dot) / norm_min with p_j the softmax over all and dot = sum_s grad_s p_s
 * (slots choosing one expert twice, which the forward never gives, are summed as autograd sums them). Both in f32
 * (f64 on the CPU), each result rounded once; logits and grad_logits are of `dtype`, weights and grad of
 * `weights_dtype`. A chosen index outside 0..experts stops the backward's kernel (CUDA) or is an error (CPU). */
#pragma once
#include "bastile.h"

/* Threads per block: a warp a token. */
#define EXPERT_ROUTE_BLOCK 256

/* expert_route_<fwd|bwd>_<logits' dtype>_<weights' dtype> */
#define EXPERT_ROUTE_DTYPES(K, dir) \
  K(dir, f32, f32) K(dir, f32, f16) K(dir, f32, bf16) K(dir, f16, f32) K(dir, f16, f16) K(dir, f16, bf16) \
  K(dir, bf16, f32) K(dir, bf16, f16) K(dir, bf16, bf16)
#define EXPERT_ROUTE_FORWARD_KERNELS(K) EXPERT_ROUTE_DTYPES(K, fwd)
#define EXPERT_ROUTE_BACKWARD_KERNELS(K) EXPERT_ROUTE_DTYPES(K, bwd)
#define EXPERT_ROUTE_SIGMOID_FORWARD_KERNELS(K) EXPERT_ROUTE_DTYPES(K, sigmoid_fwd)
#define EXPERT_ROUTE_SIGMOID_BACKWARD_KERNELS(K) EXPERT_ROUTE_DTYPES(K, sigmoid_bwd)

typedef struct ExpertRouteForward {
  const void *logits;  /* [tokens, experts] */
  const float *bias;   /* [experts], or null */
  void *weights;       /* [tokens, k] */
  int64_t *chosen;     /* [tokens, k] */
  int64_t tokens;
  int64_t experts;
  int64_t k;
  float norm_min;
  int32_t dtype;
  int32_t weights_dtype;
  int32_t renorm;
} ExpertRouteForward;

typedef struct ExpertRouteBackward {
  const void *grad;       /* [tokens, k] */
  const void *logits;     /* [tokens, experts] */
  const int64_t *chosen;  /* [tokens, k] */
  void *grad_logits;      /* [tokens, experts] */
  int64_t tokens;
  int64_t experts;
  int64_t k;
  float norm_min;
  int32_t dtype;
  int32_t weights_dtype;
  int32_t renorm;
} ExpertRouteBackward;

/* The sigmoid router (GLM-4.5's and LFM2-MoE's): scores s_j = round(sigmoid(logits[t, j])) in `dtype` (as HF's
 * sigmoid rounds), chosen[t] the k largest of s_j + bias[j] (bias [experts] as f32, or none: s_j itself; the sum
 * rounded to `dtype` where `round_choice`, as torch rounds a sum of two 16-bit tensors) in the order above, and
 * their weights
 *   w_s = scale * s_c / (sum_r s_r + eps)   with renorm (the sum over the chosen), else scale * s_c.
 * The backward: with G_j, n_j as above and dot = sum_s grad_s s_s / (sum_r s_r + eps),
 *   grad_logits[j] = s_j (1 - s_j) * scale * (G_j - n_j dot) / (sum_r s_r + eps)   with renorm, else
 *   grad_logits[j] = s_j (1 - s_j) * scale * G_j
 * (s_j the rounded score, as HF's sigmoid backward reads its output); 0 for experts not chosen. With groups > 1
 * (GLM-4.5's n_group, at most 32) the experts are that many consecutive groups, each scored by the sum of its two
 * largest s_j + bias[j]; the experts outside the group_k best groups (ties to the lower group) choose as -inf. */
typedef struct ExpertRouteSigmoidForward {
  const void *logits;   /* [tokens, experts] */
  const float *bias;    /* [experts], or null */
  void *weights;        /* [tokens, k] */
  int64_t *chosen;      /* [tokens, k] */
  int64_t tokens;
  int64_t experts;
  int64_t k;
  int64_t groups;
  int64_t group_k;
  float eps;
  float scale;
  int32_t dtype;
  int32_t weights_dtype;
  int32_t renorm;
  int32_t round_choice;
} ExpertRouteSigmoidForward;

typedef struct ExpertRouteSigmoidBackward {
  const void *grad;       /* [tokens, k] */
  const void *logits;     /* [tokens, experts] */
  const int64_t *chosen;  /* [tokens, k] */
  void *grad_logits;      /* [tokens, experts] */
  int64_t tokens;
  int64_t experts;
  int64_t k;
  float eps;
  float scale;
  int32_t dtype;
  int32_t weights_dtype;
  int32_t renorm;
} ExpertRouteSigmoidBackward;
