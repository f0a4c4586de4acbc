"""torch.ops.bastile.causal_conv1d against HF's causal_conv1d_fn (Qwen3.5's Gated DeltaNet conv, in its
[batch, channels, seq] layout) and an fp64 reference (F.conv1d with groups = channels, each packed sequence
on its own).

The op computes in f32 on the GPU (f64 on the CPU) and rounds once, where HF rounds after the conv and again
after SiLU: the tight checks are against the exact values, and against HF in the same dtype the op must be at
least as close to them.
"""
import pytest
import torch
import torch.nn.functional as F
from transformers.models.qwen3_5.modeling_qwen3_5 import causal_conv1d_fn

from conftest import DEVICES, Contract, needs_cuda, poison_cuda_allocator, rel_err, ulps

op = torch.ops.bastile.causal_conv1d
backward_op = torch.ops.bastile.causal_conv1d_backward
HALF = [torch.bfloat16, torch.float16]


def hf(x, weight, bias=None, silu=True):
    """HF's causal_conv1d_fn on x [batch, seq, channels], through its [batch, channels, seq] layout."""
    return causal_conv1d_fn(x.transpose(1, 2), weight, bias, activation="silu" if silu else None).transpose(1, 2)


def exact(x, weight, bias=None, cu_seqlens=None, silu=True):
    """In float64: F.conv1d with groups = channels over width - 1 zeros and x, each packed sequence alone."""
    x, weight, bias = x.double(), weight.double(), None if bias is None else bias.double()
    if cu_seqlens is not None:
        cu = cu_seqlens.tolist()
        parts = [exact(x[:, a:b], weight, bias, None, silu) for a, b in zip(cu, cu[1:]) if b > a]
        return torch.cat(parts, 1) if parts else x.new_zeros(x.shape)
    y = F.conv1d(x.transpose(1, 2), weight.unsqueeze(1), bias, padding=weight.shape[1] - 1, groups=x.shape[2])
    y = y[..., : x.shape[1]].transpose(1, 2)
    return F.silu(y) if silu else y


def shifted(x, weight, bias=None, cu_seqlens=None, silu=True):
    """Plain torch with the op's signature: each tap a shifted copy of x, masked before each token's sequence
    start; in promote(x, weight), then x's dtype. It takes any sizes, zero channels included."""
    dtype = torch.promote_types(x.dtype, weight.dtype)
    seq, width = x.shape[1], weight.shape[1]
    t = torch.arange(seq, device=x.device)
    start = torch.zeros_like(t)
    if cu_seqlens is not None:
        cu = cu_seqlens.long()
        start = cu[(torch.searchsorted(cu, t, right=True) - 1).clamp_min(0)]
    y = x.new_zeros(x.shape, dtype=dtype) + (0 if bias is None else bias)
    for k in range(width):
        tap = F.pad(x.to(dtype), (0, 0, k, 0))[:, :seq]  # x[t - k]
        y = y + weight[:, width - 1 - k] * tap * (t - k >= start).to(dtype)[:, None]
    return (F.silu(y) if silu else y).to(x.dtype)


def inputs(shape, width, dtype, device, w_dtype=None, bias=True, seed=0):
    """x, weight, bias: x ~ N(0, 1), weight of nn.Conv1d's init scale (1 / sqrt(width)), a small bias."""
    g = torch.Generator().manual_seed(seed)
    c = shape[-1]
    x = torch.randn(shape, generator=g).to(dtype).to(device)
    w = (torch.randn(c, width, generator=g) / width ** 0.5).to(w_dtype or dtype).to(device)
    b = (0.2 * torch.randn(c, generator=g)).to(w_dtype or dtype).to(device) if bias else None
    return x, w, b


def grads(fn, x, w, b, dy, *args):
    """fn's output and the gradients of x, weight and bias (None without a bias) for dy."""
    leaves = [t.detach().clone().requires_grad_() if t is not None else None for t in (x, w, b)]
    y = fn(*leaves, *args)
    wrt = [t for t in leaves if t is not None]
    got = torch.autograd.grad(y, wrt, dy.to(y.dtype))
    return y.detach(), *got, *([None] if b is None else [])


