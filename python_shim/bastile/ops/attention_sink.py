"""A learned sink logit per head joined to an attention output computed without it: `attention_sink`."""
import torch

from .. import _library  # noqa: F401  (loads the ops)


def attention_sink(out: torch.Tensor, lse: torch.Tensor, sinks: torch.Tensor) -> torch.Tensor:
    """The attention with one sink logit per head (GPT-OSS's `sinks`: a column of the softmax with no value, dropped
    after it) from the attention without it: out [..., heads, dim] and its rows' log-sum-exp of the scores lse
    [..., heads] (float32; float64 with float64 out) as a flash kernel returns them, sinks [heads] of any float
    dtype. Returns out * exp(lse - logaddexp(lse, sinks)) in out's dtype, computed in float32 (float64 on CPU)
    and rounded once. Differentiable in all three.

    `torch.ops.bastile.attention_sink_forward` also returns the normaliser logaddexp(lse, sinks) (in memory
    [heads, tokens], as flash kernels lay out their log-sum-exp), and `attention_sink_backward(grad_y, y,
    normaliser, sinks, lse=None)` the gradients of out (given lse, else an empty tensor), lse and sinks:
    bastile.sinks runs them around torch's flash kernels."""
    return torch.ops.bastile.attention_sink(out, lse, sinks)
