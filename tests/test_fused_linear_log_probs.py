"""torch.ops.bastile.fused_linear_log_probs against plain torch in fp64 (log_softmax of the scaled logits)
and against TRL's own head (trl.kernels.ChunkedLogProbFunction)."""
from functools import partial

import pytest
import torch
import torch.nn.functional as F

import bastile
from conftest import DEVICES, Contract, needs_cuda, rel_err
from test_fused_linear_cross_entropy import chunks, make, sample

op = torch.ops.bastile.fused_linear_log_probs


def reference(h, w, t, b=None, ignore_index=-100, temperature=1.0, logit_scale=1.0, softcap=0.0, uniform_grad=False,
              fp32_weight_grad=True, chunk_bytes=0):
    """The five fields from their definitions on the full logits, in the inputs' dtype promoted to f32 (f64
    stays f64); 0 (False) where the target is ignored."""
    z = F.linear(h, w, b)
    z = (z.double() if z.dtype == torch.float64 else z.float()) * logit_scale
    if softcap:
        z = softcap * torch.tanh(z / softcap)
    s = z / temperature
    log_p = torch.log_softmax(s, -1)
    keep = t != ignore_index
    safe = torch.where(keep, t, 0)
    lp = log_p.gather(-1, safe.unsqueeze(-1)).squeeze(-1)
    entropy = -(log_p.exp() * log_p).sum(-1)
    sq = torch.logsumexp(2 * log_p, -1)
    mean = s.mean(-1)
    top1 = s.argmax(-1) == safe
    zero = lambda x: torch.where(keep, x, torch.zeros_like(x))
    return zero(lp), zero(entropy), zero(sq).detach(), zero(mean).detach(), top1 & keep


def samples(device):
    call = partial(sample, device)

    several = chunks(5, 40, 4)  # chunks of 5 rows at vocab 40, of 3 at vocab 56
    return [call(12, 16, 40, chunk_bytes=several), call(19, 24, 56, seed=1, chunk_bytes=several),
            call(10, 8, 30, bias=False, seed=2, temperature=0.7, logit_scale=1.5, softcap=5.0),
            call(9, 8, 20, seed=3, frozen="wb", temperature=1.3),
            call(9, 8, 20, seed=4, frozen="h", fp32_weight_grad=False, softcap=3.0)]


def gradcheck_samples():
    h, w, b, t = make(7, 5, 11, dtype=torch.float64, ignored=0.3)
    return [((h, w, t, b), dict(temperature=temperature, logit_scale=scale, softcap=softcap, chunk_bytes=chunks(3, 11, 8)))
            for temperature, scale, softcap in [(1.0, 1.0, 0.0), (0.6, 2.0, 2.0)]]


def empty(device):
    h, w, b, t = make(0, 8, 10, device=device)
    return [((h, w, t, b), {}), ((h, w, t), dict(softcap=2.0, temperature=0.5))]


def _args(n=4):
    return torch.randn(n, 8), torch.randn(10, 8), torch.zeros(n, dtype=torch.long)


BAD = [
    (lambda: op(torch.randn(4, 8), torch.randn(10, 7), torch.zeros(4, dtype=torch.long)), "weight must have shape"),
    (lambda: op(*_args(), temperature=0.0), "temperature must be > 0"),
    (lambda: op(*_args(), logit_scale=float("nan")), "logit_scale must be finite"),
    (lambda: op(*_args(), softcap=-1.0), "softcap must be"),
    (lambda: torch.ops.bastile.fused_linear_log_probs_backward(torch.ones(3), None, *_args()),
     "the gradients must be floating with target's shape"),
]

CONTRACT = Contract(op=op, samples=samples, empty=empty, reference=reference, bad=BAD,
                    gradcheck_samples=gradcheck_samples)

TOL = {torch.float32: 1e-6, torch.bfloat16: 6e-3, torch.float16: 8e-4}
OPTIONS = [dict(), dict(temperature=0.7, logit_scale=0.5), dict(softcap=3.0, temperature=1.3, logit_scale=2.0)]


def _inputs64(h, w, b):
    return [x.detach().double().requires_grad_() for x in (h, w, b)]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", list(TOL))
@pytest.mark.parametrize("options", OPTIONS)
def test_matches_fp64(device, dtype, options):
    """Values, and the gradients of random weightings of log_probs and entropy (the backward's
    recomputation, several chunks), against the fp64 definitions."""
    n, hdim, vocab = 50, 64, 300
    h, w, b, t = make(n, hdim, vocab, dtype, device)
    g = torch.Generator().manual_seed(9)
    up_lp, up_h = torch.randn(n, generator=g).to(device), torch.randn(n, generator=g).to(device)
    got = op(h, w, t, b, chunk_bytes=chunks(16, vocab, 2), **options)
    x64 = _inputs64(h, w, b)
    want = reference(x64[0], x64[1], t, x64[2], **options)
    for k, (a, e) in enumerate(zip(got, want)):
        if k == 4:
            # argmax may flip only where the top two scaled logits are within the logits' rounding
            assert (a == e).float().mean() > 0.97 if dtype != torch.float32 else torch.equal(a, e)
        else:
            assert rel_err(a, e) < TOL[dtype], (k, rel_err(a, e))
    grads = torch.autograd.grad((got[0] * up_lp).sum() + (got[1] * up_h).sum(), (h, w, b))
    want_g = torch.autograd.grad((want[0] * up_lp.double()).sum() + (want[1] * up_h.double()).sum(), x64)
    for a, e in zip(grads, want_g):
        assert rel_err(a, e) < TOL[dtype] * (3 if dtype != torch.float32 else 1), rel_err(a, e)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("options", OPTIONS)
