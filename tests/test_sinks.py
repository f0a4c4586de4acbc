"""GPT-OSS's sink attention (python_shim/bastile/sinks.py) against HF's eager attention.

The op: values and gradients (the sinks' included) equal to HF's eager_attention_forward in fp64, with and
without a sliding window, HF's padding masks, and a packed stream equal to its sequences alone; on the GPU the
flash path against the same fp64 reference. The model: a mini GPT-OSS with sinks far from zero and sliding
and full layers, plain, all-ones-masked and padded batches, two AdamW steps as HF's with HF's eager attention
never running; no [seq, seq] tensor kept for the backward.
"""
import sys
import types

import pytest
import torch
from torch.nn import functional as F
from transformers.models.gpt_oss import modeling_gpt_oss as hf

import bastile
from bastile import sinks
from conftest import NO_TRAINERS, needs_cuda, rel_err
from test_families import adam_steps, assert_grad_close, mini
from test_qwen3_training import batches

MIN = torch.finfo(torch.float32).min


def hf_eager(q, k, v, s, scale, mask):
    """HF's GPT-OSS eager attention on [batch, heads, seq, dim] inputs, out [batch, seq, heads, dim]."""
    module = types.SimpleNamespace(num_key_value_groups=q.shape[1] // k.shape[1], sinks=s, training=False)
    return hf.eager_attention_forward(module, q, k, v, mask, scaling=scale)[0]


def causal_mask(batch, seq, window=None, pad_left=(), pad_right=(), dtype=torch.float64, device="cpu"):
    """HF's additive [batch, 1, seq, seq] mask: causal, windowed, rows' padding at either end."""
    i = torch.arange(seq, device=device)
    offset = i[:, None] - i[None, :]
    seen = (offset >= 0) & ((offset < window) if window else True)
    mask = torch.where(seen, 0.0, MIN).to(dtype)[None, None].repeat(batch, 1, 1, 1)
    for row, n in enumerate(pad_left):
        mask[row, :, :, :n] = MIN
    for row, n in enumerate(pad_right):
        if n:
            mask[row, :, :, seq - n:] = MIN
    return mask


def inputs(batch, seq, heads, kv_heads, dim, dtype, device="cpu", seed=0):
    g = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(batch, h, seq, dim, generator=g, dtype=torch.float64)
               for h in (heads, kv_heads, kv_heads))
    s = torch.randn(heads, generator=g, dtype=torch.float64) * 3  # sinks far from zero, either sign
    return [t.to(device=device, dtype=dtype).requires_grad_() for t in (q, k, v, s)]


def ours(q, k, v, s, scale, window=None, mask=None, cu=None, longest=None):
    return sinks.attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), s, scale, window, mask, cu,
                           longest)


@pytest.mark.parametrize("padded", [False, True], ids=["causal", "padded"])
@pytest.mark.parametrize("window", [None, 4])
def test_sink_attention_matches_hf_eager_fp64(window, padded):
    q, k, v, s = inputs(3, 11, 4, 2, 8, torch.float64)
    mask = causal_mask(3, 11, window, pad_left=(0, 3, 0), pad_right=(0, 0, 5))
    out = ours(q, k, v, s, 0.3, window, mask if padded else None)
    ref = hf_eager(q, k, v, s, 0.3, mask if padded else causal_mask(3, 11, window))
    dy = torch.randn_like(ref)
    torch.testing.assert_close(out, ref, rtol=1e-12, atol=1e-12)
    for a, b in zip(torch.autograd.grad(out, (q, k, v, s), dy), torch.autograd.grad(ref, (q, k, v, s), dy)):
        torch.testing.assert_close(a, b, rtol=1e-11, atol=1e-11)


def test_sink_attention_gradcheck():
    q, k, v, s = inputs(2, 7, 4, 2, 4, torch.float64)
    assert torch.autograd.gradcheck(lambda q, k, v, s: ours(q, k, v, s, 0.5, 3), (q, k, v, s))


