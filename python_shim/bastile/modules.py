"""nn.Module versions of the ops, drop-in for the HF classes they replace."""
import torch
from torch import nn

from . import hf
from .families import Mlp


class BastileRMSNorm(nn.Module):
    """Same parameters and state-dict keys as HF's LlamaRMSNorm/Qwen3RMSNorm."""

    def __init__(self, hidden_size: int, eps: float = 1e-6, device=None, dtype=None):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size, device=device, dtype=dtype))
        self.variance_epsilon = eps

    forward = hf.rms_norm_forward

    def extra_repr(self) -> str:
        return f"{tuple(self.weight.shape)}, eps={self.variance_epsilon}"


class BastileSwiGLUMLP(nn.Module):
    """Drop-in for Qwen3MLP/LlamaMLP (same submodules and state-dict keys): down(silu(gate(x)) * up(x)) with
    the activation and product fused. The projections stay nn.Linear, so PEFT/LoRA can wrap them."""

    def __init__(self, config, device=None, dtype=None):
        super().__init__()
        self.config = config
        self.hidden_size, self.intermediate_size = config.hidden_size, config.intermediate_size
        bias = getattr(config, "mlp_bias", False)
        kw = dict(bias=bias, device=device, dtype=dtype)
        self.gate_proj = nn.Linear(self.hidden_size, self.intermediate_size, **kw)
        self.up_proj = nn.Linear(self.hidden_size, self.intermediate_size, **kw)
        self.down_proj = nn.Linear(self.intermediate_size, self.hidden_size, **kw)
        if config.hidden_act not in ("silu", "swish"):
            raise ValueError(f"BastileSwiGLUMLP: hidden_act must be silu, got {config.hidden_act!r}")
        self.act_fn = nn.SiLU()

    forward = hf.mlp_forward(Mlp())
