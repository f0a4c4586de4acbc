/* Parameter blocks of cuda/expert_route.cu: a mixture of experts' router after its logits. For each token t of
 * logits [tokens, experts] the forward picks chosen[t] [k], the k largest logits, largest first, a tie going to the
 * lower index (as torch.topk picks them; -0 equals +0 and NaN is the largest) and gives their weights [k]:
 *   renorm   w_s = e_s / sum_r e_r   (a softmax over the chosen logits)
 *   else     w_s = e_s / sum_j e^(logits[t, j] - m)   (the softmax over all experts, at the chosen)
 * with e_s = e^(logits[t, chosen[s]] - m), m the largest logit. The backward gives the logits' gradient for the
 * weights' `grad` [tokens, k]: with dot = sum_s grad_s w_s and G_j = sum over the slots s choosing j of grad_s
 * (n_j of them),
 *   renorm   grad_logits[j] = p_j (G_j - n_j dot), p_j = e_j / sum_s e_s
 *   else     grad_logits[j] = p_j (G_j - dot),     p_j the softmax over all experts
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

typedef struct ExpertRouteForward {
  const void *logits;  /* [tokens, experts] */
  void *weights;       /* [tokens, k] */
  int64_t *chosen;     /* [tokens, k] */
  int64_t tokens;
  int64_t experts;
  int64_t k;
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
  int32_t dtype;
  int32_t weights_dtype;
  int32_t renorm;
} ExpertRouteBackward;
