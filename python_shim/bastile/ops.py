"""Functional entry points: thin aliases of torch.ops.bastile.* with HF-style defaults."""
import torch

from . import _library  # noqa: F401  (loads the ops)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """HF RMSNorm: weight * to(x.dtype)(x * rsqrt(mean(x**2, -1) + eps)), statistics in float32."""
    return torch.ops.bastile.rms_norm(x, weight, eps)


def swiglu(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """HF's SwiGLU `act_fn(gate) * up` with act_fn = SiLU (Qwen3MLP), in the inputs' dtype: silu(gate) is
    computed in float32 and rounded to that dtype, then multiplied by up in float32 and rounded again.
    gate and up must have the same shape, dtype and device. The backward recomputes silu from the
    saved gate and up, so no activation is kept for it."""
    return torch.ops.bastile.swiglu(gate, up)
