"""torch.ops.bastile.rms_norm_gated against HF's Qwen3_5RMSNormGated (Qwen3.5's Gated DeltaNet output norm) and
an fp64 reference. The op rounds n = x * rstd to x's dtype where HF does and y once, where HF also rounds
weight * n to promote(x, weight) before the gate: against HF in the same dtype it must be at least as close
to the fp64 values."""
import types

import pytest
import torch
import torch.nn.functional as F
from transformers.models.qwen3_5.modeling_qwen3_5 import Qwen3_5RMSNormGated

from conftest import DEVICES, Contract, needs_cuda, poison_cuda_allocator, rel_err

op = torch.ops.bastile.rms_norm_gated
forward_op = torch.ops.bastile.rms_norm_gated_forward
backward_op = torch.ops.bastile.rms_norm_gated_backward
EPS = 1e-6

HF_FORWARD = Qwen3_5RMSNormGated.forward  # taken before any test patches it


def hf(x, z, w, eps=EPS):
    """HF's Qwen3_5RMSNormGated.forward with the given weight (the independent reference)."""
    return HF_FORWARD(types.SimpleNamespace(weight=w, variance_epsilon=eps, activation="silu"), x, z)


def f64_reference(x, z, w, eps=EPS):
    x, z, w = x.double(), z.double(), w.double()
    return w * x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * F.silu(z)


def inputs(shape, x_dtype, w_dtype=None, device="cpu", seed=0):
    """x ~ N(0, 1), z ~ 3 N(0, 1) (the gate's curved range and its flat ends), weight ~ 1 + 0.2 N(0, 1) and
    dy ~ N(0, 1), of x_dtype (the weight's w_dtype)."""
    g = torch.Generator().manual_seed(seed)
    x, z = torch.randn(shape, generator=g), 3 * torch.randn(shape, generator=g)
    w, dy = 1 + 0.2 * torch.randn(shape[-1], generator=g), torch.randn(shape, generator=g)
    return (x.to(x_dtype).to(device), z.to(x_dtype).to(device), w.to(w_dtype or x_dtype).to(device),
            dy.to(x_dtype).to(device))


def grads(fn, x, z, w, dy):
    """fn(x, z, w) and its gradients for dy, through autograd, in the inputs' dtypes."""
    x, z, w = (t.detach().clone().requires_grad_() for t in (x, z, w))
    y = fn(x, z, w)
    return (y.detach(), *torch.autograd.grad(y, (x, z, w), dy.to(y.dtype)))


# ---------------------------------------------------------------- the generic tests' contract (test_contract.py)


def samples(device):
    def call(shape, eps=EPS, seed=0):
        x, z, w, _ = inputs(shape, torch.float32, device=device, seed=seed)
        return (x.requires_grad_(), z.requires_grad_(), w.requires_grad_(), eps), {}

    return [call((4, 3, 16)), call((7, 5, 24)), call((5, 33), 1e-5, seed=1), call((8,), seed=2), call((2, 1), seed=3)]


def empty(device):
    def call(shape):
        x, z, w, _ = inputs(shape, torch.float32, device=device)
        return (x.requires_grad_(), z.requires_grad_(), w.requires_grad_(), EPS), {}

    return [call((0, 32)), call((3, 0, 16)), call((4, 0))]


f32 = lambda *s: torch.randn(*s)
BAD = [
    (lambda: op(f32(4, 8), f32(4, 8), f32(7), EPS), "rms_norm_gated: weight must have shape \\[8\\]"),
    (lambda: op(f32(4, 8), f32(4, 8), f32(2, 4), EPS), "weight must have shape"),
    (lambda: op(f32(4, 8), f32(4, 9), f32(8), EPS), "rms_norm_gated: x and z must have the same shape"),
    (lambda: op(f32(4, 8), f32(8), f32(8), EPS), "x and z must have the same shape"),
    (lambda: op(f32(4, 8), f32(4, 8).bfloat16(), f32(8), EPS), "x and z must have the same dtype"),
    (lambda: op(torch.randint(0, 5, (4, 8)), f32(4, 8), f32(8), EPS), "rms_norm_gated: x must be float32"),
    (lambda: op(f32(4, 8), torch.ones(4, 8, dtype=torch.int32), f32(8), EPS), "z must be float32"),
    (lambda: op(f32(4, 8), f32(4, 8), torch.ones(8, dtype=torch.int32), EPS), "weight must be float32"),
    (lambda: op(f32(4, 8), torch.randn(4, 8, device="meta"), f32(8), EPS), "x is on cpu but z is on meta"),
    (lambda: op(f32(4, 8), f32(4, 8), torch.randn(8, device="meta"), EPS), "weight is on meta"),
    (lambda: op(torch.tensor(1.0), torch.tensor(1.0), f32(1), EPS), "x must have at least one dimension"),
    (lambda: backward_op(f32(4, 8), f32(4, 8), f32(4, 8), f32(8), f32(3)),
     "rms_norm_gated_backward: rstd must be the statistics"),
    (lambda: backward_op(f32(4, 8), f32(4, 8), f32(4, 8), f32(8), f32(4).double()), "rstd must be the statistics"),
    (lambda: backward_op(f32(4, 9), f32(4, 8), f32(4, 8), f32(8), f32(4)),
     "rms_norm_gated_backward: x and grad_y must have the same shape"),
    (lambda: backward_op(f32(4, 8).half(), f32(4, 8), f32(4, 8), f32(8), f32(4)), "x and grad_y must have the same dtype"),
]

