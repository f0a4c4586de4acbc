"""Replacements for HF forward functions (transformers 5.x), shared by every family and specialised by the
family's traits (families.py): each factory takes a Family and returns the forward for its classes.

Each keeps its HF signature and falls back to HF's own math where a Bastile op does not apply (another
activation, a wrapped LM head, a custom loss), so a patched model always computes what HF would. Which other
roles of the family run Bastile's forwards is asked of `runs(role)`, which patch.py passes in.
"""
import contextlib
import dataclasses
import functools
import inspect
import sys
import warnings
import weakref
from typing import Callable, Optional

import torch
from torch import nn
from torch.nn import functional as F
from transformers.activations import ACT2FN, GELUTanh, SiLUActivation
from transformers.integrations.accelerate import force_accelerate_hooks
from transformers.masking_utils import (create_causal_mask, create_recurrent_attention_mask,
                                        create_sliding_window_causal_mask)
from transformers.modeling_layers import GradientCheckpointingLayer
from transformers.modeling_outputs import CausalLMOutputWithPast
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

from . import long_context, lora, varlen
from .families import LINEAR, Family, Layout, Mlp, Norm, QkNorm, Window
from .ops.causal_conv1d import causal_conv1d
from .ops.fused_linear_cross_entropy import fused_linear_cross_entropy
from .ops.gated_delta_rule import gated_delta_rule
from .ops.geglu import geglu
from .ops.qk_norm_rope import qk_norm_rope
from .ops.rms_norm import rms_norm
from .ops.rms_norm_gated import rms_norm_gated
from .ops.rope import rope
from .ops.swiglu import swiglu

Runs = Callable[..., bool]  # runs(role[, part]): whether Bastile's forwards run it (patch.py)
Settings = Callable[[], long_context.Settings]  # apply()'s library-wide settings, as they are now


def hf_attr(family: Family, name: str):
    """`name` from the family's HF modeling module (imported already: its classes are what call this)."""
    return getattr(sys.modules[family.module], name)


# ------------------------------------------------------------------------------------------------ norm


def norm_args(norm: Norm, module, x) -> tuple:
    """(weight, eps, cast_after_weight, weight_offset): how rms_norm and qk_norm_rope compute the RMSNorm
    `module` of x, which rounds as `norm` says. Gemma 4's norm without a weight (with_scale False) multiplies
    by ones, exactly."""
    if norm is Norm.CAST_THEN_WEIGHT:
        return module.weight, module.variance_epsilon, False, 0.0
    if norm is Norm.WEIGHT_THEN_CAST:
        return module.weight, module.variance_epsilon, True, 0.0
    if norm is Norm.OFFSET_THEN_CAST:
        return module.weight, module.eps, True, 1.0
    weight = module.weight if module.with_scale else x.new_ones(x.shape[-1], dtype=torch.float32)
    return weight, module.eps, True, 0.0


def rms_norm_forward(self, hidden_states):
    return rms_norm(hidden_states, *norm_args(Norm.CAST_THEN_WEIGHT, self, hidden_states))


def rms_norm_cast_after_weight_forward(self, hidden_states):
    """GptOssRMSNorm, Olmo2RMSNorm: the weight multiplies before the result is rounded to the input's dtype."""
    return rms_norm(hidden_states, *norm_args(Norm.WEIGHT_THEN_CAST, self, hidden_states))


def rms_norm_offset_forward(self, hidden_states):
    """GemmaRMSNorm: to(x.dtype)((1 + weight) * n), in float32."""
    return rms_norm(hidden_states, *norm_args(Norm.OFFSET_THEN_CAST, self, hidden_states))


def rms_norm_optional_weight_forward(self, hidden_states):
    """Gemma4RMSNorm: to(x.dtype)(weight * n) in float32, or to(x.dtype)(n) without a weight."""
    return rms_norm(hidden_states, *norm_args(Norm.OPTIONAL_WEIGHT_THEN_CAST, self, hidden_states))


NORM_FORWARDS = {Norm.CAST_THEN_WEIGHT: rms_norm_forward, Norm.WEIGHT_THEN_CAST: rms_norm_cast_after_weight_forward,
                 Norm.OFFSET_THEN_CAST: rms_norm_offset_forward,
                 Norm.OPTIONAL_WEIGHT_THEN_CAST: rms_norm_optional_weight_forward}


# ------------------------------------------------------------------------------------------------ MLP

_SILU = (nn.SiLU, SiLUActivation)


def gated_activation(f) -> Optional[str]:
    """The `swiglu` activation that computes the activation module f as HF does: "silu", "gelu_tanh"
    (GELUTanh through torch's gelu, not its Python formula), or None."""
    if isinstance(f, _SILU):
        return "silu"
    if type(f) is GELUTanh and isinstance(f.act, functools.partial):
        return "gelu_tanh"
    return None


def mlp_why_not(traits: Mlp) -> Callable:
    """The function of a dense MLP module that says why its projections are not fused: None when they are."""
    act = traits.activation

    def why_not(mlp):
        f = getattr(mlp, act)
        return None if gated_activation(f) else f"activation {type(f).__name__} is neither SiLU nor GELU-tanh"
    return why_not


