"""The decoder role: the decoder's forward (its masks, cache and the packed batch's bounds) and its layers'
(each sublayer between the family's norms, added to the residual stream through the family's dropout or
multiplier), each built from stages chosen once per family; Gemma 4's per-layer inputs and experts beside the
MLP are its own (gemma4.py).
"""
import contextlib
import functools
from typing import Callable

import torch
from transformers.masking_utils import (create_causal_mask, create_recurrent_attention_mask,
                                        create_sliding_window_causal_mask)
from transformers.modeling_layers import GradientCheckpointingLayer

from .. import long_context, varlen
from ..families import CONV, LINEAR, Family, Residual
from . import Context, Declaration, Target, gemma4, hf_attr, mlp, named, short_conv
from .attention import varlen_rule
from .recompute import recomputing

# ------------------------------------------------------------------------------------------------ the layer


def checkpointed(forward):
    """A decoder layer's forward as transformers makes its own. Newer releases (5.23) wrap each
    GradientCheckpointingLayer subclass's forward in the checkpointing when the class is made (earlier ones
    checkpoint in __call__, and this returns `forward` itself): a forward set on the class afterwards gets
    the same wrapper, from the same code, through a subclass made for it."""
    return type("Checkpointed", (GradientCheckpointingLayer,), {"forward": forward}).forward


# What HF's decoder layer keeps from its Gated DeltaNet: the positions, and the cache under its own name.
_NOT_MIXED = ("position_embeddings", "position_ids", "past_key_values")


def attend(self, x, kwargs):
    out, _ = self.self_attn(hidden_states=x, **kwargs)
    return out


def mix(self, x, kwargs):
    """A hybrid layer's token mixer on x: its attention, or on a linear-attention layer (HF's block_type says
    which) its Gated DeltaNet, which takes the cache as cache_params, and no positions."""
    if self.block_type == LINEAR:
        rest = {k: v for k, v in kwargs.items() if k not in _NOT_MIXED}
        return self.linear_attn(hidden_states=x, cache_params=kwargs.get("past_key_values"), **rest)
    return attend(self, x, kwargs)


def add(self, residual, out, branch):
    return residual + out


def dropped(modules):
    """Phi-3: the layer's dropout module of each branch (attention's, the MLP's) on its output."""
    def add(self, residual, out, branch):
        return residual + getattr(self, modules[branch])(out)
    return add


def multiplied(attribute):
    """Granite: each branch's output times the layer's residual_multiplier."""
    def add(self, residual, out, branch):
        return residual + out * getattr(self, attribute)
    return add


def adder(res: Residual) -> Callable:
    if res.dropout is not None and res.multiplier is not None:
        raise NotImplementedError("bastile: a residual with both dropout and a multiplier")
    return dropped(res.dropout) if res.dropout else multiplied(res.multiplier) if res.multiplier else add


def call_mlp(attribute: str) -> Callable:
    def call(self, x, checkpointed):
        return getattr(self, attribute)(x)
    return call


def dense_mlp(ctx: Context) -> Callable:
    """The dense MLP of a layer. A gradient-checkpointed layer's (Bastile's) keeps its activation: the
    recomputation stops once the last tensor the backward needs is saved, the down projection's input for a plain
    down projection, which then never runs again; the fused node would run it (and the activation once more in
    its backward), and its memory saving lasts one layer's backward only. With offload_checkpoints, that MLP runs
    over chunks of tokens instead where its input is longer than one (long_context.tiled_mlp)."""
    f = ctx.family
    attribute, down = f.residual.mlp, f.mlp.projections[2]

    def call(self, x, checkpointed):
        mlp = getattr(self, attribute)
        if (checkpointed and ctx.runs("mlp", "dense") and type(mlp) is hf_attr(f, f.name("MLP"))
                and "forward" not in vars(mlp)):
            chunk = long_context.chunk_tokens(ctx.settings(), x, getattr(mlp, down).in_features)
            return long_context.tiled_mlp(mlp, x, chunk) if chunk else mlp(x, keep_activation=True)
        return mlp(x)
    return call


def routed(out):
    """GPT-OSS's MoE block returns (hidden, router scores)."""
    hidden, _ = out
    return hidden


def unrouted(out):
    return out


def alone(self, out, residual):
    return out


def unchanged(self, hidden_states, per_layer_input):
    return hidden_states


