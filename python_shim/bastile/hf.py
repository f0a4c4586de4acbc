"""Replacements for HF forward functions, written against the HF code they replace (transformers 5.x).

Each keeps its HF signature and falls back to HF's own math where a Bastile op does not apply (another
activation, a wrapped LM head, a custom loss), so a patched model always computes what HF would.
"""
import dataclasses
import functools
import sys
import warnings

import torch
from torch import nn
from transformers.activations import SiLUActivation
from transformers.masking_utils import create_causal_mask, create_sliding_window_causal_mask
from transformers.modeling_outputs import CausalLMOutputWithPast
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

from . import lora, varlen
from .ops.fused_linear_cross_entropy import fused_linear_cross_entropy
from .ops.geglu import geglu
from .ops.qk_norm_rope import qk_norm_rope
from .ops.rms_norm import rms_norm
from .ops.rope import rope
from .ops.swiglu import swiglu


def rms_norm_forward(self, hidden_states):
    return rms_norm(hidden_states, self.weight, self.variance_epsilon)


def rms_norm_cast_after_weight_forward(self, hidden_states):
    """GptOssRMSNorm: the weight multiplies before the result is rounded to the input's dtype."""
    return rms_norm(hidden_states, self.weight, self.variance_epsilon, cast_after_weight=True)


_SILU = (nn.SiLU, SiLUActivation)


def swiglu_mlp_why_not(self):
    """None when swiglu_mlp_forward runs this MLP through its fused ops and nodes, else why not."""
    return None if isinstance(self.act_fn, _SILU) else f"activation {type(self.act_fn).__name__} is not SiLU"


def swiglu_mlp_forward(self, x):
    """`down(act(gate(x)) * up(x))` with the activation and product fused when the activation is SiLU,
    and the down projection fused with them so that the activation is not kept for the backward. PEFT
    LoRA adapters on the projections run in fused nodes (lora.py); anything else is called as a module."""
    if swiglu_mlp_why_not(self) is not None:
        return self.down_proj(self.act_fn(self.gate_proj(x)) * self.up_proj(x))
    gate, up = lora.project(x, self.gate_proj, self.up_proj)
    if getattr(self, "_bastile_checkpointed", False):
        # Its layer is recomputed in the backward (gradient checkpointing, told by decoder_forward), which
        # stops once the last tensor the backward needs is saved: the down projection's input, for a plain
        # down projection, which is then never run again; the fused node would run it (and the activation
        # once more in its backward), and its memory saving lasts one layer's backward only.
        (out,) = lora.project(swiglu(gate, up), self.down_proj)
        return out
    return lora.swiglu_down(gate, up, self.down_proj)


def apply_rotary_pos_emb(q, k, cos, sin, unsqueeze_dim=1):
    return rope(q, k, cos, sin, unsqueeze_dim)


def _hf(module_of, name):
    """`name` from the HF module that defines module_of's class (imported already, since it is)."""
    return getattr(sys.modules[type(module_of).__module__], name)


def attention_forward(self, hidden_states, position_embeddings, attention_mask=None, past_key_values=None,
                      **kwargs):
    """The attention forward of Llama, Qwen2, Mistral, Qwen3 and Qwen3-MoE (theirs differ only in the
    sliding window they pass and Qwen3's q/k norms): q/k/v through one fused node and o through another
    where PEFT LoRA adapters wrap them (lora.py), and Qwen3's q_norm, k_norm and rotation in one op."""
    input_shape = hidden_states.shape[:-1]
    hidden_shape = (*input_shape, -1, self.head_dim)
    cos, sin = position_embeddings
    q, k, v = (t.view(hidden_shape) for t in lora.project(hidden_states, self.q_proj, self.k_proj, self.v_proj))
    if not hasattr(self, "q_norm"):
        query_states, key_states = _hf(self, "apply_rotary_pos_emb")(q.transpose(1, 2), k.transpose(1, 2), cos, sin)
    elif self.q_norm.variance_epsilon == self.k_norm.variance_epsilon:
        q, k = qk_norm_rope(q, k, self.q_norm.weight, self.k_norm.weight, cos, sin, self.q_norm.variance_epsilon)
        query_states, key_states = q.transpose(1, 2), k.transpose(1, 2)
    else:  # one eps per launch: norms with different eps go separately
        query_states, key_states = rope(self.q_norm(q).transpose(1, 2), self.k_norm(k).transpose(1, 2), cos, sin)
    value_states = v.transpose(1, 2)

    # Llama passes none, Mistral its config's, Qwen2/Qwen3 their layer's (None on full-attention layers)
    sliding_window = getattr(self, "sliding_window", getattr(self.config, "sliding_window", None))
    dropout = 0.0 if not self.training else self.attention_dropout
    if past_key_values is None and dropout == 0.0 and kwargs.get("cu_seq_lens_q") is not None:
        # a packed batch: the varlen kernel; HF's mask, where it made one, goes unused
        tokens = (t.transpose(1, 2).reshape(-1, t.shape[1], self.head_dim)
                  for t in (query_states, key_states, value_states))
        attn_output = varlen.attention(*tokens, kwargs["cu_seq_lens_q"], kwargs["max_length_q"], self.scaling,
                                       sliding_window).view(*input_shape, -1)
        attn_weights = None
    else:
        if past_key_values is not None:
            key_states, value_states = past_key_values.update(key_states, value_states, self.layer_idx)
        attention_interface = ALL_ATTENTION_FUNCTIONS.get_interface(self.config._attn_implementation,
                                                                    _hf(self, "eager_attention_forward"))
        attn_output, attn_weights = attention_interface(
            self, query_states, key_states, value_states, attention_mask, dropout=dropout,
            scaling=self.scaling, sliding_window=sliding_window, **kwargs)
        attn_output = attn_output.reshape(*input_shape, -1).contiguous()
    (out,) = lora.project(attn_output, self.o_proj)
    return out, attn_weights


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


