"""torch.ops.bastile.fused_linear_divergence against its definition in fp64 (the full logits of both heads), and
TRL's distillation loss on it against TRL's own (trl.trainer.distillation_trainer._chunked_divergence_loss)."""
import math
from functools import partial

import pytest
import torch
import torch.nn.functional as F

import bastile
from conftest import DEVICES, Contract, needs_cuda, rel_err

op = torch.ops.bastile.fused_linear_divergence


def _scaled(logits, scale, softcap, temperature):
    z = logits * scale
    if softcap:
        z = softcap * torch.tanh(z / softcap)
    return z / temperature


def reference(sh, sw, th, tw, mask=None, sb=None, tb=None, beta=0.5, temperature=1.0, student_scale=1.0,
              student_softcap=0.0, teacher_scale=1.0, teacher_softcap=0.0, fp32_weight_grad=True, chunk_bytes=0):
    """The divergence and entropy sums from their definitions on the full logits, in float32 (float64 stays
    float64); the teacher a constant."""
    up = (lambda x: x.double()) if sh.dtype == torch.float64 else (lambda x: x.float())
    ls = torch.log_softmax(_scaled(up(F.linear(sh, sw, sb)), student_scale, student_softcap, temperature), -1)
    with torch.no_grad():
        lt = torch.log_softmax(_scaled(up(F.linear(th, tw, tb)), teacher_scale, teacher_softcap, temperature), -1)
    kl = lambda lp, lq: (lp.exp() * (lp - lq)).sum(-1)
    if beta == 0:
        d = kl(lt, ls)
    elif beta == 1:
        d = kl(ls, lt)
    else:
        lm = torch.logaddexp(ls + math.log(1 - beta), lt + math.log(beta))
        d = beta * kl(lt, lm) + (1 - beta) * kl(ls, lm)
    entropy = -(ls.exp() * ls).sum(-1).detach()
    keep = torch.ones_like(d, dtype=torch.bool) if mask is None else mask
    zero = torch.zeros((), dtype=d.dtype, device=d.device)
    return torch.where(keep, d, zero).sum(), torch.where(keep, entropy, zero).sum()


def make(n, hs, ht, vocab, dtype=torch.float32, device="cpu", bias=True, masked=0.3, seed=0, lead=None):
    """Student (hidden, weight, bias) requiring grad, teacher (hidden, weight, bias) not, and a mask; with
    `lead`, the hiddens and mask shaped lead + [width] (n = its product)."""
    g = torch.Generator().manual_seed(seed)
    shape = list(lead) if lead else [n]
    side = lambda width, grad: ((torch.randn(*shape, width, generator=g)).to(device, dtype).requires_grad_(grad),
                                (2 * torch.randn(vocab, width, generator=g) / width ** 0.5).to(device, dtype)
                                .requires_grad_(grad),
                                (0.3 * torch.randn(vocab, generator=g)).to(device, dtype).requires_grad_(grad)
                                if bias else None)
    sh, sw, sb = side(hs, True)
    th, tw, tb = side(ht, False)
    mask = (torch.rand(*shape, generator=g) >= masked).to(device)
    return sh, sw, th, tw, mask, sb, tb


def chunks(rows, vocab, row_bytes):
    """A chunk_bytes budget of `rows` rows at `row_bytes` a vocabulary column. An f32 student's gradient is
    written over its logits (8 bytes: chunks of rows * row_bytes / 8 rows); a 16-bit one has its own buffer, and
    half the budget makes a chunk, the rest a group of chunks folded into the gradients together."""
    return rows * vocab * row_bytes


def sample(device, n, hs, ht, vocab, bias=True, seed=0, frozen="", **kwargs):
    sh, sw, th, tw, mask, sb, tb = make(n, hs, ht, vocab, device=device, bias=bias, seed=seed)
    for name, x in zip("hwb", (sh, sw, sb)):
        if name in frozen and x is not None:
            x.requires_grad_(False)
    return (sh, sw, th, tw, mask, sb, tb), kwargs


