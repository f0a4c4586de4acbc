"""torch.ops.bastile.attention_sink (and its forward/backward pieces) against the softmax with a sink column.

The reference is the definition: a row's softmax over its scores and the head's sink logit, the sink's column
dropped, times the values, in fp64; the op gets the same attention computed without the sink (out and lse). Its
gradients are fp64 autograd's of y = out * exp(lse - logaddexp(lse, sink)); the sink's also through the softmax.
"""
import pytest
import torch

from conftest import CUDA, DEVICES, Contract, needs_cuda, poison_cuda_allocator, rel_err, ulps

op = torch.ops.bastile.attention_sink
forward_op = torch.ops.bastile.attention_sink_forward
backward_op = torch.ops.bastile.attention_sink_backward
DTYPES = [torch.bfloat16, torch.float16, torch.float32]


def reference(out, lse, sinks):
    """The op's expression in plain torch, at lse's precision, rounded to out's dtype."""
    normaliser = torch.logaddexp(lse, sinks.to(lse.dtype))
    return (out.to(lse.dtype) * torch.exp(lse - normaliser)[..., None]).to(out.dtype)


def attention(tokens, heads, dim, keys=6, seed=0):
    """fp64 (out, lse, sinks, y): rows of `keys` scores over values, out and lse their softmax without the sink,
    y with it (the definition, through torch.softmax of the scores and the sink)."""
    g = torch.Generator().manual_seed(seed)
    scores = torch.randn(tokens, heads, keys, dtype=torch.float64, generator=g) * 3
    values = torch.randn(tokens, heads, keys, dim, dtype=torch.float64, generator=g)
    sinks = torch.randn(heads, dtype=torch.float64, generator=g) * 3
    out = (torch.softmax(scores, -1)[..., None] * values).sum(-2)
    with_sink = torch.cat([scores, sinks[None, :, None].expand(tokens, heads, 1)], -1)
    y = (torch.softmax(with_sink, -1)[..., :-1, None] * values).sum(-2)
    return out, torch.logsumexp(scores, -1), sinks, y


def grads(fn, out, lse, sinks, dy):
    leaves = [t.detach().clone().requires_grad_() for t in (out, lse, sinks)]
    y = fn(*leaves)
    return (y.detach(), *torch.autograd.grad(y, leaves, dy))


def cast(out, lse, sinks, dtype, device):
    stats = torch.float64 if dtype == torch.float64 else torch.float32
    return out.to(device, dtype), lse.to(device, stats), sinks.to(device, dtype)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES + [torch.float64])
@pytest.mark.parametrize("dim", [64, 36, 1])
def test_values_and_gradients_match_fp64(device, dtype, dim):
    if dtype == torch.float64 and device == "cuda":
        pytest.skip("float64 runs on the CPU only (its refusal is a contract test)")
    out, lse, sinks, y_def = attention(37, 5, dim)
    dy = torch.randn(out.shape, dtype=out.dtype, generator=torch.Generator().manual_seed(1))
    args = cast(out, lse, sinks, dtype, device)
    y, g_out, g_lse, g_sinks = grads(op, *args, dy.to(device, dtype))
    # The definition's y, the expression's gradients, all exact, from the same rounded inputs.
    exact = [a.double().cpu() for a in args]
    y_ref, *g_ref = grads(lambda o, l, s: o * torch.exp(l - torch.logaddexp(l, s))[..., None], *exact, dy.to(dtype).double())
    y_soft = attention(37, 5, dim)[3]
    assert rel_err(y_ref, y_soft.to(dtype).double()) < 4 * torch.finfo(dtype).eps  # the two references agree
    unit = torch.finfo(dtype).eps
    # Rounded once, from a normaliser rounded to float32: that rounding (|L| < 8) is a few float32 units of y.
    within = {torch.float32: 8}.get(dtype, 1)
    for got, want in [(y, y_ref), (g_out, g_ref[0])]:
        assert got.dtype == dtype
        assert (ulps(got.cpu(), want) <= within).all() if dtype != torch.float64 else rel_err(got, want) < 1e-14
    # grad_lse = p_sink * sum(dy * y): y rounded to dtype, the normaliser to the statistics' dtype (|L| < 16), the
    # products summed at that precision; bounded by the size of the terms. The reference's autograd takes
    # 1 - exp(lse - L) for p_sink, which cancels: its own error is a few units of the sum without p_sink. grad_sinks
    # sums grad_lse over the tokens.
    _, l_e, s_e = exact
    stats = torch.finfo(args[1].dtype).eps
    products = (dy.to(dtype).double() * y_ref).abs().sum(-1)
    terms = torch.exp(s_e - torch.logaddexp(l_e, s_e)) * products
    bound = 2 * (2 * unit + (16 + dim) * stats) * terms + 8 * torch.finfo(torch.float64).eps * products
    assert ((g_lse.cpu().double() - g_ref[1]).abs() <= bound).all()
    assert ((g_sinks.cpu().double() - g_ref[2]).abs() <= bound.sum(0) + unit * g_ref[2].abs()).all()
    assert g_sinks.dtype == dtype and g_lse.dtype == args[1].dtype


