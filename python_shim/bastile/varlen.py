"""Attention over packed rows: each sequence of a row attends causally within itself, with no mask.

A batch is packed when the collator says so (`cu_seq_lens_q` and `max_length_q`: TRL's padding-free
collator, `DataCollatorWithFlattening(return_flash_attn_kwargs=True)`, `bastile.data.collate`), or when
its position ids restart inside a row: HF's rule, a position other than its predecessor's plus one starts
a sequence. HF's SDPA path turns such rows into a [seq, seq] block-diagonal mask, and SDPA's masked kernels
run at less than half the speed of its causal one; here the sequences go to a variable-length kernel.
"""
from typing import List, Optional, Tuple

import torch
import torch.nn.functional as F
from torch.nn.attention.varlen import varlen_attn
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS, AttentionInterface

KEYS = ("cu_seq_lens_q", "cu_seq_lens_k", "max_length_q", "max_length_k")
MAX_HEAD_DIM = 256  # torch's varlen kernel (FlashAttention 2) takes heads up to this wide
_REGISTERED = AttentionInterface()  # transformers' registry without the overrides of ALL_ATTENTION_FUNCTIONS
_SDPA = F.scaled_dot_product_attention


def local(implementation: str) -> bool:
    """Whether the attention of `implementation` sees every token that the module's queries attend to, so that
    Bastile's kernels may compute it in HF's function's place. Not where an engine spreads the sequence over
    ranks and exchanges it inside the attention call: DeepSpeed's Ulysses replaces the implementation's function
    in ALL_ATTENTION_FUNCTIONS with its own, and torch's context_parallel (accelerate's ring CP) replaces
    F.scaled_dot_product_attention while its context lasts. There a packed batch's bounds and a rank's position
    ids describe the rank's shard, not the sequence, and the call goes to their function."""
    return (ALL_ATTENTION_FUNCTIONS.get(implementation) is _REGISTERED.get(implementation)
            and F.scaled_dot_product_attention is _SDPA)


def sequences(position_ids: torch.Tensor, batch: int) -> Optional[dict]:
    """The varlen kwargs (KEYS) of rows whose position ids restart, or None where each row is one sequence.
    One host read of the positions per batch (the collators above give the kwargs and skip it): the kernel
    takes the longest length as an int, and the number of sequences sizes its grid."""
    pos = position_ids.expand(batch, -1).cpu()
    starts = torch.ones_like(pos, dtype=torch.bool)
    starts[:, 1:] = pos[:, 1:] != pos[:, :-1] + 1
    if int(starts.sum()) == batch:
        return None
    cu = torch.cat([starts.reshape(-1).nonzero().flatten(), torch.tensor([pos.numel()])]).to(torch.int32)
    longest = int(cu.diff().max())
    cu = cu.to(position_ids.device, non_blocking=True)
    return dict(zip(KEYS, (cu, cu, longest, longest)))


def padding(mask: torch.Tensor) -> List[Optional[Tuple[int, int]]]:
    """Each row of a 2-D padding mask as (the pads before its tokens, its tokens) where its tokens are one run
    (pads at its start, its end, both or neither), None where pads lie between them; a row of pads only is
    (0, 0), padded at its end. One host read."""
    keep = mask.bool()
    n = keep.sum(1)
    lead = (~keep).long().cumprod(1).sum(1) * (n > 0)
    i = torch.arange(keep.shape[1], device=keep.device)
    run = (keep == ((i >= lead[:, None]) & (i < (lead + n)[:, None]))).all(1)
    return [(a, b) if r else None for a, b, r in torch.stack((lead, n, run.long())).t().tolist()]


def padded(rows: List[Tuple[int, int]], seq: int, device) -> dict:
    """The varlen kwargs (KEYS) of rows of `seq` tokens whose tokens are one run (`padding`'s rows): a row's
    tokens are one sequence and its pads before and after them two others, so that each token sees the tokens
    that HF's mask shows it and the pads see only pads."""
    lengths = [span for lead, n in rows for span in (lead, n, seq - lead - n) if span]
    cu = torch.tensor([0, *lengths]).cumsum(0).to(torch.int32).to(device, non_blocking=True)
    return dict(zip(KEYS, (cu, cu, max(lengths), max(lengths))))


def flash(q: torch.Tensor) -> bool:
    """Whether `attention` runs torch's flash varlen kernel for q (CUDA, 16-bit) rather than one SDPA call
    per sequence (CPU, fp32), which reads the lengths on the host."""
    return q.is_cuda and q.dtype in (torch.float16, torch.bfloat16)


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seq_lens: torch.Tensor, max_length: int,
              scale: float, sliding_window: Optional[int] = None) -> torch.Tensor:
    """Causal self-attention within each sequence of a packed token stream.

    q: [tokens, q_heads, head_dim]; k, v: [tokens, kv_heads, head_dim] with kv_heads dividing q_heads (GQA);
    unit last stride. cu_seq_lens: int32 [sequences + 1], the sequences' bounds in the stream; max_length:
    the longest. sliding_window as HF's masks read it: a query sees itself and the sliding_window - 1 tokens
    before it. Returns [tokens, q_heads, head_dim]."""
    left = -1 if sliding_window is None else sliding_window - 1
    if flash(q):
        return varlen_attn(q, k, v, cu_seq_lens, cu_seq_lens, max_length, max_length, scale=scale,
                           window_size=(left, 0))
    bounds = cu_seq_lens.tolist()
    outs = []
    for start, end in zip(bounds, bounds[1:]):
        n = end - start
        if n == 0:
            continue
        mask = None
        if left >= 0 and n > left + 1:
            i = torch.arange(n, device=q.device)
            mask = (i[None, :] <= i[:, None]) & (i[None, :] >= i[:, None] - left)
        qs, ks, vs = (t[start:end].transpose(0, 1) for t in (q, k, v))
        out = F.scaled_dot_product_attention(qs, ks, vs, attn_mask=mask, is_causal=mask is None, scale=scale,
                                             enable_gqa=True)
        outs.append(out.transpose(0, 1))
    return torch.cat(outs) if outs else q.new_empty(q.shape)
