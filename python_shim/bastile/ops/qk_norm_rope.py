"""Per-head q/k RMSNorm followed by the rotary embedding (Qwen3's, Gemma 3's and Gemma 4's attention):
`qk_norm_rope`."""
import torch

from .. import _library  # noqa: F401  (loads the ops)


def qk_norm_rope(q: torch.Tensor, k: torch.Tensor, q_weight: torch.Tensor, k_weight: torch.Tensor,
                 cos: torch.Tensor, sin: torch.Tensor, eps: float = 1e-6, cast_after_weight: bool = False,
                 weight_offset: float = 0.0) -> tuple[torch.Tensor, torch.Tensor]:
    """The attention's q_norm/k_norm followed by apply_rotary_pos_emb, fused.

    q: [B, S, Hq, D] and k: [B, S, Hk, D] (the projections' .view, any strides); cos/sin: [S, D], [1, S, D]
    or [B, S, D] (HF's rotary embedding output; no gradient). Returns fresh contiguous (q_out, k_out) in
    [B, S, H, D]; their .transpose(1, 2) is HF's layout. Rounding as HF: per head row, with statistics in
    float32, n = to(promote(x, w))(w * to(x.dtype)(x * rsqrt(mean(x**2) + eps))) (Qwen3), or with
    cast_after_weight n = to(x.dtype)((w + weight_offset) * x * rsqrt(...)) in float32 (Gemma 4; Gemma 3's
    (1 + w) with weight_offset 1), then out = n * cos + rotate_half(n) * sin with each product and the sum
    rounded to promote(n, cos).
    """
    return torch.ops.bastile.qk_norm_rope(q, k, q_weight, k_weight, cos, sin, eps, cast_after_weight, weight_offset)