def mlp_forward(traits: Mlp):
    """The dense MLP's forward, `down(act(gate(x)) * up(x))` (gate and up from one gate_up_proj where the
    family fuses them, gate first), with the activation and product fused when the activation is SiLU or
    GELU-tanh and the down projection fused with them, so that the activation is not kept for the
    backward. PEFT LoRA adapters on the projections run in fused nodes (lora.py); anything else is called
    as a module. `keep_activation` (a checkpointed layer, see layer_forward) keeps it instead."""
    fused, act = traits.fused_gate_up, traits.activation

    def forward(self, x, keep_activation=False):
        activation = gated_activation(getattr(self, act))
        if activation is None:  # HF's own
            gate, up = self.gate_up_proj(x).chunk(2, dim=-1) if fused else (self.gate_proj(x), self.up_proj(x))
            return self.down_proj(getattr(self, act)(gate) * up)
        if fused:
            gate, up = lora.project(x, self.gate_up_proj)[0].chunk(2, dim=-1)
        else:
            gate, up = lora.project(x, self.gate_proj, self.up_proj)
        if keep_activation:
            (out,) = lora.project(swiglu(gate, up, activation), self.down_proj)
            return out
        return lora.swiglu_down(gate, up, self.down_proj, activation)
    return forward


def swiglu_apply_gate(self, gate_up):
    """The experts' gating of transformers' grouped/batched expert implementations (`_apply_gate`):
    act(gate) * up of the halves of gate_up, fused when the activation is SiLU or GELU-tanh."""
    gate, up = gate_up.chunk(2, dim=-1)
    activation = gated_activation(self.act_fn)
    if activation is None:
        return self.act_fn(gate) * up
    return swiglu(gate, up, activation)


def geglu_apply_gate(self, gate_up):
    """GptOssExperts._apply_gate: clamped, interleaved GEGLU of gate_up in one kernel."""
    return geglu(gate_up, self.alpha, self.limit)


APPLY_GATES = {"swiglu": swiglu_apply_gate, "geglu": geglu_apply_gate}


# ------------------------------------------------------------------------------------------------ attention


def _rotate(family: Family, q, k, cos, sin):
    """HF's rotation of q and k ([batch, heads, seq, head_dim]) in the family's layout."""
    r = family.rotary
    if r.layout is Layout.HALF_TABLES:  # the half-split rotation with the half-width tables repeated
        cos, sin = torch.cat((cos, cos), dim=-1), torch.cat((sin, sin), dim=-1)
    q_out, k_out = rope(q, k, cos, sin, interleaved=r.layout is Layout.INTERLEAVED)
    return (q_out.to(q.dtype), k_out.to(k.dtype)) if r.cast_back else (q_out, k_out)


def _window(family: Family, attention):
    w = family.attention.window
    if w is Window.NONE:
        return None
    return attention.config.sliding_window if w is Window.CONFIG else attention.sliding_window


def _query_scale(family: Family, attention, q, position_ids):
    """Ministral 3's position-dependent scale of the rotated queries, as HF computes it."""
    rope_parameters = attention.config.rope_parameters
    scale = hf_attr(family, "get_llama_4_attn_scale")(position_ids, rope_parameters.get("llama_4_scaling_beta"),
                                                  rope_parameters.get("original_max_position_embeddings"))
    return q * scale.to(q.dtype)


