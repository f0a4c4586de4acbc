"""torch.ops.bastile.swiglu against HF's `act_fn(gate) * up` (ACT2FN's silu and gelu_pytorch_tanh) and an fp64
reference."""
import pytest
import torch
from transformers.activations import ACT2FN

import bastile
from conftest import CUDA, DEVICES, Contract, assert_row_dots, needs_cuda, poison_cuda_allocator, rel_err, ulps

op = torch.ops.bastile.swiglu


def backward_op(*args, **kwargs):
    """swiglu_backward's (grad_gate, grad_up), without the rows' dots."""
    return torch.ops.bastile.swiglu_backward(*args, **kwargs)[:2]

HALF = [torch.bfloat16, torch.float16]


ACTIVATIONS = ["silu", "gelu_tanh"]
HF_NAMES = {"silu": "silu", "gelu_tanh": "gelu_pytorch_tanh"}  # Qwen3MLP's, Gemma3MLP's hidden_activation


def hf(g, u, activation="silu"):
    """An HF MLP's activation times its up projection."""
    return ACT2FN[HF_NAMES[activation]](g) * u


def f64_reference(g, u, dy, activation="silu"):
    """Exact y, grad_gate, grad_up in float64, through autograd of the same expression."""
    g64, u64 = g.detach().double().requires_grad_(), u.detach().double().requires_grad_()
    y = hf(g64, u64, activation)
    return (y.detach(), *torch.autograd.grad(y, (g64, u64), dy.double()))


def inputs(shape, dtype, device, seed=0):
    """gate spans the sigmoid's curved and saturated ranges; up and grad_y are O(1)."""
    gen = torch.Generator().manual_seed(seed)
    g = (3 * torch.randn(shape, generator=gen)).to(dtype).to(device)
    u = torch.randn(shape, generator=gen).to(dtype).to(device)
    dy = torch.randn(shape, generator=gen).to(dtype).to(device)
    return g, u, dy


# Largest fraction of 16-bit elements allowed to differ (by one ulp) from a reference that rounds
# the same f32 intermediates: both compute the activation in f32, a few f32 ulps apart (the GPU uses
# the hardware exp2 and reciprocal), which moves a 16-bit rounding in ~2^-13 (fp16) or ~2^-16 (bf16)
# of the elements per rounding. GELU-tanh cancels in 1 + tanh for negative gates (f32 keeps ~2^-17 of
# it at g = -4), and the CPU kernels compute in f64: more roundings move there.
MAX_DIFFERING = {torch.bfloat16: 1e-3, torch.float16: 5e-3}
MAX_DIFFERING_GELU = {torch.bfloat16: 4e-3, torch.float16: 2e-2}


# Below this gate GELU-tanh's 1 + tanh(z) keeps less than 2^-9 of itself: f32 implementations (torch's, the
# GPU's) and the CPU kernels' f64 differ there by more ulps of the (tiny) result than a rounding makes.
CANCELLED = -3.0


def assert_matches(got, want, what="", activation="silu", gate=None):
    """16-bit: equal but for a tiny fraction, and those one ulp apart in each rounding (a one-ulp
    difference in the rounded activation moves the product by up to two); fp32: rel_err < 1e-6. GELU-tanh
    where it cancels (gate given, below CANCELLED): within 2^-14 of the largest result instead."""
    assert got.dtype == want.dtype and got.shape == want.shape, what
    assert not got.isnan().any(), what
    want = want.to(got.device)
    if got.dtype in MAX_DIFFERING:
        kept = torch.ones_like(got, dtype=torch.bool)
        if activation == "gelu_tanh":
            kept = gate.to(got.device) > CANCELLED
            err = (got.double() - want.double()).abs()[~kept]
            assert err.numel() == 0 or err.max() <= 2 ** -14 * want.double().abs().max(), what
        assert ulps(got[kept], want[kept]).max() <= 2, what
        differing = (got[kept] != want[kept]).double().mean().item()
        limit = (MAX_DIFFERING if activation == "silu" else MAX_DIFFERING_GELU)[got.dtype]
        assert differing <= limit, f"{what}: {differing:.2e} of elements differ"
    else:
        assert rel_err(got, want) < 1e-6, what


def run_both(g, u, dy, activation="silu"):
    """y and (grad_gate, grad_up) of the op through autograd."""
    g, u = g.detach().clone().requires_grad_(), u.detach().clone().requires_grad_()
    y = op(g, u, activation)
    return y, torch.autograd.grad(y, (g, u), dy)


