"""A mixture of experts' router after its logits: `expert_route`."""
from typing import Optional, Tuple

import torch

from .. import _library  # noqa: F401  (loads the ops)


def expert_route(logits: torch.Tensor, k: int, renorm: bool = True, dtype: Optional[torch.dtype] = None,
                 bias: Optional[torch.Tensor] = None, norm_min: float = 0.0) -> Tuple[torch.Tensor, torch.Tensor]:
    """Each token's top-k experts and their weights in one kernel: logits [tokens, experts] of float32, float16 or
    bfloat16 (float64 on CPU). Returns (weights [tokens, k] of `dtype`, float32 by default; chosen [tokens, k]
    int64): the k largest logits, largest first, a tie going to the lower index as torch.topk picks it (NaN
    first), and with `renorm` the softmax over the chosen logits (HF's top-k of the softmax renormalised by their
    sum, or its softmax over the top-k logits: the same numbers), else the softmax over all experts at the chosen.
    With `bias` [experts] (ERNIE 4.5's correction) the choice is by the float32 softmax plus the bias; with renorm,
    `norm_min` clamps the chosen probabilities' sum below (ERNIE's moe_norm_min). Computed in float32 (float64 on
    CPU) and rounded once. Differentiable in logits (through the weights; the bias only chooses); the backward
    recomputes the softmax from the saved logits."""
    return torch.ops.bastile.expert_route(logits, k, renorm, dtype, bias, norm_min)


def expert_route_sigmoid(logits: torch.Tensor, k: int, bias: Optional[torch.Tensor] = None, renorm: bool = False,
                         eps: float = 0.0, scale: float = 1.0, groups: int = 1, group_k: int = 1,
                         dtype: Optional[torch.dtype] = None) -> Tuple[torch.Tensor, torch.Tensor]:
    """A sigmoid router (GLM-4.5's, LFM2-MoE's) after its logits in one kernel: the scores sigmoid(logits) rounded to
    logits' dtype, chosen [tokens, k] (int64) the k largest of scores + bias (bias [experts] float32, None: the
    scores; ties to the lower index; with groups > 1, at most 32, only in the group_k of that many consecutive groups
    whose two largest sum highest, GLM-4.5's n_group and topk_group), weights [tokens, k] of `dtype` (float32 by
    default) their scores, with `renorm` divided by their sum plus eps, times scale: computed in float32 (float64 on
    CPU), rounded once. Differentiable in logits (the bias only chooses)."""
    return torch.ops.bastile.expert_route_sigmoid(logits, k, bias, renorm, eps, scale, groups, group_k, dtype)
