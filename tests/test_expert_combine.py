"""torch.ops.bastile.expert_combine (and its backward piece) against torch's expression and fp64.

The reference is what transformers' MoE layers compute after their experts: each pair's row times its routing
weight, summed over a token's k pairs, `(rows[position] * weights[..., None]).sum(1)`; its gradients are fp64
autograd's. The pairs' rows are shuffled as sorting by expert leaves them.
"""
import pytest
import torch

from conftest import DEVICES, Contract, needs_cuda, poison_cuda_allocator, ulps

op = torch.ops.bastile.expert_combine
backward_op = torch.ops.bastile.expert_dispatch
# (rows' dtype, weights' dtype): weights of the rows' dtype (Qwen3-MoE casts them), float32 (Mixtral, GLM), bf16
# with fp32 rows (an fp32 Qwen3-MoE under bf16 autocast), and a pair that promotes to float32.
DTYPES = [(torch.bfloat16, torch.bfloat16), (torch.bfloat16, torch.float32), (torch.float16, torch.float16),
          (torch.float16, torch.float32), (torch.float32, torch.float32), (torch.float32, torch.bfloat16),
          (torch.bfloat16, torch.float16)]


def reference(rows, position, weights=None, bias=None, expert=None):
    """torch's expression: products rounded to the promoted dtype, summed over k (each pair's row plus its expert's
    bias first, as HF adds the experts' down bias)."""
    picked = rows[position] if bias is None else rows[position] + bias[expert]
    return (picked * weights[..., None] if weights is not None else picked).sum(1)


def pairs(tokens, k, dim, seed=0, dtype=torch.float64):
    """(rows, position, weights, order): rows of a random permutation of the pairs (position and its inverse)."""
    g = torch.Generator().manual_seed(seed)
    rows = torch.randn(tokens * k, dim, generator=g, dtype=dtype)
    order = torch.randperm(tokens * k, generator=g)
    position = torch.empty_like(order).scatter_(0, order, torch.arange(tokens * k)).view(tokens, k)
    weights = torch.rand(tokens, k, generator=g, dtype=dtype)
    return rows, position, weights, order


def grads(fn, rows, position, weights, dy):
    leaves = [rows.detach().clone().requires_grad_(), weights.detach().clone().requires_grad_()]
    y = fn(leaves[0], position, leaves[1])
    return (y.detach(), *torch.autograd.grad(y, leaves, dy))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype,weights_dtype", DTYPES + [(torch.float64, torch.float64)])