def attention_forward(family: Family):
    """The family's attention forward: q/k/v (one qkv_proj or three projections) through one fused node
    and o through another where PEFT LoRA adapters wrap them (lora.py), q/k norms per head with the
    rotation in one op (qk_norm_rope) or over the whole width (rms_norm), the rotation in the family's
    layout (none on NoPE layers), and the attention: the varlen kernel on packed batches (varlen.py), else
    HF's attention interface with the family's sliding window and sinks; the output gated by the sigmoid of
    q_proj's gate where the family has one. The rest is HF's (cache update)."""
    a, r, weight_then_cast = family.attention, family.rotary, family.norm is Norm.WEIGHT_THEN_CAST
    # qk_norm_rope rotates half-split pairs with head-wide tables, in the norm's dtype.
    fuse_qk = (a.qk_norm is QkNorm.PER_HEAD and r.layout is Layout.HALF_SPLIT and not r.partial
               and not r.cast_back)

    def project(self, hidden_states):
        """q, k, v; k and v None in a layer that takes them from an earlier one (Attention.shared_kv)."""
        if a.fused_qkv:
            (qkv,) = lora.project(hidden_states, self.qkv_proj)
            kv = self.config.num_key_value_heads * self.head_dim
            return qkv.split([qkv.shape[-1] - 2 * kv, kv, kv], dim=-1)
        if a.shared_kv and self.is_kv_shared_layer:
            return (*lora.project(hidden_states, self.q_proj), None, None)
        if a.shared_kv and self.v_proj is None:
            q, k = lora.project(hidden_states, self.q_proj, self.k_proj)
            return q, k, k
        return lora.project(hidden_states, self.q_proj, self.k_proj, self.v_proj)

    def norm_rotate(self, q, k, cos, sin, rotates):
        """q and k ([batch, seq, heads, head_dim]; k None: q alone) through the per-head norms and the rotation,
        in HF's layout; one qk_norm_rope where the family's rotation allows and both norms share an epsilon."""
        k_in = q[:, :, :0] if k is None else k
        if fuse_qk and rotates:
            qw, eps, cast_after_weight, offset = norm_args(family.norm, self.q_norm, q)
            kw, k_eps, _, _ = (qw, eps, None, None) if k is None else norm_args(family.norm, self.k_norm, k)
            if eps == k_eps:
                q, k_out = qk_norm_rope(q, k_in, qw, kw, cos, sin, eps, cast_after_weight, offset)
                return q.transpose(1, 2), k_out.transpose(1, 2)
        if a.qk_norm is QkNorm.PER_HEAD:  # a layer that takes k from an earlier one has no k_norm
            q, k_in = self.q_norm(q), k_in if k is None else self.k_norm(k_in)
        q, k_in = q.transpose(1, 2), k_in.transpose(1, 2)
        return _rotate(family, q, k_in, cos, sin) if rotates else (q, k_in)

    def forward(self, hidden_states, position_embeddings=None, attention_mask=None, past_key_values=None, **kwargs):
        input_shape = hidden_states.shape[:-1]
        hidden_shape = (*input_shape, -1, self.head_dim)
        shared = kwargs.pop("shared_kv_states") if a.shared_kv else None
        q, k, v = project(self, hidden_states)
        gate = None
        if a.output_gate:  # each head's query, then its gate
            q, gate = q.view(*input_shape, -1, 2 * self.head_dim).chunk(2, dim=-1)
            gate = gate.reshape(*input_shape, -1)
        if a.qk_norm is QkNorm.FULL_WIDTH:
            q = rms_norm(q, self.q_norm.weight, self.q_norm.variance_epsilon, weight_then_cast)
            k = rms_norm(k, self.k_norm.weight, self.k_norm.variance_epsilon, weight_then_cast)
        cos, sin = position_embeddings
        rotates = r.layer_flag is None or getattr(self, r.layer_flag)
        if k is None:  # k and v of an earlier layer, normed and rotated there
            query_states = norm_rotate(self, q.view(hidden_shape), None, cos, sin, rotates)[0]
            key_states, value_states = shared[self.layer_type]
            if query_states.requires_grad and not key_states.requires_grad:
                warnings.warn(f"bastile: layer {self.layer_idx} reuses keys and values that carry no gradient: the "
                              "layer that made them ran without autograd (reentrant gradient checkpointing), so "
                              "their projections get no gradient from the layers that share them, in HF's forward "
                              "too; use_reentrant=False keeps it", stacklevel=2)
        else:
            q, k, v = (t.view(hidden_shape) for t in (q, k, v))
            query_states, key_states = norm_rotate(self, q, k, cos, sin, rotates)
            value_states = (self.v_norm(v) if a.value_norm else v).transpose(1, 2)
            if past_key_values is not None:
                key_states, value_states = past_key_values.update(key_states, value_states, self.layer_idx)
            if a.shared_kv and self.store_full_length_kv:
                shared[self.layer_type] = key_states, value_states
        if a.query_scale:
            query_states = _query_scale(family, self, query_states, kwargs.pop("position_ids"))

        window = _window(family, self)
        dropout = 0.0 if not self.training else self.attention_dropout
        if past_key_values is None and kwargs.get("cu_seq_lens_q") is not None and _varlen(family, self):
            # a packed batch: the varlen kernel; HF's mask, where it made one, goes unused
            tokens = (t.transpose(1, 2).reshape(-1, t.shape[1], self.head_dim)
                      for t in (query_states, key_states, value_states))
            attn_output = varlen.attention(*tokens, kwargs["cu_seq_lens_q"], kwargs["max_length_q"], self.scaling,
                                           window).view(*input_shape, -1)
            attn_weights = None
        else:
            attention_interface = ALL_ATTENTION_FUNCTIONS.get_interface(self.config._attn_implementation,
                                                                        hf_attr(family, "eager_attention_forward"))
            if a.sinks:
                kwargs["s_aux"] = self.sinks
            if a.softcap:
                kwargs["softcap"] = self.attn_logit_softcapping
            attn_output, attn_weights = attention_interface(
                self, query_states, key_states, value_states, attention_mask, dropout=dropout, scaling=self.scaling,
                sliding_window=window, **kwargs)
            attn_output = attn_output.reshape(*input_shape, -1).contiguous()
        if gate is not None:
            attn_output = attn_output * torch.sigmoid(gate)
        (out,) = lora.project(attn_output, self.o_proj)
        return out, attn_weights
    return forward