def test_uniform_grad_forms_the_gradients_of_the_nll(device, options):
    """uniform_grad: the gradients of SFT's loss -sum(log_probs) / tokens equal the recomputing backward's,
    and those of the fp64 definition, with ignored rows and several chunks."""
    n, hdim, vocab = 40, 32, 200
    h, w, b, t = make(n, hdim, vocab, torch.float32, device)
    tokens = (t != -100).sum()
    kw = dict(chunk_bytes=chunks(16, vocab, 4), **options)
    formed = torch.autograd.grad(-op(h, w, t, b, uniform_grad=True, **kw)[0].sum() / tokens, (h, w, b))
    remade = torch.autograd.grad(-op(h, w, t, b, **kw)[0].sum() / tokens, (h, w, b))
    x64 = _inputs64(h, w, b)
    want = torch.autograd.grad(-reference(x64[0], x64[1], t, x64[2], **options)[0].sum() / tokens, x64)
    for a, r, e in zip(formed, remade, want):
        assert rel_err(a, e) < 1e-6 and rel_err(r, e) < 1e-6


def test_uniform_grad_refuses_what_it_cannot_form():
    """Different upstream gradients across counted rows, or a gradient of the entropy: a clear error, never a
    silently wrong gradient. Ignored rows may get any gradient."""
    h, w, b, t = make(12, 8, 20)
    lp, entropy = op(h, w, t, b, uniform_grad=True)[:2]
    with pytest.raises(RuntimeError, match="uniform_grad promised one upstream gradient"):
        torch.autograd.grad((lp * torch.arange(12.0)).sum(), (h,))
    lp, entropy = op(h, w, t, b, uniform_grad=True)[:2]
    with pytest.raises(RuntimeError, match="the entropy has a gradient"):
        torch.autograd.grad(lp.sum() + entropy.sum(), (h,))
    lp = op(h, w, t, b, uniform_grad=True)[0]
    up = torch.where(t != -100, 2.0, torch.arange(12.0))
    got = torch.autograd.grad((lp * up).sum(), (h, w, b))
    want = torch.autograd.grad((op(h, w, t, b)[0] * up).sum(), (h, w, b))
    for a, e in zip(got, want):
        assert rel_err(a, e) < 1e-6


@pytest.mark.parametrize("device", DEVICES)
def test_all_ignored_rows(device):
    h, w, b, t = make(6, 8, 20, device=device)
    t = torch.full_like(t, -100)
    out = op(h, w, t, b)
    assert all(not o.any() for o in out)
    for uniform in (False, True):
        grads = torch.autograd.grad(op(h, w, t, b, uniform_grad=uniform)[0].sum() - 1.0, (h, w, b))
        assert all(not g.any() for g in grads)


@pytest.mark.parametrize("options", OPTIONS)
def test_matches_trls_head(options):
    """TRL's own head (its torch path) gives the same fields and gradients."""
    from trl.kernels import ChunkedLogProbFunction
    h, w, b, t = make(30, 16, 90, torch.float64, ignored=0.0)
    names = ("log_probs", "entropy", "log_sum_sq_probs", "mean_logits", "is_top1")
    trl = ChunkedLogProbFunction.apply(h, w, b, t, options.get("temperature", 1.0), 32, options.get("softcap"),
                                       options.get("logit_scale", 1.0), names)
    ours = bastile.fused_linear_log_probs(h, w, t, b, **options)
    for name, a, e in zip(names, ours, trl):
        assert torch.equal(a, e) if name == "is_top1" else rel_err(a, e) < 1e-6, name
    up = torch.randn(30, dtype=torch.float64)
    want = torch.autograd.grad((trl[0] * up).sum() + trl[1].sum(), (h, w, b))
    got = torch.autograd.grad((ours.log_probs * up).sum() + ours.entropy.sum(), (h, w, b))
    for a, e in zip(got, want):
        assert rel_err(a, e) < 1e-5


@needs_cuda
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_cuda_vocab_of_qwen3(dtype):
    """A real vocabulary (151936: the stats kernels' shared-memory cache) in 16-bit on CUDA, against fp64."""
    n, hdim, vocab = 64, 128, 151936
    h, w, b, t = make(n, hdim, vocab, dtype, "cuda", bias=False)
    out = op(h, w, t, softcap=30.0, temperature=0.9)
    x64 = _inputs64(h, w, h)
    want = reference(x64[0], x64[1], t, softcap=30.0, temperature=0.9)
    for k in range(4):
        assert rel_err(out[k], want[k]) < TOL[dtype], k
    up = torch.randn(n, device="cuda")
    grads = torch.autograd.grad((out[0] * up).sum() + out[1].sum(), (h, w))
    want_g = torch.autograd.grad((want[0] * up.double()).sum() + want[1].sum(), x64[:2])
    for a, e in zip(grads, want_g):
        assert rel_err(a, e) < 3 * TOL[dtype]
