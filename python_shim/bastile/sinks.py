"""Attention with a learned sink per head (GPT-OSS), keeping O(seq) for the backward.

A head's sink is a logit s with no value: the softmax runs over the row's scores and s, and s's column is
dropped. So the output is the sink-free attention's o times exp(lse - L), lse the row's log-sum-exp and
L = logaddexp(lse, s) the normaliser with the sink. The backward of attention needs its probabilities (made
again from the normaliser) and D = rowsum(dy * y): given L and y, the backward of the sink-free attention gives
the sink attention's dq, dk, dv exactly (its probabilities exp(x - L) are the sink attention's, the sink adding
nothing to dP), and the sink's gradient is -sum over rows of exp(s - L) D. The flash kernel runs unchanged both
ways, and Bastile's attention_sink ops between them take one pass each (the row factor and L; D and the sink's
gradient): no [heads, seq, seq] tensor is formed on CUDA (16-bit, heads to 256 wide), nor kept anywhere.
Elsewhere (the CPU, fp32/fp64, HF's masks of pads inside a row) the scores of a block of queries at a time.
"""
from typing import Callable, NamedTuple, Optional

import torch

from . import _library  # noqa: F401  (loads the ops)
from . import varlen

# Query rows per block of the dense path: its [batch, heads, rows, keys] fp32 scores near this many elements.
BLOCK_ELEMENTS = 1 << 26


class _Flash(NamedTuple):
    """torch's flash varlen kernel over a token stream: q [tokens, heads, dim], k, v [tokens, kv_heads, dim];
    each sequence of `cu` attends causally within itself, a query seeing `left` keys before it (-1: all)."""
    cu: torch.Tensor
    longest: int
    scale: float
    left: int

    def _window(self):
        return dict(scale=self.scale, window_size_left=self.left, window_size_right=0)

    def forward(self, q, k, v):
        out, lse = torch.ops.aten._flash_attention_forward(
            q, k, v, self.cu, self.cu, self.longest, self.longest, 0.0, self.left < 0, False, **self._window())[:2]
        if lse.shape != (q.shape[1], q.shape[0]):  # older kernels padded it to [sequences, heads, longest]
            raise RuntimeError(f"bastile: sink attention reads the flash kernel's log-sum-exp as [heads, tokens] "
                               f"{(q.shape[1], q.shape[0])}; this torch gives {tuple(lse.shape)}")
        return out, lse.t()

    def backward(self, dy, q, k, v, y, normaliser):
        rng, unused = torch.zeros(2, dtype=torch.uint64, device=q.device), q.new_empty(0)
        return torch.ops.aten._flash_attention_backward(
            dy, q, k, v, y, normaliser.t().contiguous(), self.cu, self.cu, self.longest, self.longest, 0.0,
            self.left < 0, rng, unused, **self._window())


