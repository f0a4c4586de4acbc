"""Qwen3.5's gated RMSNorm (HF Qwen3_5RMSNormGated, the output norm of its Gated DeltaNet layers):
`rms_norm_gated`."""
import torch

from .. import _library  # noqa: F401  (loads the ops)


def rms_norm_gated(x: torch.Tensor, z: torch.Tensor, weight: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """HF Qwen3_5RMSNormGated(x, gate=z) in one kernel: to(x.dtype)(weight * to(x.dtype)(n) * silu(z)) with
    n = x * rsqrt(mean(x**2, -1) + eps), statistics and products in float32 (float64 on CPU for float64 x),
    of x's dtype whatever the weight's. HF also rounds weight * n to promote(x, weight) before the gate;
    here y is rounded once. z has x's shape and dtype; one whose rows lie one stride apart with a unit last
    stride (a slice of a fused projection) is read in place. Differentiable in x, z and weight."""
    return torch.ops.bastile.rms_norm_gated(x, z, weight, eps)