# ---------------------------------------------------------------- the generic tests' contract (test_contract.py)


def samples(device):
    def call(shape, seed=0):
        g, u, _ = inputs(shape, torch.float32, device, seed)
        return (g.requires_grad_(), u.requires_grad_()), {}

    gelu = lambda shape, seed: (call(shape, seed)[0], {"activation": "gelu_tanh"})
    return [call((4, 3, 8)), call((6, 5, 12)), call((7,), 1), call((), 2), gelu((5, 9), 3)]


def empty(device):
    def call(shape):
        return (torch.randn(shape, device=device, requires_grad=True),
                torch.randn(shape, device=device, requires_grad=True)), {}

    return [call((0, 32)), call((4, 0)), call((0,))]


f32 = lambda *s: torch.randn(*s)
BAD = [
    (lambda: op(f32(4, 8), f32(4, 8).double()), "gate and up must have the same dtype"),
    (lambda: op(f32(4, 8).half(), f32(4, 8).bfloat16()), "gate and up must have the same dtype"),
    (lambda: op(f32(4, 8), f32(4, 9)), "gate and up must have the same shape"),
    (lambda: op(f32(4, 8), f32(8, 4)), "gate and up must have the same shape"),
    (lambda: op(f32(4, 8), f32(32)), "gate and up must have the same shape"),
    (lambda: op(f32(4, 8), torch.randn(4, 8, device="meta")), "up is on meta"),
    (lambda: op(torch.randint(0, 5, (4, 8)), f32(4, 8)), "gate must be float32"),
    (lambda: op(f32(4, 8), torch.randint(0, 5, (4, 8))), "up must be float32"),
    (lambda: op(torch.ones(4, 8, dtype=torch.int32), torch.ones(4, 8, dtype=torch.int32)), "gate must be float32"),
    (lambda: backward_op(f32(4, 9), f32(4, 8), f32(4, 8)), "gate and grad_y must have the same shape"),
    (lambda: backward_op(f32(4, 8).half(), f32(4, 8), f32(4, 8)), "gate and grad_y must have the same dtype"),
    (lambda: backward_op(f32(4, 8), f32(4, 8), f32(4, 7)), "gate and up must have the same shape"),
    (lambda: op(f32(4, 8), f32(4, 8), "gelu"), 'swiglu: activation must be "silu" or "gelu_tanh", got "gelu"'),
    (lambda: backward_op(f32(4, 8), f32(4, 8), f32(4, 8), "relu"),
     'swiglu_backward: activation must be "silu" or "gelu_tanh", got "relu"'),
    (lambda: backward_op(f32(()), f32(()), f32(()), "silu", True), "swiglu_backward: dot sums rows, and a 0-dim input"),
    (lambda: backward_op(f32(4, 4), f32(4, 7), None), "swiglu_backward: without up, gate holds gate and up concatenated"),
    (lambda: backward_op(f32(()), f32(()), None), "swiglu_backward: without up, gate holds gate and up concatenated"),
    (lambda: backward_op(f32(4, 8), f32(4, 8), None), "grad_y must have gate's shape with the last dim halved"),
    (lambda: backward_op(f32(4, 4).half(), f32(4, 8), None), "gate and grad_y must have the same dtype"),
]

CONTRACT = Contract(op=op, samples=samples, empty=empty, reference=hf, bad=BAD)


# ---------------------------------------------------------------- CPU and any device


def matches_hf(shape, dtype, device, activation):
    """The op's output and gradients against HF's expression on random inputs; returns the inputs, dy and them."""
    g, u, dy = inputs(shape, dtype, device)
    y, (dg, du) = run_both(g, u, dy, activation)
    g2, u2 = g.clone().requires_grad_(), u.clone().requires_grad_()
    ref = hf(g2, u2, activation)
    rdg, rdu = torch.autograd.grad(ref, (g2, u2), dy)
    assert_matches(y, ref, "y", activation, g)
    assert_matches(dg, rdg, "grad_gate", activation, g)
    assert_matches(du, rdu, "grad_up", activation, g)
    return g, u, dy, y, dg, du


@pytest.mark.parametrize("activation", ACTIVATIONS)
@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_matches_hf_and_f64_reference(dtype, device, activation):
    g, u, dy, y, dg, du = matches_hf((64, 1000), dtype, device, activation)
    # Against the exact values: a few of the dtype's roundings (each result is rounded twice).
    tol = {torch.bfloat16: 2 ** -7, torch.float16: 2 ** -10, torch.float32: 1e-6}[dtype]
    for got, exact in zip((y, dg, du), f64_reference(g, u, dy, activation)):
        assert rel_err(got, exact) < tol