@pytest.mark.parametrize("dim", [64, 36, 1])
def test_values_and_gradients_match_fp64(device, dtype, weights_dtype, dim):
    if dtype == torch.float64 and device == "cuda":
        pytest.skip("float64 runs on the CPU only (its refusal is a contract test)")
    rows, position, weights, _ = pairs(37, 4, dim)
    dy = torch.randn(37, dim, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    promoted = torch.promote_types(dtype, weights_dtype)
    args = rows.to(device, dtype), position.to(device), weights.to(device, weights_dtype)
    y, g_rows, g_weights = grads(op, *args, dy.to(device, promoted))
    assert (y.dtype, g_rows.dtype, g_weights.dtype) == (promoted, dtype, weights_dtype)
    exact = [a.cpu().double() if a.is_floating_point() else a.cpu() for a in args]
    y_ref, r_ref, w_ref = grads(reference, *exact, dy.to(promoted).double())
    # One rounding of each product and of the result; the weights' gradient is a sum over dim products in f32.
    unit = torch.finfo(promoted).eps
    terms = (exact[0][exact[1]].abs() * exact[2][..., None].abs()).sum(1)
    assert ((y.cpu().double() - y_ref).abs() <= 2 * unit * terms + 1e-300).all()
    assert ulps(g_rows.cpu(), r_ref).max() <= 1  # rounded once from f32 (twice from the exact product)
    w_terms = (dy.to(promoted).double()[:, None].abs() * exact[0][exact[1]].abs()).sum(-1)
    accumulated = torch.finfo(torch.float64 if dtype == torch.float64 else torch.float32).eps
    bound = (dim * accumulated + torch.finfo(weights_dtype).eps) * w_terms + 1e-300
    assert ((g_weights.cpu().double() - w_ref).abs() <= bound).all()


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype,weights_dtype", DTYPES)
def test_equals_torch_expression(device, dtype, weights_dtype):
    """torch's expression in its own dtypes, up to the order in which torch sums the k rounded products (one unit
    of the result's dtype, or f32 units of the terms' size)."""
    rows, position, weights, _ = pairs(50, 8, 72, seed=2)
    args = rows.to(device, dtype), position.to(device), weights.to(device, weights_dtype)
    got, want = op(*args).double(), reference(*args).double()
    terms = (args[0][args[1]].double() * args[2][..., None].double()).abs().sum(1)
    unit = torch.finfo(torch.promote_types(dtype, weights_dtype)).eps
    assert ((got - want).abs() <= unit * want.abs() + 8 * torch.finfo(torch.float32).eps * terms).all()
    assert torch.equal(op(args[0], args[1]), op(args[0], args[1], torch.ones_like(args[2]).to(dtype)))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype,weights_dtype", DTYPES)
def test_backward_piece_dispatches_each_token_to_its_pairs(device, dtype, weights_dtype):
    """Without weights, each row gets its token's gradient (a gather, exact); with weights, the product rounded
    once to dtype; with rows too, the weights' gradient as the op's autograd gives it."""
    rows, position, weights, order = pairs(21, 3, 40, seed=3)
    grad = torch.randn(21, 40, generator=torch.Generator().manual_seed(4)).to(device, dtype)
    order, weights = order.to(device), weights.to(device, weights_dtype)
    plain, none = backward_op(grad, order)
    assert torch.equal(plain, grad[order // 3]) and none.numel() == 0
    scaled, _ = backward_op(grad, order, weights, dtype=dtype)
    want = (grad[order // 3].to(torch.promote_types(dtype, weights_dtype)) * weights.view(-1)[order, None]).to(dtype)
    assert torch.equal(scaled, want)
    rows = rows.to(device, dtype)
    g = grad.to(torch.promote_types(dtype, weights_dtype))
    _, g_weights = backward_op(g, order, weights, rows)
    _, _, autograd_weights = grads(op, rows, position.to(device), weights, g)
    assert torch.equal(g_weights, autograd_weights)


def biased(tokens, k, dim, experts=4, seed=5):
    """pairs() and a bias [experts, dim] with each pair's expert [tokens, k], the last expert given no pair."""
    rows, position, weights, order = pairs(tokens, k, dim, seed)
    g = torch.Generator().manual_seed(seed + 1)
    return rows, position, weights, torch.randn(experts, dim, generator=g), torch.randint(0, experts - 1, (tokens, k), generator=g)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype,weights_dtype", DTYPES)
@pytest.mark.parametrize("offset", [0, 1])
@pytest.mark.parametrize("k", [3, 6, 10])
def test_bias_is_added_to_each_row_first(device, dtype, weights_dtype, offset, k):
    """With a bias, the op is the op without one on each row plus its pair's expert's bias as torch sums them (rounded
    once, as HF's `out + bias`): bit for bit, with the rows' and weights' gradients; the bias's gradient is each
    expert's rows' gradients summed (an expert with no pair gets 0). offset 1: a bias not 16-byte aligned (the scalar
    kernels). k 3 and 6: the CUDA kernels that hold 4 and 8 pairs a token in registers; k 10: more than they hold."""
    rows, position, weights, bias, expert = biased(29, k, 40)
    promoted = torch.promote_types(dtype, weights_dtype)
    rows, weights, position, expert = rows.to(device, dtype), weights.to(device, weights_dtype), position.to(device), expert.to(device)
    bias = torch.cat([bias.new_zeros(offset), bias.flatten()]).to(device, dtype)[offset:].view(bias.shape)
    dy = torch.randn(29, 40, generator=torch.Generator().manual_seed(7)).to(device, promoted)
    row_expert = torch.empty_like(expert.view(-1)).scatter_(0, position.view(-1), expert.view(-1))
    sums = rows + bias[row_expert]
    leaves = [t.detach().clone().requires_grad_() for t in (rows, weights, bias)]
    y = op(leaves[0], position, leaves[1], leaves[2], expert)
    g_rows, g_weights, g_bias = torch.autograd.grad(y, leaves, dy)
    want = grads(op, sums, position, weights, dy)
    for got, ref in zip((y.detach(), g_rows, g_weights), want):
        assert torch.equal(got, ref)
    exact = torch.zeros(bias.shape, dtype=torch.float64).index_add_(0, row_expert.cpu(), want[1].cpu().double())
    assert g_bias.dtype == dtype and (g_bias[-1] == 0).all()
    assert ((g_bias.cpu().double() - exact).abs() <= torch.finfo(dtype).eps * exact.abs() + 1e-6 * exact.abs().max()).all()


def test_position_must_be_a_permutation_for_the_backward():
    rows, position, weights, _ = pairs(3, 2, 4)
    position[1, 0] = position[0, 0]
    y = op(rows.requires_grad_(), position, weights)  # the forward is a gather: any rows may repeat
    assert torch.equal(y.detach(), reference(rows.detach(), position, weights))
    with pytest.raises(RuntimeError, match="expert_dispatch: order holds -1, outside 0..6"):
        y.sum().backward()


@needs_cuda
@pytest.mark.parametrize("dtype,weights_dtype", DTYPES)
@pytest.mark.parametrize("shape", [(333, 8, 2048), (50, 2, 36), (7, 4, 200), (20, 10, 64)],
                         ids=["qwen3-moe", "scalar", "wide", "k-past-held"])
def test_cuda_equals_cpu(dtype, weights_dtype, shape):
    """Every element written (the allocator poisoned), as the CPU kernels (f64 sums) up to the GPU's f32 sums of the
    same rounded terms: a unit of the result plus n f32 units of the terms' size (n: the terms summed); the rows'
    gradient is one rounding of the same product. Misaligned rows and gradients take the scalar kernels."""
    tokens, k, dim = shape
    rows, position, weights, _ = pairs(tokens, k, dim, dtype=torch.float32)
    promoted = torch.promote_types(dtype, weights_dtype)
    rows, weights, dy = rows.to(dtype), weights.to(weights_dtype), torch.randn(tokens, dim).to(promoted)
    cpu = grads(op, rows, position, weights, dy)
    picked = rows[position].double().abs()
    terms = {"y": (picked * weights.double().abs()[..., None]).sum(1), "grad_weights": (dy.double().abs()[:, None] * picked).sum(-1)}
    summed = {"y": k, "grad_weights": dim}
    for offset in (0, 1):
        flat = lambda t: torch.cat([t.new_zeros(offset), t.flatten()])[offset:].view(t.shape)
        poison_cuda_allocator(1 << 26)
        gpu = grads(op, flat(rows.cuda()), position.cuda(), weights.cuda(), flat(dy.cuda()))
        for name, got, want in zip(("y", "grad_rows", "grad_weights"), gpu, cpu):
            got = got.cpu()
            assert torch.isfinite(got).all(), name
            if name == "grad_rows":
                assert ulps(got, want).max() <= 1, name
                continue
            bound = torch.finfo(want.dtype).eps * want.double().abs() + summed[name] * 2 ** -24 * terms[name]
            excess = ((got.double() - want.double()).abs() / bound).max()
            assert excess <= 1, f"{name}: {excess} times its bound"


def samples(device):
    def call(tokens, k, dim, weighted=True):
        rows, position, weights, _ = pairs(tokens, k, dim, dtype=torch.float32)
        args = (rows.to(device).requires_grad_(), position.to(device))
        return (*args, weights.to(device).requires_grad_()) if weighted else args, {}
    rows, position, weights, bias, expert = biased(5, 2, 12)
    with_bias = ((rows.float().to(device).requires_grad_(), position.to(device), weights.float().to(device).requires_grad_(),
                  bias.to(device).requires_grad_(), expert.to(device)), {})
    return [call(4, 2, 20), call(6, 2, 20), call(3, 3, 5), call(5, 2, 7, weighted=False), with_bias]


def empty(device):
    def call(tokens, k, dim):
        z = lambda *s: torch.randn(*s, device=device, requires_grad=True)
        position = torch.arange(tokens * k, device=device).view(tokens, k)
        return (z(tokens * k, dim), position, z(tokens, k)), {}
    return [call(0, 2, 8), call(3, 0, 8), call(3, 2, 0)]


def gradcheck_samples():
    rows, position, weights, _ = pairs(5, 3, 4)
    _, _, _, bias, expert = biased(5, 3, 4)
    return [((rows.requires_grad_(), position, weights.requires_grad_()), {}),
            ((rows, position, weights, bias.double().requires_grad_(), expert), {})]


f32 = lambda *s: torch.randn(*s)
perm = lambda t, k: torch.arange(t * k).view(t, k)
BAD = [
    (lambda: op(f32(6), perm(3, 2)), "rows must be \\[tokens \\* k, dim\\]"),
    (lambda: op(f32(6, 4), perm(3, 2).int()), "position must be int64"),
    (lambda: op(f32(6, 4), perm(2, 2)), "position must be \\[tokens, k\\] with tokens \\* k = rows' 6"),
    (lambda: op(torch.ones(6, 4, dtype=torch.int32), perm(3, 2)), "rows must be float32"),
    (lambda: op(f32(6, 4).bfloat16(), perm(3, 2), f32(3, 2).double()),
     "weights of Double and rows of BFloat16 promote to Double, wider than the rows' dtype or float32"),
    (lambda: op(f32(6, 4), perm(3, 2), torch.ones(3, 2, dtype=torch.int64)), "weights must be float32"),
    (lambda: op(f32(6, 4), perm(3, 2), f32(2, 3)), "weights must be \\[tokens, k\\] with tokens = 3"),
    (lambda: op(f32(6, 4), perm(3, 2).to("meta")), "rows is on cpu but position is on meta"),
    (lambda: op(f32(6, 4), perm(3, 2) + 3), "position holds 6, outside 0..6"),
    (lambda: op(f32(6, 4), perm(3, 2), None, f32(2, 4)), "bias and expert go together .* got bias without expert"),
    (lambda: op(f32(6, 4), perm(3, 2), None, f32(2, 5), perm(3, 2) % 2),
     r"bias must be \[experts, 4\] \(the rows' dim\), got \[2, 5\]"),
    (lambda: op(f32(6, 4), perm(3, 2), None, f32(2, 4), torch.zeros(6, dtype=torch.long)),
     r"expert must be \[tokens, k\] as position, each pair's expert, got shape \[6\] for position's \[3, 2\]"),
    (lambda: op(f32(6, 4), perm(3, 2), None, f32(2, 4), (perm(3, 2) % 2).int()), "expert must be int64"),
    (lambda: op(f32(6, 4), perm(3, 2), None, f32(2, 4).half(), perm(3, 2) % 2), "rows and bias must have the same dtype"),
    (lambda: op(f32(6, 4), perm(3, 2), None, f32(2, 4), torch.tensor([[0, 1], [2, 0], [0, 0]])),
     "expert_combine: expert holds 2, outside 0..2"),
    (lambda: backward_op(f32(3, 4), perm(3, 2).view(-1), None, f32(6, 4)), "rows are for the weights' gradient"),
    (lambda: backward_op(f32(3, 4), torch.arange(5)), "order's length 5 must be tokens \\* k for x's 3 tokens"),
    (lambda: backward_op(f32(3, 4), perm(3, 2).view(-1), f32(3, 2), f32(6, 5)), "rows must be \\[tokens \\* k, dim\\]"),
    (lambda: backward_op(f32(3, 4), perm(3, 2).view(-1), dtype=torch.int32), "dtype must be float32"),
]

CONTRACT = Contract(op=op, samples=samples, empty=empty, reference=reference, bad=BAD,
                    gradcheck_samples=gradcheck_samples)
