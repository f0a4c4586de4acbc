"""The head role: the causal LM's forward (and a multimodal model's head), its loss from the fused linear
cross-entropy in training with labels, HF's head and loss otherwise (inference, generation, evaluation, a hooked
head, a custom loss); MoE families add the router's load-balancing loss as HF adds it."""
import dataclasses
import functools
import inspect
import sys
import warnings
from typing import Callable

import torch
from torch import nn
from torch.distributed.fsdp import FSDPModule
from transformers.modeling_outputs import CausalLMOutputWithPast

from .. import lora
from ..families import Family, modeling
from ..ops.fused_linear_cross_entropy import fused_linear_cross_entropy
from . import Context, Declaration, Target, hf_attr, named


def _linear(head) -> bool:
    """An nn.Linear, or FSDP2's class of one (fully_shard makes FSDP<class>, a subclass, for the modules it
    shards); not another subclass (bitsandbytes' 4-bit layers are some)."""
    return type(head) is nn.Linear or (isinstance(head, FSDPModule) and type(head).__bases__ == (FSDPModule, nn.Linear))


def _fused_loss_applies(model, labels) -> bool:
    """Training with labels, a plain linear LM head and HF's default loss: the logits are never needed.
    The fused loss reads lm_head's parameters without calling lm_head, so a head whose forward is hooked
    or replaced (accelerate's offloading, a user's hook) runs as HF's, except FSDP2's: there the loss runs as
    lm_head's forward, through its call (_fused_loss). DeepSpeed ZeRO-3 hooks every
    module and keeps a parameter an empty placeholder outside its module's forward, but inside its
    engine's forward, reading the parameter through its module (as here) gathers it for the module
    running (DeepSpeed's external parameters), and ZeRO-3 reduces the gradient the fused op gives it;
    a placeholder still empty (a ZeRO-3 model called outside its engine) runs as HF's."""
    head = model.get_output_embeddings()
    if labels is None or not model.training or not _linear(head) or hasattr(model, "_loss_function"):
        return False
    if hasattr(head.weight, "ds_id"):
        usable = head.weight.numel() > 0
    elif isinstance(head, FSDPModule):
        usable = "forward" not in vars(head)
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


def routed(self, output_router_logits, kwargs):
    """MoE: whether the router logits are returned (the call's, else the config's), passed to the decoder."""
    if output_router_logits is None:
        output_router_logits = self.config.output_router_logits
    kwargs["output_router_logits"] = output_router_logits
    return output_router_logits


def unrouted(self, output_router_logits, kwargs):
    return None


def recorded(self, output_router_logits, kwargs):
    """MoE without a load-balancing loss: the call's output_router_logits, where given, passed to the decoder (which
    records the router logits from transformers 5.23), as HF's head passes its kwargs."""
    if output_router_logits is not None:
        kwargs["output_router_logits"] = output_router_logits
    return None


def dense_output(family: Family) -> Callable:
    """The output of a causal LM without routing: CausalLMOutputWithPast, or the family's own class (Head.output)."""
    name = family.head.output

    def output(self, fields, outputs, labels, routing, attention_mask):
        return _output(CausalLMOutputWithPast if name is None else hf_attr(family, family.name(name)), fields, outputs)
    return output


def recorded_output(family: Family) -> Callable:
    """The output of Head.router_logits's heads: the modeling module's MoeCausalLMOutputWithPast where it has one
    (transformers 5.23), the decoder's router logits in it; else CausalLMOutputWithPast."""
    def output(self, fields, outputs, labels, routing, attention_mask):
        return _output(getattr(sys.modules[family.module], "MoeCausalLMOutputWithPast", CausalLMOutputWithPast),
                       fields, outputs)
    return output


