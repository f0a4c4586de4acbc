"""Bastile: fused CUDA kernels for LLM fine-tuning.

    import bastile
    bastile.apply()        # patch the supported HF families (families.py) before or after building the model
"""
from . import data, ops
from ._library import PATH as library_path
from ._library import VERSION as __version__
from .ops.attention_sink import attention_sink
from .ops.causal_conv1d import causal_conv1d
from .ops.dequantize_4bit import dequantize_4bit
from .ops.expert_combine import expert_combine
from .ops.expert_linear import expert_linear
from .ops.expert_route import expert_route, expert_route_sigmoid
from .ops.expert_swiglu import expert_swiglu
from .ops.fused_linear_cross_entropy import fused_linear_cross_entropy
from .ops.fused_linear_divergence import fused_linear_divergence
from .ops.fused_linear_log_probs import fused_linear_log_probs
from .ops.gated_delta_rule import gated_delta_rule
from .ops.geglu import geglu
from .ops.qk_norm_rope import qk_norm_rope
from .ops.rms_norm import BastileRMSNorm, rms_norm
from .ops.rms_norm_gated import rms_norm_gated
from .ops.rope import rope
from .ops.swiglu import BastileSwiGLUMLP, swiglu
from .patch import apply, get_patched_ops, lora_modules, reset, supported_families
from .runtime import clear_autotune_cache, warmup_all_kernels

__all__ = ["apply", "reset", "get_patched_ops", "lora_modules", "supported_families", "warmup_all_kernels",
           "clear_autotune_cache", "data", "ops", "attention_sink", "causal_conv1d", "rms_norm", "rms_norm_gated", "swiglu", "rope", "qk_norm_rope",
           "fused_linear_cross_entropy", "fused_linear_divergence", "fused_linear_log_probs", "gated_delta_rule", "geglu", "dequantize_4bit", "expert_combine", "expert_linear", "expert_route", "expert_route_sigmoid", "expert_swiglu", "BastileRMSNorm", "BastileSwiGLUMLP", "library_path"]
