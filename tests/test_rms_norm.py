"""torch.ops.bastile.rms_norm against HF's RMSNorm and an fp64 reference, in both roundings:
Llama/Qwen3's (default) and GPT-OSS's (cast_after_weight=True: the weight multiplies before the cast), and
Gemma's (1 + weight) (weight_offset=1 with cast_after_weight)."""
import types

import pytest
import torch
from transformers.models.gemma3.modeling_gemma3 import Gemma3RMSNorm
from transformers.models.gpt_oss.modeling_gpt_oss import GptOssRMSNorm
from transformers.models.qwen3.modeling_qwen3 import Qwen3RMSNorm

import bastile
from conftest import DEVICES, Contract, needs_cuda, poison_cuda_allocator, rel_err

op = torch.ops.bastile.rms_norm
EPS = 1e-6


HF_FORWARD = Qwen3RMSNorm.forward  # taken before any test patches it
HF_GPT_OSS_FORWARD = GptOssRMSNorm.forward
HF_GEMMA_FORWARD = Gemma3RMSNorm.forward


def hf_gemma_rms_norm(x, w, eps=EPS):
    """HF's Gemma3RMSNorm.forward: to(x.dtype)((1 + weight) * n), in float32."""
    return HF_GEMMA_FORWARD(types.SimpleNamespace(weight=w, eps=eps, _norm=lambda t: Gemma3RMSNorm._norm(
        types.SimpleNamespace(eps=eps), t)), x)


def hf_rms_norm(x, w, eps=EPS, cast_after_weight=False):
    """HF's Qwen3RMSNorm.forward, or GptOssRMSNorm.forward, with the given weight (the independent reference)."""
    forward = HF_GPT_OSS_FORWARD if cast_after_weight else HF_FORWARD
    return forward(types.SimpleNamespace(weight=w, variance_epsilon=eps), x)


def f64_reference(x, w, eps=EPS):
    x64, w64 = x.double(), w.double()
    return w64 * x64 * torch.rsqrt(x64.pow(2).mean(-1, keepdim=True) + eps)


# ---------------------------------------------------------------- the generic tests' contract (test_contract.py)


def samples(device):
    def call(shape, eps=EPS, cast_after_weight=False, seed=0):
        g = torch.Generator().manual_seed(seed)
        x = torch.randn(shape, generator=g).to(device).requires_grad_()
        w = (1 + 0.2 * torch.randn(shape[-1], generator=g)).to(device).requires_grad_()
        return (x, w, eps, cast_after_weight), {}

    gemma = lambda shape: (call(shape, cast_after_weight=True, seed=2)[0] + (1.0,), {})
    return [call((4, 3, 16)), call((7, 5, 24)), call((5, 33), 1e-5, True), call((8,), seed=1), gemma((6, 20))]


def empty(device):
    def call(shape, cast_after_weight=False):
        x = torch.randn(shape, device=device, requires_grad=True)
        return (x, torch.randn(shape[-1], device=device, requires_grad=True), EPS, cast_after_weight), {}

    return [call((0, 32)), call((3, 0, 16), True), call((4, 0))]


f32 = lambda *s: torch.randn(*s)
BAD = [
    (lambda: op(f32(4, 8), f32(7), EPS), "weight must have shape"),
    (lambda: op(f32(4, 8), f32(2, 4), EPS), "weight must have shape"),
    (lambda: op(torch.randint(0, 5, (4, 8)), f32(8), EPS), "x must be float32"),
    (lambda: op(f32(4, 8), torch.ones(8, dtype=torch.int32), EPS), "weight must be float32"),
    (lambda: op(f32(4, 8), torch.randn(8, device="meta"), EPS), "weight is on meta"),
    (lambda: op(torch.tensor(1.0), f32(1), EPS), "at least one dimension"),
    (lambda: torch.ops.bastile.rms_norm_backward(f32(4, 8), f32(4, 8), f32(8), f32(3)), "rstd must be"),
    (lambda: torch.ops.bastile.rms_norm_backward(f32(4, 9), f32(4, 8), f32(8), f32(4)), "grad_y has shape"),
    # With cast_after_weight, grad_y has x's dtype, not promote(x, weight).
    (lambda: torch.ops.bastile.rms_norm_backward(f32(4, 8), f32(4, 8).bfloat16(), f32(8), f32(4), True),
     "grad_y must be BFloat16"),
    (lambda: op(f32(4, 8), f32(8), EPS, False, 1.0), "rms_norm: weight_offset 1 needs cast_after_weight=True"),
]

