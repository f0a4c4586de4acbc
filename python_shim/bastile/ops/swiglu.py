"""SwiGLU (HF's `act_fn(gate) * up` with SiLU): `swiglu`, and `BastileSwiGLUMLP`, the MLP built on it."""
import torch

from .. import _library  # noqa: F401  (loads the ops)


def swiglu(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """HF's SwiGLU `act_fn(gate) * up` with act_fn = SiLU (Qwen3MLP), in the inputs' dtype: silu(gate) is
    computed in float32 and rounded to that dtype, then multiplied by up in float32 and rounded again.
    gate and up must have the same shape, dtype and device. The backward recomputes silu from the
    saved gate and up, so no activation is kept for it."""
    return torch.ops.bastile.swiglu(gate, up)


def __getattr__(name):
    # BastileSwiGLUMLP (bastile.modules) runs bastile.hf's forward, and bastile.hf calls swiglu from
    # here: the class is fetched when asked for, so that neither import waits on the other.
    if name == "BastileSwiGLUMLP":
        from ..modules import BastileSwiGLUMLP
        return BastileSwiGLUMLP
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