def _causal_lm_loss(model, hidden, labels, num_items_in_batch=None, ignore_index=-100, shift_labels=None,
                    **_):
    """HF's ForCausalLMLoss (labels shifted left, the last position ignored) without the logits."""
    if shift_labels is None:
        shift_labels = nn.functional.pad(labels, (0, 1), value=ignore_index)[..., 1:]
    head = model.get_output_embeddings()
    return fused_linear_cross_entropy(
        hidden.reshape(-1, hidden.shape[-1]), head.weight, shift_labels.reshape(-1).to(hidden.device),
        bias=head.bias, ignore_index=ignore_index, num_items_in_batch=num_items_in_batch,
        softcap=getattr(model.config, "final_logit_softcapping", None))


def _logits_and_loss(model, hidden_states, labels, logits_to_keep, kwargs):
    """HF's head and loss of a causal LM: the fused linear cross-entropy (no logits) when training with
    labels, else HF's own `lm_head` and `loss_function`."""
    slice_indices = slice(-logits_to_keep, None) if isinstance(logits_to_keep, int) else logits_to_keep
    hidden_states = hidden_states[:, slice_indices, :]
    if _fused_loss_applies(model, labels):
        return None, _causal_lm_loss(model, hidden_states, labels, **kwargs)
    logits = model.lm_head(hidden_states)
    loss = None
    if labels is not None:
        loss = model.loss_function(logits=logits, labels=labels, vocab_size=model.config.vocab_size, **kwargs)
    return logits, loss


def _runs_varlen(decoder) -> bool:
    """Whether `attention_forward` runs the decoder's attention and would take a packed batch to the varlen
    kernel (it has no dropout)."""
    layers = getattr(decoder, "layers", None)
    return (bool(layers) and type(layers[0].self_attn).forward is attention_forward
            and (not decoder.training or not decoder.config.attention_dropout))


_MASKS = {"full_attention": create_causal_mask, "sliding_attention": create_sliding_window_causal_mask}


def _masks(decoder, input_ids, attention_mask, position_ids, past_key_values, inputs_embeds, use_cache, kwargs):
    """(attention_mask, input_ids, inputs_embeds, kwargs) to call the decoder's HF forward with.

    A call with no padding mask, no positions and no cache attends causally in every layer, which SDPA does
    itself with `is_causal`. HF finds that out only outside tracing, after a host sync on the positions (its
    packed-sequence check); under torch.compile it builds the [seq, seq] mask instead, and SDPA's masked
    kernels are ~3x slower in the backward. Decoders with `config.layer_types` take prepared masks per layer
    type; all-full-attention ones get {"full_attention": None}, which says it without the positions.

    A batch that may be packed (positions, no padding mask, no cache):
    - where `attention_forward` runs, the varlen kwargs (varlen.KEYS) if the collator did not give them,
      and in decoders that take prepared masks, none: `attention_forward` ignores HF's;
    - elsewhere, a decoder that takes prepared masks gets HF's masks made with the position ids. GPT-OSS's
      makes them without, so that its packed rows attend across their sequences."""
    config = decoder.config
    layer_types = getattr(config, "layer_types", None)
    if attention_mask is not None or past_key_values is not None or use_cache:
        return attention_mask, input_ids, inputs_embeds, kwargs
    if position_ids is None:
        if config._attn_implementation == "sdpa" and set(layer_types or ()) == {"full_attention"}:
            attention_mask = {"full_attention": None}
        return attention_mask, input_ids, inputs_embeds, kwargs
    if _runs_varlen(decoder):
        if kwargs.get("cu_seq_lens_q") is None:
            batch = (input_ids if input_ids is not None else inputs_embeds).shape[0]
            kwargs = {**kwargs, **(varlen.sequences(position_ids, batch) or {})}
        if kwargs.get("cu_seq_lens_q") is not None and layer_types:
            attention_mask = dict.fromkeys(layer_types)
    elif layer_types and set(layer_types) <= set(_MASKS):
        if inputs_embeds is None:
            input_ids, inputs_embeds = None, decoder.get_input_embeddings()(input_ids)
        attention_mask = {t: _MASKS[t](config=config, inputs_embeds=inputs_embeds, attention_mask=None,
                                       past_key_values=None, position_ids=position_ids) for t in set(layer_types)}
    return attention_mask, input_ids, inputs_embeds, kwargs


