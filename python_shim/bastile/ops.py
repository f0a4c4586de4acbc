"""Functional entry points: thin aliases of torch.ops.bastile.* with HF-style defaults."""
import torch

from . import _library  # noqa: F401  (loads the ops)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """HF RMSNorm: weight * to(x.dtype)(x * rsqrt(mean(x**2, -1) + eps)), statistics in float32."""
    return torch.ops.bastile.rms_norm(x, weight, eps)
