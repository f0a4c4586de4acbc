"""Bastile: fused CUDA kernels for LLM fine-tuning.

    import bastile
    bastile.apply()        # patch HF Qwen3/Llama/Qwen2/Mistral before or after building the model
"""
from . import ops
from ._library import PATH as library_path
from .modules import BastileRMSNorm, BastileSwiGLUMLP
from .ops import fused_linear_cross_entropy, qk_norm_rope, rms_norm, rope, swiglu
from .patch import apply, get_patched_ops, lora_modules, reset, supported_families
from .runtime import clear_autotune_cache, warmup_all_kernels

__all__ = ["apply", "reset", "get_patched_ops", "lora_modules", "supported_families", "warmup_all_kernels",
           "clear_autotune_cache", "ops", "rms_norm", "swiglu", "rope", "qk_norm_rope",
           "fused_linear_cross_entropy", "BastileRMSNorm", "BastileSwiGLUMLP", "library_path"]
__version__ = "0.1.0"
