"""Qwen3-Next's stage: its Gated DeltaNet's two input projections, grouped by key head (Family.grouped_projections)."""
import torch

from .. import lora


def project_grouped(self, hidden_states):
    """The Gated DeltaNet's (q, k, v), z, b, a as Qwen3.5's four projections give them, from in_proj_qkvz and
    in_proj_ba (through one fused node where PEFT LoRA adapters wrap them), whose outputs go key head by key head:
    its q, its k, then its value heads' v and z; its value heads' b, then their a (HF's
    fix_query_key_value_ordering). q, k and v are joined in the conv's channel order, which the grouping
    interleaves with z; value head j is the (j mod r)-th of key head j // r (r value heads a key head), the head
    the gated delta rule reads for it, as HF's repeat_interleave."""
    qkvz, ba = lora.project(hidden_states, self.in_proj_qkvz, self.in_proj_ba)
    r = self.num_v_heads // self.num_k_heads
    v_width = r * self.head_v_dim
    q, k, v, z = qkvz.unflatten(-1, (self.num_k_heads, -1)).split(
        [self.head_k_dim, self.head_k_dim, v_width, v_width], dim=-1)
    b, a = ba.unflatten(-1, (self.num_k_heads, 2 * r)).split([r, r], dim=-1)
    return torch.cat([t.flatten(-2) for t in (q, k, v)], dim=-1), z.flatten(-2), b.flatten(-2), a.flatten(-2)
