"""Ministral 3's stage: the rotated queries scaled by position (Attention.query_scale)."""
from typing import Callable

from ..families import Family
from . import hf_attr


def scale_queries(family: Family) -> Callable:
    """q *= 1 + beta * log(1 + floor(position / original max)), as HF computes it; the position ids are taken from
    the attention's kwargs (they go no further)."""
    def scale(self, q, kwargs):
        rope = self.config.rope_parameters
        factor = hf_attr(family, "get_llama_4_attn_scale")(kwargs.pop("position_ids"), rope.get("llama_4_scaling_beta"),
                                                           rope.get("original_max_position_embeddings"))
        return q * factor.to(q.dtype)
    return scale
