"""torch.ops.bastile.geglu against HF GptOssExperts._apply_gate and an fp64 reference.

The op rounds once (math in f32 on the GPU, f64 on the CPU) where HF rounds after every op, so the
tight checks are against the exact values; against HF in the same dtype the op must be at least as
close to them, and the clamp masks must agree exactly.
"""
import inspect
from types import SimpleNamespace

import pytest
import torch
from transformers import GptOssConfig
from transformers.models.gpt_oss.modeling_gpt_oss import GptOssExperts

import bastile
from conftest import CUDA, DEVICES, Contract, assert_row_dots, needs_cuda, poison_cuda_allocator, rel_err, ulps

op = torch.ops.bastile.geglu


def backward_op(*args, **kwargs):
    """geglu_backward's gradient of gate_up, without the rows' dots."""
    return torch.ops.bastile.geglu_backward(*args, **kwargs)[0]

ALPHA, LIMIT = 1.702, 7.0


def _clamp_passes_at_bounds() -> bool:
    """torch's own rule at a clamp's bound: the gradient passes (through 2.11) or stops (newer releases)."""
    x = torch.ones(1, dtype=torch.float64, requires_grad=True)
    return torch.autograd.grad(x.clamp(max=1.0), x)[0].item() == 1.0


AT_BOUNDS = _clamp_passes_at_bounds()
DTYPES = [torch.bfloat16, torch.float16, torch.float32]
HALF = [torch.bfloat16, torch.float16]


def hf(gate_up, alpha=ALPHA, limit=LIMIT, bias=None, expert=None):
    """transformers' own GptOssExperts._apply_gate on gate_up (plus each row's expert's bias, as HF adds it)."""
    if bias is not None:
        gate_up = gate_up + bias[expert].view(gate_up.shape)
    return GptOssExperts._apply_gate(SimpleNamespace(alpha=alpha, limit=limit), gate_up)


def hf_both(x, dy, alpha=ALPHA, limit=LIMIT):
    """y and grad_gate_up of HF's expression through autograd, in x's dtype."""
    x = x.detach().clone().requires_grad_()
    y = hf(x, alpha, limit)
    return y.detach(), torch.autograd.grad(y, x, dy)[0]


def run_both(x, dy, alpha=ALPHA, limit=LIMIT):
    """y and grad_gate_up of the op through autograd."""
    x = x.detach().clone().requires_grad_()
    y = op(x, alpha, limit)
    return y.detach(), torch.autograd.grad(y, x, dy)[0]


def dtype_limit(limit, dtype):
    """limit as torch's clamp of a `dtype` tensor applies it: rounded (through float32) to dtype."""
    return limit if dtype == torch.float64 else torch.tensor(limit, dtype=torch.float32).to(dtype).item()


def exact(x, dy, alpha=ALPHA, limit=LIMIT):
    """y and grad_gate_up in float64 on the same inputs, through autograd of HF's expression with the
    limit that torch's clamp of x uses."""
    return hf_both(x.double(), dy.double(), alpha, dtype_limit(limit, x.dtype))


def stopped(x, limit=LIMIT):
    """Where torch's clamps stop the gradient of gate_up: gate above limit, up outside [-limit, limit], and
    with the running torch's rule (AT_BOUNDS) at the bounds themselves."""
    lim = dtype_limit(limit, x.dtype)
    g, u = x[..., ::2], x[..., 1::2]
    if AT_BOUNDS:
        return interleave(g > lim, (u < -lim) | (u > lim))
    return interleave(g >= lim, (u <= -lim) | (u >= lim))


def assert_masks(x, dx, hdx, edx, limit=LIMIT):
    """The gradients, ours (dx) and HF's (hdx), are 0 exactly where the clamps stop them; ours is not
    0 elsewhere unless the exact value (edx) is below the dtype's range."""
    stop = stopped(x, limit)
    assert (dx[stop] == 0).all() and (hdx[stop] == 0).all()
    tiny = max(1e-30, torch.finfo(dx.dtype).smallest_normal * torch.finfo(dx.dtype).eps)
    assert (dx[~stop & (edx.abs().to(dx.device) > tiny)] != 0).all()


