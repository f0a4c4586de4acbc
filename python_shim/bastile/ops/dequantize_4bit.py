"""bitsandbytes' 4-bit weights (NF4, FP4) to dense ones: `dequantize_4bit`."""
from typing import Optional

import torch

from .. import _library  # noqa: F401  (loads the ops)


def dequantize_4bit(*weights: torch.Tensor, dtype: Optional[torch.dtype] = None) -> torch.Tensor:
    """bitsandbytes' `dequantize_4bit` of each 4-bit weight (a `Params4bit`, or any uint8 tensor of packed
    codes with its `quant_state`), bit for bit: code * scale computed in float32 and rounded once to
    `dtype`, the scales themselves dequantized first where they are nested (double quantization). The
    weights, at most three with one in_features, come one after another in one [sum of out_features,
    in_features] tensor, from one launch. dtype defaults to the first weight's quant_state.dtype.
    """
    states = [w.quant_state for w in weights]
    cols = states[0].shape[-1]
    nested = [s.state2 if s.nested else None for s in states]
    offsets = [torch.as_tensor(s.offset, dtype=torch.float32, device=w.device) if s.nested else None
               for s, w in zip(states, weights)]
    return torch.ops.bastile.dequantize_4bit(
        [w.data.view(torch.uint8) for w in weights], [s.absmax for s in states], [s.code for s in states],
        [s.blocksize for s in states], [s.shape[0] for s in states], cols, dtype or states[0].dtype,
        [n and n.absmax for n in nested], [n and n.code for n in nested], [n.blocksize if n else 1 for n in nested],
        offsets)