CONTRACT = Contract(op=op, samples=samples, empty=empty, reference=hf, bad=BAD)


# ---------------------------------------------------------------- CPU and any device

DTYPES = [torch.float32, torch.bfloat16, torch.float16]
# The dtype's unit roundoff (f32's for f64 x in the GPU's f32 arithmetic is not used: f64 runs on the CPU only).
UNIT = {torch.float64: 2 ** -53, torch.float32: 2 ** -24, torch.bfloat16: 2 ** -8, torch.float16: 2 ** -11}
PAIRS = [(torch.float32, torch.float32), (torch.bfloat16, torch.bfloat16), (torch.float16, torch.float16),
         (torch.bfloat16, torch.float32), (torch.float16, torch.float32), (torch.float32, torch.bfloat16),
         (torch.float16, torch.bfloat16)]


@pytest.mark.parametrize("x_dtype,w_dtype", PAIRS)
@pytest.mark.parametrize("device", DEVICES)
def test_matches_hf_and_f64_reference(x_dtype, w_dtype, device):
    x, z, w, dy = inputs((48, 128), x_dtype, w_dtype, device)
    got = grads(lambda *a: op(*a, EPS), x, z, w, dy)
    ref = grads(hf, x, z, w, dy)
    exact = grads(f64_reference, *(t.double() for t in (x, z, w, dy)))
    assert got[0].dtype == ref[0].dtype == x_dtype
    assert [g.dtype for g in got[1:]] == [x_dtype, x_dtype, w_dtype]
    # HF's y rounds w * n to promote(x, w) before the gate, which the op does not: that rounding and the final
    # one apart, at most. The GPU's f32 arithmetic and MUFU sigmoid are a few f32 ulps off (8 at most).
    u = max(UNIT[x_dtype], UNIT[w_dtype], 2 ** -21 if device == "cuda" else 0)
    torch.testing.assert_close(got[0], ref[0], rtol=4 * u, atol=1e-6)
    for what, g, r, e in zip(("y", "grad_x", "grad_z", "grad_w"), got, ref, exact):
        # HF rounds its intermediates to 16 bits, the op keeps f32 (f64 on the CPU): a few ulps apart, norm-wise.
        assert rel_err(g, r) < 8 * u, what
        assert rel_err(g, e) < 4 * u, what
        # At least as close to the exact values as HF (on CUDA, in float32, both are f32 arithmetic: within 1e-6).
        assert rel_err(g, e) <= rel_err(r, e) * (1 + 1e-3) + (1e-6 if g.is_cuda else 0), what


def test_f64_is_exact_math():
    x, z, w, dy = inputs((16, 300), torch.float64)
    for what, got, want in zip(("y", "grad_x", "grad_z", "grad_w"), grads(lambda *a: op(*a, EPS), x, z, w, dy),
                               grads(f64_reference, x, z, w, dy)):
        assert got.dtype == torch.float64 and rel_err(got, want) < 1e-13, what


@pytest.mark.parametrize("device", DEVICES)
def test_rstd_is_f32_statistics(device):
    x, z, w, _ = inputs((6, 3, 128), torch.bfloat16, device=device)
    y, rstd = forward_op(x, z, w, EPS)
    assert rstd.dtype == torch.float32 and rstd.shape == (6, 3)
    want = torch.rsqrt(x.double().pow(2).mean(-1) + EPS)
    assert rel_err(rstd, want) < 2e-6  # rsqrt of an f32 sum (the GPU's approximate: 2 ulps)
    assert torch.equal(y, op(x, z, w, EPS))


