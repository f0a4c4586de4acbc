"""A mixture of experts' gate/up products and their gated activation in one grouped GEMM: `expert_swiglu`."""
from typing import Optional, Tuple

import torch

from .. import _library  # noqa: F401  (loads the ops)


def expert_swiglu(x: torch.Tensor, weight: torch.Tensor, offsets: torch.Tensor, activation: str = "silu",
                  lora_x: Optional[torch.Tensor] = None,
                  lora_weight: Optional[torch.Tensor] = None) -> Tuple[torch.Tensor, torch.Tensor]:
    """x [pairs, in] with its rows grouped by expert, weight [experts, 2 * inter, in] (transformers' stored
    gate_up_proj: gate's rows, then up's), offsets [experts] (int32) each expert's end, the last pairs; optionally
    a low-rank product, lora_x [pairs, rank] and lora_weight [experts, 2 * inter, rank] (an expert LoRA's factors).
    Returns (gate_up, h): gate_up [pairs, 2 * inter], row r x[r] @ weight[e]^T + lora_x[r] @ lora_weight[e]^T for
    r's expert e (float32 sums, float64 on CPU, rounded once), and h [pairs, inter] = `swiglu(gate, up,
    activation)` of its halves ("silu" or "gelu_tanh"), as that op rounds it. On compute capability 9.0 (bf16) one
    kernel writes both; elsewhere on CUDA `expert_linear` and `swiglu` (bf16), or a plain kernel. Not
    differentiable: bastile.experts runs it in the experts' own node."""
    return torch.ops.bastile.expert_swiglu(x, weight, offsets, activation, lora_x, lora_weight)