def decoder_forward(forward):
    """A decoder's forward (XModel.forward, which causal LMs and TRL's fused head call) around HF's
    `forward`: the masks of `_masks`, and no cache in training unless asked for. HF's decoder makes one
    whenever config.use_cache says so, training included, and with one it does not look for the restarting
    position ids of packed rows: their sequences would attend to one another. It also tells each layer's MLP
    whether the layer is checkpointed (swiglu_mlp_forward)."""
    @functools.wraps(forward)
    def wrapper(self, input_ids=None, attention_mask=None, position_ids=None, past_key_values=None,
                inputs_embeds=None, use_cache=None, **kwargs):
        if use_cache is None:
            use_cache = False if self.training else self.config.use_cache
        for layer in getattr(self, "layers", ()):
            if (mlp := getattr(layer, "mlp", None)) is not None:
                mlp._bastile_checkpointed = self.training and getattr(layer, "gradient_checkpointing", False)
        attention_mask, input_ids, inputs_embeds, kwargs = _masks(
            self, input_ids, attention_mask, position_ids, past_key_values, inputs_embeds, use_cache, kwargs)
        return forward(self, input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                       past_key_values=past_key_values, inputs_embeds=inputs_embeds, use_cache=use_cache, **kwargs)
    return wrapper


def _no_cache_for_a_loss(use_cache, labels):
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


@hf_tuple
def causal_lm_forward(self, input_ids=None, attention_mask=None, position_ids=None, past_key_values=None,
                      inputs_embeds=None, labels=None, use_cache=None, logits_to_keep=0, **kwargs):
    """XForCausalLM.forward; in training with labels the loss comes from the fused linear cross-entropy
    and `logits` is None. Otherwise (inference, generation, evaluation) it is HF's forward."""
    outputs = self.model(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                         past_key_values=past_key_values, inputs_embeds=inputs_embeds,
                         use_cache=_no_cache_for_a_loss(use_cache, labels), **kwargs)
    logits, loss = _logits_and_loss(self, outputs.last_hidden_state, labels, logits_to_keep, kwargs)
    return CausalLMOutputWithPast(loss=loss, logits=logits, past_key_values=outputs.past_key_values,
                                  hidden_states=outputs.hidden_states, attentions=outputs.attentions)


@hf_tuple
def moe_causal_lm_forward(self, input_ids=None, attention_mask=None, position_ids=None, past_key_values=None,
                          inputs_embeds=None, labels=None, use_cache=None, output_router_logits=None,
                          logits_to_keep=0, **kwargs):
    """causal_lm_forward of a mixture-of-experts model (Qwen3-MoE, GPT-OSS): the router's load-balancing
    loss is added as HF adds it, and the router logits are returned."""
    if output_router_logits is None:
        output_router_logits = self.config.output_router_logits
    outputs = self.model(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                         past_key_values=past_key_values, inputs_embeds=inputs_embeds,
                         use_cache=_no_cache_for_a_loss(use_cache, labels),
                         output_router_logits=output_router_logits, **kwargs)
    logits, loss = _logits_and_loss(self, outputs.last_hidden_state, labels, logits_to_keep, kwargs)
    aux_loss = None
    if output_router_logits:
        aux_loss = _hf(self, "load_balancing_loss_func")(outputs.router_logits, self.num_experts,
                                                         self.num_experts_per_tok, attention_mask)
        if labels is not None:
            loss = loss + self.router_aux_loss_coef * aux_loss.to(loss.device)
    return _hf(self, "MoeCausalLMOutputWithPast")(
        loss=loss, aux_loss=aux_loss, logits=logits, past_key_values=outputs.past_key_values,
        hidden_states=outputs.hidden_states, attentions=outputs.attentions, router_logits=outputs.router_logits)


def swiglu_apply_gate(self, gate_up):
    """The experts' gating of transformers' grouped/batched expert implementations (`_apply_gate`):
    act(gate) * up of the halves of gate_up, fused when the activation is SiLU."""
    gate, up = gate_up.chunk(2, dim=-1)
    if isinstance(self.act_fn, _SILU):
        return swiglu(gate, up)
    return self.act_fn(gate) * up


def gpt_oss_apply_gate(self, gate_up):
    """GptOssExperts._apply_gate: clamped, interleaved GEGLU of gate_up in one kernel."""
    return geglu(gate_up, self.alpha, self.limit)


def half_split_apply_rotary_pos_emb(q, k, cos, sin, unsqueeze_dim=1):
    """GPT-OSS's rotation: halves (x1, x2) -> (x1 cos - x2 sin, x2 cos + x1 sin) with cos and sin of
    head_dim / 2; the rotate-half rotation with cos and sin repeated, which the rope op computes."""
    return rope(q, k, torch.cat((cos, cos), dim=-1), torch.cat((sin, sin), dim=-1), unsqueeze_dim)