def ours(x, w, b, dy, cu=None, silu=True):
    return grads(lambda x, w, b: op(x, w, b, cu, silu), x, w, b, dy)


def exacts(x, w, b, dy, cu=None, silu=True):
    return grads(lambda x, w, b: exact(x, w, b, cu, silu), x.double(), w.double(), None if b is None else b.double(),
                 dy.double())


NAMES = ["y", "grad_x", "grad_weight", "grad_bias"]


def assert_exact(got, want, what):
    """got against the float64 value: on the CPU rounded once, so within half an ulp (16-bit through f32: a
    hair more; float32 near 0: the reference's own float64 error), on the GPU from f32 math."""
    assert not got.isnan().any(), what
    if got.dtype == torch.float64:
        assert rel_err(got, want) < 1e-12, what
    elif got.device.type == "cpu":
        err = torch.where((got.double() - want).abs() <= 1e-13, 0, ulps(got, want))
        assert err.max() <= 0.5 + 2 ** -10, f"{what}: {err.max().item():.3f} ulps at {err.argmax().item()}"
    elif got.dtype == torch.float32:
        assert rel_err(got, want) < (1e-6 if what in NAMES[:2] else 1e-5), what
    else:
        assert_rarely_differs(got, want.to(got.dtype), what)


def assert_rarely_differs(got, want, what):
    """got (CUDA, 16-bit) equals want (the value rounded once, or the CPU kernel's) but for a few elements:
    f32 math moves a result across a rounding boundary only near one. Where a sum cancels, f32's error is
    that of its terms, so the few are not always within an ulp: norm-wise within one rounding."""
    want = want.to(got.device)
    differing = (got != want).sum().item()
    assert differing <= 1e-2 * got.numel() + 2, f"{what}: {differing} of {got.numel()} differ"
    assert rel_err(got, want) <= torch.finfo(got.dtype).eps, what


def assert_matches_hf_and_exact(x, w, b, dy, silu=True):
    got = ours(x, w, b, dy, silu=silu)
    want = exacts(x, w, b, dy, silu=silu)
    ref = grads(lambda x, w, b: hf(x, w, b, silu), x, w, b, dy)
    for what, g, e, h in zip(NAMES, got, want, ref):
        if g is None:
            continue
        assert g.dtype == h.dtype and g.shape == h.shape, what
        assert_exact(g, e, what)
        # At least as close to the exact values as HF's own result (on the GPU float32's math is no more
        # accurate than torch's float32 kernels: there both are within 1e-6). Where HF rounds once too (a
        # float32 weight), the two f32 computations may put one element on either side of a rounding boundary.
        if not (x.is_cuda and g.dtype == torch.float32):
            e = e.to(g.device)
            flip = torch.finfo(g.dtype).eps * (e.abs().max() / e.norm()).item() if x.is_cuda else 0.0
            assert rel_err(g, e) <= rel_err(h, e) * (1 + 1e-9) + 1e-15 + flip, what


# ---------------------------------------------------------------- the generic tests' contract (test_contract.py)


def samples(device):
    def call(shape, width=4, bias=True, cu=None, silu=True, seed=0):
        x, w, b = inputs(shape, width, torch.float32, device, bias=bias, seed=seed)
        cu = None if cu is None else torch.tensor(cu, dtype=torch.int32, device=device)
        return (x.requires_grad_(), w.requires_grad_(), b if b is None else b.requires_grad_(), cu, silu), {}

    return [call((2, 7, 6)), call((3, 11, 6)), call((1, 12, 37), 3, cu=[0, 2, 2, 7, 12], seed=1),
            call((2, 5, 9), 2, bias=False, silu=False, seed=2), call((1, 3, 4), 1, seed=3)]


def empty(device):
    def call(shape, width=4, bias=True, cu=None):
        x, w, b = inputs(shape, width, torch.float32, device, bias=bias)
        cu = None if cu is None else torch.tensor(cu, dtype=torch.int64, device=device)
        return (x.requires_grad_(), w.requires_grad_(), b if b is None else b.requires_grad_(), cu, True), {}

    return [call((2, 0, 6)), call((0, 5, 6), 2), call((2, 5, 0)), call((1, 0, 3), bias=False, cu=[0, 0])]