def test_packed_stream_equals_its_sequences_alone():
    q, k, v, s = inputs(2, 11, 4, 2, 8, torch.float64)
    cu = torch.tensor([0, 4, 11, 15, 22], dtype=torch.int32)
    out = ours(q, k, v, s, 0.3, 4, None, cu, 7).reshape(1, 22, 4, 8)
    stream = [t.transpose(1, 2).reshape(1, 22, -1, 8).transpose(1, 2) for t in (q, k, v)]
    alone = torch.cat([ours(*(t[:, :, a:b] for t in stream), s, 0.3, 4) for a, b in zip(cu[:-1], cu[1:])], 1)
    torch.testing.assert_close(out, alone, rtol=1e-12, atol=1e-12)


# ------------------------------------------------------------------------------------------------ the model


def gpt_oss(**overrides):
    """The family tests' mini GPT-OSS (a sliding layer, window 16, and a full one) with sinks from -3 to 3."""
    model = mini("gpt_oss", "cpu", torch.float32, output_router_logits=False, **overrides)
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.sinks.copy_(torch.linspace(-3, 3, layer.self_attn.sinks.numel()))
    return model


def padded_batch(seed=4):
    """Two rows of 48 tokens, one padded on the right (10) and one on the left (7)."""
    (ids, labels), = batches(1, 1, 2, 48, "cpu", ignore_fraction=0.1, seed=seed)[0]
    mask = torch.ones_like(ids)
    mask[0, -10:] = 0
    mask[1, :7] = 0
    return dict(input_ids=ids, attention_mask=mask, labels=labels.masked_fill(mask == 0, -100))


def holes(batch):
    """The padded batch with three pads inside its first row as well."""
    mask = batch["attention_mask"].clone()
    mask[0, 20:23] = 0
    return dict(batch, attention_mask=mask, labels=batch["labels"].masked_fill(mask == 0, -100))


BATCHES = {
    "plain": lambda b: {k: b[k] for k in ("input_ids", "labels")},
    "ones": lambda b: {**b, "attention_mask": torch.ones_like(b["input_ids"]), "labels": b["input_ids"]},
    "padded": lambda b: b,
    "holes": holes,
}


def eager_refused(monkeypatch):
    def refuse(*args, **kwargs):
        raise AssertionError("HF's eager attention ran")
    monkeypatch.setattr(hf, "eager_attention_forward", refuse)


def masks_made(monkeypatch):
    made = []
    for name in ("create_causal_mask", "create_sliding_window_causal_mask"):
        original = getattr(hf, name)
        monkeypatch.setattr(hf, name, lambda *a, _f=original, **kw: made.append(1) or _f(*a, **kw))
    return made


@pytest.mark.parametrize("kind", list(BATCHES))
def test_training_matches_hf_eager(kind, monkeypatch):
    """Two AdamW steps' losses within 1e-5 of HF's eager model, the first step's gradients (the sinks'
    included) as the family tests compare them; in the patched steps HF's eager attention never runs, and HF's
    masks are made only where pads lie inside a row (rows padded at one end run as varlen spans)."""
    steps = [BATCHES[kind](padded_batch(seed)) for seed in (4, 5)]
    ref = gpt_oss()
    ref_losses, ref_grads = adam_steps(ref, steps)
    model = gpt_oss()
    bastile.apply(model=model, **NO_TRAINERS)
    with monkeypatch.context() as m:
        eager_refused(m)
        made = masks_made(m)
        losses, grads = adam_steps(model, steps)
    assert bool(made) == (kind == "holes")
    for step, (a, b) in enumerate(zip(losses, ref_losses)):
        assert abs(a - b) <= 1e-5 * abs(b), f"step {step}: {a} vs {b}"
    assert grads.keys() == ref_grads.keys() and any(n.endswith("sinks") for n in grads)
    for name, g in ref_grads.items():
        assert_grad_close(grads[name], g, name)