def layer_forward(ctx: Context) -> Callable:
    """The decoder layer. The output of Bastile's norm before each sublayer is computed again in the backward
    rather than kept (recompute.py)."""
    f = ctx.family
    res = f.residual
    mixer = mix if f.linear_attention else short_conv.mix(ctx, attend) if f.short_conv else attend
    combine = adder(res)
    mlp = dense_mlp(ctx) if f.mlp.dense else call_mlp(res.mlp)
    mlp_out = routed if f.mlp.router_scores else unrouted
    beside = gemma4.experts_beside if f.mlp.beside else alone
    after = gemma4.per_layer_input if res.per_layer_input else unchanged

    def norm(self, name, x):
        return x if name is None else getattr(self, name)(x)

    def normed(self, name, x, checkpointed):
        """norm(self, name, x), and the context its sublayer runs in: one that recomputes it in the backward where
        that saves memory (recompute.py)."""
        n = norm(self, name, x)
        if name is None or not ctx.runs("norm") or checkpointed:
            return n, contextlib.nullcontext()
        return n, recomputing((n,), lambda: (norm(self, name, x),))

    def layer(self, hidden_states, per_layer_input, kwargs):
        checkpointed = self.gradient_checkpointing and self.training
        residual = hidden_states
        x, saving = normed(self, res.attention_in, hidden_states, checkpointed)
        with saving:
            out = mixer(self, x, kwargs)
        hidden_states = combine(self, residual, norm(self, res.attention_out, out), 0)
        residual = hidden_states
        x, saving = normed(self, res.mlp_in, hidden_states, checkpointed)
        with saving:
            out = mlp_out(mlp(self, x, checkpointed))
        out = beside(self, out, residual)
        hidden_states = combine(self, residual, norm(self, res.mlp_out, out), 1)
        return after(self, hidden_states, per_layer_input)

    return gemma4.layer_signature(layer) if res.per_layer_input else plain_signature(layer)


def plain_signature(layer):
    def forward(self, hidden_states, **kwargs):
        return layer(self, hidden_states, None, kwargs)
    return forward


# ------------------------------------------------------------------------------------------------ the decoder


_MASKS = {"full_attention": create_causal_mask, "sliding_attention": create_sliding_window_causal_mask,
          LINEAR: create_recurrent_attention_mask, CONV: create_recurrent_attention_mask}
# The layer types whose unpadded, uncached mask is None: SDPA's is_causal, a linear attention's or short
# convolution's unmasked inputs.
_UNMASKED = {"full_attention", LINEAR, CONV}


def positions_as_given(position_ids):
    return position_ids


def text_of_sections(position_ids):
    """The text positions of multimodal RoPE's (Rotary.sections), as the decoder's HF forward finds them: they
    come with the sections' rows, [4, batch, seq] with the text's first, or [3, batch, seq] with none (HF's
    masks then take no positions)."""
    if position_ids is None or position_ids.ndim == 2:
        return position_ids
    return position_ids[0] if position_ids.shape[0] == 4 else None


def text_positions(family: Family) -> Callable:
    """The text positions in the position ids a decoder of the family is given."""
    return text_of_sections if family.rotary.sections else positions_as_given


def _varlen_types(ctx: Context, takes_varlen: Callable, decoder, layer_types) -> set:
    """The layer types (None standing for all layers, where the decoder has no layer types) whose every
    attention layer takes a packed batch to the varlen kernel: Bastile's attention runs them, and takes_varlen
    (attention.varlen_rule) holds for each."""
    if not ctx.runs("attention"):
        return set()
    types = layer_types or [None] * len(decoder.layers)
    # Bastile's Gated DeltaNet and short convolution (the attention role's too) take any packed batch
    mixers = ctx.family.mixer_types
    return set(types) - {t for t, layer in zip(types, decoder.layers)
                         if t not in mixers and not takes_varlen(layer.self_attn)}


