"""torch.ops.bastile.qk_norm_rope against HF's Qwen3, Gemma 3 and Gemma 4 q_norm/k_norm + apply_rotary_pos_emb,
and fp64."""
import types

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from transformers.models.qwen3.configuration_qwen3 import Qwen3Config
from transformers.models.gemma3.modeling_gemma3 import Gemma3RMSNorm
from transformers.models.gemma4.modeling_gemma4 import Gemma4RMSNorm
from transformers.models.qwen3.modeling_qwen3 import Qwen3RMSNorm, Qwen3RotaryEmbedding, apply_rotary_pos_emb

import bastile
from conftest import DEVICES, Contract, needs_cuda, poison_cuda_allocator, rel_err

op = torch.ops.bastile.qk_norm_rope
fwd_op = torch.ops.bastile.qk_norm_rope_forward
bwd_op = torch.ops.bastile.qk_norm_rope_backward
EPS = 1e-6

HF_NORM = Qwen3RMSNorm.forward  # taken before any test patches HF
HF_ROPE = apply_rotary_pos_emb
# The rounding modes (cast_after_weight, weight_offset) of Gemma 3's (1 + w) norm and Gemma 4's, with their HF
# modules' forwards.
GEMMA = {"gemma3": ((True, 1.0), Gemma3RMSNorm, Gemma3RMSNorm.forward),
         "gemma4": ((True, 0.0), Gemma4RMSNorm, Gemma4RMSNorm.forward)}

# Spacing of representable numbers just above 1, and the unit roundoff, per dtype.
SPACING = {torch.bfloat16: 2 ** -7, torch.float16: 2 ** -10, torch.float32: 2 ** -23, torch.float64: 2 ** -52}
ULP = {dt: s / 2 for dt, s in SPACING.items()}


def cast_after_weight_norm(x, w, eps, weight_offset):
    """HF's Gemma norms in plain torch: to(x.dtype)((w + offset) * n), n and the product in float32 (float64
    for float64 input, where HF's modules would round to float32)."""
    f = x.dtype if x.dtype == torch.float64 else torch.float32
    n = x.to(f) * torch.rsqrt(x.to(f).pow(2).mean(-1, keepdim=True) + eps)
    return (n * (w.to(f) + weight_offset)).to(x.dtype)


def hf_qk_norm_rope(q, k, qw, kw, cos, sin, eps=EPS, cast_after_weight=False, weight_offset=0.0):
    """HF's Qwen3Attention path with the given weights (with cast_after_weight, Gemma's norms), returned in the
    op's [B, S, H, D] layout."""
    if cast_after_weight:
        qn = cast_after_weight_norm(q, qw, eps, weight_offset).transpose(1, 2)
        kn = cast_after_weight_norm(k, kw, eps, weight_offset).transpose(1, 2)
    else:
        qn = HF_NORM(types.SimpleNamespace(weight=qw, variance_epsilon=eps), q).transpose(1, 2)
        kn = HF_NORM(types.SimpleNamespace(weight=kw, variance_epsilon=eps), k).transpose(1, 2)
    if cos.dim() == 2:
        cos, sin = cos[None], sin[None]
    qo, ko = HF_ROPE(qn, kn, cos, sin)
    return qo.transpose(1, 2), ko.transpose(1, 2)


def rope_tables(batch, seq, dim, device="cpu", dtype=torch.float32, restart=None):
    """cos/sin from HF's Qwen3RotaryEmbedding: [1, seq, dim], or [batch, seq, dim] when sequences are packed
    (`restart`: positions restart at these offsets in every batch row, shifted per row)."""
    cfg = Qwen3Config(head_dim=dim, hidden_size=4 * dim, num_attention_heads=4, num_key_value_heads=2,
                      max_position_embeddings=4 * seq + 64)
    rope = Qwen3RotaryEmbedding(cfg).to(device)
    if restart is None:
        pos = torch.arange(seq, device=device)[None]
    else:
        rows = []
        for b in range(batch):
            p = torch.arange(seq, device=device) + 7 * b
            for r in restart:
                p[r + b:] -= p[r + b].clone()
            rows.append(p)
        pos = torch.stack(rows)
    return rope(torch.empty(0, device=device, dtype=dtype), pos)


