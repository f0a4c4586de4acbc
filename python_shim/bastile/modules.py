"""nn.Module versions of the ops, drop-in for the HF classes they replace."""
import torch
from torch import nn

from .ops import rms_norm


class BastileRMSNorm(nn.Module):
    """Same parameters and state-dict keys as HF's LlamaRMSNorm/Qwen3RMSNorm."""

    def __init__(self, hidden_size: int, eps: float = 1e-6, device=None, dtype=None):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size, device=device, dtype=dtype))
        self.variance_epsilon = eps

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        return rms_norm(hidden_states, self.weight, self.variance_epsilon)

    def extra_repr(self) -> str:
        return f"{tuple(self.weight.shape)}, eps={self.variance_epsilon}"
