"""torch.ops.bastile.fused_linear_cross_entropy against HF's eager loss and an fp64 reference."""
import os
import subprocess
import sys
from functools import partial

import pytest
import torch
import torch.nn.functional as F
from transformers.loss.loss_utils import ForCausalLMLoss

import bastile
from conftest import DEVICES, Contract, needs_cuda, poison_cuda_allocator, rel_err

op = torch.ops.bastile.fused_linear_cross_entropy
fwd_op = torch.ops.bastile.fused_linear_cross_entropy_forward
bwd_op = torch.ops.bastile.fused_linear_cross_entropy_backward
flce = bastile.fused_linear_cross_entropy


def eager(h, w, t, b=None, ignore_index=-100, reduction="mean", softcap=0.0, z_loss=0.0, label_smoothing=0.0,
          logit_scale=1.0):
    """HF's expression (logits in the inputs' dtype, loss in f32), with the logit scale (Granite's division by
    logits_scaling), softcap and z-loss in plain torch and F.cross_entropy's label smoothing. With f64 inputs it
    is the fp64 reference."""
    z = F.linear(h, w, b)
    z = z.double() if z.dtype == torch.float64 else z.float()
    z = z * logit_scale
    if softcap:
        z = softcap * torch.tanh(z / softcap)
    loss = F.cross_entropy(z, t, ignore_index=ignore_index, reduction=reduction, label_smoothing=label_smoothing)
    if z_loss:
        keep = t != ignore_index
        zl = z_loss * torch.logsumexp(z, -1) ** 2 * keep
        loss = loss + (zl if reduction == "none" else zl.sum() / keep.sum() if reduction == "mean" else zl.sum())
    return loss


def make(n, hdim, vocab, dtype=torch.float32, device="cpu", bias=True, ignored=0.2, seed=0):
    g = torch.Generator().manual_seed(seed)
    h = torch.randn(n, hdim, generator=g).to(device, dtype).requires_grad_()
    w = (torch.randn(vocab, hdim, generator=g) / hdim ** 0.5).to(device, dtype).requires_grad_()
    b = (0.1 * torch.randn(vocab, generator=g)).to(device, dtype).requires_grad_() if bias else None
    t = torch.randint(0, vocab, (n,), generator=g)
    t[torch.rand(n, generator=g) < ignored] = -100
    return h, w, b, t.to(device)


def grads(loss, inputs):
    inputs = [x for x in inputs if x is not None]
    return torch.autograd.grad(loss, inputs)


def detached64(*xs):
    return [None if x is None else x.detach().double().requires_grad_() for x in xs]


def chunks(rows, vocab, elem_bytes):
    """The op's chunk_bytes for chunks of `rows` rows (of a given vocab and element size), so that small
    inputs run several, the last one ragged."""
    return rows * vocab * elem_bytes


# ---------------------------------------------------------------- the generic tests' contract (test_contract.py)


def reference(h, w, t, b=None, ignore_index=-100, reduction="mean", softcap=0.0, z_loss=0.0, fp32_weight_grad=True,
              chunk_bytes=0, label_smoothing=0.0, logit_scale=1.0):
    """eager with the op's signature. A mean over no counted target is 0, as the op defines it
    (F.cross_entropy's is NaN): the sum's, gradients included."""
    if reduction == "mean" and not (t != ignore_index).any():
        reduction = "sum"
    return eager(h, w, t, b, ignore_index, reduction, softcap, z_loss, label_smoothing, logit_scale)


def sample(device, n, hdim, vocab, bias=True, seed=0, frozen="", **kwargs):
    """A head's call on make()'s inputs; gradients left out (grad_mask) of a frozen head ("wb", as with
    LoRA) or of hidden ("h")."""
    h, w, b, t = make(n, hdim, vocab, device=device, bias=bias, seed=seed)
    for name, x in zip("hwb", (h, w, b)):
        if name in frozen:
            x.requires_grad_(False)
    return (h, w, t, b), kwargs


def samples(device):
    call = partial(sample, device)

    several = chunks(5, 40, 4)  # chunks of 5 rows at vocab 40, of 3 at vocab 56
    return [call(12, 16, 40, chunk_bytes=several), call(19, 24, 56, seed=1, chunk_bytes=several),
            call(10, 8, 30, bias=False, seed=2, reduction="sum", softcap=5.0, z_loss=1e-3),
            call(10, 8, 30, bias=False, seed=7, logit_scale=0.125),
            call(9, 8, 20, seed=3, frozen="wb", chunk_bytes=chunks(4, 20, 4)),
            call(9, 8, 20, seed=4, frozen="h", fp32_weight_grad=False, softcap=3.0, z_loss=1e-3, label_smoothing=0.2),
            call(11, 8, 25, seed=5, reduction="none", chunk_bytes=chunks(4, 25, 4), label_smoothing=0.1),
            call(7, 8, 20, bias=False, seed=6, frozen="w", reduction="none", softcap=3.0, z_loss=1e-3, logit_scale=3.0)]