class _Dense(NamedTuple):
    """Any device and dtype: q [batch, seq, heads, dim], k, v [batch, seq, kv_heads, dim] (GQA: head h reads kv
    head h // (heads / kv_heads), as HF's repeat_kv), in fp32 (fp64 for fp64). `visible(rows)`: which keys the
    queries of `rows` see, [batch or 1, rows, keys], bool or HF's additive mask."""
    scale: float
    visible: Callable[[slice], torch.Tensor]

    @staticmethod
    def _heads(t, groups):
        """[batch, seq, heads, dim] -> [batch, kv_heads, groups, seq, dim] (k, v: groups 1) in the math dtype."""
        b, s, h, d = t.shape
        wide = torch.float64 if t.dtype == torch.float64 else torch.float32
        return t.permute(0, 2, 1, 3).reshape(b, h // groups, groups, s, d).to(wide)

    @staticmethod
    def _tokens(t):
        b, kv, g, s, d = t.shape
        return t.reshape(b, kv * g, s, d).transpose(1, 2)

    def _scores(self, q, k, rows):
        x = q[..., rows, :] @ k.transpose(-1, -2) * self.scale
        seen = self.visible(rows)[:, None, None]
        return x.masked_fill(~seen, float("-inf")) if seen.dtype == torch.bool else x + seen

    def _rows(self, q, k):
        per_row = q.shape[0] * q.shape[1] * q.shape[2] * k.shape[-2]
        step = max(1, BLOCK_ELEMENTS // max(per_row, 1))
        return [slice(r, r + step) for r in range(0, q.shape[-2], step)]

    def forward(self, q, k, v):
        # the math dtype throughout: under autocast the products would be 16-bit, and lse with them
        with torch.autocast(q.device.type, enabled=False):
            return self._forward(q, k, v)

    def backward(self, dy, q, k, v, y, normaliser):
        with torch.autocast(q.device.type, enabled=False):
            return self._backward(dy, q, k, v, y, normaliser)

    def _forward(self, q, k, v):
        groups = q.shape[2] // k.shape[2]
        qh, kh, vh = self._heads(q, groups), self._heads(k, 1), self._heads(v, 1)
        outs, lses = [], []
        for rows in self._rows(qh, kh):
            x = self._scores(qh, kh, rows)
            lse = torch.logsumexp(x, -1)
            # a row that sees no key: o = 0, lse = -inf (the sink then takes all of it)
            outs.append(torch.exp(x - lse.nan_to_num(neginf=0.0)[..., None]) @ vh)
            lses.append(lse)
        o, lse = torch.cat(outs, -2), torch.cat(lses, -1)
        return self._tokens(o).to(q.dtype), self._tokens(lse[..., None])[..., 0]

    def _backward(self, dy, q, k, v, y, normaliser):
        groups = q.shape[2] // k.shape[2]
        qh, kh, vh = self._heads(q, groups), self._heads(k, 1), self._heads(v, 1)
        dyh, yh = self._heads(dy, groups), self._heads(y, groups)
        norm = self._heads(normaliser[..., None], groups)[..., 0]
        dq, dk, dv = torch.empty_like(qh), torch.zeros_like(kh), torch.zeros_like(vh)
        for rows in self._rows(qh, kh):
            p = torch.exp(self._scores(qh, kh, rows) - norm[..., rows, None])
            d = (dyh[..., rows, :] * yh[..., rows, :]).sum(-1, keepdim=True)
            ds = p * (dyh[..., rows, :] @ vh.transpose(-1, -2) - d) * self.scale
            dq[..., rows, :] = ds @ kh
            dk += (ds.transpose(-1, -2) @ qh[..., rows, :]).sum(2, keepdim=True)
            dv += (p.transpose(-1, -2) @ dyh[..., rows, :]).sum(2, keepdim=True)
        return self._tokens(dq).to(q.dtype), self._tokens(dk).to(k.dtype), self._tokens(dv).to(v.dtype)


class _SinkAttention(torch.autograd.Function):
    """The sink attention over a core (_Flash, _Dense) that gives the sink-free o and lse ([..., heads]), and
    dq, dk, dv from dy, y and the normaliser."""

    @staticmethod
    def forward(ctx, core, q, k, v, sinks):
        o, lse = core.forward(q, k, v)
        y, normaliser = torch.ops.bastile.attention_sink_forward(o, lse, sinks)
        ctx.core = core
        ctx.save_for_backward(q, k, v, sinks, y, normaliser)
        return y

    @staticmethod
    def backward(ctx, dy):
        q, k, v, sinks, y, normaliser = ctx.saved_tensors
        dy = dy.contiguous()
        dq, dk, dv = ctx.core.backward(dy, q, k, v, y, normaliser)
        dsinks = torch.ops.bastile.attention_sink_backward(dy, y, normaliser, sinks)[2]
        return None, dq, dk, dv, dsinks


def _causal(seq: int, left: int, device) -> Callable[[slice], torch.Tensor]:
    i = torch.arange(seq, device=device)

    def visible(rows):
        offset = i[rows, None] - i[None, :]
        return ((offset >= 0) & ((offset <= left) | (left < 0)))[None]
    return visible


def _packed(cu: torch.Tensor, tokens: int, left: int) -> Callable[[slice], torch.Tensor]:
    """The causal (windowed) mask of a token stream's sequences, none seeing another."""
    sequence = torch.searchsorted(cu[1:].to(torch.int64), torch.arange(tokens, device=cu.device), right=True)
    causal = _causal(tokens, left, cu.device)
    return lambda rows: causal(rows) & (sequence[rows, None] == sequence[None, :])[None]


def flash(q: torch.Tensor) -> bool:
    """Whether the flash kernel takes q ([..., heads, dim]): varlen.flash's dtypes and device, its head widths."""
    return varlen.flash(q) and q.shape[-1] % 8 == 0 and q.shape[-1] <= varlen.MAX_HEAD_DIM


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, sinks: torch.Tensor, scale: float,
              sliding_window: Optional[int] = None, mask: Optional[torch.Tensor] = None,
              cu_seq_lens: Optional[torch.Tensor] = None, max_length: Optional[int] = None,
              padding: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Causal self-attention with one sink logit per head (`sinks` [heads]), as HF's GPT-OSS eager attention.

    q: [batch, seq, heads, dim]; k, v: [batch, seq, kv_heads, dim], kv_heads dividing heads. sliding_window as
    HF's masks read it (a query sees itself and the sliding_window - 1 tokens before it). The rows' tokens:
    - cu_seq_lens (int32 [sequences + 1]) and max_length: a packed stream (varlen.py), each sequence alone;
      `padding` ([batch, seq], zeros at pads; varlen.padded's spans): the pads' outputs are zeros, as HF's
      eager attention gives a left pad (it sees no key; its output predicts the row's first token). A right
      pad's differs from HF's eager output (the row's tokens attended; zeros in HF's flash attention): only a
      loss over labels at pads reads it;
    - else `mask`: HF's [batch, 1, seq, seq] mask (pads inside a row), added to the scores as HF does;
    - else each row one sequence.
    Returns [batch, seq, heads, dim]."""
    left = -1 if sliding_window is None else sliding_window - 1
    shape = q.shape
    if flash(q) and (cu_seq_lens is not None or mask is None):
        if cu_seq_lens is None:
            cu_seq_lens = torch.arange(0, (shape[0] + 1) * shape[1], shape[1], dtype=torch.int32, device=q.device)
            max_length = shape[1]
        tokens = (t.reshape(-1, *t.shape[2:]) for t in (q, k, v))
        out = _SinkAttention.apply(_Flash(cu_seq_lens, max_length, scale, left), *tokens, sinks).view(shape)
    else:
        if cu_seq_lens is not None:
            q, k, v = (t.reshape(1, -1, *t.shape[2:]) for t in (q, k, v))
            visible = _packed(cu_seq_lens, q.shape[1], left)
        elif mask is not None:
            visible = (lambda rows: mask[:, 0, rows])
        else:
            visible = _causal(shape[1], left, q.device)
        out = _SinkAttention.apply(_Dense(scale, visible), q, k, v, sinks).view(shape)
    # the pads' outputs, and so their gradients, zero: nothing of theirs reaches the sinks or q, k, v
    return out if padding is None else out * padding[..., None, None].to(out.dtype)