def interleave(g, u):
    return torch.stack((g, u), -1).flatten(-2)


def inputs(shape, dtype, device, seed=0):
    """gate_up [..., 2 * shape[-1]] and grad_y `shape`: gate and up ~ 4 N(0, 1), so that ~8% of
    each lies beyond the limit 7 and gates reach the sigmoid's curved and flat ranges."""
    gen = torch.Generator().manual_seed(seed)
    g = 4 * torch.randn(shape, generator=gen)
    u = 4 * torch.randn(shape, generator=gen)
    dy = torch.randn(shape, generator=gen)
    return interleave(g, u).to(dtype).to(device), dy.to(dtype).to(device)


def biased(shape, dtype, device, experts=5, seed=0):
    """inputs() with a bias [experts, 2 * I] ~ 2 N(0, 1) and each row's expert, the last expert given no row."""
    x, dy = inputs(shape, dtype, device, seed)
    gen = torch.Generator().manual_seed(seed + 1)
    bias = 2 * torch.randn(experts, x.shape[-1], generator=gen)
    expert = torch.randint(0, experts - 1, (x.numel() // max(x.shape[-1], 1),), generator=gen)
    return x, dy, bias.to(dtype).to(device), expert.to(device)


# Per element, against the exact value: rounded once, so half an ulp, plus the f32 math of the GPU
# (one gate value next to the zero of d/dg [g sig(a g)] at g = -0.7512 cancels ~0.3 fp16 ulp; the
# rest stays below 0.01 ulp) or the 16-bit rounding through f32 of the CPU (2^-16 ulp).
MAX_ULPS = {"cpu": 0.5 + 2 ** -10, "cuda": 1.0}
# Largest fraction of 16-bit CUDA results allowed to differ from the correctly rounded value (plus 2
# elements, for small tensors): the f32 math moves a result across a rounding boundary only within a
# few 2^-24 of it (simulated with the MUFU's error bounds: 4e-5 of bf16 and 3e-4 of fp16 results).
MAX_MISROUNDED = {torch.bfloat16: 1e-3, torch.float16: 3e-3}


def assert_rarely_differs(got, want, what):
    """got (CUDA, 16-bit) equals want (the same value rounded correctly or by the CPU kernel) but for
    a few elements."""
    differing = (got != want.to(got.device)).sum().item()
    assert differing <= MAX_MISROUNDED[got.dtype] * got.numel() + 2, f"{what}: {differing} of {got.numel()} differ"


def assert_exact(got, want, x, what):
    """got (any dtype) against the float64 `want`: 16-bit and CPU float32 per element in ulps; CUDA
    float32, whose f32 math cancels near the zero of the gate's derivative, within 1e-6 norm-wise."""
    dev = got.device.type
    assert got.dtype == x.dtype and got.shape == want.shape and not got.isnan().any(), what
    if got.dtype == torch.float32 and dev == "cuda":
        assert rel_err(got, want) < 1e-6, what
        return
    err = ulps(got, want)
    assert err.max() <= MAX_ULPS[dev], f"{what}: {err.max().item():.3f} ulps at {err.argmax().item()}"
    if dev == "cuda":
        assert_rarely_differs(got, want.to(got.dtype), what)


# Norm-wise distance of HF's result in the dtype to the op's (both near the exact values; HF's error
# is many roundings of the dtype, largest for its gradient near the zero of the gate's derivative).
HF_REL = {torch.bfloat16: 2 ** -7, torch.float16: 2 ** -10, torch.float32: 1e-6}


def assert_matches_hf_and_exact(x, dy, alpha=ALPHA, limit=LIMIT):
    y, dx = run_both(x, dy, alpha, limit)
    hy, hdx = hf_both(x, dy, alpha, limit)
    ey, edx = exact(x, dy, alpha, limit)
    assert_masks(x, dx, hdx, edx, limit)
    for what, got, ref, ex in (("y", y, hy, ey), ("grad_gate_up", dx, hdx, edx)):
        assert_exact(got, ex, x, what)
        assert rel_err(got, ref) < HF_REL[x.dtype], what
        # At least as close to the exact values as HF's own result (the GPU's float32 math is not
        # more accurate than torch's float32 kernels: there both are within 1e-6).
        if not (x.is_cuda and x.dtype == torch.float32):
            assert rel_err(got, ex) <= rel_err(ref, ex), what


# ---------------------------------------------------------------- the generic tests' contract (test_contract.py)


def samples(device):
    def call(shape, alpha=ALPHA, limit=LIMIT, seed=0):
        x, _ = inputs(shape, torch.float32, device, seed)
        return (x.requires_grad_(), alpha, limit), {}

    x, _, bias, expert = biased((7, 12), torch.float32, device)
    with_bias = ((x.requires_grad_(), ALPHA, LIMIT, bias.requires_grad_(), expert), {})
    return [call((4, 3, 8)), call((6, 5, 12)), call((5,), 1.0, 3.0, 1), call((1,), seed=2), with_bias]


def kink_free(shape, gen):
    """float64 gate_up whose gates and ups keep 0.2 from the clamp limits (finite differences step
    across no kink), spread over both sides of each."""
    g = torch.empty(shape, dtype=torch.float64).uniform_(-12, 12, generator=gen)
    u = torch.empty(shape, dtype=torch.float64).uniform_(-10, 10, generator=gen)
    g = torch.where((g - LIMIT).abs() < 0.2, g + 0.5, g)
    u = torch.where((u.abs() - LIMIT).abs() < 0.2, u * 0.9, u)
    return interleave(g, u)


def gradcheck_samples():
    """Kink-free gate_up (a sample's gates and ups may lie within a finite-difference step of a limit),
    with values on every side of the limits."""
    calls = []
    for alpha, limit in [(ALPHA, LIMIT), (1.0, 3.0)]:
        x = kink_free((3, 5, 40), torch.Generator().manual_seed(0)) * limit / LIMIT
        assert ((x[..., ::2] > limit).any() and (x[..., 1::2].abs() > limit).any()
                and (x[..., ::2] < limit).any())  # every branch
        calls.append(((x.requires_grad_(), alpha, limit), {}))
    # With a bias: gate_up is the kink-free sums less each row's expert's bias.
    gen = torch.Generator().manual_seed(1)
    sums = kink_free((6, 20), gen)
    bias = torch.randn(4, 40, dtype=torch.float64, generator=gen)
    expert = torch.tensor([0, 2, 2, 1, 0, 2])
    calls.append((((sums - bias[expert]).requires_grad_(), ALPHA, LIMIT, bias.requires_grad_(), expert), {}))
    return calls


def empty(device):
    return [((torch.randn(shape, device=device, requires_grad=True), ALPHA, LIMIT), {})
            for shape in [(0, 64), (4, 0), (0,), (2, 0, 6)]]


f32 = lambda *s: torch.randn(*s)
BAD = [
    (lambda: op(f32(4, 7), ALPHA, LIMIT), "last dim of gate_up interleaves gate and up, so it must be even"),
    (lambda: op(f32(5), ALPHA, LIMIT), "must be even"),
    (lambda: op(torch.tensor(1.0), ALPHA, LIMIT), "gate_up must have at least one dimension"),
    (lambda: op(torch.randint(0, 5, (4, 8)), ALPHA, LIMIT), "gate_up must be float32"),
    (lambda: op(torch.ones(4, 8, dtype=torch.int32), ALPHA, LIMIT), "gate_up must be float32"),
    (lambda: op(torch.ones(4, 8, dtype=torch.bool), ALPHA, LIMIT), "gate_up must be float32"),
    (lambda: backward_op(f32(4, 8), f32(4, 8), ALPHA, LIMIT), "grad_y must have gate_up's shape with the last dim halved"),
    (lambda: backward_op(f32(4, 5), f32(4, 8), ALPHA, LIMIT), "grad_y must have gate_up's shape"),
    (lambda: backward_op(f32(4, 4).half(), f32(4, 8), ALPHA, LIMIT), "gate_up and grad_y must have the same dtype"),
    (lambda: backward_op(torch.ones(4, 4, dtype=torch.int64), f32(4, 8), ALPHA, LIMIT), "grad_y must be float32"),
    (lambda: backward_op(f32(4, 4), f32(4, 7), ALPHA, LIMIT), "must be even"),
    (lambda: backward_op(f32(4, 4), torch.randn(4, 8, device="meta"), ALPHA, LIMIT), "gate_up is on meta but grad_y is on cpu"),
    (lambda: backward_op(f32(4, 4), f32(4, 8), ALPHA, float("nan")), "geglu_backward: limit is NaN"),
    (lambda: op(f32(4, 8), ALPHA, LIMIT, f32(3, 8)), "bias and expert go together .* got bias without expert"),
    (lambda: backward_op(f32(4, 4), f32(4, 8), ALPHA, LIMIT, None, torch.zeros(4, dtype=torch.long)),
     "geglu_backward: bias and expert go together .* got expert without bias"),
    (lambda: op(f32(4, 8), ALPHA, LIMIT, f32(3, 8), torch.zeros(4, dtype=torch.int32)), "expert must be int64, got Int"),
    (lambda: op(f32(4, 8), ALPHA, LIMIT, f32(3, 6), torch.zeros(4, dtype=torch.long)),
     r"bias must be \[experts, 8\] \(gate_up's last dim\), got \[3, 6\]"),
    (lambda: op(f32(4, 8), ALPHA, LIMIT, f32(8), torch.zeros(4, dtype=torch.long)), r"bias must be \[experts, 8\]"),
    (lambda: op(f32(4, 8), ALPHA, LIMIT, f32(3, 8), torch.zeros(3, dtype=torch.long)),
     r"expert must hold one index for each of gate_up's rows of 8, got shape \[3\]"),
    (lambda: op(f32(4, 8), ALPHA, LIMIT, f32(3, 8).double(), torch.zeros(4, dtype=torch.long)),
     "gate_up and bias must have the same dtype"),
    (lambda: op(f32(4, 8), ALPHA, LIMIT, f32(3, 8), torch.tensor([0, 1, 3, 0])), "geglu: expert holds 3, outside 0..3"),
    (lambda: backward_op(f32(4, 4), f32(4, 8), ALPHA, LIMIT, f32(3, 8), torch.tensor([0, -1, 0, 0])),
     "geglu: expert holds -1, outside 0..3"),
    (lambda: op(f32(4, 8), ALPHA, LIMIT, f32(3, 8), torch.zeros(4, dtype=torch.long, device="meta")),
     "gate_up is on cpu but expert is on meta"),
]

CONTRACT = Contract(op=op, samples=samples, empty=empty, reference=hf, bad=BAD, gradcheck_samples=gradcheck_samples)


# ---------------------------------------------------------------- CPU and any device


# Values at and around the limits: exactly +-7, one ulp of the dtype beyond and within, far beyond
# (large gates saturate the sigmoid, large negative ones zero it), and ups at -1 (zero gate gradient).
def edge_inputs(dtype, device):
    step = 4 * torch.finfo(dtype).eps  # the dtype's spacing at 7
    near = [LIMIT, LIMIT + step, LIMIT - step, LIMIT + 0.5, 20.0, 100.0]
    gates = near + [-v for v in near] + [0.0, -0.75, 1.0]
    ups = near + [-v for v in near] + [-1.0, 0.0, 0.5]
    g = torch.tensor(gates, dtype=torch.float64).repeat_interleave(len(ups))
    u = torch.tensor(ups, dtype=torch.float64).repeat(len(gates))
    # Nonzero and of both signs, so that only the clamps and up = -1 or gate = 0 zero a gradient.
    dy = torch.linspace(0.25, 2, len(g), dtype=torch.float64) * (-1) ** torch.arange(len(g))
    x = interleave(g, u).to(dtype).to(device)
    assert torch.equal(x.double().cpu(), interleave(g, u)), "edge values not representable"
    return x, dy.to(dtype).to(device)


def test_clamp_edges_fp64_exact():
    x, dy = edge_inputs(torch.float64, "cpu")
    y, dx = run_both(x, dy)
    hy, hdx = hf_both(x, dy)
    # atol: near gate = -0.75 both cancel in d/dg [g sig(a g)], whose terms are O(1).
    torch.testing.assert_close(y, hy, rtol=1e-14, atol=0)
    torch.testing.assert_close(dx, hdx, rtol=1e-14, atol=1e-14)
    assert torch.equal(dx == 0, hdx == 0)
    g, u = x[..., ::2], x[..., 1::2]
    # Beyond the limits torch's clamp stops the gradient; at them it passes it or not (AT_BOUNDS).
    stop = stopped(x)
    assert torch.equal(dx[..., ::2] == 0, stop[..., ::2] | (u == -1))
    assert torch.equal(dx[..., 1::2] == 0, stop[..., 1::2] | (g == 0))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES)
def test_clamp_edges(dtype, device):
    x, dy = edge_inputs(dtype, device)
    y, dx = run_both(x, dy)
    hy, hdx = hf_both(x, dy)
    ey, edx = exact(x, dy)
    assert_masks(x, dx, hdx, edx)
    # Below gate -50 the GPU's f32 sigmoid flushes to 0 (exact results ~1e-37 and below).
    g = x[..., ::2]
    for what, got, ex, keep in (("y", y, ey, g > -50), ("grad", dx, edx, (g > -50).repeat_interleave(2, -1))):
        if dtype == torch.float32 and device == "cuda":
            # alpha in f32 and the rounding of alpha * g * log2(e) move sig(alpha * g) by ~3e-6 at g = -20,
            # relative: a rounding of the exponent z = alpha * g * log2(e) moves 2^z by |z| * 2^-24 * ln 2,
            # and |z| reaches 49 there; the H100 run showed 1.25e-5 in the gradient.
            torch.testing.assert_close(got[keep].double(), ex[keep].to(device), rtol=3e-5, atol=0)
        else:
            assert_exact(got[keep], ex[keep], x, what)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(64, 1000), (9, 2880), (33, 3)])