def test_sink_gradient_through_the_softmax():
    """The sinks' gradient equals fp64 autograd's through the softmax over scores and sink (the definition)."""
    g = torch.Generator().manual_seed(3)
    scores = torch.randn(2, 9, 4, 9, dtype=torch.float64, generator=g)  # [batch, seq, heads, keys]
    values = torch.randn(2, 9, 4, 9, 8, dtype=torch.float64, generator=g)
    sinks = (torch.randn(4, dtype=torch.float64, generator=g) * 2).requires_grad_()
    dy = torch.randn(2, 9, 4, 8, dtype=torch.float64, generator=g)
    with_sink = torch.cat([scores, sinks[:, None].expand(2, 9, 4, 1)], -1)
    want = torch.autograd.grad((torch.softmax(with_sink, -1)[..., :-1, None] * values).sum(-2), sinks, dy)[0]
    out = (torch.softmax(scores, -1)[..., None] * values).sum(-2)
    got = torch.autograd.grad(op(out, torch.logsumexp(scores, -1), sinks), sinks, dy)[0]
    assert rel_err(got, want) < 1e-13


@pytest.mark.parametrize("device", DEVICES)
def test_pieces(device):
    """The normaliser is logaddexp(lse, sink), [heads, tokens] in memory whatever lse's layout; the backward
    without lse gives the same grad_lse and grad_sinks and an empty grad_out."""
    out, lse, sinks, _ = attention(12, 3, 16)
    out, lse, sinks = cast(out.reshape(3, 4, 3, 16), lse.reshape(3, 4, 3), sinks, torch.float32, device)
    for layout in (lse, lse.transpose(0, 1).contiguous().transpose(0, 1), lse.permute(2, 0, 1).contiguous().permute(1, 2, 0)):
        y, normaliser = forward_op(out, layout, sinks)
        assert torch.equal(y, op(out, lse, sinks))
        assert normaliser.shape == lse.shape and normaliser.permute(2, 0, 1).is_contiguous()
        torch.testing.assert_close(normaliser, torch.logaddexp(lse, sinks), rtol=0, atol=2e-6)
    dy = torch.randn_like(y)
    full, partial = backward_op(dy, y, normaliser, sinks, lse), backward_op(dy, y, normaliser, sinks)
    assert partial[0].numel() == 0 and full[0].shape == y.shape
    assert torch.equal(full[1], partial[1]) and torch.equal(full[2], partial[2])


def test_rows_that_see_no_key():
    """lse = -inf: the sink takes the row, y = 0 and the normaliser is the sink; the gradients stay finite."""
    out = torch.randn(2, 3, 4, generator=torch.Generator().manual_seed(5)).requires_grad_()
    lse = torch.tensor([[float("-inf"), 0.5, float("-inf")], [1.0, float("-inf"), 2.0]], requires_grad=True)
    sinks = torch.tensor([0.25, -1.0, 3.0], requires_grad=True)
    y, normaliser = forward_op(out.detach(), lse.detach(), sinks.detach())
    seen = ~torch.isinf(lse.detach())
    assert torch.equal(normaliser[~seen], sinks.detach().expand(2, 3)[~seen])
    assert (y[~seen] == 0).all() and (y[seen] != 0).all()
    op(out, lse, sinks).sum().backward()
    assert all(torch.isfinite(t.grad).all() for t in (out, lse, sinks))


