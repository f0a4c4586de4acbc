"""The Gated DeltaNet (Family.linear_attention: Qwen3.5's and Qwen3-Next's), of the attention role.

In training and evaluation without a cache its forward is HF's math through Bastile's ops: the input projections
(Qwen3.5's four, Qwen3-Next's two grouped by key head: qwen3_next.py) in one fused node where PEFT LoRA adapters
wrap them (lora.py), causal_conv1d with SiLU over the
fused q/k/v projection as it is ([batch, seq, channels]), q, k and v split from it as views, the gated delta
rule over the l2-normed q and k (unrepeated: the op reads each value head's key head), rms_norm_gated, out_proj
in another fused node. A packed batch (the decoder's varlen kwargs: cu_seq_lens_q) runs as one stream whose
conv and recurrence restart at each sequence, where HF's would carry them across. With a cache (generation),
or an activation other than SiLU, it is HF's forward.
"""
import functools
from typing import Callable, Optional

from torch.nn import functional as F
from transformers.activations import ACT2FN
from transformers.integrations.accelerate import force_accelerate_hooks

from .. import lora
from ..families import Family
from ..ops.causal_conv1d import causal_conv1d
from ..ops.gated_delta_rule import gated_delta_rule
from ..ops.rms_norm_gated import rms_norm_gated
from . import hf_attr, named, qwen3_next
from .mlp import SILU


def why_not(module) -> Optional[str]:
    """Why a Gated DeltaNet runs HF's forward in training (causal_conv1d's activation is SiLU), or None."""
    act = ACT2FN[module.activation]
    return None if isinstance(act, SILU) else f"conv activation {type(act).__name__} is not SiLU"


def project_separate(self, hidden_states):
    """Qwen3.5's (q, k, v), z, b, a: a projection each."""
    return lora.project(hidden_states, self.in_proj_qkv, self.in_proj_z, self.in_proj_b, self.in_proj_a)


def gated_delta_net(family: Family) -> Callable:
    """The factory of the forward, from HF's (which runs with a cache)."""
    project = qwen3_next.project_grouped if family.grouped_projections else project_separate

    def delta_net(self, hidden_states, attention_mask, cu_seqlens):
        hidden_states = hf_attr(family, "apply_mask_to_padding_states")(hidden_states, attention_mask)
        batch, seq, _ = hidden_states.shape
        rows = (batch, seq) if cu_seqlens is None else (1, batch * seq)  # packed: the rows as one stream
        qkv, z, b, a = (t.reshape(*rows, -1) for t in project(self, hidden_states))
        qkv = causal_conv1d(qkv, self.conv1d.weight.squeeze(1), self.conv1d.bias, cu_seqlens)
        q, k, v = qkv.split([self.key_dim, self.key_dim, self.value_dim], dim=-1)
        q, k = q.unflatten(-1, (-1, self.head_k_dim)), k.unflatten(-1, (-1, self.head_k_dim))
        v = v.unflatten(-1, (-1, self.head_v_dim))
        g = -self.A_log.float().exp() * F.softplus(a.float() + self.dt_bias)  # float32, as HF's
        o, _ = gated_delta_rule(q, k, v, g, b.sigmoid(), self.head_k_dim ** -0.5, None, cu_seqlens, True)
        o = rms_norm_gated(o, z.view(o.shape), self.norm.weight, self.norm.variance_epsilon)
        (out,) = lora.project(o.reshape(batch, seq, -1), self.out_proj)
        return out

    # conv1d's weight is read without calling conv1d: its accelerate hooks (offloading) fired first, as HF's
    hooked = force_accelerate_hooks("conv1d")(delta_net)

    def wrap(original):
        @functools.wraps(original)
        def forward(self, hidden_states, cache_params=None, attention_mask=None, **kwargs):
            if cache_params is not None or why_not(self):
                return original(self, hidden_states, cache_params=cache_params, attention_mask=attention_mask,
                                **kwargs)
            return hooked(self, hidden_states, attention_mask, kwargs.get("cu_seq_lens_q"))
        return named(forward, "attention", family)
    return wrap