@pytest.mark.parametrize("device", DEVICES)
def test_strided_gate_is_read_in_place(device):
    """z as a slice of a fused projection (a row stride, unit last stride; read in place) and with a last stride
    of 3 (copied first): the values of a contiguous z."""
    x, _, w, dy = inputs((2, 9, 4, 64), torch.bfloat16, torch.float32, device)
    fused = 3 * torch.randn(2, 9, 4, 3 * 64, device=device).bfloat16()
    for z in (fused[..., 64:128], fused[..., ::3]):
        assert not z.is_contiguous()
        got = grads(lambda *a: op(*a, EPS), x, z, w, dy)
        want = grads(lambda *a: op(*a, EPS), x, z.contiguous(), w, dy)
        for g, r in zip(got, want):
            assert torch.equal(g, r)


@pytest.mark.parametrize("device", DEVICES)
def test_saves_inputs_and_rstd_only(device):
    x, z, w, _ = inputs((4, 32), torch.float32, device=device)
    x, z, w = (t.requires_grad_() for t in (x, z, w))
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        op(x, z, w, EPS)
    assert [t.data_ptr() for t in saved[:3]] == [x.data_ptr(), z.data_ptr(), w.data_ptr()]
    assert len(saved) == 4 and saved[3].shape == (4,)


@pytest.mark.parametrize("device", DEVICES)
def test_autocast_leaves_dtypes_as_hf(device):
    x, z, w, _ = inputs((8, 64), torch.float32, device=device)
    with torch.autocast(device, dtype=torch.bfloat16):
        y32, ref32 = op(x, z, w, EPS), hf(x, z, w)
        y16 = op(x.bfloat16(), z.bfloat16(), w, EPS)
    assert y32.dtype == ref32.dtype == torch.float32 and y16.dtype == torch.bfloat16
    assert rel_err(y32, ref32) < 1e-6


def test_module_forward_matches():
    """A Qwen3_5RMSNormGated module's own forward (weight and eps from the module) and the op, in bf16."""
    m = Qwen3_5RMSNormGated(128, eps=1e-6).to(torch.bfloat16)
    with torch.no_grad():
        m.weight.normal_(1, 0.2)
    x, z, _, _ = inputs((2, 5, 4, 128), torch.bfloat16)
    torch.testing.assert_close(op(x, z, m.weight, m.variance_epsilon), m(x, z), rtol=2 ** -6, atol=1e-6)


# ---------------------------------------------------------------- CUDA against the CPU kernels

# (forward rtol, gradient norm-relative error) of CUDA against the CPU kernels: f32 arithmetic and the MUFU
# sigmoid against f64, each result rounded once.
TOL = {torch.float32: (2e-6, 2e-6), torch.float16: (2 ** -9, 2e-3), torch.bfloat16: (2 ** -6, 1.2e-2)}
# Qwen3.5's head_v_dim (rows: 4096 tokens x 32 heads), odd and unaligned widths, register-cached and streamed ones.
SHAPES = [(131072, 128), (4099, 128), (777, 3), (600, 1000), (300, 1001), (256, 4096), (100, 9000), (40, 20000)]


def assert_cuda_matches_cpu(x, z, w, dy, dtype):
    """Forward and backward ops on CUDA (x, z, w, dy there) against the CPU kernels on the same values."""
    cpu = [t.cpu() for t in (x, z, w, dy)]
    y, rstd = forward_op(*cpu[:3], EPS)
    gx, gz, gw = backward_op(cpu[3], *cpu[:3], rstd)
    poison_cuda_allocator(16 * x.numel() * x.element_size())
    yc, rstdc = forward_op(x, z, w, EPS)
    poison_cuda_allocator(16 * x.numel() * x.element_size())
    gxc, gzc, gwc = backward_op(dy, x, z, w, rstdc)
    for t in (yc, rstdc, gxc, gzc, gwc):
        assert t.is_cuda and not t.isnan().any()
    ftol, gtol = TOL[dtype]
    torch.testing.assert_close(rstdc.cpu(), rstd, rtol=2e-6, atol=0)
    torch.testing.assert_close(yc.cpu(), y, rtol=ftol, atol=1e-5)
    for what, got, want in (("grad_x", gxc, gx), ("grad_z", gzc, gz), ("grad_w", gwc, gw)):
        assert got.dtype == want.dtype and rel_err(got, want) < gtol, what
    assert rel_err(yc, f64_reference(*cpu[:3])) < 4 * ftol


@needs_cuda
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", SHAPES)
def test_cuda_matches_cpu(dtype, shape):
    x, z, w, dy = inputs(shape, dtype, device="cuda")
    assert_cuda_matches_cpu(x, z, w, dy, dtype)