CONTRACT = Contract(op=op, samples=samples, empty=empty, reference=hf_rms_norm, bad=BAD)


# ---------------------------------------------------------------- CPU and any device


@pytest.mark.parametrize("device", DEVICES)
def test_opcheck_mixed_dtypes_cast_after_weight(device):
    x = torch.randn(6, 256, device=device).bfloat16().requires_grad_()
    w = torch.randn(256, device=device, requires_grad=True)
    torch.library.opcheck(op.default, (x, w, EPS, True))


@pytest.mark.parametrize("dtype,tol", [(torch.float64, 1e-12), (torch.float32, 1e-6)])
@pytest.mark.parametrize("cw", [False, True])
def test_forward_and_backward_match_f64_reference(dtype, tol, cw):
    x = torch.randn(64, 1000, dtype=dtype, requires_grad=True)
    w = torch.randn(1000, dtype=dtype, requires_grad=True)
    y = op(x, w, EPS, cw)
    assert y.dtype == dtype
    g = torch.randn_like(y)
    gx, gw = torch.autograd.grad(y, (x, w), g)
    xr, wr = x.detach().double().requires_grad_(), w.detach().double().requires_grad_()
    yr = f64_reference(xr, wr)
    gxr, gwr = torch.autograd.grad(yr, (xr, wr), g.double())
    assert rel_err(y, yr) < tol and rel_err(gx, gxr) < tol and rel_err(gw, gwr) < tol


@pytest.mark.parametrize("x_dtype,w_dtype", [
    (torch.bfloat16, torch.float32), (torch.float32, torch.bfloat16), (torch.float16, torch.float32),
    (torch.bfloat16, torch.bfloat16), (torch.float16, torch.float16), (torch.float16, torch.bfloat16),
])
@pytest.mark.parametrize("device", DEVICES)
def test_mixed_dtypes_match_hf(x_dtype, w_dtype, device):
    x = torch.randn(16, 256, device=device).to(x_dtype).requires_grad_()
    w = (1 + 0.1 * torch.randn(256, device=device)).to(w_dtype).requires_grad_()
    y = op(x, w, EPS)
    x2, w2 = x.detach().clone().requires_grad_(), w.detach().clone().requires_grad_()
    ref = hf_rms_norm(x2, w2)
    assert y.dtype == ref.dtype
    # At most one ulp apart in each rounding HF makes (to x's dtype, then to y's dtype).
    spacing = {torch.bfloat16: 2 ** -7, torch.float16: 2 ** -10, torch.float32: 2 ** -20}
    torch.testing.assert_close(y, ref, rtol=2 * max(spacing[x_dtype], spacing[y.dtype]), atol=1e-6)
    g = torch.randn_like(y)
    gx, gw = torch.autograd.grad(y, (x, w), g)
    rgx, rgw = torch.autograd.grad(ref, (x2, w2), g)
    assert gx.dtype == x_dtype and gw.dtype == w_dtype
    # HF rounds its intermediates to the 16-bit dtype, we keep f32; a few ulps apart in norm.
    assert rel_err(gx, rgx) < 8 * ulp_of(x_dtype) and rel_err(gw, rgw) < 8 * ulp_of(x_dtype, w_dtype, y.dtype)