f32 = lambda *s: torch.randn(*s)
cu32 = lambda *v: torch.tensor(v, dtype=torch.int32)
BAD = [
    (lambda: op(f32(8, 6), f32(6, 4)), r"x must have shape \[batch, seq, channels\]"),
    (lambda: op(f32(1, 8, 6), f32(5, 4)), r"weight must have shape \[channels, width\] with channels = 6"),
    (lambda: op(f32(1, 8, 6), f32(6)), r"weight must have shape \[channels, width\]"),
    (lambda: op(f32(1, 8, 6), f32(6, 5)), "weight's width \\(its last dim\\) must be 1 to 4, got 5"),
    (lambda: op(f32(1, 8, 6), f32(6, 0)), "weight's width \\(its last dim\\) must be 1 to 4, got 0"),
    (lambda: op(torch.ones(1, 8, 6, dtype=torch.int32), f32(6, 4)), "causal_conv1d: x must be float32"),
    (lambda: op(f32(1, 8, 6), f32(6, 4), f32(6).half()), "weight and bias must have the same dtype"),
    (lambda: op(f32(1, 8, 6), f32(6, 4), f32(7)), r"bias must have shape \[6\]"),
    (lambda: op(f32(1, 8, 6), f32(6, 4), None, torch.tensor([0.0, 8.0])), "cu_seqlens must be int32 or int64"),
    (lambda: op(f32(1, 8, 6), f32(6, 4), None, cu32(0, 8).view(1, 2)), r"cu_seqlens must have shape \[sequences \+ 1\]"),
    (lambda: op(f32(2, 8, 6), f32(6, 4), None, cu32(0, 8)), "with cu_seqlens, x holds the packed sequences in one row"),
    (lambda: op(f32(1, 8, 6), f32(6, 4), None, cu32(0, 3, 7)), "cu_seqlens must start at 0 and end at seq = 8"),
    (lambda: op(f32(1, 8, 6), f32(6, 4), None, cu32(1, 8)), "cu_seqlens must start at 0 and end at seq = 8"),
    (lambda: op(f32(1, 8, 6), f32(6, 4), None, cu32(0, 5, 3, 8)), "cu_seqlens must not decrease, got 5 then 3"),
    (lambda: op(f32(1, 8, 6), torch.randn(6, 4, device="meta")), "x is on cpu but weight is on meta"),
    (lambda: backward_op(f32(1, 8, 6).half(), f32(1, 8, 6), f32(6, 4)),
     "causal_conv1d_backward: x and grad_y must have the same dtype"),
    (lambda: backward_op(f32(1, 7, 6), f32(1, 8, 6), f32(6, 4)), "causal_conv1d_backward: x and grad_y must have the same shape"),
    (lambda: backward_op(f32(1, 8, 6), f32(1, 8, 6), f32(6, 4), None, cu32(0, 9)),
     "causal_conv1d_backward: cu_seqlens must start at 0 and end at seq = 8"),
]

CONTRACT = Contract(op=op, samples=samples, empty=empty, reference=shifted, bad=BAD)


# ---------------------------------------------------------------- CPU and any device


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("width", [1, 2, 3, 4])
@pytest.mark.parametrize("bias,silu", [(True, True), (False, True), (True, False)])
def test_matches_hf_and_f64_reference(dtype, device, width, bias, silu):
    # Odd channels (the scalar kernels on the GPU) and a multiple of 8 (the vector ones).
    for shape in [(2, 33, 37), (1, 70, 64)]:
        x, w, b = inputs(shape, width, dtype, device, bias=bias, seed=width)
        dy = torch.randn(shape, generator=torch.Generator().manual_seed(9)).to(dtype).to(device)
        assert_matches_hf_and_exact(x, w, b, dy, silu)


@pytest.mark.parametrize("width", [1, 4])
def test_fp64_is_exact_math(width):
    x, w, b = inputs((2, 40, 12), width, torch.float64, "cpu")
    dy = torch.randn(x.shape, dtype=torch.float64)
    for what, got, want in zip(NAMES, ours(x, w, b, dy), exacts(x, w, b, dy)):
        assert rel_err(got, want) < 1e-13, what


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("x_dtype,w_dtype", [(torch.bfloat16, torch.float32), (torch.float16, torch.float32),
                                             (torch.float32, torch.bfloat16), (torch.bfloat16, torch.float16)])