def inputs(batch=2, seq=5, hq=4, hk=2, dim=64, device="cpu", dtype=torch.float32, w_dtype=None, packed=False,
           seed=0):
    w_dtype = w_dtype or dtype
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(batch, seq, hq, dim, generator=g).to(device, dtype)
    k = torch.randn(batch, seq, hk, dim, generator=g).to(device, dtype)
    qw = (1 + 0.2 * torch.randn(dim, generator=g)).to(device, w_dtype)
    kw = (1 + 0.2 * torch.randn(dim, generator=g)).to(device, w_dtype)
    cos, sin = rope_tables(batch, seq, dim, device, dtype, restart=[seq // 2] if packed else None)
    return q, k, qw, kw, cos, sin


def leaves(*ts):
    return [t.detach().clone().requires_grad_() for t in ts]


def f64_reference(q, k, qw, kw, cos, sin):
    return hf_qk_norm_rope(q.double(), k.double(), qw.double(), kw.double(), cos.double(), sin.double())


# ---------------------------------------------------------------- the generic tests' contract (test_contract.py)


def sample(device, batch, seq, hq, hk, dim, packed=False, seq_by_dim=False, eps=EPS, seed=0, **rounding):
    q, k, qw, kw, cos, sin = inputs(batch, seq, hq, hk, dim, device, packed=packed, seed=seed)
    if seq_by_dim:
        cos, sin = cos[0], sin[0]
    return (*leaves(q, k, qw, kw), cos, sin, eps), rounding


def samples(device):
    # Tables [1, S, D] (shared), [B, S, D] (packed sequences) and [S, D]; head_dim 6 has an odd half; Gemma 3's
    # and Gemma 4's rounding.
    return [sample(device, 2, 3, 4, 2, 8), sample(device, 3, 5, 6, 3, 12),
            sample(device, 2, 4, 3, 1, 6, packed=True, seed=1),
            sample(device, 1, 5, 2, 2, 16, seq_by_dim=True, eps=1e-5, seed=2),
            sample(device, 2, 3, 4, 2, 8, seed=3, cast_after_weight=True, weight_offset=1.0),
            sample(device, 2, 4, 2, 1, 6, packed=True, seed=4, cast_after_weight=True)]


def empty(device):
    return [sample(device, *shape) for shape in [(2, 0, 4, 2, 16), (0, 3, 4, 2, 16)]]


def _bad(**kw):
    args = dict(zip(("q", "k", "qw", "kw", "cos", "sin"), inputs(2, 3, 4, 2, 8)))
    args.update(kw)
    return lambda: op(args["q"], args["k"], args["qw"], args["kw"], args["cos"], args["sin"], EPS)


BAD = [
    (_bad(q=torch.randn(2, 3, 32)), "must be \\[batch, seq, heads, head_dim\\]"),
    (_bad(k=torch.randn(2, 4, 2, 8)), "must agree in batch, seq and head_dim"),
    (_bad(k=torch.randn(2, 3, 2, 6)), "must agree in batch, seq and head_dim"),
    (_bad(q=torch.randn(2, 3, 4, 7), k=torch.randn(2, 3, 2, 7), qw=torch.randn(7), kw=torch.randn(7),
          cos=torch.randn(3, 7), sin=torch.randn(3, 7)), "head_dim must be even"),
    (_bad(k=torch.randn(2, 3, 2, 8, dtype=torch.float64)), "q and k must have the same dtype"),
    (_bad(qw=torch.randn(6)), "must have shape \\[8\\]"),
    (_bad(kw=torch.randn(8, dtype=torch.float64)), "q_weight and k_weight must have the same dtype"),
    (_bad(q=torch.randint(0, 5, (2, 3, 4, 8))), "q must be float32"),
    (_bad(cos=torch.randn(1, 4, 8), sin=torch.randn(1, 4, 8)), "cos and sin must have shape \\[seq, head_dim\\]"),
    (_bad(cos=torch.randn(3, 3, 8), sin=torch.randn(3, 3, 8)), "cos and sin must have shape \\[seq, head_dim\\]"),
    (_bad(sin=torch.randn(1, 3, 8, dtype=torch.float64)), "cos and sin must have the same dtype"),
    (_bad(kw=torch.randn(8, device="meta")), "q is on cpu but k_weight is on meta"),
    (lambda: op(*inputs(2, 3, 4, 2, 8), EPS, False, 1.0), "qk_norm_rope: weight_offset 1 needs cast_after_weight=True"),
    (lambda: bwd_op(*(t for t in fwd_op(*inputs(2, 3, 4, 2, 8), EPS)[:2]), *inputs(2, 3, 4, 2, 8),
                    torch.zeros(2, 3, 4), torch.zeros(2, 3, 3)), "q_rstd and k_rstd must be"),
    (lambda: bwd_op(torch.zeros(2, 3, 4, 8, dtype=torch.float64), torch.zeros(2, 3, 2, 8), *inputs(2, 3, 4, 2, 8),
                    torch.zeros(2, 3, 4), torch.zeros(2, 3, 2)), "grad_q and grad_k must be"),
]

CONTRACT = Contract(op=op, samples=samples, empty=empty, reference=hf_qk_norm_rope, bad=BAD)


# ---------------------------------------------------------------- CPU and any device


def test_gradcheck_fp64_strided_inputs():
    qkv = torch.randn(2, 3, 4, 8, dtype=torch.float64, requires_grad=True)
    _, _, qw, kw, cos, sin = inputs(2, 3, 2, 1, 8, dtype=torch.float64)
    f = lambda qkv, qw, kw: op(qkv[:, :, :2], qkv[:, :, 2:3], qw, kw, cos, sin, EPS)
    assert torch.autograd.gradcheck(f, (qkv, *leaves(qw, kw)))


# Forward: HF rounds n to x's dtype, the weight product to promote(x, w), each rotation product and
# the sum to the output's dtype, and so do we, so outputs agree except where the f32 statistics differ
# in their last bit (a different summation order) and flip one rounding: then by one unit, at its
# magnitude (|n| < 4), of the coarser dtype rounded to, x's or the output's (x's, for a 16-bit x and a
# float32 output). Gradients: HF rounds its intermediates to 16 bits, we keep f32, so a few units of
# roundoff apart in norm.
FWD_ATOL = {torch.bfloat16: 4 * SPACING[torch.bfloat16], torch.float16: 4 * SPACING[torch.float16],
            torch.float32: 4e-5}  # f32: rsqrtf and torch's rsqrt differ by ulps, amplified where n*cos and rot(n)*sin cancel
GRAD_TOL = {torch.bfloat16: 8 * ULP[torch.bfloat16], torch.float16: 8 * ULP[torch.float16], torch.float32: 1e-5}


def exact_tol(grad_dtype, x_dtype):
    """Ours against the exact gradient of the same inputs: f32 arithmetic, one rounding to the gradient's
    dtype, and (weights) HF's normalised x rounded to x's dtype."""
    return max(3 * max(ULP[grad_dtype], ULP[x_dtype]), 1e-5)


def check_against_hf(q, k, qw, kw, cos, sin, out_dtype, mismatch_max=0.02):
    """Forward and backward (inputs and both weights) of the op against HF modules and fp64."""
    ql, kl = leaves(q, k)
    qn, kn = Qwen3RMSNorm(q.shape[-1], EPS), Qwen3RMSNorm(q.shape[-1], EPS)
    qn.weight.data, kn.weight.data = qw.clone(), kw.clone()
    qn, kn = qn.to(q.device), kn.to(q.device)
    hq, hk = HF_ROPE(qn(ql).transpose(1, 2), kn(kl).transpose(1, 2), *(t[None] if t.dim() == 2 else t for t in (cos, sin)))
    hq, hk = hq.transpose(1, 2), hk.transpose(1, 2)
    bq, bk, bqw, bkw = leaves(q, k, qw, kw)
    oq, ok = op(bq, bk, bqw, bkw, cos, sin, EPS)
    assert oq.dtype == ok.dtype == hq.dtype == out_dtype and oq.shape == q.shape and ok.shape == k.shape
    coarser = max(q.dtype, out_dtype, key=SPACING.get)  # of the two roundings of n (see FWD_ATOL)
    for ours, ref in ((oq, hq), (ok, hk)):
        torch.testing.assert_close(ours, ref, rtol=SPACING[coarser], atol=FWD_ATOL[coarser])
        if out_dtype != torch.float32:  # the same roundings as HF: almost every element identical
            assert (ours != ref).float().mean().item() < mismatch_max
    gq, gk = torch.randn_like(oq), torch.randn_like(ok)
    ours = torch.autograd.grad((oq, ok), (bq, bk, bqw, bkw), (gq, gk))
    hf = torch.autograd.grad((hq, hk), (ql, kl, qn.weight, kn.weight), (gq, gk))
    xr = leaves(q, k, qw, kw)
    exact = torch.autograd.grad(f64_reference(*xr, cos, sin), xr, (gq.double(), gk.double()))
    for name, a, b, c, t in zip(("q", "k", "q_weight", "k_weight"), ours, hf, exact, (q, k, qw, kw)):
        assert a.dtype == t.dtype, name
        # A weight's gradient sums n rounded to x's dtype: the flips of the forward move its terms too.
        assert rel_err(a, b) < GRAD_TOL[max(t.dtype, q.dtype, key=SPACING.get)], (name, rel_err(a, b))
        assert rel_err(a, c) < exact_tol(t.dtype, q.dtype), (name, rel_err(a, c))
    # Each of HF's roundings (x's dtype, the weight product, the rotation) costs at most one roundoff.
    coarsest = max(ULP[t.dtype] for t in (q, qw, cos, oq))
    for a, c in zip((oq, ok), f64_reference(q, k, qw, kw, cos, sin)):
        assert rel_err(a, c) < 4 * coarsest + 1e-7


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_matches_hf_and_fp64(device, dtype):
    check_against_hf(*inputs(2, 9, 4, 2, 64, device, dtype), out_dtype=dtype)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("family", list(GEMMA))
@pytest.mark.parametrize("dtype,w_dtype", [(torch.bfloat16, torch.bfloat16), (torch.float16, torch.float16),
                                           (torch.float32, torch.float32), (torch.bfloat16, torch.float32)])
def test_gemma_norms_match_hf_and_fp64(device, family, dtype, w_dtype):
    """Gemma 3's (1 + w) and Gemma 4's q/k norms (the product in float32, one rounding to x's dtype), then HF's
    rotation: against HF's modules, and the exact gradient."""
    (cast_after_weight, offset), cls, hf_forward = GEMMA[family]
    q, k, qw, kw, cos, sin = inputs(2, 9, 4, 2, 256, device, dtype, w_dtype, seed=5)
    if offset:  # Gemma 3 stores its weights around 0
        qw, kw = qw - offset, kw - offset
    norms = [cls(256, EPS).to(device) for _ in range(2)]
    for m, w in zip(norms, (qw, kw)):
        m.weight.data = w.clone()
    ql, kl = leaves(q, k)
    hq, hk = (t.transpose(1, 2) for t in HF_ROPE(hf_forward(norms[0], ql).transpose(1, 2),
                                                 hf_forward(norms[1], kl).transpose(1, 2), cos, sin))
    bq, bk, bqw, bkw = leaves(q, k, qw, kw)
    oq, ok = op(bq, bk, bqw, bkw, cos, sin, EPS, cast_after_weight, offset)
    assert oq.dtype == ok.dtype == hq.dtype == dtype
    for ours, ref in ((oq, hq), (ok, hk)):
        torch.testing.assert_close(ours, ref, rtol=SPACING[dtype], atol=FWD_ATOL[dtype])
        if dtype != torch.float32:  # HF's roundings: almost every element identical
            assert (ours != ref).float().mean().item() < 0.02
    gq, gk = torch.randn_like(oq), torch.randn_like(ok)
    ours = torch.autograd.grad((oq, ok), (bq, bk, bqw, bkw), (gq, gk))
    hf = torch.autograd.grad((hq, hk), (ql, kl, norms[0].weight, norms[1].weight), (gq, gk))
    xr = leaves(*(t.double() for t in (q, k, qw, kw)))
    exact_out = hf_qk_norm_rope(*xr, cos.double(), sin.double(), EPS, True, offset)
    exact = torch.autograd.grad(exact_out, xr, (gq.double(), gk.double()))
    for name, a, b, c, t in zip(("q", "k", "q_weight", "k_weight"), ours, hf, exact, (q, k, qw, kw)):
        assert a.dtype == t.dtype, name
        assert rel_err(a, b) < GRAD_TOL[max(t.dtype, q.dtype, key=SPACING.get)], (name, rel_err(a, b))
        assert rel_err(a, c) < exact_tol(t.dtype, q.dtype), (name, rel_err(a, c))
    coarsest = max(ULP[t.dtype] for t in (q, cos, oq))  # the product rounds once, to x's dtype
    for a, c in zip((oq, ok), exact_out):
        assert rel_err(a, c) < 4 * coarsest + 1e-7


@pytest.mark.parametrize("device", DEVICES)
def test_gemma4_query_alone(device):
    """Gemma 4's K/V-sharing layers norm and rotate q alone: k with no heads."""
    q, k, qw, kw, cos, sin = inputs(2, 5, 4, 0, 64, device, torch.bfloat16)
    ql = leaves(q)[0]
    oq, ok = op(ql, k, qw, qw, cos, sin, EPS, True)
    assert ok.shape == (2, 5, 0, 64)
    ref = hf_qk_norm_rope(q, q[:, :, :1], qw, qw, cos, sin, EPS, True)[0]
    torch.testing.assert_close(oq, ref, rtol=0, atol=0)
    oq.sum().backward()
    assert ql.grad is not None and ql.grad.isfinite().all()


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("x_dtype,w_dtype,c_dtype", [
    (torch.bfloat16, torch.float32, torch.bfloat16),  # fp32 norm weights, cos in x's dtype (HF)
    (torch.bfloat16, torch.float32, torch.float32),
    (torch.float16, torch.bfloat16, torch.float16),
    (torch.float32, torch.bfloat16, torch.bfloat16),
])
def test_mixed_dtypes_match_hf(device, x_dtype, w_dtype, c_dtype):
    q, k, qw, kw, cos, sin = inputs(2, 6, 4, 2, 64, device, x_dtype, w_dtype)
    cos, sin = cos.to(c_dtype), sin.to(c_dtype)
    out = torch.promote_types(torch.promote_types(x_dtype, w_dtype), c_dtype)
    check_against_hf(q, k, qw, kw, cos, sin, out_dtype=out)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_packed_sequences_cos_per_batch_row(device, dtype):
    q, k, qw, kw, cos, sin = inputs(3, 12, 4, 2, 64, device, dtype, packed=True)
    assert cos.shape[0] == 3 and not torch.equal(cos[0], cos[1])
    check_against_hf(q, k, qw, kw, cos, sin, out_dtype=dtype)


@pytest.mark.parametrize("device", DEVICES)
def test_cos_as_seq_by_dim_and_broadcast(device):
    q, k, qw, kw, cos, sin = inputs(2, 7, 4, 2, 32, device)
    ref = op(q, k, qw, kw, cos, sin, EPS)  # [1, S, D]
    for c, s in ((cos[0], sin[0]), (cos.expand(2, -1, -1), sin.expand(2, -1, -1)),
                 (cos.expand(2, -1, -1).contiguous(), sin.expand(2, -1, -1).contiguous())):
        for a, b in zip(op(q, k, qw, kw, c, s, EPS), ref):
            torch.testing.assert_close(a, b, rtol=0, atol=0)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("hq,hk", [(16, 8), (32, 8), (8, 8)])
@pytest.mark.parametrize("dim", [64, 128, 256])
def test_gqa_and_head_dims(device, hq, hk, dim):
    check_against_hf(*inputs(1, 4, hq, hk, dim, device, torch.bfloat16), out_dtype=torch.bfloat16)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_slices_of_fused_qkv_projection(device, dtype):
    b, s, hq, hk, d = 2, 6, 4, 2, 64
    _, _, qw, kw, cos, sin = inputs(b, s, hq, hk, d, device, dtype)
    qkv = torch.randn(b, s, (hq + 2 * hk) * d, device=device).to(dtype).requires_grad_()
    heads = qkv.view(b, s, hq + 2 * hk, d)
    q, k = heads[:, :, :hq], heads[:, :, hq:hq + hk]
    assert not q.is_contiguous() and not k.is_contiguous()
    oq, ok = op(q, k, qw, kw, cos, sin, EPS)
    rq, rk = hf_qk_norm_rope(q, k, qw, kw, cos, sin)
    torch.testing.assert_close(oq, rq, rtol=SPACING[dtype], atol=FWD_ATOL[dtype])
    torch.testing.assert_close(ok, rk, rtol=SPACING[dtype], atol=FWD_ATOL[dtype])
    gq, gk = torch.randn_like(oq), torch.randn_like(ok)
    (g_ours,) = torch.autograd.grad((oq, ok), qkv, (gq, gk))
    (g_hf,) = torch.autograd.grad((rq, rk), qkv, (gq, gk))
    assert g_ours[..., (hq + hk) * d:].abs().max() == 0  # v gets nothing
    assert rel_err(g_ours, g_hf) < GRAD_TOL[dtype]
    # The same as on contiguous copies.
    for a, c in zip(op(q.contiguous(), k.contiguous(), qw, kw, cos, sin, EPS), (oq, ok)):
        torch.testing.assert_close(a, c, rtol=0, atol=0)


@pytest.mark.parametrize("device", DEVICES)
def test_transposed_view_gradients(device):
    q, k, qw, kw, cos, sin = inputs(2, 5, 4, 2, 64, device, torch.bfloat16)
    qo, ko, qr, kr = fwd_op(q, k, qw, kw, cos, sin, EPS)
    # What attention hands back: gradients of the [B, H, S, D] outputs, seen through the transpose.
    gq = torch.randn(2, 4, 5, 64, device=device).to(qo.dtype).transpose(1, 2)
    gk = torch.randn(2, 2, 5, 64, device=device).to(ko.dtype).transpose(1, 2)
    assert not gq.is_contiguous()
    strided = bwd_op(gq, gk, q, k, qw, kw, cos, sin, qr, kr)
    packed = bwd_op(gq.contiguous(), gk.contiguous(), q, k, qw, kw, cos, sin, qr, kr)
    for a, b in zip(strided, packed):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    # And through autograd, as HF's attention uses the outputs.
    ql, kl = leaves(q, k)
    oq, ok = op(ql, kl, qw, kw, cos, sin, EPS)
    (oq.transpose(1, 2) * gq.transpose(1, 2)).sum().backward(retain_graph=True)
    torch.testing.assert_close(ql.grad, packed[0], rtol=0, atol=0)


@pytest.mark.parametrize("device", DEVICES)
def test_one_output_unused(device):
    q, k, qw, kw, cos, sin = inputs(2, 3, 4, 2, 32, device)
    ql, kl, qwl, kwl = leaves(q, k, qw, kw)
    oq, _ = op(ql, kl, qwl, kwl, cos, sin, EPS)
    oq.sum().backward()
    assert kl.grad.abs().max() == 0 and kwl.grad.abs().max() == 0 and qwl.grad.abs().max() > 0


class BackwardHeads(TorchDispatchMode):
    """Records the heads of q and k that qk_norm_rope_backward is called with."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func is bwd_op.default:
            self.heads = (args[2].shape[2], args[3].shape[2])
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("frozen", ["q", "k"])
def test_frozen_side_gets_no_gradient(device, frozen):
    """With one side's input and weight frozen (LoRA on the other projection), that output requires no
    grad, as HF's does, the backward leaves that side out, and the other side's gradients are HF's."""
    q, k, qw, kw, cos, sin = inputs(2, 3, 4, 2, 32, device)
    side, live = (0, 1) if frozen == "q" else (1, 0)
    hf_in, op_in = leaves(q, k, qw, kw), leaves(q, k, qw, kw)
    for ts in (hf_in, op_in):
        ts[side].requires_grad_(False)
        ts[side + 2].requires_grad_(False)
    theirs, ours = hf_qk_norm_rope(*hf_in, cos, sin), op(*op_in, cos, sin, EPS)
    assert [o.requires_grad for o in ours] == [o.requires_grad for o in theirs] == [live == 0, live == 1]
    recorder = BackwardHeads()
    with recorder:
        got = torch.autograd.grad(ours[live].square().sum(), [op_in[live], op_in[live + 2]])
    want = torch.autograd.grad(theirs[live].square().sum(), [hf_in[live], hf_in[live + 2]])
    assert recorder.heads == ((0, 2) if frozen == "q" else (4, 0))
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b)


def test_cos_requiring_grad_is_refused_in_grad_mode():
    q, k, qw, kw, cos, sin = inputs()
    cos.requires_grad_()
    with pytest.raises(RuntimeError, match="cos requires grad, but qk_norm_rope does not differentiate it"):
        op(*leaves(q, k), qw, kw, cos, sin, EPS)
    with torch.no_grad():
        op(q, k, qw, kw, cos, sin, EPS)


@pytest.mark.parametrize("device", DEVICES)
def test_autocast_keeps_dtypes(device):
    q, k, qw, kw, cos, sin = inputs(device=device, dtype=torch.bfloat16, w_dtype=torch.float32)
    with torch.autocast(device, dtype=torch.float16):
        oq, ok = op(q, k, qw, kw, cos, sin, EPS)
    assert oq.dtype == ok.dtype == torch.float32
    torch.testing.assert_close(oq, op(q, k, qw, kw, cos, sin, EPS)[0], rtol=0, atol=0)


def test_python_function():
    args = inputs()
    for a, b in zip(bastile.qk_norm_rope(*args), op(*args, 1e-6)):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    for a, b in zip(bastile.qk_norm_rope(*args, eps=1e-5), hf_qk_norm_rope(*args, eps=1e-5)):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


# ---------------------------------------------------------------- CUDA against the CPU reference

CUDA_TOL = {  # (forward rtol, gradient norm-relative error); the GPU accumulates in f32
    torch.float32: (2e-6, 2e-6),
    torch.float16: (2 ** -9, 2e-3),
    torch.bfloat16: (2 ** -6, 1.2e-2),
}


def cuda_vs_cpu(q, k, qw, kw, cos, sin, dtype, cuda_qk=None, grad_layout="contiguous", rounding=(False, 0.0)):
    """Forward and backward on CUDA against the CPU kernels on the same inputs (`cuda_qk`: q and k as
    laid out on the GPU, when not plain copies; `rounding`: cast_after_weight and weight_offset)."""
    ref = fwd_op(q, k, qw, kw, cos, sin, EPS, *rounding)
    gq, gk = torch.randn_like(ref[0]), torch.randn_like(ref[1])
    ref_b = bwd_op(gq, gk, q, k, qw, kw, cos, sin, ref[2], ref[3], *rounding)
    cu = list(cuda_qk or (q.cuda(), k.cuda())) + [t.cuda() for t in (qw, kw, cos, sin)]
    poison_cuda_allocator(16 * (q.numel() + k.numel()) * 4)
    out = fwd_op(*cu, EPS, *rounding)
    gqc, gkc = gq.cuda(), gk.cuda()
    if grad_layout == "transposed":
        gqc = gqc.transpose(1, 2).contiguous().transpose(1, 2)
        gkc = gkc.transpose(1, 2).contiguous().transpose(1, 2)
    poison_cuda_allocator(16 * (q.numel() + k.numel()) * 4)
    out_b = bwd_op(gqc, gkc, *cu, out[2], out[3], *rounding)
    ftol, gtol = CUDA_TOL[dtype]
    for t in (*out, *out_b):
        assert not t.isnan().any()
    for a, b in zip(out[:2], ref[:2]):
        assert a.dtype == b.dtype
        torch.testing.assert_close(a.cpu(), b, rtol=ftol, atol=4 * ftol)
    for a, b in zip(out[2:], ref[2:]):
        torch.testing.assert_close(a.cpu(), b, rtol=2e-6, atol=0)
    for a, b in zip(out_b, ref_b):
        assert a.dtype == b.dtype and rel_err(a, b) < gtol, rel_err(a, b)
    exact = hf_qk_norm_rope(*(t.double() for t in (q, k, qw, kw, cos, sin)), EPS, *rounding)
    assert rel_err(out[0], exact[0]) < 4 * ftol and rel_err(out[1], exact[1]) < 4 * ftol


@needs_cuda
@pytest.mark.parametrize("dtype", list(CUDA_TOL))
@pytest.mark.parametrize("shape", [(2, 512, 16, 8, 128), (1, 300, 32, 8, 128), (2, 128, 8, 8, 64),
                                   (1, 100, 8, 4, 256)])
def test_cuda_matches_cpu(dtype, shape):
    cuda_vs_cpu(*inputs(*shape, dtype=dtype), dtype=dtype)


@needs_cuda
@pytest.mark.parametrize("dtype", list(CUDA_TOL))
@pytest.mark.parametrize("family", list(GEMMA))
@pytest.mark.parametrize("shape", [(2, 256, 8, 4, 256), (1, 300, 16, 8, 512), (2, 64, 4, 1, 6)])
def test_cuda_gemma_rounding_matches_cpu(dtype, family, shape):
    # Gemma 3's and Gemma 4's head_dim 256, Gemma 4's global 512 (vec in 16 bits, element by element in f32),
    # and an odd half row.
    q, k, qw, kw, cos, sin = inputs(*shape, dtype=dtype, packed=True)
    cuda_vs_cpu(q, k, qw, kw, cos, sin, dtype=dtype, rounding=GEMMA[family][0])
    cuda_vs_cpu(q, k, qw.float(), kw.float(), cos, sin, dtype=dtype, rounding=GEMMA[family][0])


@needs_cuda
@pytest.mark.parametrize("x_dtype,w_dtype,c_dtype", [(torch.bfloat16, torch.float32, torch.bfloat16),
                                                     (torch.float16, torch.bfloat16, torch.float32)])
def test_cuda_mixed_dtypes_match_cpu(x_dtype, w_dtype, c_dtype):
    q, k, qw, kw, cos, sin = inputs(2, 200, 16, 8, 128, dtype=x_dtype, w_dtype=w_dtype, packed=True)
    cuda_vs_cpu(q, k, qw, kw, cos.to(c_dtype), sin.to(c_dtype), dtype=torch.bfloat16)


@needs_cuda
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_cuda_strided_inputs_and_transposed_grads(dtype):
    b, s, hq, hk, d = 2, 256, 16, 8, 128
    _, _, qw, kw, cos, sin = inputs(b, s, hq, hk, d, dtype=dtype, packed=True)
    heads = torch.randn(b, s, hq + 2 * hk, d).to(dtype)
    on_gpu = heads.cuda()
    cuda_vs_cpu(heads[:, :, :hq], heads[:, :, hq:hq + hk], qw, kw, cos, sin, dtype=dtype,
                cuda_qk=(on_gpu[:, :, :hq], on_gpu[:, :, hq:hq + hk]), grad_layout="transposed")


@needs_cuda
@pytest.mark.parametrize("dim", [6, 24, 1024])
def test_cuda_element_by_element_variant(dim):
    # Half rows not a whole number of vectors (6, 24 for bf16), or longer than 32 vectors (1024).
    cuda_vs_cpu(*inputs(2, 50, 4, 2, dim, dtype=torch.bfloat16), dtype=torch.bfloat16)


@needs_cuda
def test_cuda_misaligned_views_fall_back_correctly():
    dtype = torch.bfloat16
    b, s, hq, hk, d = 2, 64, 4, 2, 128
    flat = torch.randn(b * s * (hq + hk) * d + 1).to(dtype)
    heads = flat[1:].view(b, s, hq + hk, d)  # 2-byte offset: no 16-byte vectors
    _, _, qw, kw, cos, sin = inputs(b, s, hq, hk, d, dtype=dtype)
    heads_c = flat.cuda()[1:].view(b, s, hq + hk, d)
    qc, kc = heads_c[:, :, :hq], heads_c[:, :, hq:]
    assert qc.data_ptr() % 16 != 0
    out = op(qc, kc, qw.cuda(), kw.cuda(), cos.cuda(), sin.cuda(), EPS)
    ref = op(heads[:, :, :hq], heads[:, :, hq:], qw, kw, cos, sin, EPS)
    for a, r in zip(out, ref):
        torch.testing.assert_close(a.cpu(), r, rtol=2 ** -6, atol=2 ** -5)


@needs_cuda
def test_cuda_beyond_int32_elements():
    # q holds 2^31 + 2^18 elements: every offset past 2^31 needs 64-bit indexing.
    b, s, hq, hk, d = 1, 2 ** 20 + 16, 16, 1, 128
    dtype = torch.bfloat16
    q = torch.randn(b, s, hq, d, device="cuda", dtype=dtype)
    k = torch.randn(b, s, hk, d, device="cuda", dtype=dtype)
    qw, kw = torch.randn(d, device="cuda", dtype=dtype), torch.randn(d, device="cuda", dtype=dtype)
    ang = torch.randn(s, d // 2, device="cuda").repeat(1, 2)
    cos, sin = ang.cos().to(dtype), ang.sin().to(dtype)
    qo, ko, qr, kr = fwd_op(q, k, qw, kw, cos, sin, EPS)
    gq, gk, gqw, gkw = bwd_op(qo, ko, q, k, qw, kw, cos, sin, qr, kr)
    tail = slice(s - 8, s)
    args = [t[:, tail].cpu() for t in (q, k)] + [qw.cpu(), kw.cpu(), cos[tail].cpu(), sin[tail].cpu()]
    ref = fwd_op(*args, EPS)
    torch.testing.assert_close(qo[:, tail].cpu(), ref[0], rtol=2 ** -6, atol=2 ** -5)
    ref_b = bwd_op(qo[:, tail].cpu(), ko[:, tail].cpu(), *args, ref[2], ref[3])
    assert rel_err(gq[:, tail], ref_b[0]) < 1.2e-2
    # The weight gradient sums every row: compare with a float64 sum over all of them, in chunks.
    h = d // 2
    ref_w = torch.zeros(d, dtype=torch.float64, device="cuda")
    for t0 in range(0, s, 2 ** 16):
        t = slice(t0, min(s, t0 + 2 ** 16))
        g, c, sn = qo[:, t].double(), cos[None, t, None].double(), sin[None, t, None].double()
        gn = torch.cat([g[..., :h] * c[..., :h] + g[..., h:] * sn[..., h:],
                        g[..., h:] * c[..., h:] - g[..., :h] * sn[..., :h]], -1)
        n = (q[:, t].float() * qr[:, t, :, None]).to(dtype).double()
        ref_w += (gn * n).sum((0, 1, 2))
    assert rel_err(gqw, ref_w) < 1e-2