def one_rounding_from_hf(y, x, w, hf):
    """y (a norm rounding after its weight) and its gradients for a random upstream g against hf(x, w) in x's
    dtype: one rounding to x's dtype of f32 values that agree to a few f32 ulps (the statistic's summation
    order), so at most one ulp of x's dtype apart; HF's backward runs in f32 too. Returns g and the gradients."""
    x_dtype, w_dtype = x.dtype, w.dtype
    x2, w2 = x.detach().clone().requires_grad_(), w.detach().clone().requires_grad_()
    ref = hf(x2, w2)
    assert y.dtype == ref.dtype == x_dtype  # x's dtype even with an f32 weight
    torch.testing.assert_close(y, ref, rtol=2 * ulp_of(x_dtype) + 2 ** -21, atol=0)
    g = torch.randn_like(y)
    gx, gw = torch.autograd.grad(y, (x, w), g)
    rgx, rgw = torch.autograd.grad(ref, (x2, w2), g)
    assert gx.dtype == x_dtype and gw.dtype == w_dtype
    assert rel_err(gx, rgx) < 2 * ulp_of(x_dtype) + 1e-6 and rel_err(gw, rgw) < 2 * ulp_of(w_dtype) + 1e-6
    return g, gx, gw


# GPT-OSS's rounding, from HF's expression (weight * (x.float() * rsqrt(mean(x.float()^2) + eps))).to(x.dtype):
# the product stays in f32 and only the result is rounded, so y and its gradients follow HF to the
# last rounding, up to f32 summation order.
@pytest.mark.parametrize("x_dtype,w_dtype", [
    (torch.bfloat16, torch.float32), (torch.bfloat16, torch.bfloat16), (torch.float16, torch.float32),
    (torch.float16, torch.float16), (torch.float32, torch.float32), (torch.float32, torch.bfloat16),
])
@pytest.mark.parametrize("device", DEVICES)
def test_cast_after_weight_matches_hf_gpt_oss(x_dtype, w_dtype, device):
    x = (3 * torch.randn(16, 512, device=device)).to(x_dtype).requires_grad_()
    w = (1 + 0.5 * torch.randn(512, device=device)).to(w_dtype).requires_grad_()
    y = op(x, w, EPS, True)
    one_rounding_from_hf(y, x, w, lambda x2, w2: hf_rms_norm(x2, w2, cast_after_weight=True))
    # And the two modes really differ where the rounding differs (a test that could not tell them apart
    # would pass either way).
    if x_dtype != torch.float32:
        assert not torch.equal(y, op(x.detach(), w.detach(), EPS).to(x_dtype))


def test_cast_after_weight_f64_reference_from_hf_expression():
    """fp32 on CPU against HF's GPT-OSS expression evaluated in fp64, forward and both gradients."""
    x = torch.randn(32, 768, requires_grad=True)
    w = (1 + 0.3 * torch.randn(768)).requires_grad_()
    y = op(x, w, EPS, True)
    x64, w64 = x.detach().double().requires_grad_(), w.detach().double().requires_grad_()
    ref = w64 * (x64 * torch.rsqrt(x64.pow(2).mean(-1, keepdim=True) + EPS))
    g = torch.randn_like(y)
    gx, gw = torch.autograd.grad(y, (x, w), g)
    rgx, rgw = torch.autograd.grad(ref, (x64, w64), g.double())
    assert rel_err(y, ref) < 1e-6 and rel_err(gx, rgx) < 1e-6 and rel_err(gw, rgw) < 1e-6