def test_mixed_dtypes(x_dtype, w_dtype, device):
    # As a model in bf16 with its conv kept in float32: y and grad_x in x's dtype, the weight's in its own.
    x, w, b = inputs((2, 50, 40), 4, x_dtype, device, w_dtype)
    dy = torch.randn(x.shape, generator=torch.Generator().manual_seed(3)).to(x_dtype).to(device)
    y, gx, gw, gb = ours(x, w, b, dy)
    assert (y.dtype, gx.dtype, gw.dtype, gb.dtype) == (x_dtype, x_dtype, w_dtype, w_dtype)
    assert_matches_hf_and_exact(x, w, b, dy)


@pytest.mark.parametrize("device", DEVICES)
def test_rounds_once(device):
    # bf16, where HF's result (rounded after the conv and after SiLU) differs from the exact value rounded
    # once, which the op returns.
    x, w, b = inputs((2, 256, 64), 4, torch.bfloat16, device)
    y = op(x, w, b)
    e = exact(x, w, b).to(torch.bfloat16)
    assert (hf(x, w, b) != e.to(device)).double().mean() > 0.05
    if device == "cpu":
        assert torch.equal(y, e)
    else:
        assert_rarely_differs(y, e, "y")


def packed_case(device, dtype=torch.float32, int64=False, seed=0):
    """One row of 40 tokens packing sequences of 0 (first, between and last), 1, 2 (shorter than the conv),
    3, 9 and 25 tokens; x, weight, bias, dy and cu_seqlens."""
    cu = torch.tensor([0, 0, 1, 3, 3, 12, 15, 40, 40], dtype=torch.int64 if int64 else torch.int32, device=device)
    x, w, b = inputs((1, 40, 21), 4, dtype, device, seed=seed)
    dy = torch.randn(x.shape, generator=torch.Generator().manual_seed(seed + 1)).to(dtype).to(device)
    return x, w, b, dy, cu


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_packed_equals_sequences_run_alone(dtype, device):
    x, w, b, dy, cu = packed_case(device, dtype)
    y, gx, gw, gb = ours(x, w, b, dy, cu)
    bounds = cu.tolist()
    sw, sb = torch.zeros_like(gw, dtype=torch.float64), torch.zeros_like(gb, dtype=torch.float64)
    for s, e in zip(bounds, bounds[1:]):
        if e == s:
            continue
        ay, agx, agw, agb = ours(x[:, s:e], w, b, dy[:, s:e])
        # Token by token the same arithmetic: equal to the bit.
        assert torch.equal(y[:, s:e], ay) and torch.equal(gx[:, s:e], agx), (s, e)
        sw += agw.double()
        sb += agb.double()
    # The weight and bias gradients sum the sequences' (each rounded alone, here).
    tol = 2 ** -7 if dtype == torch.bfloat16 else 1e-5
    assert rel_err(gw, sw) < tol and rel_err(gb, sb) < tol
    for what, got, want in zip(NAMES, (y, gx, gw, gb), exacts(x, w, b, dy, cu)):
        assert_exact(got, want, what)


@pytest.mark.parametrize("device", DEVICES)
def test_cu_seqlens_int64_as_int32(device):
    a = ours(*packed_case(device, int64=False))
    b = ours(*packed_case(device, int64=True))
    for what, x, y in zip(NAMES, a, b):
        assert torch.equal(x, y), what


def test_packed_differs_from_unpacked_near_boundaries():
    """The conv restarts at each sequence: within W - 1 tokens of a start the packed row differs from the
    unpacked one, further in it is the same."""
    x, w, b, _, cu = packed_case("cpu")
    packed, whole = op(x, w, b, cu), op(x, w, b)
    near = [1, 2, 3, 4, 5, 12, 13, 14, 15, 16, 17]  # cu: 0, 0, 1, 3, 3, 12, 15, 40, 40
    assert all(not torch.equal(packed[:, t], whole[:, t]) for t in near)
    assert all(torch.equal(packed[:, t], whole[:, t]) for t in [0, 6, 11, 18, 39])


