"""The attention role: the attention's forward, and the Gated DeltaNet's (linear_attention.py) or the gated short
convolution's (short_conv.py) where the family mixes tokens with one.

The forward is `project_out(gate(attend(scale_queries(states(x)))))`, each a stage chosen once per family:
- states: q, k, v ([batch, heads, seq, head_dim]) from the projections (q/k/v, or one fused qkv_proj) through
  one fused node where PEFT LoRA adapters wrap them (lora.py), q's output gate split off, the q/k norms (over the
  whole width, or per head with the rotation in one qk_norm_rope where the rotation allows, whose outputs the
  attend stage's kernel keeps as how to compute them again), the rotation in the family's layout (none on NoPE
  layers), the cache update; Gemma 4's K/V sharing is its own (gemma4.py);
- scale_queries: Ministral 3's position-dependent scale (ministral3.py);
- attend: the varlen kernel on packed batches (varlen.py), else HF's attention interface with the family's
  sliding window and its extras (Gemma 2's softcap); GPT-OSS's sink attention (sinks.py) on every uncached
  call, packed or not, where no dropout runs;
- gate: the output times the sigmoid of q_proj's gate (Qwen3.5).
"""
import contextlib
from typing import Callable, NamedTuple

import torch
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

from .. import lora, sinks, varlen
from ..families import Family, Layout, QkNorm, Window
from ..ops.qk_norm_rope import qk_norm_rope
from ..ops.rms_norm import rms_norm
from ..ops.rope import rope
from . import (Context, Declaration, Target, fused, gemma4, hf_attr, linear_attention, ministral3, named, norm,
               short_conv)
from .recompute import recomputing

# ------------------------------------------------------------------------------------------------ projections


def project_qkv(self, hidden_states):
    return lora.project(hidden_states, self.q_proj, self.k_proj, self.v_proj)


def project_fused_qkv(self, hidden_states):
    """Phi-3's qkv_proj: the query's width, then the key's and the value's."""
    (qkv,) = lora.project(hidden_states, self.qkv_proj)
    kv = self.config.num_key_value_heads * self.head_dim
    return qkv.split([qkv.shape[-1] - 2 * kv, kv, kv], dim=-1)


def no_gate(self, q, shape):
    return q, None


def split_gate(self, q, shape):
    """Qwen3.5: q_proj gives each head's query followed by as wide a gate."""
    q, gate = q.view(*shape, -1, 2 * self.head_dim).chunk(2, dim=-1)
    return q, gate.reshape(*shape, -1)


def ungated(out, gate):
    return out


def gated(out, gate):
    return out * torch.sigmoid(gate)


# ------------------------------------------------------------------------------------------------ norms, rotation


def no_full_width_norm(self, q, k):
    return q, k


def full_width_norm(family: Family) -> Callable:
    """OLMo 2's q and k norms, over the whole projection width before the heads are split."""
    norm_args, (q_norm, k_norm) = norm.ARGS[family.norm], family.attention.norms

    def qk_norm(self, q, k):
        return (rms_norm(q, *norm_args(getattr(self, q_norm), q)),
                rms_norm(k, *norm_args(getattr(self, k_norm), k)))
    return qk_norm


def rotation(family: Family) -> Callable:
    """HF's rotation of q and k ([batch, heads, seq, head_dim]) in the family's layout."""
    r = family.rotary
    interleaved = r.layout is Layout.INTERLEAVED

    def rotate(q, k, cos, sin):
        if r.layout is Layout.HALF_TABLES:  # the half-split rotation with the half-width tables repeated
            cos, sin = torch.cat((cos, cos), dim=-1), torch.cat((sin, sin), dim=-1)
        q_out, k_out = rope(q, k, cos, sin, interleaved=interleaved)
        return (q_out.to(q.dtype), k_out.to(k.dtype)) if r.cast_back else (q_out, k_out)
    return rotate


def always(self) -> bool:
    return True