def masks(ctx: Context) -> Callable:
    """The function of a decoder's call that gives (attention_mask, input_ids, inputs_embeds, kwargs) to call its
    HF forward with.

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
      its packed rows attend across their sequences.

    A 2-D padding mask whose rows are padded only at their ends (TRL's and HF's collators pad on the right), with
    no positions or varlen kwargs, is dropped outside tracing (one host read, as HF's SDPA check makes): every
    layer is causal, so no token sees the pads after it, and the call runs as an unpadded one (SDPA's
    `is_causal`, ~3x faster than its masked kernels). Only the pads' own outputs change, which no loss reads
    with the pads' labels ignored (-100). Where every layer runs varlen (_varlen_types), rows whose tokens are
    one run but with pads before them (an RL trainer's prompts padded on the left, its completions on the right)
    run as varlen spans instead (varlen.padded: a row's tokens one sequence, its pads others), with no mask; the
    pads' outputs change as above, and the positions stay HF's (0 at each row's first place, pad or not). Other masks
    (pads inside a row, layers that keep HF's attention) go to HF's.

    Where Bastile's sink attention runs every layer (GPT-OSS, `masks_itself`), it applies causality and each
    layer's window itself, and the decoder makes no masks: a 2-D mask of ones is dropped, and rows whose tokens
    are one run go as varlen spans (with positions too), each layer given the 2-D mask, whose pads' outputs the
    sink attention zeroes. Only a mask with pads inside a row reaches HF's masks (the sink attention's dense
    core)."""
    positions, takes_varlen = text_positions(ctx.family), varlen_rule(ctx.family)
    typed = "layer_types" in ctx.family.config
    sinks = ctx.family.attention.sinks

    def prepare(decoder, input_ids, attention_mask, position_ids, past_key_values, inputs_embeds, use_cache, kwargs):
        config = decoder.config
        layer_types = config.layer_types if typed else None
        if past_key_values is not None or use_cache:
            return attention_mask, input_ids, inputs_embeds, kwargs
        masks_itself = sinks and typed and _varlen_types(ctx, takes_varlen, decoder, layer_types) == set(layer_types)
        packed = kwargs.get("cu_seq_lens_q") is not None
        if isinstance(attention_mask, torch.Tensor) and attention_mask.ndim == 2 and (masks_itself or (
                position_ids is None and not packed and not torch.compiler.is_compiling())):
            rows, seq = varlen.padding(attention_mask), attention_mask.shape[1]
            if all(r == (0, seq) for r in rows) or (not masks_itself and all(r and r[0] == 0 for r in rows)):
                # no pads, or pads only after each row's tokens, which causal attention never shows them
                attention_mask = None
            elif not packed and None not in rows and (masks_itself or _varlen_types(
                    ctx, takes_varlen, decoder, layer_types) == set(layer_types or [None])):
                # each row's tokens one run (a prompt padded on the left, its completion on the right): spans
                spans = varlen.padded(rows, seq, attention_mask.device)
                mask = attention_mask if masks_itself else None  # the sink attention zeroes the pads' outputs
                return ((dict.fromkeys(layer_types, mask) if typed else mask), input_ids, inputs_embeds,
                        {**kwargs, **spans})
        if attention_mask is not None:
            return attention_mask, input_ids, inputs_embeds, kwargs
        position_ids = positions(position_ids)
        if position_ids is None:
            if masks_itself or (config._attn_implementation == "sdpa" and layer_types
                                and set(layer_types) <= _UNMASKED):
                attention_mask = dict.fromkeys(layer_types)
            return attention_mask, input_ids, inputs_embeds, kwargs
        direct = set(layer_types) if masks_itself else _varlen_types(ctx, takes_varlen, decoder, layer_types)
        if direct and kwargs.get("cu_seq_lens_q") is None:
            batch = (input_ids if input_ids is not None else inputs_embeds).shape[0]
            kwargs = {**kwargs, **(varlen.sequences(position_ids, batch) or {})}
        if masks_itself:
            return dict.fromkeys(layer_types), input_ids, inputs_embeds, kwargs
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
    return prepare


def decoder_forward(ctx: Context) -> Callable:
    """A decoder's forward (XModel.forward, which causal LMs and TRL's fused head call) around HF's: the
    masks of `masks`, and no cache in training unless asked for. HF's decoder makes one whenever
    config.use_cache says so, training included, and with one it does not look for the restarting position
    ids of packed rows: their sequences would attend to one another. With offload_checkpoints, a
    checkpointed decoder's saved layer inputs go to host memory (long_context.offloaded). `check(model)`
    runs on each model's first call (a model built after apply() is checked there)."""
    f, prepare = ctx.family, masks(ctx)

    def wrap(forward):
        @functools.wraps(forward)
        def wrapper(self, input_ids=None, attention_mask=None, position_ids=None, past_key_values=None,
                    inputs_embeds=None, use_cache=None, **kwargs):
            ctx.check(self)
            if use_cache is None:
                use_cache = False if self.training else self.config.use_cache
            attention_mask, input_ids, inputs_embeds, kwargs = prepare(
                self, input_ids, attention_mask, position_ids, past_key_values, inputs_embeds, use_cache, kwargs)
            offload = (ctx.settings().offload_checkpoints and self.gradient_checkpointing and self.training
                       and torch.is_grad_enabled())
            with long_context.offloaded(offload):
                return forward(self, input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                               past_key_values=past_key_values, inputs_embeds=inputs_embeds, use_cache=use_cache,
                               **kwargs)
        return named(wrapper, "decoder", f)
    return wrap


def declare(ctx: Context) -> Declaration:
    f = ctx.family
    layer = named(layer_forward(ctx), "decoder", f)
    return Declaration((
        Target(f.decoder, "forward", decoder_forward(ctx), wraps=True),
        # Gemma 4's per-layer input: a gated projection like the dense MLP's
        Target("DecoderLayer", "forward", checkpointed(layer), lora=mlp.why_not(f.mlp) if f.residual.per_layer_input
               else None),
    ))
