"""The norm role: an RMSNorm's forward as one rms_norm, rounding where the family's Norm trait says."""
from typing import Callable

import torch

from ..families import Norm
from ..ops.rms_norm import rms_norm
from . import Context, Declaration, Target, named

# A norm module's arguments to rms_norm and qk_norm_rope for its input x, (weight, eps, cast_after_weight,
# weight_offset), by how the family's RMSNorm rounds.


def cast_then_weight(module, x) -> tuple:
    """Llama: weight * to(x.dtype)(n)."""
    return module.weight, module.variance_epsilon, False, 0.0


def weight_then_cast(module, x) -> tuple:
    """GPT-OSS, OLMo 2: to(x.dtype)(weight * n), the product in float32."""
    return module.weight, module.variance_epsilon, True, 0.0


def offset_then_cast(module, x) -> tuple:
    """Gemma: to(x.dtype)((1 + weight) * n) in float32; its epsilon is `eps`."""
    return module.weight, module.eps, True, 1.0


def optional_weight_then_cast(module, x) -> tuple:
    """Gemma 4: to(x.dtype)(weight * n) in float32, or to(x.dtype)(n) where the norm has no weight
    (with_scale False: ones, exactly)."""
    weight = module.weight if module.with_scale else x.new_ones(x.shape[-1], dtype=torch.float32)
    return weight, module.eps, True, 0.0


ARGS = {Norm.CAST_THEN_WEIGHT: cast_then_weight, Norm.WEIGHT_THEN_CAST: weight_then_cast,
        Norm.OFFSET_THEN_CAST: offset_then_cast, Norm.OPTIONAL_WEIGHT_THEN_CAST: optional_weight_then_cast}


def norm_forward(args: Callable) -> Callable:
    def forward(self, hidden_states):
        return rms_norm(hidden_states, *args(self, hidden_states))
    return forward


def declare(ctx: Context) -> Declaration:
    f = ctx.family
    return Declaration((Target("RMSNorm", "forward", named(norm_forward(ARGS[f.norm]), "norm", f)),))