def samples(device):
    call = partial(sample, device)
    several = chunks(4, 40, 8)  # chunks of 4 rows at vocab 40, of 2 or 3 at vocab 56
    return [call(12, 16, 24, 40, chunk_bytes=several), call(19, 24, 8, 56, seed=1, chunk_bytes=several),
            call(10, 8, 12, 30, bias=False, seed=2, beta=0.0, temperature=0.7, student_scale=1.5, student_softcap=5.0),
            call(9, 8, 8, 20, seed=3, frozen="wb", beta=1.0, teacher_softcap=3.0, teacher_scale=0.5),
            call(9, 8, 16, 20, seed=4, frozen="h", beta=0.3, fp32_weight_grad=False, temperature=1.4)]


def gradcheck_samples():
    sh, sw, th, tw, mask, sb, tb = make(7, 5, 6, 11, dtype=torch.float64)
    return [((sh, sw, th, tw, mask, sb, tb), dict(beta=beta, temperature=t, student_scale=s, student_softcap=c,
                                                  teacher_softcap=c, chunk_bytes=chunks(3, 11, 16)))
            for beta, t, s, c in [(0.0, 1.0, 1.0, 0.0), (0.4, 0.6, 2.0, 2.0), (1.0, 1.3, 0.7, 3.0)]]


def empty(device):
    sh, sw, th, tw, mask, sb, tb = make(0, 8, 6, 10, device=device)
    return [((sh, sw, th, tw, mask, sb, tb), {}), ((sh, sw, th, tw), dict(beta=0.0, student_softcap=2.0))]


def _args(n=4, vocab=10):
    return torch.randn(n, 8), torch.randn(vocab, 8), torch.randn(n, 6), torch.randn(vocab, 6)


BAD = [
    (lambda: op(torch.randn(4, 8), torch.randn(10, 7), *_args()[2:]), "student_weight must have shape"),
    (lambda: op(*_args()[:3], torch.randn(11, 6)), "the heads' vocabularies differ"),
    (lambda: op(*_args()[:2], torch.randn(5, 6), torch.randn(10, 6)), "teacher_hidden must have student_hidden's shape"),
    (lambda: op(*_args(), torch.ones(4)), "mask must be bool"),
    (lambda: op(*_args(), beta=1.5), r"beta must be in \[0, 1\]"),
    (lambda: op(*_args(), temperature=0.0), "temperature must be > 0"),
    (lambda: op(*_args(), teacher_softcap=-1.0), "teacher_softcap must be >= 0"),
    (lambda: op(*_args(), student_scale=float("inf")), "student_scale must be finite"),
]

CONTRACT = Contract(op=op, samples=samples, empty=empty, reference=reference, bad=BAD,
                    gradcheck_samples=gradcheck_samples)

# Against fp64, relative to the gradients' norms: f32 GEMMs and the kernel's f32 sums; the 16-bit hiddens and
# heads are rounded where the reference takes them as they are, and the gradient once to the student's dtype.
TOL = {torch.float32: 2e-5, torch.bfloat16: 1e-2, torch.float16: 2e-3}
OPTIONS = [dict(beta=0.0), dict(beta=1.0), dict(beta=0.5),
           dict(beta=0.2, temperature=0.7, student_scale=0.5, teacher_scale=1.5),
           dict(beta=0.9, student_softcap=3.0, teacher_softcap=4.0, temperature=1.3, student_scale=2.0)]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", list(TOL))
