"""Bastile: fused CUDA kernels for LLM fine-tuning.

    import bastile
    bastile.apply()        # patch HF Qwen3/Llama/Qwen2/Mistral before or after building the model
"""
from . import ops
from ._library import PATH as library_path
from .modules import BastileRMSNorm
from .ops import rms_norm
from .patch import apply, get_patched_ops, reset, supported_families

__all__ = ["apply", "reset", "get_patched_ops", "supported_families", "ops", "rms_norm", "BastileRMSNorm",
           "library_path"]
__version__ = "0.1.0"