@pytest.mark.parametrize("activation", ACTIVATIONS)
def test_fp64_is_exact_math(activation):
    g, u, dy = inputs((16, 100), torch.float64, "cpu")
    y, grads = run_both(g, u, dy, activation)
    for got, exact in zip((y, *grads), f64_reference(g, u, dy, activation)):
        assert rel_err(got, exact) < 1e-14


# Rows of whole vectors, of one vector, odd (the scalar kernels), a 3-d batch, empty rows, and more rows than a
# GPU's warps (each warp takes several).
DOT_SHAPES = [(37, 40), (33, 768), (5, 3), (2, 5, 16), (4, 0), (20000, 8)]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32, torch.float64])
@pytest.mark.parametrize("activation", ACTIVATIONS)
@pytest.mark.parametrize("shape", DOT_SHAPES + ["halves"])
def test_row_dots(shape, activation, dtype, device):
    """dot=True: each row's <grad_y, y>, y as the op gives it, summed (against fp64); the gradients those without
    it, bit for bit; gate and up as the halves of one gate/up too."""
    if dtype == torch.float64 and device == "cuda":
        pytest.skip("float64 runs on the CPU only")
    if shape == "halves":
        gate_up, _, dy = inputs((300, 2 * 64), dtype, device)
        g, u = gate_up.chunk(2, dim=-1)
        dy = dy[:, :64].contiguous()
    else:
        g, u, dy = inputs(shape, dtype, device)
    poison_cuda_allocator(16 * dy.numel())
    dg, du, dots = torch.ops.bastile.swiglu_backward(dy, g, u, activation, True)
    assert_row_dots(dots, dy, op(g, u, activation))
    want = backward_op(dy, g, u, activation)
    assert torch.equal(dg, want[0]) and torch.equal(du, want[1])
    if device == "cpu" and shape == (2, 5, 16):
        torch.library.opcheck(torch.ops.bastile.swiglu_backward, (dy, g, u, activation, True))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32, torch.float64])
@pytest.mark.parametrize("shape", [(300, 64), (2, 7, 5), (0, 8)])
@pytest.mark.parametrize("dot", [False, True])
def test_gate_up_gradient_is_written_whole(dot, shape, dtype, device):
    """Without up, gate is a concatenated gate/up ([..., 2 * cols]): its gradient is cat(grad_gate, grad_up) of the
    halves' backward, bit for bit, with the same dots; rows of whole 16-byte vectors, odd rows (the scalar kernels),
    no rows."""
    if dtype == torch.float64 and device == "cuda":
        pytest.skip("float64 runs on the CPU only")
    gate_up, _, dy = inputs((*shape[:-1], 2 * shape[-1]), dtype, device)
    dy = dy[..., :shape[-1]].contiguous()
    gate, up = gate_up.chunk(2, dim=-1)
    poison_cuda_allocator(16 * gate_up.numel())
    grad, second, dots = torch.ops.bastile.swiglu_backward(dy, gate_up, None, "silu", dot)
    grad_gate, grad_up, want_dots = torch.ops.bastile.swiglu_backward(dy, gate.contiguous(), up.contiguous(), "silu", dot)
    assert grad.shape == gate_up.shape and second.numel() == 0
    assert torch.equal(grad, torch.cat((grad_gate, grad_up), dim=-1)) and torch.equal(dots, want_dots)
    if device == "cpu" and shape == (2, 7, 5):
        torch.library.opcheck(torch.ops.bastile.swiglu_backward, (dy, gate_up, None, "silu", dot))


@pytest.mark.parametrize("device", DEVICES)
def test_rounds_where_hf_rounds(device):
    # bf16 inputs whose every output differs from the exactly computed value rounded once
    # (-0.54296875, 0.75390625, -0.4296875): the op must round silu(g) and dy * u to bf16 as HF does.
    t = lambda v: torch.tensor([v], dtype=torch.bfloat16, device=device)
    y, (dg, du) = run_both(t(0.75), t(-1.0625), t(-0.84375))
    assert (y.item(), dg.item(), du.item()) == (-0.5390625, 0.7578125, -0.427734375)