def test_matches_hf_and_f64_reference(dtype, device, shape):
    x, dy = inputs(shape, dtype, device)
    assert_matches_hf_and_exact(x, dy)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("alpha,limit", [(1.0, 3.0), (ALPHA, 7.1), (ALPHA, 7.11), (ALPHA, float("inf"))])
def test_other_alpha_and_limit(dtype, device, alpha, limit):
    # 7.1 and 7.11 are not representable in 16 bits: torch's clamp rounds them to the dtype (7.09375
    # and 7.125 in bf16), and so does the op, masks included.
    x, dy = inputs((16, 500), dtype, device, seed=1)
    x[0, :8] = torch.tensor([7.09375, 7.09375, 7.125, 7.125, -7.125, -7.125, 3.0, -3.0])
    assert_matches_hf_and_exact(x, dy, alpha, limit)


def test_fp64_is_exact_math():
    x, dy = inputs((16, 100), torch.float64, "cpu")
    for got, want in zip(run_both(x, dy), hf_both(x, dy)):
        assert rel_err(got, want) < 1e-14


@pytest.mark.parametrize("device", DEVICES)
def test_rounds_once(device):
    # bf16 inputs where HF's result (rounded after each op) differs from the exact value rounded once,
    # which the op returns.
    x, dy = inputs((64, 1000), torch.bfloat16, device, seed=2)
    y, dx = run_both(x, dy)
    hy, hdx = hf_both(x, dy)
    ey, edx = exact(x, dy)
    ey, edx = ey.to(x.dtype), edx.to(x.dtype)
    assert (hy != ey).double().mean() > 0.05 and (hdx != edx).double().mean() > 0.05
    if device == "cpu":
        assert torch.equal(y, ey) and torch.equal(dx, edx)
    else:
        assert_rarely_differs(y, ey, "y")
        assert_rarely_differs(dx, edx, "grad_gate_up")