def _varlen(family: Family, attention) -> bool:
    """Whether Bastile's attention, in the attention module given, takes a packed batch (without a cache) to
    the varlen kernel: the family has no sinks, the module no softcap, no dropout in training, and heads the
    kernel takes (varlen.MAX_HEAD_DIM). The one rule: the decoder drops HF's masks only where it holds for
    every layer of a layer type (_varlen_types)."""
    a = family.attention
    return (not a.sinks and not (a.softcap and attention.attn_logit_softcapping is not None)
            and not (attention.training and attention.attention_dropout)
            and attention.head_dim <= varlen.MAX_HEAD_DIM)


def _varlen_types(family: Family, runs: Runs, decoder, layer_types) -> set:
    """The layer types (None standing for all layers, where the decoder has no layer types) whose every
    attention layer takes a packed batch to the varlen kernel: Bastile's attention runs them, and _varlen
    holds for each."""
    if not runs("attention"):
        return set()
    types = layer_types or [None] * len(decoder.layers)
    # Bastile's Gated DeltaNet (the attention role's too) takes any packed batch
    return set(types) - {t for t, layer in zip(types, decoder.layers)
                         if t != LINEAR and not _varlen(family, layer.self_attn)}


# ------------------------------------------------------------------------------------------------ linear attention


def delta_net_why_not(module) -> Optional[str]:
    """Why a Gated DeltaNet runs HF's forward in training (causal_conv1d's activation is SiLU), or None."""
    act = ACT2FN[module.activation]
    return None if isinstance(act, _SILU) else f"conv activation {type(act).__name__} is not SiLU"


def gated_delta_net_forward(family: Family):
    """A Gated DeltaNet's forward (Family.linear_attention), made from HF's: in training and evaluation
    without a cache, HF's math through Bastile's ops. The four input projections in one fused node where
    PEFT LoRA adapters wrap them (lora.py), causal_conv1d with SiLU over the fused q/k/v projection as it is
    ([batch, seq, channels]), q, k and v split from it as views, the gated delta rule over the l2-normed q and
    k (unrepeated: the op reads each value head's key head), rms_norm_gated, out_proj in another fused node.
    A packed batch (the decoder's varlen kwargs: cu_seq_lens_q) runs as one stream whose conv and recurrence
    restart at each sequence, where HF's would carry them across. With a cache (generation), or an
    activation other than SiLU, it is HF's forward."""
    def delta_net(self, hidden_states, attention_mask, cu_seqlens):
        hidden_states = hf_attr(family, "apply_mask_to_padding_states")(hidden_states, attention_mask)
        batch, seq, _ = hidden_states.shape
        rows = (batch, seq) if cu_seqlens is None else (1, batch * seq)  # packed: the rows as one stream
        qkv, z, b, a = (t.reshape(*rows, -1) for t in lora.project(
            hidden_states, self.in_proj_qkv, self.in_proj_z, self.in_proj_b, self.in_proj_a))
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
            if cache_params is not None or delta_net_why_not(self):
                return original(self, hidden_states, cache_params=cache_params, attention_mask=attention_mask,
                                **kwargs)
            return hooked(self, hidden_states, attention_mask, kwargs.get("cu_seq_lens_q"))
        return forward
    return wrap


# ------------------------------------------------------------------------------------------------ decoder layer


def checkpointed(forward):
    """A decoder layer's forward as transformers makes its own. Newer releases (5.23) wrap each
    GradientCheckpointingLayer subclass's forward in the checkpointing when the class is made (earlier ones
    checkpoint in __call__, and this returns `forward` itself): a forward set on the class afterwards gets
    the same wrapper, from the same code, through a subclass made for it."""
    return type("Checkpointed", (GradientCheckpointingLayer,), {"forward": forward}).forward


class _Recompute:
    """What autograd keeps of a view of a recomputed tensor: its geometry (see _recomputing)."""

    def __init__(self, t):
        self.size, self.stride, self.offset = t.shape, t.stride(), t.storage_offset()


@contextlib.contextmanager
def _recomputing(n, compute: Callable):
    """Inside, autograd saves for n and its views not n but how to compute it again: `compute()`, under the
    forward's autocast, at the first unpack; the last drops it. A norm's output, which every projection after
    it would keep (hidden-sized, twice a layer), costs a norm forward per sublayer in the backward instead.
    Off where n's memory is not the layer's to save: without autograd, in a checkpointed layer (the
    checkpoint recomputes it anyway), under torch.compile, or inside other saved-tensor hooks (activation
    offloading: these would take its tensors from them), or where such hooks are disabled."""
    hooks = torch._C._autograd
    if (not torch.is_grad_enabled() or torch.compiler.is_compiling() or not n.is_contiguous()
            or hooks._top_saved_tensors_default_hooks(False) is not None
            or hooks._saved_tensors_hooks_get_disabled_error_message() is not None):
        yield
        return
    device = n.device.type
    amp = dict(device_type=device, enabled=torch.is_autocast_enabled(device), dtype=torch.get_autocast_dtype(device),
               cache_enabled=torch.is_autocast_cache_enabled())
    meta = (n.shape, n.dtype)
    ref = weakref.ref(n)  # a strong one would keep n for as long as the hooks, the graph's lifetime
    state = {"packed": 0, "unpacked": 0, "value": None}

    def pack(t):
        base = ref()
        if base is None or (t is not base and t._base is not base):
            return t
        state["packed"] += 1
        return _Recompute(t)

    def unpack(saved):
        if not isinstance(saved, _Recompute):
            return saved
        value = state["value"]
        if value is None:
            with torch.autocast(**amp):
                value = compute()
            if (value.shape, value.dtype) != meta or not value.is_contiguous():
                raise RuntimeError(f"bastile: a norm computed again for the backward gave {value.dtype} "
                                   f"{tuple(value.shape)}, its forward {meta[1]} {tuple(meta[0])}")
        state["unpacked"] += 1
        state["value"] = value if state["unpacked"] < state["packed"] else None
        return value.as_strided(saved.size, saved.stride, saved.offset)

    with torch.autograd.graph.saved_tensors_hooks(pack, unpack):
        yield