@pytest.mark.parametrize("options", OPTIONS, ids=lambda o: ",".join(f"{k}={v}" for k, v in o.items()))
def test_matches_fp64(device, dtype, options):
    """Both sums, and the divergence's gradients in the student's hidden, weight and bias over several chunks
    (16-bit: chunks of 5 rows in groups of 20, the last of each partial),
    against the definitions in fp64 on the same (rounded) inputs; the teacher gets none."""
    n, hs, ht, vocab = 37, 32, 48, 300
    sh, sw, th, tw, mask, sb, tb = make(n, hs, ht, vocab, dtype, device, lead=(1, n))
    th.requires_grad_(True)  # as an unfrozen teacher's would: the op leaves it without a gradient
    d, e = op(sh, sw, th, tw, mask, sb, tb, chunk_bytes=chunks(8, vocab, 10), **options)
    up = [x.detach().double().requires_grad_(x.requires_grad) for x in (sh, sw, th, tw, sb, tb)]
    d64, e64 = reference(up[0], up[1], up[2], up[3], mask, up[4], up[5], **options)
    assert d.dtype == e.dtype == torch.float32 and d.dim() == e.dim() == 0
    # The logits are f32 GEMMs of the same values in every dtype: the sums are as close as f32 makes them.
    assert d.item() == pytest.approx(d64.item(), rel=1e-4, abs=1e-4)
    assert e.item() == pytest.approx(e64.item(), rel=1e-5)
    got = torch.autograd.grad(d, [sh, sw, sb], allow_unused=True)
    want = torch.autograd.grad(d64, [up[0], up[1], up[4]])
    for name, a, b, x in zip(["hidden", "weight", "bias"], got, want, (sh, sw, sb)):
        assert a.dtype == x.dtype, name
        assert rel_err(a, b) <= TOL[dtype], (name, rel_err(a, b))
    assert th.grad is None


def test_grad_scales_with_upstream():
    """The gradients formed in the forward are scaled by the upstream gradient, retain_graph or not."""
    sh, sw, th, tw, mask, sb, tb = make(15, 16, 8, 30)
    d, _ = op(sh, sw, th, tw, mask, sb, tb)
    g1 = torch.autograd.grad(d, [sh, sw, sb], retain_graph=True)
    g3 = torch.autograd.grad(3 * d, [sh, sw, sb])
    for a, b in zip(g1, g3):
        torch.testing.assert_close(3 * a, b)


def test_rows_masked_out_take_no_part():
    """A masked row's hidden gets a zero gradient, and changing it changes nothing."""
    sh, sw, th, tw, mask, sb, tb = make(12, 8, 8, 20, masked=0.0)
    mask[3] = False
    d, e = op(sh, sw, th, tw, mask, sb, tb)
    (g,) = torch.autograd.grad(d, [sh])
    assert (g[3] == 0).all() and (g[2] != 0).any()
    other = sh.detach().clone()
    other[3] = 100.0
    d2, e2 = op(other, sw, th, tw, mask, sb, tb)
    assert (d2.item(), e2.item()) == (d.item(), e.item())


@needs_cuda
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("beta", [0.0, 0.5, 1.0])
def test_cuda_matches_cpu_kernel(dtype, beta):
    """The CUDA kernel against the CPU kernel (f64 math) on the same inputs: vocabularies with and without
    vector access, softcaps, masked rows; the gradients within the f32 math and one rounding."""
    for vocab, softcap in [(1000, 0.0), (1003, 5.0)]:
        sh, sw, th, tw, mask, sb, tb = make(33, 64, 96, vocab, dtype, "cuda", seed=vocab)
        kw = dict(beta=beta, temperature=0.9, student_softcap=softcap, teacher_softcap=softcap, chunk_bytes=chunks(16, vocab, 10))
        d, e = op(sh, sw, th, tw, mask, sb, tb, **kw)
        grads = torch.autograd.grad(d, [sh, sw, sb])
        cpu = [x.detach().cpu().requires_grad_(x.requires_grad) if x is not None else None for x in (sh, sw, th, tw, sb, tb)]
        # The CPU kernel reads the logits the CPU GEMMs make from the same values: compare in f32 inputs.
        c32 = [x.detach().float().requires_grad_(x.requires_grad) for x in cpu]
        dc, ec = op(c32[0], c32[1], c32[2], c32[3], mask.cpu(), c32[4], c32[5], **kw)
        want = torch.autograd.grad(dc, [c32[0], c32[1], c32[4]])
        assert d.item() == pytest.approx(dc.item(), rel=1e-4, abs=1e-3)
        assert e.item() == pytest.approx(ec.item(), rel=1e-5)
        tol = {torch.float32: 1e-5, torch.bfloat16: 8e-3, torch.float16: 2e-3}[dtype]
        for name, a, b in zip(["hidden", "weight", "bias"], grads, want):
            assert rel_err(a.float(), b) <= tol, (name, vocab, rel_err(a.float(), b))