def load_balancing_loss(router_logits, experts: int, top_k: int, attention_mask=None):
    """HF's load_balancing_loss_func (one function in every MoE modeling module of transformers 5.17-5.23):
    experts times the sum over experts of the share of the layers' rows choosing each (the top-k of the softmax of
    each layer's logits) times its mean softmax probability, over the rows the attention mask keeps. Without its
    host sync: the counts are summed in place on the device as float32 (exact integers), where transformers 5.17's
    torch.bincount reads each layer's largest index on the host (5.23's torch.histc does not: with 5.23 the oldest
    release tested, HF's function can serve again)."""
    if router_logits is None or not isinstance(router_logits, tuple):
        return 0
    device = router_logits[0].device
    counts = torch.zeros(experts, dtype=torch.float32, device=device)
    probs = torch.zeros(experts, dtype=torch.float32, device=device)
    mask = None if attention_mask is None else attention_mask.reshape(-1).to(device=device, dtype=torch.float32)
    slots = None if mask is None else mask.repeat_interleave(top_k)  # each row's mask, once a chosen expert
    for logits in router_logits:
        weights = nn.functional.softmax(logits.to(device), dim=-1)
        _, chosen = torch.topk(weights, top_k, dim=-1)
        chosen = chosen.reshape(-1)
        if mask is None:
            counts.scatter_add_(0, chosen, torch.ones_like(chosen, dtype=torch.float32))
            probs = probs + weights.float().sum(dim=0)
        else:
            counts.scatter_add_(0, chosen, slots)
            probs = probs + (weights.float() * mask.unsqueeze(-1)).sum(dim=0)
    rows = float(sum(g.shape[0] for g in router_logits)) if mask is None else mask.sum() * len(router_logits)
    return torch.sum(counts / rows * (probs / rows).unsqueeze(0)) * experts


def moe_output(family: Family) -> Callable:
    """MoeCausalLMOutputWithPast, with the router's load-balancing loss added to the loss as HF adds it."""
    def output(self, fields, outputs, labels, routing, attention_mask):
        aux_loss, loss = None, fields["loss"]
        if routing:
            aux_loss = load_balancing_loss(outputs.router_logits, self.num_experts, self.num_experts_per_tok,
                                           attention_mask)
            if labels is not None:
                loss = loss + self.router_aux_loss_coef * aux_loss.to(loss.device)
        return hf_attr(family, "MoeCausalLMOutputWithPast")(
            **{**fields, "loss": loss}, aux_loss=aux_loss, router_logits=outputs.router_logits)
    return output


def causal_lm_forward(ctx: Context) -> Callable:
    """XForCausalLM.forward; in training with labels the loss comes from the fused linear cross-entropy
    (HF's ForCausalLMLoss: labels shifted left, the last position ignored; the family's logit divisor as its
    logit scale, its softcap as the op's) and `logits` is None."""
    family = ctx.family
    divisor, softcap = family.head.logit_divisor, family.head.softcap
    route, finish = ((routed, moe_output(family)) if family.head.router_aux_loss else
                     (recorded, recorded_output(family)) if family.head.router_logits else
                     (unrouted, dense_output(family)))

    def forward(self, input_ids=None, attention_mask=None, position_ids=None, past_key_values=None,
                inputs_embeds=None, labels=None, use_cache=None, logits_to_keep=0, output_router_logits=None,
                **kwargs):
        ctx.check(self)
        routing = route(self, output_router_logits, kwargs)
        outputs = self.model(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                             past_key_values=past_key_values, inputs_embeds=inputs_embeds,
                             use_cache=no_cache_for_a_loss(use_cache, labels), **kwargs)
        kwargs.pop("output_router_logits", None)
        logits, loss = _head_and_loss(self, outputs.last_hidden_state, labels, logits_to_keep, kwargs,
                                      divisor and getattr(self.config, divisor), softcap and getattr(self.config, softcap))
        fields = dict(loss=loss, logits=logits, past_key_values=outputs.past_key_values,
                      hidden_states=outputs.hidden_states, attentions=outputs.attentions)
        return finish(self, fields, outputs, labels, routing, attention_mask)
    return hf_tuple(named(forward, "head", family))


def _output(cls, fields: dict, outputs):
    """cls(**fields), its other fields taken from the decoder's outputs where they have them. (The class's
    field dict, not dataclasses.fields, which torch.compile cannot trace on a class.)"""
    return cls(**fields, **{name: getattr(outputs, name) for name in cls.__dataclass_fields__
                            if name not in fields and hasattr(outputs, name)})