def norm_rotation(family: Family) -> Callable:
    """q and k ([batch, seq, heads, head_dim]; k None: q alone) through the per-head norms and the rotation, to
    HF's layout: in one qk_norm_rope where the family's rotation allows (half-split pairs, head-wide tables, in
    the norm's dtype) and both norms share an epsilon. Returns q, k and `kept()`, a context inside which
    autograd keeps qk_norm_rope's outputs as how to compute them again (recompute.py): the attention's kernel
    would keep them beside the inputs qk_norm_rope keeps."""
    a, r = family.attention, family.rotary
    args, rotate = norm.ARGS[family.norm], rotation(family)
    q_norm, k_norm = a.norms
    rotates = always if r.layer_flag is None else (lambda self: getattr(self, r.layer_flag))
    normed = always if a.qk_norm_flag is None else (lambda self: getattr(self, a.qk_norm_flag))
    per_head = a.qk_norm is QkNorm.PER_HEAD
    fuse = per_head and r.layout is Layout.HALF_SPLIT and not r.partial and not r.cast_back

    def norm_rotate(self, q, k, position_embeddings):
        cos, sin = position_embeddings
        k_in = q[:, :, :0] if k is None else k
        if fuse and rotates(self) and normed(self):
            qw, eps, cast_after_weight, offset = args(getattr(self, q_norm), q)
            kw, k_eps = (qw, eps) if k is None else args(getattr(self, k_norm), k)[:2]
            if eps == k_eps:
                def again():
                    return qk_norm_rope(q, k_in, qw, kw, cos, sin, eps, cast_after_weight, offset)
                q_out, k_out = again()
                return q_out.transpose(1, 2), k_out.transpose(1, 2), lambda: recomputing((q_out, k_out), again)
        if per_head and normed(self):  # a layer that takes k from an earlier one has no k_norm
            q, k_in = getattr(self, q_norm)(q), k_in if k is None else getattr(self, k_norm)(k_in)
        q, k_in = q.transpose(1, 2), k_in.transpose(1, 2)
        return (*(rotate(q, k_in, cos, sin) if rotates(self) else (q, k_in)), contextlib.nullcontext)
    return norm_rotate


# ------------------------------------------------------------------------------------------------ states


def states_of(family: Family) -> Callable:
    """The family's q, k, v (and output gate) of the hidden states."""
    a = family.attention
    project = project_fused_qkv if a.fused_qkv else project_qkv
    gate = split_gate if a.output_gate else no_gate
    full_width = full_width_norm(family) if a.qk_norm is QkNorm.FULL_WIDTH else no_full_width_norm
    norm_rotate = norm_rotation(family)

    def states(self, hidden_states, position_embeddings, cache, kwargs):
        shape = hidden_states.shape[:-1]
        q, k, v = project(self, hidden_states)
        q, g = gate(self, q, shape)
        q, k = full_width(self, q, k)
        q, k, v = (t.view(*shape, -1, self.head_dim) for t in (q, k, v))
        q, k, kept = norm_rotate(self, q, k, position_embeddings)
        v = v.transpose(1, 2)
        if cache is not None:
            k, v = cache.update(k, v, self.layer_idx)
        return q, k, v, g, kept
    return states


def no_query_scale(self, q, kwargs):
    return q


# ------------------------------------------------------------------------------------------------ attend


def no_extras(self) -> dict:
    return {}


def sink_logits(self) -> dict:
    """GPT-OSS: its learned sinks, to HF's eager attention (generation, dropout)."""
    return {"s_aux": self.sinks}


def softcap(self) -> dict:
    """Gemma 2: the module's attn_logit_softcapping, to HF's attention."""
    return {"softcap": self.attn_logit_softcapping}


WINDOWS = {Window.NONE: lambda self: None, Window.CONFIG: lambda self: self.config.sliding_window,
           Window.LAYER: lambda self: self.sliding_window,
           Window.LAYER_TYPE: lambda self: (self.config.sliding_window
                                            if self.config.layer_types[self.layer_idx] == "sliding_attention" else None)}


def dropout_of(family: Family) -> Callable:
    """The attention module's dropout probability in its current mode: 0 in evaluation, and where the family's
    module has none (Attention.dropout None: HF's forward passes 0)."""
    name = family.attention.dropout

    def dropout(self) -> float:
        return getattr(self, name) if name is not None and self.training else 0.0
    return dropout


def varlen_rule(family: Family) -> Callable:
    """Whether Bastile's attention, in an attention module of the family, takes a packed batch (without a cache)
    itself (the varlen kernel; the sink attention, which takes unpacked rows too): the module has no softcap,
    no dropout in training, heads the kernel takes (varlen.MAX_HEAD_DIM), and its attention sees the whole
    sequence (varlen.local: no sequence-parallel engine has taken the call over). The one rule: the decoder drops
    HF's masks only where it holds for every layer of a layer type (decoder.py)."""
    a, dropout = family.attention, dropout_of(family)

    def takes(attention) -> bool:
        return (not (a.softcap and attention.attn_logit_softcapping is not None)
                and not dropout(attention)
                and attention.head_dim <= varlen.MAX_HEAD_DIM
                and varlen.local(attention.config._attn_implementation))
    return takes