def gradcheck_samples():
    """Chunks of 3, 3 and 1 rows, with and without softcap and z-loss."""
    h, w, b, t = make(7, 5, 11, dtype=torch.float64, ignored=0.3)
    return [((h, w, t, b), dict(reduction=reduction, softcap=softcap, z_loss=z_loss, label_smoothing=eps,
                                logit_scale=scale, chunk_bytes=chunks(3, 11, 8)))
            for reduction in ("mean", "sum", "none")
            for softcap, z_loss, eps, scale in [(0.0, 0.0, 0.0, 1.0), (2.0, 0.1, 0.15, 0.4)]]


def empty(device):
    h, w, b, t = make(0, 8, 10, device=device)
    return [((h, w, t, b), {}), ((h, w, t), dict(reduction="sum", softcap=2.0, z_loss=0.1)),
            ((h, w, t, b), dict(reduction="none"))]


BAD = [
    (lambda: op(torch.randn(4, 8), torch.randn(10, 7), torch.zeros(4, dtype=torch.long)), "weight must have shape"),
    (lambda: op(torch.randn(4, 8), torch.randn(10, 8), torch.zeros(5, dtype=torch.long)), "target must have shape"),
    (lambda: op(torch.randn(4, 8), torch.randn(10, 8), torch.zeros(4, dtype=torch.int32)), "target must be int64"),
    (lambda: op(torch.randn(4, 8), torch.randn(10, 8), torch.zeros(4, dtype=torch.long), torch.randn(9)),
     "bias must have shape"),
    (lambda: op(torch.randn(4, 8), torch.randn(10, 8, device="meta"), torch.zeros(4, dtype=torch.long)),
     "hidden is on cpu but weight is on meta"),
    (lambda: op(torch.randn(4, 8), torch.randn(10, 8), torch.zeros(4, dtype=torch.long), reduction="max"),
     "reduction must be"),
    (lambda: fwd_op(torch.randn(4, 8), torch.randn(10, 8), torch.zeros(4, dtype=torch.long), reduction="none"),
     "forms no gradients in the forward"),
    (lambda: torch.ops.bastile.fused_linear_cross_entropy_rows_backward(
        torch.ones(3), torch.randn(4, 8), torch.randn(10, 8), torch.zeros(4, dtype=torch.long)),
     "grad_rows must be floating with target's shape"),
    (lambda: op(torch.randn(4, 8), torch.randn(10, 8), torch.zeros(4, dtype=torch.long), softcap=-1.0),
     "softcap must be"),
    (lambda: op(torch.randn(4, 8), torch.randn(10, 8), torch.zeros(4, dtype=torch.long), label_smoothing=1.5),
     "label_smoothing must be in"),
    (lambda: op(torch.randn(4, 8), torch.randn(10, 8), torch.zeros(4, dtype=torch.long), logit_scale=float("inf")),
     "logit_scale must be finite"),
    (lambda: op(torch.randint(0, 3, (4, 8)), torch.randn(10, 8), torch.zeros(4, dtype=torch.long)),
     "hidden must be float32"),
    (lambda: bwd_op(torch.ones(2), torch.randn(3), torch.randn(3), torch.randn(0)), "grad_loss must be a 0-dim"),
]

CONTRACT = Contract(op=op, samples=samples, empty=empty, reference=reference, bad=BAD,
                    gradcheck_samples=gradcheck_samples)


# ---------------------------------------------------------------- CPU and any device


# Norm-relative error against the fp64 reference allowed per dtype; ours must also be within 1.25x of
# HF's own error (the 16-bit logits' rounding dominates both).
TOL = {torch.float32: 1e-6, torch.bfloat16: 6e-3, torch.float16: 8e-4}


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", list(TOL))
@pytest.mark.parametrize("softcap,z_loss,label_smoothing,logit_scale",
                         [(0.0, 0.0, 0.0, 1.0), (3.0, 1e-3, 0.0, 1.0), (0.0, 0.0, 0.1, 1.0), (0.0, 0.0, 0.0, 1 / 16),
                          (3.0, 0.0, 0.0, 4.0)])