def test_dropout_in_training_runs_hf_eager(monkeypatch):
    """Attention dropout in training: HF's eager attention (its dropout of the probabilities) with HF's masks,
    equal to HF's; in evaluation the sink attention, dropout off."""
    batch = padded_batch()
    ref, model = gpt_oss(attention_dropout=1e-12), gpt_oss(attention_dropout=1e-12)  # draws that change nothing
    bastile.apply(model=model, **NO_TRAINERS)
    calls = []
    monkeypatch.setattr(hf, "eager_attention_forward",
                        lambda *a, _f=hf.eager_attention_forward, **kw: calls.append(1) or _f(*a, **kw))
    torch.manual_seed(0)
    expected = ref(**batch).loss
    calls.clear()
    torch.manual_seed(0)
    torch.testing.assert_close(model(**batch).loss, expected, rtol=1e-5, atol=0)
    assert len(calls) == model.config.num_hidden_layers
    calls.clear()
    with torch.no_grad():
        evaluated = model.eval()(**batch, use_cache=False).loss
    assert calls == []
    torch.testing.assert_close(evaluated, ref.eval()(**batch, use_cache=False).loss, rtol=1e-5, atol=0)


def saved_shapes(model, batch):
    shapes = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: shapes.append(tuple(t.shape)) or t, lambda t: t):
        model(**batch).loss
    return shapes


def test_no_seq_by_seq_tensor_is_kept():
    """HF's eager attention keeps [batch, heads, seq, seq] probabilities for the backward; the sink attention
    keeps only [.., seq, heads] rows (padded batches too)."""
    square = lambda shapes: [s for s in shapes if sum(n in (48, 49) for n in s) >= 2]  # HF's: [.., 48, 49]
    for kind in BATCHES:
        batch, model = BATCHES[kind](padded_batch()), gpt_oss()
        assert square(saved_shapes(model, batch))
        bastile.apply(model=model, **NO_TRAINERS)
        assert square(saved_shapes(model, batch)) == [], kind
        bastile.reset()


# ------------------------------------------------------------------------------------------------ the GPU


def yardstick(q, k, v, scale, dy):
    """The error of torch's own flash SDPA (no sinks, causal) from fp64 at these inputs: values, dq, dk, dv."""
    wide = [t.detach().double().requires_grad_() for t in (q, k, v)]
    low = [t.detach().requires_grad_() for t in (q, k, v)]
    out = [F.scaled_dot_product_attention(*ts, is_causal=True, scale=scale, enable_gqa=True) for ts in (wide, low)]
    grads = [torch.autograd.grad(o, ts, dy.transpose(1, 2).to(o.dtype)) for o, ts in zip(out, (wide, low))]
    return [rel_err(b.double(), a) for a, b in zip([out[0], *grads[0]], [out[1], *grads[1]])]


@needs_cuda
@pytest.mark.parametrize("window", [None, 128])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_cuda_matches_fp64(dtype, window):
    """GPT-OSS-20b's heads (64 of width 64, 8 of K/V), 2 rows of 1024: the flash path (16-bit; fp32 the dense
    one) against HF's eager attention in fp64, values and gradients, within twice torch's own flash SDPA's
    error at the same inputs without sinks (fp32: 1e-5); a packed stream of the same tokens equal to its rows."""
    q, k, v, s = inputs(2, 1024, 64, 8, 64, dtype, "cuda")
    out = ours(q, k, v, s, 0.125, window)
    wide = [t.detach().double().requires_grad_() for t in (q, k, v, s)]
    ref = hf_eager(*wide, 0.125, causal_mask(2, 1024, window, device="cuda"))
    dy = torch.randn_like(ref)
    got = [out, *torch.autograd.grad(out, (q, k, v, s), dy.to(dtype))]
    want = [ref, *torch.autograd.grad(ref, wide, dy)]
    bound = [1e-5] * 5 if dtype == torch.float32 else [2 * e + 1e-4 for e in yardstick(q, k, v, 0.125, dy)]
    bound.append(bound[1])  # the sinks' gradient: sums of rows as dq's
    for name, a, b, tol in zip(("out", "dq", "dk", "dv", "dsinks"), got, want, bound):
        assert rel_err(a.double(), b) <= tol, f"{name}: {rel_err(a.double(), b):.2e} > {tol:.2e}"
    cu = torch.tensor([0, 1024, 2048], dtype=torch.int32, device="cuda")
    packed = sinks.attention(*(t.transpose(1, 2).reshape(1, 2048, -1, 64) for t in (q, k, v)), s, 0.125, window,
                             None, cu, 1024)
    torch.testing.assert_close(packed.reshape(out.shape), out, rtol=0, atol=0)