def multimodal_lm_forward(ctx: Context) -> Callable:
    """The forward of a multimodal model's head (Gemma3ForConditionalGeneration, Gemma4's), made from HF's
    (whose signature it shows: generate checks its inputs against it): the inner model (the vision and audio
    towers, HF's, and the family's decoder) given the multimodal inputs, then the head and loss as
    causal_lm_forward's (no divisor; the family's softcap where the multimodal head applies it). MoE families
    add the router's load-balancing loss where output_router_logits says so, as HF's head does: the call's, or
    where HF's head takes it as a parameter (transformers 5.23), the text config's by default."""
    family = ctx.family
    mm, softcap, moe = family.multimodal, family.head.softcap, family.head.router_aux_loss

    def wrap(original):
        by_config = moe and "output_router_logits" in inspect.signature(original).parameters

        @hf_tuple
        def forward(self, input_ids=None, attention_mask=None, position_ids=None, past_key_values=None,
                    inputs_embeds=None, labels=None, use_cache=None, logits_to_keep=0, **kwargs):
            ctx.check(self)
            if by_config and kwargs.get("output_router_logits") is None:
                kwargs["output_router_logits"] = self.config.get_text_config().output_router_logits
            inputs = {k: kwargs.pop(k) for k in mm.inputs if k in kwargs}
            if mm.labels:
                inputs["labels"] = labels
            outputs = self.model(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                                 past_key_values=past_key_values, inputs_embeds=inputs_embeds,
                                 use_cache=no_cache_for_a_loss(use_cache, labels), return_dict=True, **inputs,
                                 **kwargs)
            cap = getattr(self.config.get_text_config(), softcap) if mm.softcap else None
            logits, loss = _head_and_loss(self, outputs.last_hidden_state, labels, logits_to_keep, kwargs,
                                          softcap=cap)
            fields = dict(loss=loss, logits=logits, past_key_values=outputs.past_key_values,
                          hidden_states=outputs.hidden_states, attentions=outputs.attentions)
            if moe and kwargs.get("output_router_logits"):
                text = self.config.get_text_config()
                fields["aux_loss"] = load_balancing_loss(outputs.router_logits, text.num_experts,
                                                         text.num_experts_per_tok, attention_mask)
                if labels is not None:
                    fields["loss"] = loss + text.router_aux_loss_coef * fields["aux_loss"].to(loss.device)
            return _output(output_class(family), fields, outputs)
        return named(functools.wraps(original)(forward), "head", family)
    return wrap


def output_class(family: Family):
    """The output class of the family's multimodal head: the first of Multimodal.output in its modeling module."""
    mm = family.multimodal
    module = sys.modules[modeling(mm.module) if mm.module else family.module]
    names = [n.format(prefix=mm.prefix or family.prefix) for n in mm.output]
    return getattr(module, next(n for n in names if hasattr(module, n)))


def _fused_loss(model, hidden, labels, logit_scale, softcap, num_items_in_batch=None, ignore_index=-100,
                shift_labels=None, **_):
    """HF's ForCausalLMLoss without the logits. Where FSDP2 shards lm_head (alone, or with the final norm as
    accelerate does), the loss is lm_head's forward for the call: FSDP2's hooks around it unshard the weight, register
    the reduction of its gradient, and count lm_head as run in its group (a group whose module never runs is never
    unsharded again)."""
    if shift_labels is None:
        shift_labels = nn.functional.pad(labels, (0, 1), value=ignore_index)[..., 1:]
    head = model.get_output_embeddings()

    def loss(hidden):
        return fused_linear_cross_entropy(
            hidden.reshape(-1, hidden.shape[-1]), head.weight, shift_labels.reshape(-1).to(hidden.device),
            bias=head.bias, ignore_index=ignore_index, num_items_in_batch=num_items_in_batch,
            logit_scale=logit_scale, softcap=softcap)
    if not isinstance(head, FSDPModule):
        return loss(hidden)
    head.forward = loss
    try:
        return head(hidden)
    finally:
        del head.forward


def declare(ctx: Context) -> Declaration:
    f = ctx.family
    targets = [Target("ForCausalLM", "forward", causal_lm_forward(ctx))] if f.causal_lm else []
    mm = f.multimodal
    if mm:
        targets.append(Target(mm.head, "forward", multimodal_lm_forward(ctx), wraps=True,
                              owner=(modeling(mm.module), mm.prefix) if mm.module else None))
    return Declaration(tuple(targets))