def hf_attention(family: Family) -> Callable:
    """HF's attention interface, as the module's HF forward calls it."""
    a = family.attention
    window, dropout = WINDOWS[a.window], dropout_of(family)
    extras = sink_logits if a.sinks else softcap if a.softcap else no_extras

    def attend(self, q, k, v, mask, cache, shape, kwargs):
        interface = ALL_ATTENTION_FUNCTIONS.get_interface(self.config._attn_implementation,
                                                          hf_attr(family, "eager_attention_forward"))
        out, weights = interface(self, q, k, v, mask, dropout=dropout(self),
                                 scaling=self.scaling, sliding_window=window(self), **extras(self), **kwargs)
        return out.reshape(*shape, -1).contiguous(), weights
    return attend


def attention_of(family: Family) -> Callable:
    window, takes_varlen, hf = WINDOWS[family.attention.window], varlen_rule(family), hf_attention(family)

    def attend(self, q, k, v, mask, cache, shape, kwargs):
        if cache is None and kwargs.get("cu_seq_lens_q") is not None and takes_varlen(self):
            # a packed batch: the varlen kernel; HF's mask, where it made one, goes unused
            tokens = (t.transpose(1, 2).reshape(-1, t.shape[1], self.head_dim) for t in (q, k, v))
            out = varlen.attention(*tokens, kwargs["cu_seq_lens_q"], kwargs["max_length_q"], self.scaling,
                                   window(self))
            return out.view(*shape, -1), None
        return hf(self, q, k, v, mask, cache, shape, kwargs)
    return attend


def sink_attention_of(family: Family) -> Callable:
    """GPT-OSS: the sink attention on uncached calls that varlen_rule takes, HF's eager interface on the others
    (the cache, dropout). A packed batch's sequences apart: HF's mask, where it made one, unused; the
    decoder's 2-D padding mask (rows padded at one end as varlen spans) zeroes the pads' outputs."""
    window, takes, hf = WINDOWS[family.attention.window], varlen_rule(family), hf_attention(family)

    def attend(self, q, k, v, mask, cache, shape, kwargs):
        if cache is not None or not takes(self):
            return hf(self, q, k, v, mask, cache, shape, kwargs)
        cu = kwargs.get("cu_seq_lens_q")
        padding = mask if cu is not None and mask is not None and mask.ndim == 2 else None
        out = sinks.attention(*(t.transpose(1, 2) for t in (q, k, v)), self.sinks, self.scaling, window(self),
                              None if cu is not None else mask, cu, kwargs.get("max_length_q"), padding)
        return out.reshape(*shape, -1), None
    return attend


# ------------------------------------------------------------------------------------------------ the forward


class Stages(NamedTuple):
    states: Callable
    scale_queries: Callable
    attend: Callable
    gate: Callable


def stages(family: Family) -> Stages:
    a = family.attention
    states = gemma4.attention_states(norm_rotation(family)) if a.shared_kv else states_of(family)
    attend = sink_attention_of(family) if a.sinks else attention_of(family)
    return Stages(states, ministral3.scale_queries(family) if a.query_scale else no_query_scale, attend,
                  gated if a.output_gate else ungated)


def attention_forward(s: Stages, output: str) -> Callable:
    def forward(self, hidden_states, position_embeddings=None, attention_mask=None, past_key_values=None, **kwargs):
        shape = hidden_states.shape[:-1]
        q, k, v, gate, kept = s.states(self, hidden_states, position_embeddings, past_key_values, kwargs)
        q = s.scale_queries(self, q, kwargs)
        with kept():
            out, weights = s.attend(self, q, k, v, attention_mask, past_key_values, shape, kwargs)
        (out,) = lora.project(s.gate(out, gate), getattr(self, output))
        return out, weights
    return forward


def declare(ctx: Context) -> Declaration:
    f = ctx.family
    targets = [Target("Attention", "forward", named(attention_forward(stages(f), f.attention.output), "attention", f),
                      lora=fused)]
    if f.short_conv:
        targets.append(Target("ShortConv", "forward", short_conv.short_conv(f), wraps=True, lora=short_conv.why_not))
    if not f.linear_attention:
        return Declaration(tuple(targets))
    targets.append(Target("GatedDeltaNet", "forward", linear_attention.gated_delta_net(f), wraps=True,
                          lora=linear_attention.why_not))
    return Declaration(tuple(targets), reads=("RMSNormGated",))