# ------------------------------------------------------------------------------------------- TRL's seam


trl = pytest.importorskip("trl")
from trl.kernels import chunked_divergence  # noqa: E402
from trl.trainer import distillation_trainer  # noqa: E402


@pytest.mark.parametrize("beta", [0.0, 0.5, 1.0])
@pytest.mark.parametrize("items", [None, 23])
def test_trl_divergence_loss_as_trl(beta, items, monkeypatch):
    """TRL's _chunked_divergence_loss with Bastile's patch: its loss, entropy sum and count as TRL's own, the
    student's gradients within 1e-4; TRL's ChunkedDivergenceFunction does not run."""
    g = torch.Generator().manual_seed(1)
    B, K, hs, ht, vocab = 3, 7, 16, 24, 64
    sh = torch.randn(B, K, hs, generator=g, requires_grad=True)
    th = torch.randn(B, K, ht, generator=g)
    sw = (torch.randn(vocab, hs, generator=g) / 4).requires_grad_()
    tw = torch.randn(vocab, ht, generator=g) / 4
    sb = (0.1 * torch.randn(vocab, generator=g)).requires_grad_()
    cm = (torch.rand(B, K, generator=g) > 0.3).long()
    kw = dict(num_items_in_batch=items, student_lm_head_bias=sb, student_logit_scale=1.2, teacher_logit_scale=0.8,
              student_final_logit_softcapping=6.0, temperature=0.9)
    original = distillation_trainer._chunked_divergence_loss
    want = original(sh, th, sw, tw, cm, beta, **kw)
    want_g = torch.autograd.grad(want[0], [sh, sw, sb])
    assert bastile.apply(divergence=True, log_probs=False, families=[]) == ["divergence_trl"]
    calls = []
    monkeypatch.setattr(chunked_divergence.ChunkedDivergenceFunction, "apply",
                        lambda *a: calls.append(a) or pytest.fail("TRL's divergence ran"))
    got = distillation_trainer._chunked_divergence_loss(sh, th, sw, tw, cm, beta, **kw)
    got_g = torch.autograd.grad(got[0], [sh, sw, sb])
    assert distillation_trainer._chunked_divergence_loss is not original and not calls
    torch.testing.assert_close(got[0], want[0], rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(got[1], want[1].to(got[1].dtype), rtol=1e-5, atol=1e-5)
    assert got[2].item() == want[2].item()
    for a, b in zip(got_g, want_g):
        assert rel_err(a, b) <= 1e-4
    bastile.reset()
    assert distillation_trainer._chunked_divergence_loss is original


def test_trl_signature_change_is_refused(monkeypatch):
    """A TRL whose _chunked_divergence_loss takes other arguments is refused before anything is patched."""
    def moved(student_hidden_states, teacher_hidden_states, weights, completion_mask, beta):
        raise AssertionError
    monkeypatch.setattr(distillation_trainer, "_chunked_divergence_loss", moved)
    with pytest.raises(RuntimeError, match="_chunked_divergence_loss takes"):
        bastile.apply(divergence=True, log_probs=True, families=[])
    assert distillation_trainer._chunked_divergence_loss is moved
    assert bastile.get_patched_ops() == []
