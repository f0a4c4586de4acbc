"""A mixture of experts' grouped product of each row with its expert's weight: `expert_linear`."""
from typing import Optional

import torch

from .. import _library  # noqa: F401  (loads the ops)


def expert_linear(x: torch.Tensor, weight: torch.Tensor, offsets: torch.Tensor, lora_x: Optional[torch.Tensor] = None,
                  lora_weight: Optional[torch.Tensor] = None) -> torch.Tensor:
    """x [pairs, in] with its rows grouped by expert, weight [experts, out, in] (transformers' stored down_proj; or
    its transpose contiguous), offsets [experts] (int32) each expert's end, the last pairs; optionally a low-rank
    product, lora_x [pairs, rank] and lora_weight [experts, out, rank] (an expert LoRA's factors). Returns y
    [pairs, out], row r x[r] @ weight[e]^T + lora_x[r] @ lora_weight[e]^T for r's expert e (float32 sums, float64
    on CPU, rounded once). On compute capability 9.0 (bf16, out a multiple of 8) our grouped GEMM, the low-rank
    product in the same kernel; elsewhere on CUDA torch's grouped GEMM (bf16; the products apart), or a plain
    kernel. Not differentiable: bastile.experts runs it in the experts' own node."""
    return torch.ops.bastile.expert_linear(x, weight, offsets, lora_x, lora_weight)
