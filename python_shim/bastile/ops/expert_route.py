"""A mixture of experts' router after its logits: `expert_route`."""
from typing import Optional, Tuple

import torch

from .. import _library  # noqa: F401  (loads the ops)


def expert_route(logits: torch.Tensor, k: int, renorm: bool = True,
                 dtype: Optional[torch.dtype] = None) -> Tuple[torch.Tensor, torch.Tensor]:
    """Each token's top-k experts and their weights in one kernel: logits [tokens, experts] of float32, float16 or
    bfloat16 (float64 on CPU). Returns (weights [tokens, k] of `dtype`, float32 by default; chosen [tokens, k]
    int64): the k largest logits, largest first, a tie going to the lower index as torch.topk picks it (NaN
    first), and with `renorm` the softmax over the chosen logits (HF's top-k of the softmax renormalised by their
    sum, or its softmax over the top-k logits: the same numbers), else the softmax over all experts at the chosen.
    Computed in float32 (float64 on CPU) and rounded once. Differentiable in logits (through the weights); the
    backward recomputes the softmax from the saved logits."""
    return torch.ops.bastile.expert_route(logits, k, renorm, dtype)