@pytest.mark.parametrize("device", DEVICES)
def test_autocast_leaves_dtypes_alone(device):
    g, u, _ = inputs((8, 64), torch.float32, device)
    with torch.autocast(device, dtype=torch.bfloat16):
        y32 = op(g, u)
        ref32 = hf(g, u)
        y16 = op(g.bfloat16(), u.bfloat16())
    assert y32.dtype == ref32.dtype == torch.float32 and y16.dtype == torch.bfloat16
    assert rel_err(y32, ref32) < 1e-6


@pytest.mark.parametrize("device", DEVICES)
def test_gradient_of_one_input(device):
    g, u, dy = inputs((4, 24), torch.float32, device)
    g.requires_grad_()
    (dg,) = torch.autograd.grad(op(g, u), g, dy)
    g2 = g.detach().clone().requires_grad_()
    (rdg,) = torch.autograd.grad(hf(g2, u), g2, dy)
    assert_matches(dg, rdg)


def test_saves_only_gate_and_up():
    g, u, _ = inputs((4, 16), torch.float32, "cpu")
    g.requires_grad_()
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        op(g, u)
    assert len(saved) == 2 and saved[0].data_ptr() == g.data_ptr() and saved[1].data_ptr() == u.data_ptr()


# The halves of a concatenated [..., 2 cols] gate/up (chunk(2, -1), as the fused gate/up projections and the MoE
# experts give them): read where they lie, rows of whole 16-byte vectors or not (5 columns; 12 are in f32 only); 3-D
# with a size-1 leading dimension too.
HALVES = [(64, 2 * 768), (2, 5, 2 * 16), (1, 7, 2 * 24), (9, 2 * 5), (4, 2 * 12)]


def copies_made(fn):
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        fn()
    return sum(e.count for e in prof.key_averages() if e.key in ("aten::copy_", "aten::clone", "aten::contiguous"))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("shape", HALVES)
