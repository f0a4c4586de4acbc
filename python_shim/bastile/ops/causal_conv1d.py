"""Qwen3.5's short convolution (HF causal_conv1d_fn, before the gated delta rule of its Gated DeltaNet
layers): `causal_conv1d`."""
from typing import Optional

import torch

from .. import _library  # noqa: F401  (loads the ops)


def causal_conv1d(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor] = None,
                  cu_seqlens: Optional[torch.Tensor] = None, silu: bool = True) -> torch.Tensor:
    """The depthwise causal convolution of channels-last x [batch, T, C] with weight [C, W] (HF's
    conv1d.weight.squeeze(1), W <= 4) and bias [C], then SiLU where `silu`: y[b, t, c] = act(bias[c] +
    sum_i weight[c, i] x[b, t - W + 1 + i, c]), x before a sequence's start taken as 0. Sequences are the batch
    rows, or with cu_seqlens (int32/int64 [N + 1], batch 1) the packed spans. Math in float32 (float64 on CPU
    for float64 x), y rounded once to x's dtype. Differentiable in x, weight and bias."""
    return torch.ops.bastile.causal_conv1d(x, weight, bias, cu_seqlens, silu)