# What HF's decoder layer keeps from its Gated DeltaNet: the positions, and the cache under its own name.
_NOT_MIXED = ("position_embeddings", "position_ids", "past_key_values")


def layer_forward(family: Family, runs: Runs, settings: Settings):
    """The decoder layer: each sublayer between the family's norms, added to the residual stream through the
    family's dropout and multiplier. The output of Bastile's norm before each sublayer is computed again in
    the backward rather than kept (_recomputing). A gradient-checkpointed layer's dense MLP (Bastile's) keeps
    its activation: the recomputation stops once the last tensor the backward needs is saved, the down
    projection's input for a plain down projection, which then never runs again; the fused node would run it
    (and the activation once more in its backward), and its memory saving lasts one layer's backward only.
    With offload_checkpoints, that MLP runs over chunks of tokens instead where its input is longer than one
    (long_context.tiled_mlp)."""
    res, router_scores, dense, beside = family.residual, family.mlp.router_scores, family.mlp.dense, family.mlp.beside
    linear = family.linear_attention

    def mix(self, x, kwargs):
        """The layer's token mixer on x: its attention, or on a linear-attention layer (HF's block_type says
        which) its Gated DeltaNet, which takes the cache as cache_params, and no positions."""
        if linear and self.block_type == LINEAR:
            rest = {k: v for k, v in kwargs.items() if k not in _NOT_MIXED}
            return self.linear_attn(hidden_states=x, cache_params=kwargs.get("past_key_values"), **rest)
        out, _ = self.self_attn(hidden_states=x, **kwargs)
        return out

    def norm(self, name, x):
        return x if name is None else getattr(self, name)(x)

    @contextlib.contextmanager
    def normed(self, name, x, checkpointed):
        """norm(self, name, x), recomputed in the backward where that saves memory (_recomputing)."""
        n = norm(self, name, x)
        if name is None or not runs("norm") or checkpointed:
            yield n
            return
        with _recomputing(n, lambda: norm(self, name, x)):
            yield n

    def add(self, residual, out, branch):
        if res.dropout is not None:
            out = getattr(self, res.dropout[branch])(out)
        if res.multiplier is not None:
            out = out * getattr(self, res.multiplier)
        return residual + out

    def layer(self, hidden_states, per_layer_input, kwargs):
        checkpointed = self.gradient_checkpointing and self.training
        residual = hidden_states
        with normed(self, res.attention_in, hidden_states, checkpointed) as x:
            out = mix(self, x, kwargs)
        hidden_states = add(self, residual, norm(self, res.attention_out, out), 0)
        residual = hidden_states
        with normed(self, res.mlp_in, hidden_states, checkpointed) as x:
            if (dense and checkpointed and runs("mlp", "dense")
                    and type(self.mlp) is hf_attr(family, family.name("MLP")) and "forward" not in vars(self.mlp)):
                chunk = long_context.chunk_tokens(settings(), x, self.mlp.down_proj.in_features)
                # Bastile's forward (mlp_forward), whole or over chunks
                out = long_context.tiled_mlp(self.mlp, x, chunk) if chunk else self.mlp(x, keep_activation=True)
            else:
                out = self.mlp(x)
        if router_scores:
            out, _ = out
        if beside and self.enable_moe_block:
            flat = residual.reshape(-1, residual.shape[-1])
            _, weights, index = self.router(flat)
            experts = self.experts(self.pre_feedforward_layernorm_2(flat), index, weights).reshape(residual.shape)
            out = self.post_feedforward_layernorm_1(out) + self.post_feedforward_layernorm_2(experts)
        hidden_states = add(self, residual, norm(self, res.mlp_out, out), 1)
        if res.per_layer_input and self.hidden_size_per_layer_input:
            hidden_states = hidden_states + self.post_per_layer_input_norm(
                _gated_projection(hidden_states, self.per_layer_input_gate, self.act_fn, per_layer_input,
                                  self.per_layer_projection))
        return hidden_states if res.scalar is None else hidden_states * getattr(self, res.scalar)

    if res.per_layer_input:  # HF's decoder passes it second, by position
        def forward(self, hidden_states, per_layer_input=None, **kwargs):
            return layer(self, hidden_states, per_layer_input, kwargs)
    else:
        def forward(self, hidden_states, **kwargs):
            return layer(self, hidden_states, None, kwargs)
    return forward