def test_saves_only_inputs():
    x, w, b, _, cu = packed_case("cpu")
    leaves = [t.requires_grad_() for t in (x, w, b)]
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        op(*leaves, cu)
    assert sorted(t.data_ptr() for t in saved) == sorted(t.data_ptr() for t in (x, w, b, cu))


def test_without_bias():
    """With no bias the conv is that with a zero bias, and the backward op still returns the bias gradient
    (the sum of dpre over tokens), which autograd drops."""
    x, w, _ = inputs((2, 9, 5), 3, torch.float32, "cpu", bias=False)
    zero = torch.zeros(5, requires_grad=True)
    y0 = op(x, w, zero)
    assert torch.equal(op(x, w), y0.detach())
    dy = torch.randn_like(y0)
    _, _, gb = backward_op(dy, x, w)
    assert torch.equal(gb, torch.autograd.grad(y0, zero, dy)[0])
    leaves = [x.requires_grad_(), w.requires_grad_()]
    assert len(torch.autograd.grad(op(*leaves), leaves, dy)) == 2


@pytest.mark.parametrize("device", DEVICES)
def test_autocast_leaves_dtypes_alone(device):
    x, w, b = inputs((2, 16, 32), 4, torch.float32, device)
    with torch.autocast(device, dtype=torch.bfloat16):
        y = op(x, w, b)
        y16 = op(x.bfloat16(), w, b)
    assert y.dtype == torch.float32 and y16.dtype == torch.bfloat16
    assert torch.equal(y, op(x, w, b))


# ---------------------------------------------------------------- CUDA against the CPU kernels


def assert_cuda_matches_cpu(got, want, what):
    """The CPU kernels' results are the exact values rounded once; the GPU's come from f32 math."""
    assert got.is_cuda and got.dtype == want.dtype and got.shape == want.shape and not got.isnan().any(), what
    if got.dtype in HALF:
        assert_rarely_differs(got, want, what)
    else:
        assert rel_err(got, want) < (1e-6 if what in NAMES[:2] else 1e-5), what


def cuda_vs_cpu(x, w, b, dy, cu=None, silu=True):
    """Forward and backward ops on the CPU copies and on the given CUDA tensors (outputs poisoned)."""
    cpu = lambda t: None if t is None else t.cpu()
    want = (op(cpu(x), cpu(w), cpu(b), cpu(cu), silu), *backward_op(cpu(dy), cpu(x), cpu(w), cpu(b), cpu(cu), silu))
    poison_cuda_allocator(16 * x.numel())
    y = op(x, w, b, cu, silu)
    poison_cuda_allocator(16 * x.numel())
    got = (y, *backward_op(dy, x, w, b, cu, silu))
    for what, g, e in zip(NAMES, got, want):
        assert_cuda_matches_cpu(g, e, what)


@needs_cuda
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("shape,width", [((1, 4096, 8192), 4), ((2, 777, 8192), 4), ((2, 77, 37), 4),
                                         ((3, 5, 6), 3), ((4, 130, 64), 2), ((1, 3, 16), 4), ((2, 50, 24), 1)])
def test_cuda_matches_cpu(dtype, shape, width):
    # Qwen3.5-9B's conv (8192 channels over 4096 tokens), ragged token counts, odd channels (scalar
    # kernels), sequences shorter than the conv.
    x, w, b = inputs(shape, width, dtype, "cuda")
    dy = torch.randn(shape, device="cuda").to(dtype)
    cuda_vs_cpu(x, w, b, dy)


@needs_cuda
@pytest.mark.parametrize("silu,bias", [(False, True), (True, False)])
def test_cuda_without_silu_or_bias(silu, bias):
    x, w, b = inputs((2, 300, 256), 4, torch.bfloat16, "cuda", bias=bias)
    cuda_vs_cpu(x, w, b, torch.randn_like(x), silu=silu)


@needs_cuda
@pytest.mark.parametrize("x_dtype,w_dtype", [(torch.bfloat16, torch.float32), (torch.float16, torch.bfloat16),
                                             (torch.float32, torch.float16)])