@pytest.mark.parametrize("device", DEVICES)
def test_nan_as_hf(device):
    nan = float("nan")
    x = torch.tensor([[nan, 1.0, 1.0, nan, nan, 9.0, 9.0, nan, 2.0, -0.5]], device=device)
    dy = torch.ones(1, 5, device=device)
    y, dx = run_both(x, dy)
    hy, hdx = hf_both(x, dy)
    torch.testing.assert_close(y, hy, equal_nan=True, rtol=1e-6, atol=0)
    torch.testing.assert_close(dx, hdx, equal_nan=True, rtol=1e-6, atol=0)


def test_nan_limit_is_refused():
    """With a NaN limit HF's clamps make every output NaN: the op refuses the value instead."""
    x, _ = inputs((4, 8), torch.float32, "cpu")
    assert hf(x, limit=float("nan")).isnan().all()
    with pytest.raises(RuntimeError, match="bastile.geglu: limit is NaN"):
        op(x, ALPHA, float("nan"))


@pytest.mark.parametrize("device", DEVICES)
def test_autocast_leaves_dtype_alone(device):
    x, _ = inputs((8, 64), torch.float32, device)
    with torch.autocast(device, dtype=torch.bfloat16):
        y32 = op(x, ALPHA, LIMIT)
        ref32 = hf(x)
        y16 = op(x.bfloat16(), ALPHA, LIMIT)
    assert y32.dtype == ref32.dtype == torch.float32 and y16.dtype == torch.bfloat16
    assert rel_err(y32, ref32) < 1e-6


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(37, 40), (9, 2880), (33, 3), (2, 5, 16)])
def test_bias_is_added_to_each_row_first(dtype, device, shape):
    """With a bias, the op is the op without one on gate_up + bias[expert] as torch sums it (rounded once, as HF's
    sum): bit for bit, forward and backward; the bias's gradient is the exact gradient of gate_up summed over each
    expert's rows (an expert with no rows gets 0)."""
    x, dy, bias, expert = biased(shape, dtype, device)
    sums = x + bias[expert].view(x.shape)
    xr, br = x.clone().requires_grad_(), bias.clone().requires_grad_()
    y = op(xr, ALPHA, LIMIT, br, expert)
    dx, dbias = torch.autograd.grad(y, (xr, br), dy)
    assert torch.equal(y, op(sums, ALPHA, LIMIT))
    assert torch.equal(dx, backward_op(dy, sums, ALPHA, LIMIT))
    assert torch.equal(backward_op(dy, x, ALPHA, LIMIT, bias, expert), dx)
    _, exact_dx = exact(sums, dy)
    want = torch.zeros(bias.shape, dtype=torch.float64).index_add_(0, expert.cpu(), exact_dx.view(-1, x.shape[-1]).cpu())
    assert dbias.dtype == dtype and (dbias[-1] == 0).all()
    assert rel_err(dbias, want) < HF_REL[dtype]


