"""RMSNorm (HF's LlamaRMSNorm, Qwen3RMSNorm, GptOssRMSNorm, GemmaRMSNorm): `rms_norm`, and
`BastileRMSNorm`, the module built on it."""
import torch
from torch import nn

from .. import _library  # noqa: F401  (loads the ops)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float = 1e-6, cast_after_weight: bool = False,
             weight_offset: float = 0.0) -> torch.Tensor:
    """HF RMSNorm with n = x * rsqrt(mean(x**2, -1) + eps), statistics in float32:
    Llama/Qwen3's weight * to(x.dtype)(n), of dtype promote(x, weight), or with cast_after_weight
    GPT-OSS's to(x.dtype)(weight * n), the product in float32, of x's dtype. weight_offset (with
    cast_after_weight) is added to the weight in float32: 1 is Gemma's to(x.dtype)((1 + weight) * n)."""
    return torch.ops.bastile.rms_norm(x, weight, eps, cast_after_weight, weight_offset)


class BastileRMSNorm(nn.Module):
    """Same parameters and state-dict keys as HF's LlamaRMSNorm/Qwen3RMSNorm, whose math it computes."""

    def __init__(self, hidden_size: int, eps: float = 1e-6, device=None, dtype=None):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size, device=device, dtype=dtype))
        self.variance_epsilon = eps

    def forward(self, hidden_states):
        return rms_norm(hidden_states, self.weight, self.variance_epsilon)

    def extra_repr(self) -> str:
        return f"{tuple(self.weight.shape)}, eps={self.variance_epsilon}"