@pytest.mark.parametrize("x_dtype,w_dtype", [
    (torch.bfloat16, torch.bfloat16), (torch.bfloat16, torch.float32), (torch.float16, torch.float16),
    (torch.float32, torch.float32),
])
@pytest.mark.parametrize("device", DEVICES)
def test_offset_matches_hf_gemma(x_dtype, w_dtype, device):
    """Gemma's (1 + w): HF's to its last rounding, forward and gradients, and the fp64 value of its expression."""
    x = (3 * torch.randn(16, 640, device=device)).to(x_dtype).requires_grad_()
    w = (0.5 * torch.randn(640, device=device)).to(w_dtype).requires_grad_()  # Gemma's weights are near 0
    y = op(x, w, EPS, True, 1.0)
    g, gx, gw = one_rounding_from_hf(y, x, w, hf_gemma_rms_norm)
    x64, w64 = x.detach().double().requires_grad_(), w.detach().double().requires_grad_()
    exact = (1 + w64) * x64 * torch.rsqrt(x64.pow(2).mean(-1, keepdim=True) + EPS)
    egx, egw = torch.autograd.grad(exact, (x64, w64), g.double())
    tol = 4 * ulp_of(x_dtype, w_dtype) + 1e-6
    assert rel_err(y, exact) < tol and rel_err(gx, egx) < tol and rel_err(gw, egw) < tol


def test_offset_patch_replaces_gemma_rms_norm():
    m = Gemma3RMSNorm(64, eps=1e-5)
    with torch.no_grad():
        m.weight.normal_()
    x = torch.randn(2, 3, 64).bfloat16()
    torch.testing.assert_close(bastile.roles.norm.norm_forward(bastile.roles.norm.offset_then_cast)(m, x), HF_GEMMA_FORWARD(m, x), rtol=2 ** -7, atol=0)


def test_cast_after_weight_patch_replaces_gpt_oss_rms_norm():
    m = GptOssRMSNorm(64, eps=1e-5)
    with torch.no_grad():
        m.weight.normal_()
    x = torch.randn(2, 3, 64).bfloat16()
    ref = HF_GPT_OSS_FORWARD(m, x)
    y = bastile.roles.norm.norm_forward(bastile.roles.norm.weight_then_cast)(m, x)
    assert y.dtype == torch.bfloat16
    torch.testing.assert_close(y, ref, rtol=2 ** -7, atol=0)


def ulp_of(*dtypes):
    return max({torch.bfloat16: 2 ** -8, torch.float16: 2 ** -11, torch.float32: 2 ** -23}[d] for d in dtypes)


@pytest.mark.parametrize("device", DEVICES)
def test_autocast_leaves_dtypes_as_hf(device):
    dt = torch.bfloat16
    x = torch.randn(8, 64, device=device)
    w = torch.randn(64, device=device)
    with torch.autocast(device, dtype=dt):
        y = op(x.to(dt), w, EPS)
        ref = hf_rms_norm(x.to(dt), w)
        y32 = op(x, w, EPS)
        y_cw = op(x.to(dt), w, EPS, True)
        ref_cw = hf_rms_norm(x.to(dt), w, cast_after_weight=True)
    assert y.dtype == ref.dtype == torch.float32 and y32.dtype == torch.float32
    assert y_cw.dtype == ref_cw.dtype == dt
    torch.testing.assert_close(y, ref, rtol=2 ** -20, atol=1e-6)
    torch.testing.assert_close(y_cw, ref_cw, rtol=2 ** -7, atol=0)


