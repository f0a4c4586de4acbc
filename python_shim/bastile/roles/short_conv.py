"""The gated short convolution (Family.short_conv: LFM2's), of the attention role, and the decoder layer's stage that
mixes its tokens with it or with attention.

In training and evaluation without a cache its forward is HF's math through Bastile's ops: in_proj in a fused node
where PEFT LoRA adapters wrap it (lora.py), its three chunks B, C, x as views, causal_conv1d (no activation) over
B * x as it is ([batch, seq, hidden]), C times that, out_proj in another fused node. A packed batch (the decoder's
varlen kwargs: cu_seq_lens_q) runs as one stream whose convolution restarts at each sequence, where HF's would carry
it across. With a cache (generation), or a kernel wider than causal_conv1d takes, it is HF's forward.
"""
import functools
from typing import Callable, Optional

from transformers.integrations.accelerate import force_accelerate_hooks

from .. import lora, varlen
from ..families import Family
from ..ops.causal_conv1d import causal_conv1d
from . import Context, hf_attr, named

MAX_WIDTH = 4  # causal_conv1d's widest kernel


def why_not(module) -> Optional[str]:
    """Why a short convolution runs HF's forward in training (its kernel is wider than causal_conv1d's), or None."""
    width = module.conv_kernel_size
    return None if width <= MAX_WIDTH else f"conv kernel of {width} taps, wider than causal_conv1d's {MAX_WIDTH}"


def short_conv(family: Family) -> Callable:
    """The factory of the forward, from HF's (which runs with a cache)."""
    def gated_conv(self, hidden_states, attention_mask, cu_seqlens):
        hidden_states = hf_attr(family, "apply_mask_to_padding_states")(hidden_states, attention_mask)
        batch, seq, _ = hidden_states.shape
        (bcx,) = lora.project(hidden_states, self.in_proj)
        if cu_seqlens is not None:  # packed: the rows as one stream
            bcx = bcx.reshape(1, batch * seq, -1)
        b, c, x = bcx.chunk(3, dim=-1)
        y = c * causal_conv1d(b * x, self.conv.weight.squeeze(1), self.conv.bias, cu_seqlens, False)
        (out,) = lora.project(y.reshape(batch, seq, -1), self.out_proj)
        return out

    # conv's weight is read without calling conv: its accelerate hooks (offloading) fired first, as HF's
    hooked = force_accelerate_hooks("conv")(gated_conv)

    def wrap(original):
        @functools.wraps(original)
        def forward(self, hidden_states, past_key_values=None, attention_mask=None, **kwargs):
            if not varlen.local(self.config._attn_implementation):
                # accelerate refuses linear attention under Ulysses, not LFM2's convolutions, which HF's forward
                # would restart at each rank's slice: trained wrong without an error
                raise RuntimeError(f"bastile: {type(self).__name__} under sequence parallelism (DeepSpeed's Ulysses "
                                   "or ring context parallelism) would convolve each rank's slice of the sequence "
                                   "alone, and the ranks exchange nothing: refused")
            if past_key_values is not None or why_not(self):
                return original(self, hidden_states, past_key_values=past_key_values, attention_mask=attention_mask,
                                **{k: v for k, v in kwargs.items() if k not in VARLEN})
            return hooked(self, hidden_states, attention_mask, kwargs.get("cu_seq_lens_q"))
        return named(forward, "attention", family)
    return wrap


# What the decoder layer gives its short convolution beyond HF's: the packed batch's bounds, which only Bastile's
# forward reads (transformers 5.17's HF forward takes seq_idx alone)
VARLEN = ("cu_seq_lens_q", "cu_seq_lens_k", "max_length_q", "max_length_k")


def mix(ctx: Context, attend: Callable) -> Callable:
    """The layer's token mixer on x (decoder.py's stage): `attend`, or on a short-convolution layer (HF's
    is_attention_layer says which) its gated convolution, which takes the cache and the padding mask, no positions,
    and the packed batch's bounds where Bastile's forward runs it (the attention role)."""
    def mixer(self, x, kwargs):
        if self.is_attention_layer:
            return attend(self, x, kwargs)
        bounds = {k: kwargs[k] for k in VARLEN if k in kwargs} if ctx.runs("attention") else {}
        return self.conv(hidden_states=x, past_key_values=kwargs.get("past_key_values"),
                         attention_mask=kwargs.get("attention_mask"), seq_idx=kwargs.get("seq_idx"), **bounds)
    return mixer