# Rows of whole vectors, odd (the scalar kernels), GPT-OSS's, a 3-d batch, empty rows, more rows than a GPU's warps.
DOT_SHAPES = [(37, 40), (33, 3), (9, 2880), (2, 5, 16), (4, 0), (20000, 8)]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES + [torch.float64])
@pytest.mark.parametrize("shape", DOT_SHAPES)
@pytest.mark.parametrize("with_bias", [False, True])
def test_row_dots(with_bias, shape, dtype, device):
    """dot=True: each row's <grad_y, y>, y as the op gives it (with each row's expert's bias), summed (against
    fp64); the gradient that without it, bit for bit."""
    if dtype == torch.float64 and device == "cuda":
        pytest.skip("float64 runs on the CPU only")
    x, dy, bias, expert = biased(shape, dtype, device)
    args = (bias, expert) if with_bias else (None, None)
    poison_cuda_allocator(16 * dy.numel())
    dx, dots = torch.ops.bastile.geglu_backward(dy, x, ALPHA, LIMIT, *args, True)
    assert_row_dots(dots, dy, op(x, ALPHA, LIMIT, *args))
    assert torch.equal(dx, backward_op(dy, x, ALPHA, LIMIT, *args))
    if device == "cpu" and shape == (2, 5, 16):
        torch.library.opcheck(torch.ops.bastile.geglu_backward, (dy, x, ALPHA, LIMIT, *args, True))