@needs_cuda
@pytest.mark.parametrize("x_dtype,w_dtype", [p for p in PAIRS if p[0] != p[1]])
@pytest.mark.parametrize("cols", [128, 1001])
def test_cuda_mixed_dtypes_match_cpu(x_dtype, w_dtype, cols):
    x, z, w, dy = inputs((2048, cols), x_dtype, w_dtype, "cuda")
    assert_cuda_matches_cpu(x, z, w, dy, x_dtype)


@needs_cuda
@pytest.mark.parametrize("which", ["x", "z", "grad_y", "weight"])
def test_cuda_misaligned_inputs_take_the_scalar_kernels(which):
    """A tensor starting one element past a 16-byte boundary: no 16-byte vectors, the same values."""
    rows, cols = 512, 128
    t = dict(zip(("x", "z", "weight", "grad_y"), inputs((rows, cols), torch.bfloat16, device="cuda")))
    shifted = torch.empty(t[which].numel() + 1, device="cuda", dtype=torch.bfloat16)[1:].view(t[which].shape)
    shifted.copy_(t[which])
    t[which] = shifted
    assert_cuda_matches_cpu(t["x"], t["z"], t["weight"], t["grad_y"], torch.bfloat16)


@needs_cuda
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("width", [2 * 128, 128 + 1, 3 * 128])
def test_cuda_strided_gate(dtype, width):
    """z as the last 128 of a wider last dimension, [B, T, H, width]: read in place, in 16-byte vectors where
    its start and row stride allow them (2 * 128, 3 * 128), else single elements (129)."""
    x, _, w, dy = inputs((4, 257, 8, 128), dtype, torch.float32, "cuda")
    fused = 3 * torch.randn(4, 257, 8, width, device="cuda").to(dtype)
    z = fused[..., width - 128:]
    assert not z.is_contiguous()
    assert_cuda_matches_cpu(x, z, w, dy, dtype)


@needs_cuda
@pytest.mark.parametrize("x_dtype,w_dtype", [(torch.bfloat16, torch.bfloat16), (torch.bfloat16, torch.float32)])
def test_cuda_autograd_matches_hf(x_dtype, w_dtype):
    """Qwen3.5's layout, [B, T, Hv, 128], through autograd on CUDA against HF's module and the fp64 values."""
    x, z, w, dy = inputs((2, 1024, 32, 128), x_dtype, w_dtype, "cuda")
    got = grads(lambda *a: op(*a, EPS), x, z, w, dy)
    ref = grads(hf, x, z, w, dy)
    exact = grads(f64_reference, *(t.double() for t in (x, z, w, dy)))
    u = max(UNIT[x_dtype], UNIT[w_dtype])
    torch.testing.assert_close(got[0], ref[0], rtol=4 * u, atol=1e-6)
    for what, g, r, e in zip(("y", "grad_x", "grad_z", "grad_w"), got, ref, exact):
        assert rel_err(g, r) < 8 * u and rel_err(g, e) < 4 * u, what
        assert rel_err(g, e) <= rel_err(r, e) * (1 + 1e-3) + 1e-6, what


@needs_cuda
def test_cuda_rows_beyond_int32_elements():
    # 2^31 + 2^13 elements: every offset past 2^31 needs 64-bit indexing.
    rows, cols = 2 ** 24 + 64, 128
    x = torch.randn(rows, cols, device="cuda", dtype=torch.bfloat16)
    z = 3 * torch.randn(rows, cols, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(cols, device="cuda", dtype=torch.bfloat16)
    y, rstd = forward_op(x, z, w, EPS)
    gx, gz, gw = backward_op(y, x, z, w, rstd)
    tail = slice(rows - 8, rows)
    y_ref, rstd_ref = forward_op(x[tail].cpu(), z[tail].cpu(), w.cpu(), EPS)
    gx_ref, gz_ref, _ = backward_op(y[tail].cpu(), x[tail].cpu(), z[tail].cpu(), w.cpu(), rstd_ref)
    torch.testing.assert_close(y[tail].cpu(), y_ref, rtol=2 ** -6, atol=1e-5)
    assert rel_err(gx[tail], gx_ref) < 1.2e-2 and rel_err(gz[tail], gz_ref) < 1.2e-2
    # The weight gradient sums every row: against a float64 sum over all of them, a chunk at a time.
    want = torch.zeros(cols, dtype=torch.float64, device="cuda")
    for i in range(0, rows, 2 ** 20):
        part = slice(i, i + 2 ** 20)
        n = (x[part].float() * rstd[part].unsqueeze(-1)).to(torch.bfloat16).double()
        want += (y[part].double() * F.silu(z[part].double()) * n).sum(0)
    assert rel_err(gw, want) < 1e-2
