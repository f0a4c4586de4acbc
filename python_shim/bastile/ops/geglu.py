"""GPT-OSS's clamped GEGLU expert activation: `geglu`."""
from typing import Optional

import torch

from .. import _library  # noqa: F401  (loads the ops)


def geglu(gate_up: torch.Tensor, alpha: float = 1.702, limit: float = 7.0, bias: Optional[torch.Tensor] = None,
          expert: Optional[torch.Tensor] = None) -> torch.Tensor:
    """GPT-OSS's expert activation (HF GptOssExperts._apply_gate) in one kernel:
    gate, up = gate_up[..., ::2], gate_up[..., 1::2]; gate = gate.clamp(max=limit);
    up = up.clamp(-limit, limit); returns (up + 1) * gate * sigmoid(gate * alpha).

    gate_up: [..., 2 * I] of float32, float16 or bfloat16 (float64 on CPU), gate at even and up at odd
    positions of the last dim (read in place, no de-interleaving copy; a non-contiguous tensor is made
    contiguous first). Returns [..., I] in gate_up's dtype, computed in float32 (float64 on CPU) and
    rounded once: HF rounds after each op in the input's dtype, so this is closer to the exact value.
    limit is rounded to the dtype, as torch's clamp does. Differentiable: the gradient is autograd's of
    that expression (torch's clamp passes the gradient where gate <= limit and -limit <= up <= limit,
    the bounds included, else 0), recomputed from the saved gate_up, so no activation is kept.

    bias [experts, 2 * I] (gate_up's dtype) with expert (int64, one per row of gate_up): each row's expert's
    bias is added to it first, the sum rounded to the dtype as HF's `gate_up + bias[expert]` (the experts'
    gate/up bias, with no pass of its own). Its gradient is gate_up's summed over each expert's rows.
    """
    return torch.ops.bastile.geglu(gate_up, alpha, limit, bias, expert)
