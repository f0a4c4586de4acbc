"""A mixture of experts' grouped product of each row with its expert's weight: `expert_linear`."""
import torch

from .. import _library  # noqa: F401  (loads the ops)


def expert_linear(x: torch.Tensor, weight: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    """x [pairs, in] with its rows grouped by expert, weight [experts, out, in] (transformers' stored down_proj),
    offsets [experts] (int32) each expert's end, the last pairs. Returns y [pairs, out], row r x[r] @ weight[e]^T
    for r's expert e (float32 sums, float64 on CPU, rounded once). On compute capability 9.0 (bf16, out a multiple
    of 256) our grouped GEMM; elsewhere on CUDA torch's grouped GEMM (bf16), or a plain kernel. Not
    differentiable: bastile.experts runs it in the experts' own node."""
    return torch.ops.bastile.expert_linear(x, weight, offsets)