def _gated_projection(x, gate, act, up, projection):
    """projection(act(gate(x)) * up), the activation and product fused with the projection where the activation
    is one `swiglu` computes and up has gate's dtype (as lora.swiglu_down needs), else HF's math."""
    (g,) = lora.project(x, gate)
    activation = gated_activation(act)
    if activation is None or up.dtype != g.dtype:
        return projection(act(g) * up)
    return lora.swiglu_down(g, up, projection, activation)


# ------------------------------------------------------------------------------------------------ decoder


_MASKS = {"full_attention": create_causal_mask, "sliding_attention": create_sliding_window_causal_mask,
          LINEAR: create_recurrent_attention_mask}
# The layer types whose unpadded, uncached mask is None: SDPA's is_causal, a linear attention's unmasked inputs.
_UNMASKED = {"full_attention", LINEAR}


def _text_positions(family: Family, position_ids):
    """The text positions in the position ids a decoder is given, as its HF forward finds them: multimodal
    RoPE's (Rotary.sections) come with the sections' rows, [4, batch, seq] with the text's first, or [3,
    batch, seq] with none (HF's masks then take no positions)."""
    if not family.rotary.sections or position_ids is None or position_ids.ndim == 2:
        return position_ids
    return position_ids[0] if position_ids.shape[0] == 4 else None


def _masks(family, runs, decoder, input_ids, attention_mask, position_ids, past_key_values, inputs_embeds, use_cache,
           kwargs):
    """(attention_mask, input_ids, inputs_embeds, kwargs) to call the decoder's HF forward with.

    A call with no padding mask, no positions and no cache attends causally in every layer, which SDPA does
    itself with `is_causal`. HF finds that out only outside tracing, after a host sync on the positions (its
    packed-sequence check); under torch.compile it builds the [seq, seq] mask instead, and SDPA's masked
    kernels are ~3x slower in the backward. Decoders with `config.layer_types` take prepared masks per layer
    type; those whose types are all _UNMASKED get None for each, which says it without the positions.

    A batch that may be packed (positions, no padding mask, no cache):
    - where the attention of some layers runs varlen (_varlen_types), the varlen kwargs (varlen.KEYS) if the
      collator did not give them;
    - a decoder that takes prepared masks gets none for the layer types that run varlen (Bastile's attention
      ignores HF's) and HF's, made with the position ids, for the others. GPT-OSS's makes them without, so that
      its packed rows attend across their sequences."""
    config = decoder.config
    layer_types = config.layer_types if "layer_types" in family.config else None
    if attention_mask is not None or past_key_values is not None or use_cache:
        return attention_mask, input_ids, inputs_embeds, kwargs
    position_ids = _text_positions(family, position_ids)
    if position_ids is None:
        if config._attn_implementation == "sdpa" and layer_types and set(layer_types) <= _UNMASKED:
            attention_mask = dict.fromkeys(layer_types)
        return attention_mask, input_ids, inputs_embeds, kwargs
    direct = _varlen_types(family, runs, decoder, layer_types)
    if direct and kwargs.get("cu_seq_lens_q") is None:
        batch = (input_ids if input_ids is not None else inputs_embeds).shape[0]
        kwargs = {**kwargs, **(varlen.sequences(position_ids, batch) or {})}
    if not layer_types or (direct and kwargs.get("cu_seq_lens_q") is None):  # not packed after all
        return attention_mask, input_ids, inputs_embeds, kwargs
    embeds = inputs_embeds
    if embeds is None and set(layer_types) - direct:
        # HF's masks read the embeddings' shape, dtype and device: made for them without a graph, while the
        # decoder embeds the ids itself (Gemma 4's per-layer embeddings read the ids)
        with torch.no_grad():
            embeds = decoder.get_input_embeddings()(input_ids)
    attention_mask = {t: None if t in direct else _MASKS[t](config=config, inputs_embeds=embeds, attention_mask=None,
                                                             past_key_values=None, position_ids=position_ids)
                      for t in set(layer_types)}
    return attention_mask, input_ids, inputs_embeds, kwargs


def decoder_forward(family: Family, runs: Runs, settings: Settings, check: Callable):
    """A decoder's forward (XModel.forward, which causal LMs and TRL's fused head call) around HF's: the
    masks of `_masks`, and no cache in training unless asked for. HF's decoder makes one whenever
    config.use_cache says so, training included, and with one it does not look for the restarting position
    ids of packed rows: their sequences would attend to one another. With offload_checkpoints, a
    checkpointed decoder's saved layer inputs go to host memory (long_context.offloaded). `check(model)`
    runs on each model's first call (families.check: a model built after apply() is checked there)."""
    def wrap(forward):
        @functools.wraps(forward)
        def wrapper(self, input_ids=None, attention_mask=None, position_ids=None, past_key_values=None,
                    inputs_embeds=None, use_cache=None, **kwargs):
            check(self)
            if use_cache is None:
                use_cache = False if self.training else self.config.use_cache
            attention_mask, input_ids, inputs_embeds, kwargs = _masks(
                family, runs, self, input_ids, attention_mask, position_ids, past_key_values, inputs_embeds,
                use_cache, kwargs)
            offload = (settings().offload_checkpoints and self.gradient_checkpointing and self.training
                       and torch.is_grad_enabled())
            with long_context.offloaded(offload):
                return forward(self, input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                               past_key_values=past_key_values, inputs_embeds=inputs_embeds, use_cache=use_cache,
                               **kwargs)
        return wrapper
    return wrap


