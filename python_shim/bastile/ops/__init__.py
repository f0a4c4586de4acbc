"""The ops, one module each: `bastile.ops.<op>` holds the function `<op>` (also `bastile.<op>`), a thin
alias of torch.ops.bastile.<op> with HF-style defaults, and for rms_norm and swiglu the nn.Module built on
it:

    from bastile.ops.rms_norm import BastileRMSNorm, rms_norm
    from bastile.ops.swiglu import BastileSwiGLUMLP, swiglu
"""
from . import attention_sink, causal_conv1d, dequantize_4bit, expert_combine, expert_linear, expert_route, expert_swiglu, fused_linear_cross_entropy, fused_linear_divergence, fused_linear_log_probs, gated_delta_rule, geglu, qk_norm_rope, rms_norm, rms_norm_gated, rope, swiglu

__all__ = ["attention_sink", "causal_conv1d", "dequantize_4bit", "expert_combine", "expert_linear", "expert_route", "expert_swiglu", "fused_linear_cross_entropy", "fused_linear_divergence", "fused_linear_log_probs", "gated_delta_rule", "geglu", "qk_norm_rope", "rms_norm", "rms_norm_gated", "rope", "swiglu"]
