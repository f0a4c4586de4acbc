"""Rotary position embedding: `rope`, HF's `apply_rotary_pos_emb` in one kernel."""
import torch

from .. import _library  # noqa: F401  (loads the ops)


def rope(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, unsqueeze_dim: int = 1,
         *, interleaved: bool = False, position_ids=None) -> tuple[torch.Tensor, torch.Tensor]:
    """HF apply_rotary_pos_emb (transformers 5.17 signature): q * cos + rotate_half(q) * sin, same for k,
    in one kernel; cos and sin are broadcast over heads (and batch if their first dim is 1 or absent).

    q: [batch, q_heads, seq, head_dim], k: [batch, k_heads, seq, head_dim] for unsqueeze_dim=1 ([batch, seq,
    heads, head_dim] for 2), any strides with a unit last stride (HF's transposed views are read in place);
    cos, sin: [seq, rot], [1, seq, rot] or [batch, seq, rot]; head_dim even. With rot < head_dim (even, > 0)
    only the first rot elements of each head rotate and the rest pass through, as Phi-3's partial rotary
    (``torch.cat([rotated, q_pass], -1)``). interleaved=True rotates the pairs (2j, 2j + 1) by cos[j], sin[j]
    of the tables' first half, as GLM-4's apply_rotary_pos_emb; else the pairs (i, i + rot / 2), as
    rotate_half. Results have dtype promote(q, cos), rounded as HF rounds (each product, then the sum), and
    q's layout where it is dense. Differentiable in q and k; cos and sin must not require grad. position_ids
    is ignored, as in older HF versions that still accepted it.
    """
    return torch.ops.bastile.rope(q, k, cos, sin, unsqueeze_dim, interleaved)