# ------------------------------------------------------------------------------------------------ head


def _fused_loss_applies(model, labels) -> bool:
    """Training with labels, a plain linear LM head and HF's default loss: the logits are never needed.
    The fused loss reads lm_head's parameters without calling lm_head, so a head whose forward is hooked
    or replaced (accelerate's offloading, a user's hook) runs as HF's. DeepSpeed ZeRO-3 hooks every
    module and keeps a parameter an empty placeholder outside its module's forward, but inside its
    engine's forward, reading the parameter through its module (as here) gathers it for the module
    running (DeepSpeed's external parameters), and ZeRO-3 reduces the gradient the fused op gives it;
    a placeholder still empty (a ZeRO-3 model called outside its engine) runs as HF's."""
    head = model.get_output_embeddings()
    if labels is None or not model.training or type(head) is not nn.Linear or hasattr(model, "_loss_function"):
        return False
    if hasattr(head.weight, "ds_id"):
        usable = head.weight.numel() > 0
    else:
        usable = not lora.hooked(head)
    if not usable:
        warnings.warn("bastile: lm_head's forward is hooked or replaced, or its weight is a ZeRO-3 placeholder, "
                      "and the fused cross-entropy never calls lm_head: HF's head and loss run instead",
                      stacklevel=3)
    return usable


def no_cache_for_a_loss(use_cache, labels):
    """use_cache for the decoder: False for a loss (labels given) unless asked for. In evaluation HF's
    decoder makes a cache by default (as in training: see decoder_forward), and with one its packed rows
    attend across their sequences; a forward that computes a loss needs none (generate passes no labels)."""
    return False if use_cache is None and labels is not None else use_cache


def hf_tuple(forward):
    """HF's can_return_tuple (a tuple where return_dict=False is passed or set in the config), except that
    the tuple keeps the logits' slot, None, where the fused loss made no logits. HF's to_tuple drops None
    fields, so `loss, logits = out[:2]` would bind the cache as the logits."""
    @functools.wraps(forward)
    def wrapper(self, *args, **kwargs):
        return_dict = kwargs.pop("return_dict", None)
        if return_dict is None:
            return_dict = getattr(self.config, "return_dict", True)
        out = forward(self, *args, **kwargs)
        if return_dict:
            return out
        return tuple(getattr(out, f.name) for f in dataclasses.fields(out)
                     if getattr(out, f.name) is not None or (f.name == "logits" and out.loss is not None))
    return wrapper


def _head_and_loss(model, hidden_states, labels, logits_to_keep, kwargs, divisor=None, softcap=None):
    """(logits, loss) of an HF causal LM's head over the positions logits_to_keep keeps: the logits divided by
    `divisor` and softcapped by `softcap` where given, and HF's ForCausalLMLoss; in training with labels the
    fused linear cross-entropy instead, and no logits (_fused_loss_applies)."""
    slice_indices = slice(-logits_to_keep, None) if isinstance(logits_to_keep, int) else logits_to_keep
    hidden = hidden_states[:, slice_indices, :]
    if _fused_loss_applies(model, labels):
        scale = 1.0 if divisor is None else 1.0 / divisor
        return None, _fused_loss(model, hidden, labels, scale, softcap, **kwargs)
    logits = model.lm_head(hidden)
    if divisor is not None:
        logits = logits / divisor
    if softcap is not None:
        logits = torch.tanh(logits / softcap) * softcap
    loss = None
    if labels is not None:
        loss = model.loss_function(logits=logits, labels=labels, vocab_size=model.config.get_text_config().vocab_size,
                                   **kwargs)
    return logits, loss