def test_cuda_mixed_dtypes(x_dtype, w_dtype):
    x, w, b = inputs((2, 500, 1024), 4, x_dtype, "cuda", w_dtype)
    cuda_vs_cpu(x, w, b, torch.randn_like(x))


@needs_cuda
@pytest.mark.parametrize("int64", [False, True])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_cuda_packed(dtype, int64):
    x, w, b, dy, cu = packed_case("cuda", dtype, int64)
    cuda_vs_cpu(x, w, b, dy, cu)
    # Many sequences over long tiles: boundaries inside tiles, at their first token and in their halos.
    lengths = torch.randint(0, 70, (120,), generator=torch.Generator().manual_seed(0))
    cu = torch.cat([torch.zeros(1, dtype=torch.long), lengths.cumsum(0)]).to(torch.int64 if int64 else torch.int32)
    x, w, b = inputs((1, int(cu[-1]), 2048), 4, dtype, "cuda")
    cuda_vs_cpu(x, w, b, torch.randn_like(x), cu.cuda())


@needs_cuda
@pytest.mark.parametrize("which", ["x", "grad_y", "both"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_cuda_misaligned_views(dtype, which):
    # A view one element into its buffer is contiguous but not aligned for vectors: the scalar kernels run.
    shape = (2, 300, 512)
    n = shape[0] * shape[1] * shape[2]
    base_x, base_g = torch.randn(n + 1, device="cuda").to(dtype), torch.randn(n + 1, device="cuda").to(dtype)
    x = (base_x[1:] if which in ("x", "both") else base_x[:-1]).view(shape)
    dy = (base_g[1:] if which in ("grad_y", "both") else base_g[:-1]).view(shape)
    _, w, b = inputs(shape, 4, dtype, "cuda")
    cuda_vs_cpu(x, w, b, dy)


@needs_cuda
@pytest.mark.parametrize("pad", [8, 1])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_cuda_strided_rows(dtype, pad):
    # x and grad_y as slices of wider rows (a fused projection's columns): read in place, with vectors when
    # the row stride allows them (pad 8), single channels when not (pad 1).
    shape = (2, 300, 1024)
    wide = lambda: torch.randn(shape[0], shape[1], shape[2] + pad, device="cuda").to(dtype)[..., pad:]
    x, dy = wide(), wide()
    assert not x.is_contiguous() and x.stride(-1) == 1
    _, w, b = inputs(shape, 4, dtype, "cuda")
    cuda_vs_cpu(x, w, b, dy)
    # A transposed view ([batch, channels, seq] memory, HF's layout) has no unit channel stride: copied.
    t = torch.randn(shape[0], shape[2], shape[1], device="cuda").to(dtype).transpose(1, 2)
    cuda_vs_cpu(t, w, b, dy)


@needs_cuda
def test_cuda_backward_is_deterministic():
    x, w, b = inputs((1, 4096, 8192), 4, torch.bfloat16, "cuda", torch.float32)
    dy = torch.randn_like(x)
    first = backward_op(dy, x, w, b)
    for _ in range(3):
        for got, want in zip(backward_op(dy, x, w, b), first):
            assert torch.equal(got, want)


@needs_cuda
def test_cuda_invalid_cu_seqlens_stay_in_bounds():
    """CUDA reads cu_seqlens on the device with no check (a check would sync with the host): offsets out of
    range or out of order give unspecified values but no out-of-bounds access (compute-sanitizer runs this)."""
    x, w, b = inputs((1, 100, 64), 4, torch.bfloat16, "cuda")
    for cu in [[0, 1000, -5, 100], [50, 20, 100, 7], [-3, 200], [0, 50]]:
        cu = torch.tensor(cu, dtype=torch.int32, device="cuda")
        y = op(x, w, b, cu)
        grads = backward_op(torch.ones_like(y), x, w, b, cu)
        torch.cuda.synchronize()
        assert all(t.isfinite().all() for t in (y, *grads))


@needs_cuda
def test_cuda_refuses_float64():
    x, w, b = inputs((1, 8, 16), 4, torch.float64, "cuda")
    with pytest.raises(RuntimeError, match="causal_conv1d: float64 is supported on CPU only"):
        op(x, w, b)
