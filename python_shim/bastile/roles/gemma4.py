"""Gemma 4's stages: its K/V (shared by the last layers, v normed, k's projection as v), its per-layer inputs
and layer scalar, and the experts beside its dense MLP (the 26B-A4B model's enable_moe_block).
"""
import warnings
from typing import Callable

from .. import lora
from .mlp import gated_projection


def attention_states(norm_rotate: Callable) -> Callable:
    """q, k, v of Gemma 4's attention (attention.py's states): k's projection as v where the module has no v_proj
    (attention_k_eq_v), v through the module's v_norm; a layer whose is_kv_shared_layer is set takes k and v
    from shared_kv_states, where the last earlier layer of its type (store_full_length_kv) put them."""
    def states(self, hidden_states, position_embeddings, cache, kwargs):
        heads = (*hidden_states.shape[:-1], -1, self.head_dim)
        shared = kwargs.pop("shared_kv_states")
        if self.is_kv_shared_layer:  # k and v of an earlier layer, normed and rotated there
            (q,) = lora.project(hidden_states, self.q_proj)
            q, _, kept = norm_rotate(self, q.view(heads), None, position_embeddings)
            k, v = shared[self.layer_type]
            if q.requires_grad and not k.requires_grad:
                warnings.warn(f"bastile: layer {self.layer_idx} reuses keys and values that carry no gradient: the "
                              "layer that made them ran without autograd (reentrant gradient checkpointing), so "
                              "their projections get no gradient from the layers that share them, in HF's forward "
                              "too; use_reentrant=False keeps it", stacklevel=2)
            return q, k, v, None, kept
        if self.v_proj is None:
            q, k = lora.project(hidden_states, self.q_proj, self.k_proj)
            v = k
        else:
            q, k, v = lora.project(hidden_states, self.q_proj, self.k_proj, self.v_proj)
        q, k, kept = norm_rotate(self, q.view(heads), k.view(heads), position_embeddings)
        v = self.v_norm(v.view(heads)).transpose(1, 2)
        if cache is not None:
            k, v = cache.update(k, v, self.layer_idx)
        if self.store_full_length_kv:
            shared[self.layer_type] = k, v
        return q, k, v, None, kept
    return states


def experts_beside(self, out, residual):
    """The layer's router and experts beside its dense MLP, on the MLP's residual input:
    post_feedforward_layernorm_1(mlp) + post_feedforward_layernorm_2(experts(pre_feedforward_layernorm_2(h), router(h)))."""
    if not self.enable_moe_block:
        return out
    flat = residual.reshape(-1, residual.shape[-1])
    _, weights, index = self.router(flat)
    experts = self.experts(self.pre_feedforward_layernorm_2(flat), index, weights).reshape(residual.shape)
    return self.post_feedforward_layernorm_1(out) + self.post_feedforward_layernorm_2(experts)


def per_layer_input(self, hidden_states, per_layer_input):
    """After the MLP, h + post_per_layer_input_norm(per_layer_projection(act_fn(per_layer_input_gate(h)) *
    per_layer_input)) where the layer has per-layer inputs; then the output times the layer's layer_scalar."""
    if self.hidden_size_per_layer_input:
        hidden_states = hidden_states + self.post_per_layer_input_norm(gated_projection(
            hidden_states, self.per_layer_input_gate, self.act_fn, per_layer_input, self.per_layer_projection))
    return hidden_states * self.layer_scalar


def layer_signature(layer: Callable) -> Callable:
    """The layer's forward as HF's decoder calls it: its per-layer input second, by position."""
    def forward(self, hidden_states, per_layer_input=None, **kwargs):
        return layer(self, hidden_states, per_layer_input, kwargs)
    return forward