def test_module_and_functional():
    m = bastile.BastileRMSNorm(48, eps=1e-5)
    with torch.no_grad():
        m.weight.normal_()
    x = torch.randn(2, 3, 48)
    hf = Qwen3RMSNorm(48, eps=1e-5)
    hf.load_state_dict(m.state_dict())
    torch.testing.assert_close(m(x), hf(x), rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(bastile.rms_norm(x, m.weight, 1e-5), hf(x), rtol=1e-5, atol=1e-6)


# ---------------------------------------------------------------- CUDA against the CPU reference

HIDDEN = [128, 1000, 1024, 2048, 2560, 3, 4096, 5120, 8192, 16384, 1001, 20000]
TOL = {  # (forward rtol, gradient norm-relative error); the GPU accumulates in f32
    torch.float32: (2e-6, 2e-6),
    torch.float16: (2 ** -9, 2e-3),
    torch.bfloat16: (2 ** -6, 1.2e-2),
}


@needs_cuda
@pytest.mark.parametrize("dtype", list(TOL))
@pytest.mark.parametrize("cols", HIDDEN)
@pytest.mark.parametrize("cw", [False, True])
def test_cuda_matches_cpu(dtype, cols, cw):
    rows = max(3, min(600, 2 ** 20 // cols))
    x = torch.randn(rows, cols).to(dtype)
    w = (1 + 0.2 * torch.randn(cols)).to(dtype)
    g = torch.randn(rows, cols).to(dtype)
    y, rstd = torch.ops.bastile.rms_norm_forward(x, w, EPS, cw)
    gx, gw = torch.ops.bastile.rms_norm_backward(g, x, w, rstd, cw)
    poison_cuda_allocator(64 * rows * cols)
    xc, wc, gc = x.cuda(), w.cuda(), g.cuda()
    yc, rstdc = torch.ops.bastile.rms_norm_forward(xc, wc, EPS, cw)
    poison_cuda_allocator(64 * rows * cols)
    gxc, gwc = torch.ops.bastile.rms_norm_backward(gc, xc, wc, rstdc, cw)
    ftol, gtol = TOL[dtype]
    for t in (yc, rstdc, gxc, gwc):
        assert not t.isnan().any()
    torch.testing.assert_close(rstdc.cpu(), rstd, rtol=2e-6, atol=0)
    torch.testing.assert_close(yc.cpu(), y, rtol=ftol, atol=1e-5)
    assert rel_err(gxc, gx) < gtol and rel_err(gwc, gw) < gtol
    # And against the exact f64 value.
    assert rel_err(yc, f64_reference(x, w)) < 4 * ftol


@needs_cuda
@pytest.mark.parametrize("x_dtype,w_dtype", [(torch.bfloat16, torch.float32), (torch.float32, torch.bfloat16),
                                             (torch.float16, torch.bfloat16), (torch.float16, torch.float32)])
@pytest.mark.parametrize("cw", [False, True])
def test_cuda_mixed_dtypes_match_cpu(x_dtype, w_dtype, cw):
    x, w, g = torch.randn(300, 2048).to(x_dtype), torch.randn(2048).to(w_dtype), torch.randn(300, 2048)
    y, rstd = torch.ops.bastile.rms_norm_forward(x, w, EPS, cw)
    gx, gw = torch.ops.bastile.rms_norm_backward(g.to(y.dtype), x, w, rstd, cw)
    yc, rstdc = torch.ops.bastile.rms_norm_forward(x.cuda(), w.cuda(), EPS, cw)
    gxc, gwc = torch.ops.bastile.rms_norm_backward(g.to(y.dtype).cuda(), x.cuda(), w.cuda(), rstdc, cw)
    assert yc.dtype == y.dtype == (x_dtype if cw else torch.promote_types(x_dtype, w_dtype))
    assert gxc.dtype == x_dtype and gwc.dtype == w_dtype
    torch.testing.assert_close(yc.cpu(), y, rtol=2 ** -7, atol=1e-5)
    assert rel_err(gxc, gx) < 1.2e-2 and rel_err(gwc, gw) < 1.2e-2


@needs_cuda
def test_cuda_misaligned_views_fall_back_correctly():
    base = torch.randn(64 * 1024 + 1, device="cuda", dtype=torch.bfloat16)
    x = base[1:].view(64, 1024)  # 2-byte offset: no 16-byte vectors possible
    w = torch.randn(1024, device="cuda", dtype=torch.bfloat16)
    torch.testing.assert_close(op(x, w, EPS).cpu(), op(x.cpu(), w.cpu(), EPS), rtol=2 ** -7, atol=1e-5)


@needs_cuda
def test_cuda_rows_beyond_int32_elements():
    # 2^31 + 2^20 elements: every offset past 2^31 needs 64-bit indexing.
    rows, cols = 2 ** 17 + 64, 16384
    x = torch.randn(rows, cols, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(cols, device="cuda", dtype=torch.bfloat16)
    y, rstd = torch.ops.bastile.rms_norm_forward(x, w, EPS)
    gx, gw = torch.ops.bastile.rms_norm_backward(y, x, w, rstd)
    tail = slice(rows - 8, rows)
    y_ref, rstd_ref = torch.ops.bastile.rms_norm_forward(x[tail].cpu(), w.cpu(), EPS)
    gx_ref, _ = torch.ops.bastile.rms_norm_backward(y[tail].cpu(), x[tail].cpu(), w.cpu(), rstd_ref)
    torch.testing.assert_close(y[tail].cpu(), y_ref, rtol=2 ** -7, atol=1e-5)
    assert rel_err(gx[tail], gx_ref) < 1.2e-2
    # The weight gradient sums every row; compare with a float64 sum over all of them.
    n = (x.float() * rstd.unsqueeze(-1)).to(torch.bfloat16).double()
    assert rel_err(gw, (y.double() * n).sum(0)) < 1e-2


@needs_cuda
@pytest.mark.parametrize("dtype", list(TOL))
@pytest.mark.parametrize("cols", [1152, 2560, 1001, 21504])  # Gemma 3 1B's and 4B's widths, unaligned, streamed
def test_cuda_offset_matches_cpu_and_hf_gemma(dtype, cols):
    rows = max(3, min(600, 2 ** 20 // cols))
    x = (3 * torch.randn(rows, cols)).to(dtype)
    w = (0.5 * torch.randn(cols)).to(dtype)
    g = torch.randn(rows, cols).to(dtype)
    y, rstd = torch.ops.bastile.rms_norm_forward(x, w, EPS, True, 1.0)
    gx, gw = torch.ops.bastile.rms_norm_backward(g, x, w, rstd, True, 1.0)
    xc, wc, gc = x.cuda(), w.cuda(), g.cuda()
    poison_cuda_allocator(64 * rows * cols)
    yc, rstdc = torch.ops.bastile.rms_norm_forward(xc, wc, EPS, True, 1.0)
    poison_cuda_allocator(64 * rows * cols)
    gxc, gwc = torch.ops.bastile.rms_norm_backward(gc, xc, wc, rstdc, True, 1.0)
    ftol, gtol = TOL[dtype]
    torch.testing.assert_close(yc.cpu(), y, rtol=ftol, atol=1e-5)
    assert rel_err(gxc, gx) < gtol and rel_err(gwc, gw) < gtol
    torch.testing.assert_close(yc, hf_gemma_rms_norm(xc, wc), rtol=ftol, atol=1e-5)


@needs_cuda
@pytest.mark.parametrize("cols", [2880, 4096, 1001])  # GPT-OSS's hidden size, a register-cached one, unaligned
def test_cuda_cast_after_weight_matches_hf_gpt_oss(cols):
    x = (3 * torch.randn(512, cols, device="cuda")).bfloat16().requires_grad_()
    w = (1 + 0.5 * torch.randn(cols, device="cuda")).bfloat16().requires_grad_()
    y = op(x, w, EPS, True)
    x2, w2 = x.detach().clone().requires_grad_(), w.detach().clone().requires_grad_()
    ref = hf_rms_norm(x2, w2, cast_after_weight=True)
    assert y.dtype == ref.dtype == torch.bfloat16
    torch.testing.assert_close(y, ref, rtol=2 ** -7, atol=0)
    g = torch.randn_like(y)
    gx, gw = torch.autograd.grad(y, (x, w), g)
    rgx, rgw = torch.autograd.grad(ref, (x2, w2), g)
    # HF's backward is f32 throughout, as ours: the final roundings and f32 summation order apart.
    assert rel_err(gx, rgx) < 2 ** -7 and rel_err(gw, rgw) < 2 ** -7