def test_halves_of_gate_up_read_where_they_lie(device, dtype, shape):
    """y and gate/up's gradient through the halves equal those of their contiguous copies bit for bit, and the
    halves are not copied."""
    gate_up, _, _ = inputs(shape, dtype, device)
    dy = inputs(gate_up[..., : shape[-1] // 2].shape, dtype, device, 1)[2]
    leaf = gate_up.clone().requires_grad_()
    gate, up = leaf.chunk(2, dim=-1)
    assert not gate.is_contiguous()
    y = op(gate, up)
    (dgu,) = torch.autograd.grad(y, leaf, dy)
    ry, (rdg, rdu) = run_both(*(h.contiguous() for h in gate_up.chunk(2, dim=-1)), dy)
    torch.testing.assert_close(y, ry, rtol=0, atol=0)
    torch.testing.assert_close(dgu, torch.cat([rdg, rdu], -1), rtol=0, atol=0)
    gate, up = gate_up.chunk(2, dim=-1)
    assert copies_made(lambda: (op(gate, up), backward_op(dy, gate, up))) == 0


@pytest.mark.parametrize("device", DEVICES)
def test_expanded_and_overlapping_rows_are_read_as_copies(device):
    """Rows that repeat (an expanded up, row stride 0) or overlap (row stride under the row's length) are read as
    their contiguous copies."""
    g, u, dy = inputs((6, 16), torch.bfloat16, device)
    overlapping = lambda t: t.reshape(-1).as_strided((6, 16), (8, 1))
    for gate, up in [(g[:1].expand(6, 16), u[:1].expand(6, 16)), (overlapping(g), overlapping(u))]:
        copies = gate.contiguous(), up.contiguous()
        torch.testing.assert_close(op(gate, up), op(*copies), rtol=0, atol=0)
        for a, b in zip(backward_op(dy, gate, up), backward_op(dy, *copies)):
            torch.testing.assert_close(a, b, rtol=0, atol=0)


def test_functional_alias():
    g, u, _ = inputs((3, 40), torch.bfloat16, "cpu")
    torch.testing.assert_close(bastile.swiglu(g, u), op(g, u), rtol=0, atol=0)


# ---------------------------------------------------------------- CUDA against the CPU reference

# Qwen3 MLP activations (tokens x intermediate size) and odd sizes whose last 1..7 elements take the
# scalar tail after the 16-byte vectors. (2, 1024, 3072) in bf16 has more vectors than one resident
# wave covers but fewer than four waves: the grid-stride loop runs several steps per thread.
CUDA_SHAPES = [(2, 1024, 3072), (4096, 6144), (5, 1001), (301, 3), (3,), (1, 9), (7, 17, 1000)]


@needs_cuda
@pytest.mark.parametrize("activation", ACTIVATIONS)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("shape", CUDA_SHAPES)
def test_cuda_matches_cpu(dtype, shape, activation):
    g, u, dy = inputs(shape, dtype, "cpu")
    y = op(g, u, activation)
    dg, du = backward_op(dy, g, u, activation)
    n = g.numel()
    poison_cuda_allocator(8 * n)
    yc = op(g.cuda(), u.cuda(), activation)
    poison_cuda_allocator(8 * n)
    dgc, duc = backward_op(dy.cuda(), g.cuda(), u.cuda(), activation)
    assert yc.is_cuda and dgc.is_cuda and duc.is_cuda
    assert_matches(yc, y, "y", activation, g)
    assert_matches(dgc, dg, "grad_gate", activation, g)
    assert_matches(duc, du, "grad_up", activation, g)


@needs_cuda
@pytest.mark.parametrize("activation", ACTIVATIONS)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_cuda_matches_hf(dtype, activation):
    matches_hf((512, 3072), dtype, "cuda", activation)


@needs_cuda
@pytest.mark.parametrize("activation", ACTIVATIONS)
@pytest.mark.parametrize("dtype", HALF + [torch.float32])
@pytest.mark.parametrize("which", ["gate", "up", "all"])
def test_cuda_misaligned_views(dtype, which, activation):
    # A slice starting at element 1 is contiguous but not 16-byte aligned: the scalar kernels run.
    n = 64 * 1024
    g, u, dy = inputs((n + 1,), dtype, "cuda")
    sl = lambda t, name: (t[1:] if which in (name, "all") else t[:-1]).view(64, 1024)
    g, u, dy = sl(g, "gate"), sl(u, "up"), sl(dy, "all")
    assert g.is_contiguous() and u.is_contiguous()
    y = op(g, u, activation)
    dg, du = backward_op(dy, g, u, activation)
    assert_matches(y, op(g.cpu(), u.cpu(), activation), "y", activation, g)
    rdg, rdu = backward_op(dy.cpu(), g.cpu(), u.cpu(), activation)
    assert_matches(dg, rdg, "grad_gate", activation, g)
    assert_matches(du, rdu, "grad_up", activation, g)


@needs_cuda
def test_cuda_bad_inputs():
    g = torch.randn(4, 8, device="cuda")
    with pytest.raises(RuntimeError, match="gate is on cuda:0 but up is on cpu"):
        op(g, torch.randn(4, 8))
    with pytest.raises(RuntimeError, match="grad_y is on cpu"):
        backward_op(torch.randn(4, 8), g, g)
    with pytest.raises(RuntimeError, match="float64 is supported on CPU only"):
        op(g.double(), g.double())


# 2^31 + 2^20 + 3 elements: offsets past 2^31 need 64-bit indexing, and the last 3 take the scalar tail.
BIG = 2 ** 31 + 2 ** 20 + 3


@needs_cuda
@pytest.mark.skipif(not CUDA or torch.cuda.mem_get_info()[0] < 40 * 2 ** 30, reason="needs 40 GiB of free GPU memory")
def test_cuda_beyond_int32_elements():
    gen = torch.Generator(device="cuda").manual_seed(0)
    g = torch.randn(BIG, device="cuda", dtype=torch.bfloat16, generator=gen).mul_(3)
    u = torch.randn(BIG, device="cuda", dtype=torch.bfloat16, generator=gen)
    y = op(g, u)
    dg, du = backward_op(y, g, u)  # y doubles as the incoming gradient
    # Every element, chunk by chunk, against HF on the GPU (an element left unwritten shows up here).
    step = 2 ** 26
    for start in range(0, BIG, step):
        s = slice(start, min(start + step, BIG))
        gs, us = g[s].clone().requires_grad_(), u[s].clone().requires_grad_()
        ref = hf(gs, us)
        rdg, rdu = torch.autograd.grad(ref, (gs, us), y[s])
        for got, want in ((y[s], ref), (dg[s], rdg), (du[s], rdu)):
            assert ulps(got, want).max() <= 2 and (got != want).double().mean().item() <= 1e-3
        del gs, us, ref, rdg, rdu
    # And a few slices, the one across 2^31 included, against the CPU kernels.
    for start in (0, 2 ** 31 - 4096, BIG - 5000):
        s = slice(start, start + 5000)
        gc, uc = g[s].cpu(), u[s].cpu()
        assert_matches(y[s], op(gc, uc), "y")
        rdg, rdu = backward_op(y[s].cpu(), gc, uc)
        assert_matches(dg[s], rdg, "grad_gate")
        assert_matches(du[s], rdu, "grad_up")