def test_saves_only_gate_up():
    x, _ = inputs((4, 16), torch.float32, "cpu")
    x.requires_grad_()
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        op(x, ALPHA, LIMIT)
    assert len(saved) == 1 and saved[0].data_ptr() == x.data_ptr()


def test_functional_alias_has_gpt_oss_defaults():
    experts = GptOssExperts(GptOssConfig(hidden_size=8, intermediate_size=4, num_local_experts=2))
    params = inspect.signature(bastile.geglu).parameters
    assert list(params) == ["gate_up", "alpha", "limit", "bias", "expert"]
    assert (params["alpha"].default, params["limit"].default) == (experts.alpha, experts.limit)
    x, _ = inputs((3, 40), torch.bfloat16, "cpu")
    torch.testing.assert_close(bastile.geglu(x), op(x, ALPHA, LIMIT), rtol=0, atol=0)
    torch.testing.assert_close(bastile.geglu(x, experts.alpha, experts.limit), op(x, ALPHA, LIMIT), rtol=0, atol=0)


# ---------------------------------------------------------------- CUDA against the CPU reference

# GPT-OSS-20B expert activations (tokens x 2 * 2880, a ragged token count included), odd I (pairs
# past the last 16-byte vector take the scalar tail), and a 3-d batch.
CUDA_SHAPES = [(4096, 2880), (777, 2880), (5, 1001), (301, 3), (3,), (1, 9), (7, 17, 1000), (2, 1)]


