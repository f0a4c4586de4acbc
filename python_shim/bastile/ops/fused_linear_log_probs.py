"""Per-token log-probabilities of a linear head without the logits: `fused_linear_log_probs`."""
from typing import NamedTuple

import torch

from .. import _library  # noqa: F401  (loads the ops)


class LogProbs(NamedTuple):
    log_probs: torch.Tensor
    entropy: torch.Tensor
    log_sum_sq_probs: torch.Tensor
    mean_logits: torch.Tensor
    is_top1: torch.Tensor


def fused_linear_log_probs(hidden: torch.Tensor, weight: torch.Tensor, target: torch.Tensor,
                           bias: torch.Tensor | None = None, ignore_index: int = -100, temperature: float = 1.0,
                           logit_scale: float = 1.0, softcap: float | None = None, uniform_grad: bool = False,
                           fp32_weight_grad: bool = True, chunk_bytes: int = 0) -> LogProbs:
    """What TRL's per-token heads compute, without materialising the [tokens, vocab] logits: with
    s = softcap(logit_scale * (hidden @ weight.T + bias)) / temperature (softcap(x) = softcap * tanh(x /
    softcap), or x) and p = softmax(s), per target: log p[target] and the entropy of p (both
    differentiable), log(sum p^2), the mean of s, and whether target is argmax(s) (the first maximum), all
    0 (False) where the target is ignore_index. float32 (float64 for float64 hidden), target's shape.

    The backward makes the logits again, chunk by chunk, since each row's upstream gradient is its own.
    uniform_grad promises that every counted row gets one and the same upstream gradient of log_probs, and
    none of the entropy (SFT's negative log-likelihood: -1 / tokens each): the forward then forms the
    gradients as the fused cross-entropy does (one GEMM fewer), and the backward checks the promise on the
    device. fp32_weight_grad and chunk_bytes are fused_linear_cross_entropy's."""
    return LogProbs(*torch.ops.bastile.fused_linear_log_probs(
        hidden, weight, target, bias, ignore_index, float(temperature), float(logit_scale), float(softcap or 0.0),
        uniform_grad, fp32_weight_grad, chunk_bytes))