@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
def test_matches_hf_and_fp64(device, dtype, softcap, z_loss, label_smoothing, logit_scale, reduction):
    """Loss and gradients; with reduction "none", the row losses and the gradients of their sum weighted by
    random upstream gradients (the backward's recomputation)."""
    n, hdim, vocab = 50, 64, 300
    h, w, b, t = make(n, hdim, vocab, dtype, device)
    upstream = torch.randn(n, generator=torch.Generator().manual_seed(9)).to(device)

    def weighted(loss):
        return loss if reduction != "none" else (loss * upstream.to(loss.dtype)).sum()
    kw = dict(reduction=reduction, softcap=softcap, z_loss=z_loss, label_smoothing=label_smoothing,
              logit_scale=logit_scale)
    loss = op(h, w, t, b, **kw, chunk_bytes=chunks(16, vocab, torch.finfo(dtype).bits // 8))  # 16, 16, 16, 2 rows
    assert loss.dtype == torch.float32 and loss.shape == ((n,) if reduction == "none" else ())
    ours = (loss, *grads(weighted(loss), (h, w, b)))
    hf_loss = eager(h, w, t, b, **kw)
    hf = (hf_loss, *grads(weighted(hf_loss), (h, w, b)))
    ref_in = detached64(h, w, b)
    ref_loss = eager(ref_in[0], ref_in[1], t, ref_in[2], **kw)
    ref = (ref_loss, *grads(weighted(ref_loss), ref_in))
    for name, o, e, r in zip(["loss", "grad_hidden", "grad_weight", "grad_bias"], ours, hf, ref):
        assert o.dtype == e.dtype and o.shape == e.shape
        err, err_hf = rel_err(o, r), rel_err(e, r)
        assert err < TOL[dtype] and err <= 1.25 * err_hf + 0.1 * TOL[dtype], f"{name}: ours {err:.3g}, HF {err_hf:.3g} vs fp64"


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("reduction", ["mean", "sum"])
def test_all_targets_ignored_gives_zero_loss_and_grads(device, reduction):
    h, w, b, _ = make(9, 8, 20, device=device)
    t = torch.full((9,), -100, device=device)
    loss = op(h, w, t, b, reduction=reduction)
    g = grads(loss, (h, w, b))
    assert loss.item() == 0.0
    for x in g:
        assert not x.isnan().any() and (x == 0).all()


@pytest.mark.parametrize("device", DEVICES)
def test_custom_ignore_index_inside_vocab(device):
    h, w, b, t = make(20, 8, 30, device=device, ignored=0.0)
    t[::3] = 7  # a real token id used as the padding id
    loss = op(h, w, t, b, ignore_index=7)
    ref = eager(h, w, t, b, ignore_index=7)
    torch.testing.assert_close(loss, ref, rtol=1e-5, atol=1e-6)
    for a, e in zip(grads(loss, (h, w, b)), grads(ref, (h, w, b))):
        torch.testing.assert_close(a, e, rtol=1e-4, atol=1e-6)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("as_tensor", [False, True])
def test_num_items_in_batch_matches_hf_causal_lm_loss(device, as_tensor):
    bsz, seq, hdim, vocab = 2, 9, 16, 50
    h, w, _, _ = make(bsz * seq, hdim, vocab, device=device, bias=False)
    h3 = h.detach().view(bsz, seq, hdim).requires_grad_()
    labels = torch.randint(0, vocab, (bsz, seq), device=device)
    labels[0, :3] = -100
    num = (labels[:, 1:] != -100).sum() + 5  # as from several micro-batches
    num_arg = num if as_tensor else int(num)
    hf_loss = ForCausalLMLoss(F.linear(h3, w), labels, vocab, num_items_in_batch=num_arg)
    # HF shifts the labels: the target of position i is label i + 1.
    shifted = F.pad(labels, (0, 1), value=-100)[:, 1:]
    loss = flce(h3, w, shifted, num_items_in_batch=num_arg)
    torch.testing.assert_close(loss, hf_loss, rtol=1e-5, atol=1e-6)
    for a, e in zip(grads(loss, (h3, w)), grads(hf_loss, (h3, w))):
        torch.testing.assert_close(a, e, rtol=1e-4, atol=1e-6)
    # Without num_items_in_batch it is HF's mean.
    torch.testing.assert_close(flce(h3, w, shifted), ForCausalLMLoss(F.linear(h3, w), labels, vocab),
                               rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("device", DEVICES)
def test_tied_weight_sums_both_uses(device):
    vocab, hdim = 40, 16
    emb = torch.nn.Embedding(vocab, hdim).to(device)
    ids = torch.randint(0, vocab, (3, 7), device=device)
    t = torch.randint(0, vocab, (3, 7), device=device)

    def run(loss_fn):
        emb.weight.grad = None
        x = emb(ids)
        loss = loss_fn(torch.tanh(x) * 2, emb.weight, t)
        loss.backward()
        return loss.detach(), emb.weight.grad.clone()

    loss, g = run(lambda x, w, t: flce(x, w, t))
    ref_loss, ref_g = run(lambda x, w, t: eager(x.reshape(-1, hdim), w, t.reshape(-1)))
    torch.testing.assert_close(loss, ref_loss, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(g, ref_g, rtol=1e-4, atol=1e-6)


@pytest.mark.parametrize("device", DEVICES)
def test_leading_dims_and_non_contiguous_hidden(device):
    base = torch.randn(4, 16, 5, device=device)
    h = base.transpose(1, 2).requires_grad_()  # [4, 5, 16], last dim strided
    w = torch.randn(30, 16, device=device, requires_grad=True)
    t = torch.randint(0, 30, (4, 5), device=device)
    loss = flce(h, w, t)
    ref = eager(h.reshape(-1, 16), w, t.reshape(-1))
    torch.testing.assert_close(loss, ref, rtol=1e-5, atol=1e-6)
    (gh,) = torch.autograd.grad(loss, h)
    (rh,) = torch.autograd.grad(ref, h)
    assert gh.shape == h.shape
    torch.testing.assert_close(gh, rh, rtol=1e-4, atol=1e-6)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("bias", [False, True])
def test_hidden_size_zero_is_a_linear_of_zero_features(device, bias):
    """hidden [2, 3, 0]: the logits are the bias (zeros without one), as F.linear computes them, so each
    counted token's loss is log(vocab) without a bias."""
    h, w, b, t = make(6, 0, 10, device=device, bias=bias)
    h, t = h.detach().view(2, 3, 0).requires_grad_(), t.view(2, 3)
    loss, ref = flce(h, w, t, b), eager(h.reshape(6, 0), w, t.reshape(6), b)
    torch.testing.assert_close(loss, ref)
    if not bias:
        torch.testing.assert_close(loss.double(), torch.tensor(10.0, dtype=torch.double, device=device).log())
    inputs = (h, w) + ((b,) if bias else ())
    for got, want in zip(grads(loss, inputs), grads(ref, inputs)):
        assert got.shape == want.shape
        torch.testing.assert_close(got, want)


def count_gemms(fn):
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        fn()
    return sum(e.count for e in prof.key_averages() if e.key in ("aten::mm", "aten::addmm"))


def test_no_grad_computes_the_loss_only():
    h, w, b, t = make(10, 8, 20)
    kw = dict(chunk_bytes=chunks(4, 20, 4))  # 3 chunks
    with_grad = op(h, w, t, b, **kw)
    with torch.no_grad():
        assert count_gemms(lambda: op(h, w, t, b, **kw)) == 3  # the logits alone
        no_grad = op(h, w, t, b, **kw)
    assert no_grad.grad_fn is None
    torch.testing.assert_close(no_grad, with_grad.detach(), rtol=0, atol=0)
    assert count_gemms(lambda: op(h, w, t, b, **kw)) == 9  # logits, grad_hidden, grad_weight
    # A frozen head (LoRA): no weight gradient GEMM.
    assert count_gemms(lambda: op(h, w.detach(), t, b.detach(), **kw)) == 6


@pytest.mark.parametrize("device", DEVICES)
def test_fp32_weight_grad_is_more_accurate(device):
    n, hdim, vocab = 512, 32, 64
    h, w, _, t = make(n, hdim, vocab, torch.bfloat16, device, bias=False, ignored=0.0)
    (h64, w64) = detached64(h, w)
    (ref,) = grads(eager(h64, w64, t, reduction="sum"), (w64,))
    errs = {}
    for fp32 in (True, False):
        # 64 chunks summed into the weight gradient
        (g,) = grads(op(h, w, t, reduction="sum", fp32_weight_grad=fp32, chunk_bytes=chunks(8, vocab, 2)), (w,))
        assert g.dtype == torch.bfloat16
        errs[fp32] = rel_err(g, ref)
    msg = f"weight grad error vs fp64: f32 accumulation {errs[True]:.3g}, bf16 accumulation {errs[False]:.3g}"
    assert errs[True] < 0.5 * errs[False], msg
    assert errs[True] < 4e-3, msg  # one bf16 rounding of the result


@pytest.mark.parametrize("device", DEVICES)
def test_autocast_matches_linear_under_autocast(device):
    h, w, b, t = make(24, 32, 100, torch.float32, device)
    for h_in in (h.detach().bfloat16().requires_grad_(), h):
        with torch.autocast(device, dtype=torch.bfloat16):
            loss = op(h_in, w, t, b)
            ref = F.cross_entropy(F.linear(h_in, w, b).float(), t)
        assert loss.dtype == torch.float32
        torch.testing.assert_close(loss, ref, rtol=1e-3, atol=1e-4)
        g, rg = grads(loss, (h_in, w, b)), grads(ref, (h_in, w, b))
        assert [x.dtype for x in g] == [h_in.dtype, torch.float32, torch.float32]
        for a, e in zip(g, rg):
            assert rel_err(a, e) < 1e-2


@pytest.mark.parametrize("device", DEVICES)
def test_mixed_dtypes_without_autocast_run_in_hidden_dtype(device):
    h, w, b, t = make(16, 32, 64, torch.bfloat16, device)
    w32 = w.detach().float().requires_grad_()
    loss = op(h, w32, t, b)
    ref = op(h, w, t, b)
    torch.testing.assert_close(loss, ref, rtol=0, atol=0)
    gw32 = torch.autograd.grad(loss, w32)[0]
    assert gw32.dtype == torch.float32


def test_retain_graph():
    # A retained graph's backward scales copies of the saved gradients, the last one scales them in place.
    h, w, b, t = make(6, 8, 12)
    loss = op(h, w, t, b) * 2
    first = torch.autograd.grad(loss, (h, w, b), retain_graph=True)
    second = torch.autograd.grad(loss, (h, w, b))
    for a, e in zip(first, second):
        torch.testing.assert_close(a, e, rtol=0, atol=0)


def test_backward_accumulates_into_existing_grads():
    h, w, b, t = make(6, 8, 12)
    op(h, w, t, b).backward()
    once = [x.grad.clone() for x in (h, w, b)]
    op(h, w, t, b).backward()
    for x, g in zip((h, w, b), once):
        torch.testing.assert_close(x.grad, 2 * g, rtol=1e-6, atol=1e-7)


def test_out_of_range_target_raises_on_cpu():
    h, w, b, t = make(6, 8, 12)
    t[2] = 12
    with pytest.raises(RuntimeError, match=r"target 12 is outside \[0, 12\)"):
        op(h, w, t, b)


# ---------------------------------------------------------------- CUDA

QWEN3_VOCAB = 151936


@needs_cuda
@pytest.mark.parametrize("dtype,tol", [(torch.float32, 2e-6), (torch.bfloat16, 6e-3), (torch.float16, 8e-4)])
# Qwen3's row: vectors, parked partly in shared memory, the rest read twice; GPT-2's (odd): the scalar
# fallback, parked in shared memory whole in 16-bit types; 1001: registers only; 8: a tiny row.
@pytest.mark.parametrize("vocab", [QWEN3_VOCAB, 50257, 1001, 8])
@pytest.mark.parametrize("softcap,z_loss", [(0.0, 0.0), (30.0, 1e-4)])
def test_cuda_matches_hf_and_fp64(dtype, tol, vocab, softcap, z_loss):
    if dtype == torch.float16 and vocab > 2 ** 14:
        tol = 1e-2  # softmax terms ~1/vocab fall into fp16's subnormal range: HF's own error is ~7e-3 here
    n, hdim = 200, 256
    h, w, b, t = make(n, hdim, vocab, dtype, "cuda")
    poison_cuda_allocator(4 * n * vocab * 4)
    kw = dict(softcap=softcap, z_loss=z_loss)
    loss = op(h, w, t, b, **kw)
    ours = (loss, *grads(loss, (h, w, b)))
    hf_loss = eager(h, w, t, b, **kw)
    hf = (hf_loss, *grads(hf_loss, (h, w, b)))
    ref_in = detached64(h, w, b)
    ref_loss = eager(ref_in[0], ref_in[1], t, ref_in[2], **kw)
    ref = (ref_loss, *grads(ref_loss, ref_in))
    for name, o, e, r in zip(["loss", "grad_hidden", "grad_weight", "grad_bias"], ours, hf, ref):
        assert not o.isnan().any(), name
        err, err_hf = rel_err(o, r), rel_err(e, r)
        assert err < tol and err <= 1.25 * err_hf + 0.1 * tol, f"{name}: ours {err:.3g}, HF {err_hf:.3g} vs fp64"


@needs_cuda
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_cuda_backward_scales_in_f32_rounding_once(dtype):
    # The backward multiplies the forward's gradients by the upstream gradient, a device scalar: each
    # element in f32, rounded once to its dtype, as torch's grad * grad_loss on the CPU.
    s = torch.tensor(1 / 3, device="cuda")
    g = torch.randn(4099, device="cuda").to(dtype)
    for x in (g, g[1:], g[:5]):  # 16-byte vectors and a tail, an unaligned view, less than one vector
        want = (x.cpu().float() * s.cpu()).to(dtype)
        out = bwd_op(s, x, x[:0], x[:0])
        assert out[0].data_ptr() != x.data_ptr()
        torch.testing.assert_close(out[0].cpu(), want, rtol=0, atol=0)
        assert out[1].numel() == out[2].numel() == 0
    # Through autograd: in place on a fresh graph, into new tensors when the graph is retained.
    h, w, b, t = make(64, 32, 1000, dtype, "cuda")
    unit = grads(op(h, w, t, b), (h, w, b))
    loss = op(h, w, t, b)
    kept = torch.autograd.grad(loss, (h, w, b), s, retain_graph=True)
    fresh = torch.autograd.grad(loss, (h, w, b), s)
    for u, a, c in zip(unit, kept, fresh):
        want = (u.cpu().float() * s.cpu()).to(dtype)
        torch.testing.assert_close(a.cpu(), want, rtol=0, atol=0)
        torch.testing.assert_close(c.cpu(), want, rtol=0, atol=0)
        assert c._version > 0, "scaled in place: its version counter moves, as mul_'s would"


@needs_cuda
def test_cuda_matches_cpu_kernel():
    # Same fp32 inputs through both devices: GEMMs differ in rounding only, the logits pass is compared.
    h, w, b, t = make(64, 128, 4096, torch.float32, "cpu")
    for kw in (dict(), dict(softcap=10.0, z_loss=1e-3, reduction="sum")):
        cpu = fwd_op(h.detach(), w.detach(), t, b.detach(), **kw)
        gpu = fwd_op(h.detach().cuda(), w.detach().cuda(), t.cuda(), b.detach().cuda(), **kw)
        for a, e in zip(gpu, cpu):
            assert rel_err(a, e) < 1e-5


@needs_cuda
def test_cuda_out_of_range_targets_are_ignored():
    h, w, b, t = make(32, 64, 1000, torch.bfloat16, "cuda", ignored=0.0)
    bad = t.clone()
    bad[::4] = 1000
    bad[1::4] = -7
    ignored = t.clone()
    ignored[::4] = -100
    ignored[1::4] = -100
    a = fwd_op(h.detach(), w.detach(), bad, b.detach())
    e = fwd_op(h.detach(), w.detach(), ignored, b.detach())
    for x, y in zip(a, e):
        torch.testing.assert_close(x, y, rtol=0, atol=0)


@needs_cuda
@pytest.mark.parametrize("bias", [True, False])  # without: the Hopper path on compute capability 9.0
def test_cuda_graph_capture_has_no_host_sync(bias):
    h, w, b, t = make(300, 128, 5000, torch.bfloat16, "cuda", bias=bias)
    static_t = t.clone()
    inputs = [x for x in (h, w, b) if x is not None]

    def step():
        loss = op(h, w, static_t, b)
        return (loss, *torch.autograd.grad(loss, inputs))

    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        step()  # warm up (cuBLAS handles, workspaces) on the side stream
    torch.cuda.current_stream().wait_stream(s)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        outs = step()
    static_t.copy_(torch.randint(0, 5000, t.shape, device="cuda"))
    static_t[:100] = -100  # the mean's divisor changes: it must be counted on the device
    graph.replay()
    torch.cuda.synchronize()
    ref = op(h, w, static_t, b)
    ref = (ref, *torch.autograd.grad(ref, inputs))
    # A divisor taken from the capture-time targets would be ~30% off; GEMM algorithms may differ by ulps.
    for a, e in zip(outs, ref):
        assert rel_err(a, e) < 1e-3


# ---------------------------------------------------------------- the Hopper path (our GEMM with the softmax epilogue)
# bf16 without bias on compute capability 9.0 runs our own logits GEMM (include/fused_linear_cross_entropy.h:
# CrossEntropyGemm); BASTILE_CROSS_ENTROPY_GEMM=cublas, read once a process, takes the cuBLAS path instead.

needs_hopper = pytest.mark.skipif(not (torch.cuda.is_available() and torch.cuda.get_device_capability() == (9, 0)),
                                  reason="the GEMM path runs on compute capability 9.0")


def own_gemm_ran(fn):
    """Whether fn ran our GEMM kernel, by torch.profiler's CUDA activity. Under compute-sanitizer the profiler
    sees no kernel (CUPTI takes one subscriber), so the tests that ask are named *kernel_choice* and `make
    gpu-test` runs them in its unsanitized pass only; the others take the same paths for the same inputs."""
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    names = [e.name for e in prof.events()]
    assert names, "the profiler recorded no CUDA kernel"
    return any("fused_linear_cross_entropy_gemm_bf16" in n for n in names)


def against_fp64(h, w, t, tol=TOL[torch.bfloat16], **kw):
    """The op's loss and gradients (weighted by random upstream gradients for reduction "none") against
    fp64 on the same inputs, and no worse than HF's bf16 expression by more than a bf16 rounding: the
    weight gradient's terms carry two (exps, and the hidden scaled by the row's factor) where HF's carry
    one, which with "sum" is often exact (p - 1 rounds to -1)."""
    upstream = torch.rand(t.shape, device=t.device, dtype=torch.float64) if kw.get("reduction") == "none" else None

    def total(loss):
        return (loss.double() * upstream).sum() if upstream is not None else loss

    needed = [x for x in (h, w) if x.requires_grad]
    loss = op(h, w, t, **kw)
    ours = (loss, *grads(total(loss), needed))
    hf_loss = reference(h, w, t, **kw)
    hf = (hf_loss, *grads(total(hf_loss), needed))
    ref_in = [x.detach().double().requires_grad_(x.requires_grad) for x in (h, w)]
    ref_loss = reference(ref_in[0], ref_in[1], t, **kw)
    ref = (ref_loss, *grads(total(ref_loss), [x for x in ref_in if x.requires_grad]))
    names = ["loss"] + [n for n, x in zip(["grad_hidden", "grad_weight"], (h, w)) if x.requires_grad]
    for name, o, e, r in zip(names, ours, hf, ref):
        assert o.isfinite().all(), name
        err, err_hf = rel_err(o, r), rel_err(e, r)
        assert err < tol and err <= 1.25 * err_hf + 2 ** -8, f"{name}: ours {err:.3g}, HF {err_hf:.3g} vs fp64"


# The GEMM path's cases, which test_cuda_gemm_kernel_choice shows take our GEMM.
GEMM_VOCABS = [QWEN3_VOCAB, 5003, 8]  # whole 256-column tiles and not; a tiny row
GEMM_SOFTCAPS = [(0.0, 0.0), (30.0, 1e-4)]  # (softcap, z_loss)
GEMM_REDUCTIONS = ["mean", "sum", "none"]
GEMM_LOGIT_SCALES = [(1 / 16, 0.0), (2.0, 30.0)]  # (logit_scale, softcap)


@needs_hopper
@pytest.mark.parametrize("vocab", GEMM_VOCABS)
@pytest.mark.parametrize("softcap,z_loss", GEMM_SOFTCAPS)
@pytest.mark.parametrize("reduction", GEMM_REDUCTIONS)
def test_cuda_gemm_path_matches_fp64(vocab, softcap, z_loss, reduction):
    h, w, _, t = make(300, 256, vocab, torch.bfloat16, "cuda", bias=False)
    poison_cuda_allocator(4 * 300 * vocab * 4)
    kw = dict(softcap=softcap, z_loss=z_loss, reduction=reduction)
    # Several chunks, the last ragged (and one row tile of 128 partly outside the chunk).
    against_fp64(h, w, t, chunk_bytes=chunks(200, vocab, 2), **kw)


@needs_hopper
@pytest.mark.parametrize("logit_scale,softcap", GEMM_LOGIT_SCALES)
def test_cuda_gemm_path_logit_scale(logit_scale, softcap):
    """Granite's head divides the logits by logits_scaling: the Hopper path's epilogue scales them."""
    h, w, _, t = make(300, 256, 5003, torch.bfloat16, "cuda", bias=False)
    kw = dict(logit_scale=logit_scale, softcap=softcap)
    against_fp64(h, w, t, chunk_bytes=chunks(200, 5003, 2), **kw)


@needs_hopper
@pytest.mark.parametrize("frozen", ["weight", "hidden"])
def test_cuda_gemm_path_with_one_operand_frozen(frozen):
    """A frozen head (LoRA) needs only grad_hidden: no scaled hidden; frozen hidden only grad_weight."""
    h, w, _, t = make(300, 256, 5003, torch.bfloat16, "cuda", bias=False)
    (w if frozen == "weight" else h).requires_grad_(False)
    against_fp64(h, w, t, chunk_bytes=chunks(200, 5003, 2))


def misaligned(n, hdim):
    """A bf16 hidden whose rows are not 16-byte aligned (a view at an odd offset)."""
    flat = torch.randn(n * hdim + 3, device="cuda").to(torch.bfloat16)
    return flat[3:].view(n, hdim).requires_grad_()


@needs_hopper
def test_cuda_gemm_path_falls_back_for_rows_tma_cannot_read():
    """A hidden whose rows TMA cannot read takes the cuBLAS path (test_cuda_gemm_kernel_choice)."""
    _, w, _, t = make(300, 256, 5003, torch.bfloat16, "cuda", bias=False)
    against_fp64(misaligned(300, 256), w, t)


@needs_hopper
def test_cuda_gemm_kernel_choice():
    """The inputs of the GEMM-path tests above run our GEMM: every vocab, softcap, z_loss, reduction and logit
    scale; a misaligned hidden does not."""
    for vocab in GEMM_VOCABS:
        h, w, _, t = make(300, 256, vocab, torch.bfloat16, "cuda", bias=False)
        for softcap, z_loss in GEMM_SOFTCAPS:
            for reduction in GEMM_REDUCTIONS:
                kw = dict(softcap=softcap, z_loss=z_loss, reduction=reduction)
                assert own_gemm_ran(lambda: op(h, w, t, **kw).sum().backward()), (vocab, kw)
    h, w, _, t = make(300, 256, 5003, torch.bfloat16, "cuda", bias=False)
    for logit_scale, softcap in GEMM_LOGIT_SCALES:
        assert own_gemm_ran(lambda: op(h, w, t, logit_scale=logit_scale, softcap=softcap).backward())
    assert not own_gemm_ran(lambda: op(misaligned(300, 256), w, t).backward())


@needs_hopper
@pytest.mark.parametrize("softcap", [0.0, 30.0])
def test_cuda_gemm_path_repairs_rows_beyond_its_range(softcap):
    """Logits near +-1e4 and targets at the row's minimum: without softcap, losses in the thousands, far
    beyond the reference's range (~66), so these rows take the repair (their max as reference); with
    softcap 30 the scaled logits stay within +-30 (no repair) and tanh saturates."""
    n, hdim, vocab = 512, 128, 5003
    h, w, _, t = make(n, hdim, vocab, torch.bfloat16, "cuda", bias=False)
    with torch.no_grad():
        h[:64] *= 2500  # |logits| ~ 1e4
        z = h.double() @ w.double().t()
        t[:32] = z[:32].argmin(-1)  # the target far below the max
        t[200:232] = z[200:232].argmin(-1)  # a moderate row tile flagged too: in range, far below max
    assert z[:64].abs().amax() > 5e3
    against_fp64(h, w, t, softcap=softcap)
    against_fp64(h, w, t, softcap=softcap, reduction="none")


# The loss and gradients of the saved inputs, in a process whose environment asks for the cuBLAS path.
CUBLAS_CHILD = """
import sys, torch, bastile
from test_fused_linear_cross_entropy import grads, op, own_gemm_ran
h, w, t = torch.load(sys.argv[1])
h, w = h.requires_grad_(), w.requires_grad_()
out = []
assert not own_gemm_ran(lambda: out.append(op(h, w, t)))
torch.save((out[0], *grads(out[0], (h, w))), sys.argv[2])
"""


def gemm_path_run(h, w, t):
    loss = op(h, w, t)
    return (loss, *grads(loss, (h, w)))


@needs_hopper
def test_cuda_gemm_path_is_deterministic():
    h, w, _, t = make(1000, 512, QWEN3_VOCAB, torch.bfloat16, "cuda", bias=False)
    first, again = gemm_path_run(h, w, t), gemm_path_run(h, w, t)
    assert all(torch.equal(a, b) for a, b in zip(first, again))


@needs_hopper
def test_cuda_gemm_kernel_choice_of_the_environment_agrees_with_our_gemm(tmp_path):
    """BASTILE_CROSS_ENTROPY_GEMM=cublas in a fresh process takes the cuBLAS path, which agrees with ours."""
    h, w, _, t = make(1000, 512, QWEN3_VOCAB, torch.bfloat16, "cuda", bias=False)
    first = gemm_path_run(h, w, t)
    torch.save((h.detach(), w.detach(), t), tmp_path / "inputs.pt")
    p = subprocess.run([sys.executable, "-c", CUBLAS_CHILD, str(tmp_path / "inputs.pt"), str(tmp_path / "out.pt")],
                       env={**os.environ, "BASTILE_CROSS_ENTROPY_GEMM": "cublas"}, cwd=os.path.dirname(__file__),
                       capture_output=True, text=True, timeout=600)
    assert p.returncode == 0, p.stderr
    for a, b in zip(first, torch.load(tmp_path / "out.pt")):
        assert rel_err(a, b) < 5e-3


@needs_hopper
def test_cuda_gemm_kernel_choice_is_read_once_a_process(monkeypatch):
    """BASTILE_CROSS_ENTROPY_GEMM is read at the first call, not on every call: setting it later changes
    nothing."""
    h, w, _, t = make(300, 256, 5000, torch.bfloat16, "cuda", bias=False)
    assert own_gemm_ran(lambda: op(h, w, t).backward())
    monkeypatch.setenv("BASTILE_CROSS_ENTROPY_GEMM", "cublas")
    assert own_gemm_ran(lambda: op(h, w, t).backward())


@needs_cuda
@pytest.mark.parametrize("fp32_weight_grad,limit_gib", [(False, 1.0), (True, 2.5)])
def test_cuda_peak_memory(fp32_weight_grad, limit_gib):
    n, hdim, vocab = 32768, 2048, QWEN3_VOCAB
    need = (n * hdim + vocab * hdim) * 2 * 3 + limit_gib * 2 ** 30
    if torch.cuda.get_device_properties(0).total_memory < need + 4 * 2 ** 30:
        pytest.skip("not enough GPU memory")
    h = torch.randn(n, hdim, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    w = (torch.randn(vocab, hdim, device="cuda") / hdim ** 0.5).to(torch.bfloat16).requires_grad_()
    t = torch.randint(0, vocab, (n,), device="cuda")

    def step():
        h.grad = w.grad = None
        op(h, w, t, fp32_weight_grad=fp32_weight_grad).backward()

    step()  # cuBLAS workspaces are allocated once, outside the measurement
    h.grad = w.grad = None
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    step()
    torch.cuda.synchronize()
    extra = (torch.cuda.max_memory_allocated() - before) / 2 ** 30
    assert h.grad.dtype == w.grad.dtype == torch.bfloat16 and not w.grad.isnan().any()
    assert extra < limit_gib, f"peak extra memory {extra:.3f} GiB (fp32_weight_grad={fp32_weight_grad})"
