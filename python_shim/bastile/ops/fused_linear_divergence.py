"""The divergence between a student's and a teacher's next-token distributions without their logits:
`fused_linear_divergence`."""
from typing import NamedTuple

import torch

from .. import _library  # noqa: F401  (loads the ops)


class Divergence(NamedTuple):
    divergence: torch.Tensor
    entropy: torch.Tensor


def fused_linear_divergence(student_hidden: torch.Tensor, student_weight: torch.Tensor, teacher_hidden: torch.Tensor,
                            teacher_weight: torch.Tensor, mask: torch.Tensor | None = None,
                            student_bias: torch.Tensor | None = None, teacher_bias: torch.Tensor | None = None,
                            beta: float = 0.5, temperature: float = 1.0, student_scale: float = 1.0,
                            student_softcap: float | None = None, teacher_scale: float = 1.0,
                            teacher_softcap: float | None = None, fp32_weight_grad: bool = True,
                            chunk_bytes: int = 0) -> Divergence:
    """TRL's generalized JSD between the student's and the teacher's next-token distributions, summed over the
    rows `mask` (bool, the hiddens' leading shape; None: all) keeps, and the sum of the student's entropies there,
    without forming either [rows, vocab] logits. Each side's logits are its hidden [..., width] @ weight.T
    [vocab, width] (+ bias), computed in float32 from the hidden's dtype (as TRL's function projects them),
    then z = softcap(scale * logits) / temperature (softcap(x) = softcap * tanh(x / softcap), or x).
    beta = 0 is the forward KL(teacher || student), 1 the reverse KL(student || teacher), between them
    beta KL(p_t || m) + (1 - beta) KL(p_s || m) with m = (1 - beta) p_s + beta p_t. Both sums are 0-dim float32
    (float64 for float64 hidden); the divergence is differentiable in the student's hidden, weight and bias,
    the teacher gets no gradient and the entropy none. The student's gradients are formed in the forward and
    scaled in the backward; fp32_weight_grad and chunk_bytes (the chunk buffers' budget, 0: 1 GiB) are
    fused_linear_cross_entropy's."""
    return Divergence(*torch.ops.bastile.fused_linear_divergence(
        student_hidden, student_weight, teacher_hidden, teacher_weight, mask, student_bias, teacher_bias, float(beta),
        float(temperature), float(student_scale), float(student_softcap or 0.0), float(teacher_scale),
        float(teacher_softcap or 0.0), fp32_weight_grad, chunk_bytes))
