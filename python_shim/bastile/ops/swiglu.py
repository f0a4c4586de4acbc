"""Gated activations (HF's `act_fn(gate) * up` with SiLU, or GELU-tanh as Gemma's MLP): `swiglu`, and
`BastileSwiGLUMLP`, the MLP built on it."""
import torch
from torch import nn

from .. import _library  # noqa: F401  (loads the ops)


def swiglu(gate: torch.Tensor, up: torch.Tensor, activation: str = "silu") -> torch.Tensor:
    """HF's `act_fn(gate) * up` with act_fn SiLU (`"silu"`, Qwen3MLP's SwiGLU) or GELU with the tanh
    approximation (`"gelu_tanh"`, HF's gelu_pytorch_tanh: Gemma's GEGLU), in the inputs' dtype:
    act_fn(gate) is computed in float32 and rounded to that dtype, then multiplied by up in float32 and
    rounded again. gate and up must have the same shape, dtype and device. The backward recomputes the
    activation from the saved gate and up, so none is kept for it."""
    return torch.ops.bastile.swiglu(gate, up, activation)


class BastileSwiGLUMLP(nn.Module):
    """Drop-in for Qwen3MLP/LlamaMLP (same submodules and state-dict keys): down(silu(gate(x)) * up(x)) with
    the activation and product in one op. The projections stay nn.Linear, so PEFT/LoRA can wrap them."""

    def __init__(self, config, device=None, dtype=None):
        super().__init__()
        self.config = config
        self.hidden_size, self.intermediate_size = config.hidden_size, config.intermediate_size
        kw = dict(bias=getattr(config, "mlp_bias", False), device=device, dtype=dtype)
        self.gate_proj = nn.Linear(self.hidden_size, self.intermediate_size, **kw)
        self.up_proj = nn.Linear(self.hidden_size, self.intermediate_size, **kw)
        self.down_proj = nn.Linear(self.intermediate_size, self.hidden_size, **kw)
        if config.hidden_act not in ("silu", "swish"):
            raise ValueError(f"BastileSwiGLUMLP: hidden_act must be silu, got {config.hidden_act!r}")

    def forward(self, x):
        return self.down_proj(swiglu(self.gate_proj(x), self.up_proj(x)))