def assert_cuda_matches_cpu(got, want, what):
    """Both are the exact value rounded once, the GPU's from f32 math: 16-bit results equal but for a
    tiny fraction, those one ulp apart; float32 within 1e-6 norm-wise."""
    assert got.is_cuda and got.dtype == want.dtype and got.shape == want.shape and not got.isnan().any(), what
    if got.dtype in HALF:
        assert ulps(got, want).max() <= 1, what
        assert_rarely_differs(got, want, what)
    else:
        assert rel_err(got, want) < 1e-6, what


@needs_cuda
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", CUDA_SHAPES)
def test_cuda_matches_cpu(dtype, shape):
    x, dy = inputs(shape, dtype, "cpu")
    y = op(x, ALPHA, LIMIT)
    dx = backward_op(dy, x, ALPHA, LIMIT)
    poison_cuda_allocator(8 * x.numel())
    yc = op(x.cuda(), ALPHA, LIMIT)
    poison_cuda_allocator(8 * x.numel())
    dxc = backward_op(dy.cuda(), x.cuda(), ALPHA, LIMIT)
    assert_cuda_matches_cpu(yc, y, "y")
    assert_cuda_matches_cpu(dxc, dx, "grad_gate_up")


@needs_cuda
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("which", ["gate_up", "grad_y", "both"])
def test_cuda_misaligned_views(dtype, which):
    # A slice starting at element 1 (2 for gate_up, which keeps its pairs) is contiguous but not
    # 16-byte aligned: the scalar kernels run.
    rows, i = 64, 1000
    x, dy = inputs((rows * i + 1,), dtype, "cuda")
    x = (x[2:] if which in ("gate_up", "both") else x[:-2]).view(rows, 2 * i)
    dy = (dy[1:] if which in ("grad_y", "both") else dy[:-1]).view(rows, i)
    assert x.is_contiguous() and dy.is_contiguous()
    assert_cuda_matches_cpu(op(x, ALPHA, LIMIT), op(x.cpu(), ALPHA, LIMIT), "y")
    assert_cuda_matches_cpu(backward_op(dy, x, ALPHA, LIMIT), backward_op(dy.cpu(), x.cpu(), ALPHA, LIMIT), "grad")


