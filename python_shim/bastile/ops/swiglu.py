"""Gated activations (HF's `act_fn(gate) * up` with SiLU, or GELU-tanh as Gemma's MLP): `swiglu`, and
`BastileSwiGLUMLP`, the MLP built on it."""
import torch

from .. import _library  # noqa: F401  (loads the ops)


def swiglu(gate: torch.Tensor, up: torch.Tensor, activation: str = "silu") -> torch.Tensor:
    """HF's `act_fn(gate) * up` with act_fn SiLU (`"silu"`, Qwen3MLP's SwiGLU) or GELU with the tanh
    approximation (`"gelu_tanh"`, HF's gelu_pytorch_tanh: Gemma's GEGLU), in the inputs' dtype:
    act_fn(gate) is computed in float32 and rounded to that dtype, then multiplied by up in float32 and
    rounded again. gate and up must have the same shape, dtype and device. The backward recomputes the
    activation from the saved gate and up, so none is kept for it."""
    return torch.ops.bastile.swiglu(gate, up, activation)


def __getattr__(name):
    # BastileSwiGLUMLP (bastile.modules) runs bastile.hf's forward, and bastile.hf calls swiglu from
    # here: the class is fetched when asked for, so that neither import waits on the other.
    if name == "BastileSwiGLUMLP":
        from ..modules import BastileSwiGLUMLP
        return BastileSwiGLUMLP
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