@needs_cuda
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(333, 64, 64), (50, 8, 36), (7, 3, 200)], ids=["gpt-oss", "scalar-bf16", "wide"])
def test_cuda_equals_cpu(dtype, shape):
    """Every element written (the allocator poisoned), as the CPU kernels (f64 math) up to the GPU's f32 math;
    misaligned out and grad_y take the scalar kernels."""
    out, lse, sinks, _ = attention(*shape)
    dy = torch.randn_like(out)
    args = cast(out, lse, sinks, dtype, "cpu")
    y, g_out, g_lse, g_sinks = grads(op, *args, dy.to(dtype))
    # f32: exp(lse - L) from an L of f32 math (a few f32 units of |L| apart from the CPU's) and expf's own units.
    slack = 4 + 4 * forward_op(*args)[1].abs().max().item() if dtype == torch.float32 else 1
    # The row sums of dy * y over each side's y (they may differ by slack units of dtype), in f32, and exp(sink - L)
    # in f32; grad_sinks sums those, rounded to dtype.
    products = (dy.to(dtype).double() * y.double()).abs().sum(-1)
    row_bound = (slack * torch.finfo(dtype).eps + 1e-5) * products + 1e-5 * g_lse.double().abs()
    sinks_bound = row_bound.sum(0) + 2 * torch.finfo(dtype).eps * g_sinks.double().abs()
    for offset in (0, 1):
        flat = lambda t: torch.cat([t.new_zeros(offset), t.flatten()])[offset:].view(t.shape)
        poison_cuda_allocator(1 << 24)
        o, l, s = cast(out, lse, sinks, dtype, "cuda")
        gpu = [t.cpu() for t in grads(op, flat(o), l, s, flat(dy.to("cuda", dtype)))]
        for name, got, want in zip(("y", "grad_out", "grad_lse", "grad_sinks"), gpu, (y, g_out, g_lse, g_sinks)):
            assert torch.isfinite(got).all(), f"{name}: {got}"
            if name in ("y", "grad_out"):
                assert ulps(got, want).max() <= slack, f"{name}: {ulps(got, want).max()} units"
            else:
                bound = row_bound if name == "grad_lse" else sinks_bound
                excess = ((got.double() - want.double()).abs() / bound).max()
                assert excess <= 1, f"{name}: {excess} times its bound"


def samples(device):
    f32 = lambda *s: torch.randn(*s, device=device)
    call = lambda o, l, h: ((f32(*o).requires_grad_(), f32(*l).requires_grad_(), f32(h).requires_grad_()), {})
    return [call((6, 4, 8), (6, 4), 4), call((9, 4, 8), (9, 4), 4), call((2, 5, 3, 12), (2, 5, 3), 3)]


def empty(device):
    z = lambda *s: torch.randn(*s, device=device, requires_grad=True)
    return [((z(0, 4, 8), z(0, 4), z(4)), {}), ((z(3, 4, 0), z(3, 4), z(4)), {}), ((z(3, 0, 8), z(3, 0), z(0)), {})]


def gradcheck_samples():
    out, lse, sinks, _ = attention(5, 3, 4)
    return [((out.requires_grad_(), lse.requires_grad_(), sinks.requires_grad_()), {})]


f32 = lambda *s: torch.randn(*s)
BAD = [
    (lambda: op(f32(4, 8), f32(4, 3), f32(8)), "lse must have out's shape without its last dim"),
    (lambda: op(f32(8), f32(1), f32(1)), "out must be \\[..., heads, dim\\]"),
    (lambda: op(f32(4, 3, 8), f32(4, 3), f32(4)), "sinks must have shape \\[heads\\] = \\[3\\]"),
    (lambda: op(f32(4, 3, 8), f32(4, 3).double(), f32(3)), "lse must be Float for out of Float, got Double"),
    (lambda: op(f32(4, 3, 8).half(), f32(4, 3).half(), f32(3)), "lse must be Float for out of Half"),
    (lambda: op(torch.ones(4, 3, 8, dtype=torch.int32), f32(4, 3), f32(3)), "out must be float32"),
    (lambda: op(f32(4, 3, 8), f32(4, 3), torch.ones(3, dtype=torch.int64)), "sinks must be float32"),
    (lambda: op(f32(4, 3, 8), torch.randn(4, 3, device="meta"), f32(3)), "out is on cpu but lse is on meta"),
    (lambda: backward_op(f32(4, 3, 7), f32(4, 3, 8), f32(4, 3), f32(3)), "y and grad_y must have the same shape"),
    (lambda: backward_op(f32(4, 3, 8).half(), f32(4, 3, 8), f32(4, 3), f32(3)), "y and grad_y must have the same dtype"),
    (lambda: backward_op(f32(4, 3, 8), f32(4, 3, 8), f32(3, 4), f32(3)), "normaliser must have y's shape"),
]

CONTRACT = Contract(op=op, samples=samples, empty=empty, reference=reference, bad=BAD,
                    gradcheck_samples=gradcheck_samples)