@needs_cuda
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(4096, 2880), (777, 2880), (301, 3), (7, 17, 1000), (5, 1001), "misaligned"])
def test_cuda_bias_matches_cpu(dtype, shape):
    # Rows of whole vectors take the vector kernels with the bias, others (and a bias not 16-byte aligned) the scalar.
    x, dy, bias, expert = biased((64, 1000) if shape == "misaligned" else shape, dtype, "cpu", experts=32)
    args = lambda d: (bias.to(d), expert.to(d))
    y, dx = op(x, ALPHA, LIMIT, *args("cpu")), backward_op(dy, x, ALPHA, LIMIT, *args("cpu"))
    cuda_bias, cuda_expert = args("cuda")
    if shape == "misaligned":
        cuda_bias = torch.empty(bias.numel() + 1, dtype=dtype, device="cuda")[1:].view(bias.shape).copy_(bias)
    poison_cuda_allocator(8 * x.numel())
    yc = op(x.cuda(), ALPHA, LIMIT, cuda_bias, cuda_expert)
    poison_cuda_allocator(8 * x.numel())
    dxc = backward_op(dy.cuda(), x.cuda(), ALPHA, LIMIT, cuda_bias, cuda_expert)
    assert_cuda_matches_cpu(yc, y, "y")
    assert_cuda_matches_cpu(dxc, dx, "grad_gate_up")


@needs_cuda
def test_cuda_bad_inputs():
    x = torch.randn(4, 8, device="cuda")
    with pytest.raises(RuntimeError, match="gate_up is on cuda:0 but grad_y is on cpu"):
        backward_op(torch.randn(4, 4), x, ALPHA, LIMIT)
    with pytest.raises(RuntimeError, match="float64 is supported on CPU only"):
        op(x.double(), ALPHA, LIMIT)
    with pytest.raises(RuntimeError, match="float64 is supported on CPU only"):
        backward_op(torch.randn(4, 4, device="cuda").double(), x.double(), ALPHA, LIMIT)


# 2^31 + 2^20 + 3 pairs: gate_up has more than 2^32 elements, y more than 2^31, so the offsets of both
# need 64-bit indexing; the last 3 pairs take the scalar tail.
BIG = 2 ** 31 + 2 ** 20 + 3


def f32_reference(x, dy):
    """HF's expression through autograd in float32, each result rounded once to x's dtype."""
    y, dx = hf_both(x.float(), dy.float())
    return y.to(x.dtype), dx.to(x.dtype)


@needs_cuda
@pytest.mark.skipif(not CUDA or torch.cuda.mem_get_info()[0] < 40 * 2 ** 30, reason="needs 40 GiB of free GPU memory")
def test_cuda_beyond_int32_elements():
    gen = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(2 * BIG, device="cuda", dtype=torch.bfloat16, generator=gen).mul_(4)
    y = op(x, ALPHA, LIMIT)
    dx = backward_op(y, x, ALPHA, LIMIT)  # y doubles as the incoming gradient
    # Every element, chunk by chunk, against HF's expression in f32 rounded once (an element left
    # unwritten shows up here).
    step = 2 ** 26
    for start in range(0, BIG, step):
        s, s2 = slice(start, min(start + step, BIG)), slice(2 * start, 2 * min(start + step, BIG))
        ry, rdx = f32_reference(x[s2], y[s])
        for what, got, want in (("y", y[s], ry), ("grad_gate_up", dx[s2], rdx)):
            assert ulps(got, want).max() <= 1, what
            assert_rarely_differs(got, want, what)
        del ry, rdx
    # And slices against the CPU kernels: the first, across 2^30 pairs (gate_up's offset 2^31), across
    # 2^31 pairs (y's offset 2^31), and the last.
    for start in (0, 2 ** 30 - 2048, 2 ** 31 - 2048, BIG - 5000):
        s, s2 = slice(start, start + 5000), slice(2 * start, 2 * start + 10000)
        xc = x[s2].cpu()
        assert_cuda_matches_cpu(y[s], op(xc, ALPHA, LIMIT), "y")
        assert_cuda_matches_cpu(dx[s2], backward_op(y[s].cpu(), xc, ALPHA, LIMIT), "grad_gate_up")
