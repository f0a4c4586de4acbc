"""RMSNorm (HF's LlamaRMSNorm, Qwen3RMSNorm, GptOssRMSNorm, GemmaRMSNorm): `rms_norm`, and
`BastileRMSNorm`, the module built on it."""
import torch

from .. import _library  # noqa: F401  (loads the ops)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float = 1e-6, cast_after_weight: bool = False,
             weight_offset: float = 0.0) -> torch.Tensor:
    """HF RMSNorm with n = x * rsqrt(mean(x**2, -1) + eps), statistics in float32:
    Llama/Qwen3's weight * to(x.dtype)(n), of dtype promote(x, weight), or with cast_after_weight
    GPT-OSS's to(x.dtype)(weight * n), the product in float32, of x's dtype. weight_offset (with
    cast_after_weight) is added to the weight in float32: 1 is Gemma's to(x.dtype)((1 + weight) * n)."""
    return torch.ops.bastile.rms_norm(x, weight, eps, cast_after_weight, weight_offset)


def __getattr__(name):
    # BastileRMSNorm (bastile.modules) runs bastile.hf's forward, and bastile.hf calls rms_norm from
    # here: the class is fetched when asked for, so that neither import waits on the other.
    if name == "BastileRMSNorm":
        from ..modules import BastileRMSNorm
        return BastileRMSNorm
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