def causal_lm_forward(family: Family, check: Callable):
    """XForCausalLM.forward; in training with labels the loss comes from the fused linear cross-entropy
    (HF's ForCausalLMLoss: labels shifted left, the last position ignored; the family's logit divisor as its
    logit scale, its softcap as the op's) and `logits` is None. Otherwise (inference, generation, evaluation,
    a hooked head, a custom loss) it is HF's head and loss. MoE families add the router's load-balancing loss
    as HF adds it and return the router logits."""
    head = family.head
    divisor, softcap, moe, output = head.logit_divisor, head.softcap, head.router_aux_loss, head.output

    @hf_tuple
    def forward(self, input_ids=None, attention_mask=None, position_ids=None, past_key_values=None,
                inputs_embeds=None, labels=None, use_cache=None, logits_to_keep=0, output_router_logits=None,
                **kwargs):
        check(self)
        if moe:
            if output_router_logits is None:
                output_router_logits = self.config.output_router_logits
            kwargs["output_router_logits"] = output_router_logits
        outputs = self.model(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                             past_key_values=past_key_values, inputs_embeds=inputs_embeds,
                             use_cache=no_cache_for_a_loss(use_cache, labels), **kwargs)
        kwargs.pop("output_router_logits", None)
        logits, loss = _head_and_loss(self, outputs.last_hidden_state, labels, logits_to_keep, kwargs,
                                      divisor and getattr(self.config, divisor), softcap and getattr(self.config, softcap))
        if not moe:
            return _output(CausalLMOutputWithPast if output is None else hf_attr(family, family.name(output)),
                           dict(loss=loss, logits=logits, past_key_values=outputs.past_key_values,
                                hidden_states=outputs.hidden_states, attentions=outputs.attentions), outputs)
        aux_loss = None
        if output_router_logits:
            aux_loss = hf_attr(family, "load_balancing_loss_func")(outputs.router_logits, self.num_experts,
                                                               self.num_experts_per_tok, attention_mask)
            if labels is not None:
                loss = loss + self.router_aux_loss_coef * aux_loss.to(loss.device)
        return hf_attr(family, "MoeCausalLMOutputWithPast")(
            loss=loss, aux_loss=aux_loss, logits=logits, past_key_values=outputs.past_key_values,
            hidden_states=outputs.hidden_states, attentions=outputs.attentions, router_logits=outputs.router_logits)
    return forward


def _output(cls, fields: dict, outputs):
    """cls(**fields), its other fields taken from the decoder's outputs where they have them. (The class's
    field dict, not dataclasses.fields, which torch.compile cannot trace on a class.)"""
    return cls(**fields, **{name: getattr(outputs, name) for name in cls.__dataclass_fields__
                            if name not in fields and hasattr(outputs, name)})


def multimodal_lm_forward(family: Family, check: Callable):
    """The forward of a multimodal model's head (Gemma3ForConditionalGeneration, Gemma4's), made from HF's
    (whose signature it shows: generate checks its inputs against it): the inner model (the vision and audio
    towers, HF's, and the family's decoder) given the multimodal inputs, then the head and loss as
    causal_lm_forward's (no divisor; the family's softcap where the multimodal head applies it). MoE families
    add the router's load-balancing loss where output_router_logits says so, as HF's head does: the call's, or
    where HF's head takes it as a parameter (transformers 5.23), the text config's by default."""
    mm, softcap, moe = family.multimodal, family.head.softcap, family.head.router_aux_loss

    def wrap(original):
        by_config = moe and "output_router_logits" in inspect.signature(original).parameters

        @hf_tuple
        def forward(self, input_ids=None, attention_mask=None, position_ids=None, past_key_values=None,
                    inputs_embeds=None, labels=None, use_cache=None, logits_to_keep=0, **kwargs):
            check(self)
            if by_config and kwargs.get("output_router_logits") is None:
                kwargs["output_router_logits"] = self.config.get_text_config().output_router_logits
            inputs = {k: kwargs.pop(k) for k in mm.inputs if k in kwargs}
            outputs = self.model(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                                 past_key_values=past_key_values, inputs_embeds=inputs_embeds, labels=labels,
                                 use_cache=no_cache_for_a_loss(use_cache, labels), return_dict=True, **inputs,
                                 **kwargs)
            cap = getattr(self.config.get_text_config(), softcap) if mm.softcap else None
            logits, loss = _head_and_loss(self, outputs.last_hidden_state, labels, logits_to_keep, kwargs,
                                          softcap=cap)
            fields = dict(loss=loss, logits=logits, past_key_values=outputs.past_key_values,
                          hidden_states=outputs.hidden_states, attentions=outputs.attentions)
            if moe and kwargs.get("output_router_logits"):
                text = self.config.get_text_config()
                fields["aux_loss"] = hf_attr(family, "load_balancing_loss_func")(
                    outputs.router_logits, text.num_experts, text.num_experts_per_tok, attention_mask)
                if labels is not None:
                    fields["loss"] = loss + text.router_aux_loss_coef * fields["aux_loss"].to(loss.device)
            return _output(output_class(family), fields, outputs)
        return functools.wraps(original)(forward)
    return wrap


def output_class(family: Family):
    """The output class of the family's multimodal head: the first of Multimodal.output in its modeling module."""
    module = sys.modules[family.module]
    names = [n.format(prefix=family.prefix) for n in family.multimodal.output]
    return getattr(module, next(n for n in names if hasattr(module, n)))


def _fused_loss(model, hidden, labels, logit_scale, softcap, num_items_in_batch=None, ignore_index=-100,
                shift_labels=None, **_):
    """HF's ForCausalLMLoss without the logits."""
    if shift_labels is None:
        shift_labels = nn.functional.pad(labels, (0, 1), value=ignore_index)[..., 1:]
    head = model.get_output_embeddings()
    return fused_linear_cross_entropy(
        hidden.reshape(-1, hidden.shape[-1]), head.weight, shift_labels.reshape(-1).to(hidden.device),
        bias=head.bias, ignore_index=ignore_index, num_items_in_batch=num_items_in_batch, logit_scale=logit_scale,
        softcap=softcap)
