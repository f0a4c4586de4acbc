"""torch.ops.bastile.expert_route, a mixture of experts' router after its logits, against HF's routers and fp64.

The references are transformers' own expressions: Qwen3-MoE's router (softmax over all experts in float32, top-k,
the top-k renormalised by their sum where norm_topk_prob says), ERNIE 4.5's (the top-k of the softmax plus a
correction bias, renormalised by their sum clamped below at moe_norm_min) and GPT-OSS's (top-k of the logits,
softmax over them); their gradients are fp64 autograd's. Where logits tie, the choice is torch.topk's on CUDA: the lower index.
"""
import pytest
import torch

from conftest import DEVICES, Contract, needs_cuda, ulps

op = torch.ops.bastile.expert_route
backward_op = torch.ops.bastile.expert_route_backward


def stats(logits):
    return torch.float64 if logits.dtype == torch.float64 else torch.float32


def reference(logits, k, renorm, dtype=None, bias=None, norm_min=0.0):
    """HF's Qwen3-MoE router after its logits (transformers' Qwen3MoeTopKRouter.forward), ERNIE 4.5's with a bias
    (Ernie4_5_MoeTopKRouter.forward)."""
    probs = torch.softmax(logits.to(stats(logits)), dim=-1)
    chosen = torch.topk(probs if bias is None else probs + bias, k, dim=-1).indices
    top = probs.gather(-1, chosen)
    if renorm:
        top = top / torch.clamp(top.sum(dim=-1, keepdim=True), min=norm_min)
    return top.to(dtype or stats(logits)), chosen


def exact(logits, k, renorm, bias=None, norm_min=0.0):
    """fp64, the choice by a stable descending sort (ties to the lower index) of the logits, or of the float32
    softmax plus the bias: (weights, chosen)."""
    x = logits.detach().double().cpu().requires_grad_(logits.requires_grad)
    choice = x.detach() if bias is None else torch.softmax(x.detach(), -1).float() + bias.cpu().float()
    chosen = torch.sort(choice, dim=-1, descending=True, stable=True).indices[:, :k]
    probs = torch.softmax(x, dim=-1).gather(-1, chosen)
    return (probs / probs.sum(-1, keepdim=True).clamp(min=norm_min) if renorm else probs), chosen, x


def bias_of(experts, seed=11, device="cpu"):
    """A correction bias of ERNIE's size: as large as the probabilities it moves."""
    return torch.rand(experts, generator=torch.Generator().manual_seed(seed)).mul(0.05).to(device)


def logits_of(tokens, experts, seed=0, dtype=torch.float32, device="cpu"):
    return torch.randn(tokens, experts, generator=torch.Generator().manual_seed(seed)).mul(2).to(device, dtype)


def samples(device):
    # the first two differ in tokens only
    return [((logits_of(5, 8, 0, device=device).requires_grad_(), 2, True), {}),
            ((logits_of(7, 8, 1, device=device).requires_grad_(), 2, True), {}),
            ((logits_of(4, 40, 2, device=device).requires_grad_(), 6, False), {}),
            ((logits_of(6, 16, 3, device=device).requires_grad_(), 4, True, None, bias_of(16, device=device), 1e-12),
             {})]


def empty(device):
    return [((logits_of(0, 8, device=device).requires_grad_(), 2, True), {}),
            ((logits_of(3, 0, device=device).requires_grad_(), 0, False), {})]


BAD = [
    (lambda: op(torch.zeros(4, 8, dtype=torch.int32), 2, True), "expert_route: logits must be float32, float16, bfloat16"),
    (lambda: op(torch.zeros(2, 4, 8), 2, True), r"expert_route: logits must be \[tokens, experts\], got shape \[2, 4, 8\]"),
    (lambda: op(torch.zeros(4, 8), 9, True), "expert_route: k must be in 0..experts = 8, got 9"),
    (lambda: op(torch.zeros(4, 8), -1, True), "expert_route: k must be in 0..experts = 8, got -1"),
    (lambda: op(torch.zeros(4, 8), 2, True, torch.int64), "expert_route: dtype must be float32, float16, bfloat16"),
    (lambda: op(torch.zeros(4, 8), 2, True, None, torch.zeros(7)), r"expert_route: bias must be \[experts\] = \[8\], got shape \[7\]"),
    (lambda: op(torch.zeros(4, 8), 2, True, None, torch.zeros(8, dtype=torch.int32)), "expert_route: bias must be float32, float16, bfloat16"),
    (lambda: op(torch.zeros(4, 8), 2, True, None, None, -1.0), "expert_route: norm_min must be >= 0, got -1"),
    (lambda: backward_op(torch.zeros(4, 2), torch.zeros(4, 8), torch.zeros(4, 3, dtype=torch.long), True),
     "expert_route_backward: grad and chosen must have the same shape"),
    (lambda: backward_op(torch.zeros(4, 2), torch.zeros(4, 8), torch.zeros(4, 2, dtype=torch.int32), True),
     "expert_route_backward: chosen must be int64, got Int"),
    (lambda: backward_op(torch.zeros(1, 2), torch.zeros(1, 8), torch.tensor([[0, 8]]), True),
     "expert_route: chosen holds 8, outside 0..8"),
]

CONTRACT = Contract(op=op, samples=samples, empty=empty, reference=reference, bad=BAD)

# (logits' dtype, weights' dtype): Qwen3-MoE's and GPT-OSS's weights in the logits' dtype, Mixtral's float32
DTYPES = [(torch.float32, torch.float32), (torch.bfloat16, torch.bfloat16), (torch.bfloat16, torch.float32),
          (torch.float16, torch.float16), (torch.float16, torch.float32), (torch.float32, torch.bfloat16)]
# (tokens, experts, k): Mixtral's 8 / 2, GPT-OSS-20b's 32 / 4, OLMoE's 64 / 8, Qwen3-30B-A3B's 128 / 8, Qwen3-Next's
# 512 / 10, experts not a warp's multiple, every expert chosen, one expert, k beyond a warp
SHAPES = [(37, 8, 2), (19, 32, 4), (23, 64, 8), (41, 128, 8), (9, 512, 10), (13, 45, 7), (6, 5, 5), (3, 1, 1),
          (5, 100, 40)]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype,weights_dtype", DTYPES)
@pytest.mark.parametrize("tokens,experts,k", SHAPES)
@pytest.mark.parametrize("renorm", [True, False])
@pytest.mark.parametrize("biased", [False, True])
def test_values_and_gradients_match_fp64(device, dtype, weights_dtype, tokens, experts, k, renorm, biased):
    """The weights and the logits' gradient against fp64, the choice by the logits or (ERNIE's) by the softmax plus
    a correction bias."""
    logits = logits_of(tokens, experts, seed=experts + k, dtype=dtype, device=device).requires_grad_()
    bias = bias_of(experts, device=device) if biased else None
    weights, chosen = op(logits, k, renorm, weights_dtype, bias)
    assert (weights.dtype, chosen.dtype, weights.shape, chosen.shape) == (weights_dtype, torch.long, (tokens, k), (tokens, k))
    want, want_chosen, x = exact(logits, k, renorm, bias)
    assert torch.equal(chosen.cpu(), want_chosen)
    # computed in f32 and rounded once: float32 weights within the units of the exp, the division and the sum (a
    # lane's experts one after another, then the warp's tree), 16-bit ones within one unit
    assert ulps(weights.detach().cpu(), want).max() <= (8 + experts // 32 if weights_dtype == torch.float32 else 1)
    dy = torch.randn(tokens, k, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    (grad,) = torch.autograd.grad(weights, logits, dy.to(device, weights_dtype))
    (want_grad,) = torch.autograd.grad(want, x, dy.to(weights_dtype).double())
    assert grad.dtype == dtype
    # one rounding to the logits' dtype after an f32 computation over the row's terms
    bound = torch.finfo(dtype).eps * want_grad.abs() + 64 * torch.finfo(torch.float32).eps * dy.abs().max()
    assert ((grad.cpu().double() - want_grad).abs() <= bound).all()


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("norm_topk_prob", [True, False])
def test_equals_qwen3_moe_router(device, norm_topk_prob):
    """Qwen3-MoE's router in float32 after its logits: the same experts and weights within f32 roundings, and the
    logits' gradient."""
    logits = logits_of(64, 128, seed=3, device=device).requires_grad_()
    weights, chosen = op(logits, 8, norm_topk_prob, logits.dtype)
    want, want_chosen = reference(logits, 8, norm_topk_prob, logits.dtype)
    assert torch.equal(chosen, want_chosen)
    assert ulps(weights, want).max() <= 8  # two f32 computations of one softmax
    dy = torch.randn(64, 8, generator=torch.Generator().manual_seed(4)).to(device)
    (grad,) = torch.autograd.grad(weights, logits, dy)
    (want_grad,) = torch.autograd.grad(want, logits, dy)
    assert torch.allclose(grad, want_grad, rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_equals_ernie_router(device, dtype):
    """ERNIE 4.5's router after its float32 logits (64 experts, top 6: ERNIE-4.5-21B-A3B's): the experts its
    softmax plus the correction bias chooses, their weights renormalised by a sum clamped at moe_norm_min, in the
    hidden states' dtype; the logits' gradient."""
    logits = logits_of(64, 64, seed=12, device=device).requires_grad_()
    bias = bias_of(64, device=device)
    weights, chosen = op(logits, 6, True, dtype, bias, 1e-12)
    want, want_chosen = reference(logits, 6, True, dtype, bias, 1e-12)
    assert torch.equal(chosen, want_chosen)
    assert not torch.equal(chosen, op(logits, 6, True, dtype)[1])  # the bias chose some tokens' experts
    assert ulps(weights, want).max() <= (8 if dtype == torch.float32 else 1)
    dy = torch.randn(64, 6, generator=torch.Generator().manual_seed(13)).to(device, dtype)
    (grad,) = torch.autograd.grad(weights, logits, dy)
    (want_grad,) = torch.autograd.grad(want, logits, dy)
    rtol = 1e-5 if dtype == torch.float32 else 1e-2
    torch.testing.assert_close(grad, want_grad, rtol=rtol, atol=1e-6)


@pytest.mark.parametrize("device", DEVICES)
def test_norm_min_clamps_the_renormalising_sum(device):
    """Where the chosen probabilities sum below norm_min (a bias choosing unlikely experts), the weights are the
    probabilities over norm_min and the gradient clamp's (none through the sum), as torch.clamp's; elsewhere the
    renormalised ones. Against fp64 autograd of HF's expression, forward and backward."""
    logits = logits_of(40, 16, seed=14, device=device)
    logits[::2, :4] -= 12  # every other token's first four experts unlikely; the bias picks them for every token
    bias = torch.zeros(16, device=device)
    bias[:4] = 1.0
    x = logits.double().cpu().requires_grad_()
    # the bias ties the unlikely experts' choice values in float32 (Bastile's order) and not in fp64: by index
    by_index = lambda w, c: (c.sort(-1).values, w.gather(-1, c.sort(-1).indices))
    for norm_min in (0.2, 1e-12):
        chosen, weights = by_index(*op(logits.requires_grad_(), 4, True, torch.float32, bias, norm_min))
        want_chosen, want = by_index(*reference(x, 4, True, torch.float64, bias.cpu().double(), norm_min))
        assert torch.equal(chosen.cpu(), want_chosen)
        probs = torch.softmax(x.detach(), -1).gather(-1, want_chosen).sum(-1)
        assert (probs < norm_min).any() == (norm_min > 0.1) and not (probs < norm_min).all()  # both cases at 0.2
        torch.testing.assert_close(weights.detach().cpu().double(), want.detach(), rtol=1e-5, atol=1e-9)
        dy = torch.randn(40, 4, generator=torch.Generator().manual_seed(15), dtype=torch.float64)
        (grad,) = torch.autograd.grad(weights, logits, dy.to(device, torch.float32))
        (want_grad,) = torch.autograd.grad(want, x, dy)
        torch.testing.assert_close(grad.cpu().double(), want_grad, rtol=1e-4, atol=1e-7)
        logits = logits.detach()


@pytest.mark.parametrize("device", DEVICES)
def test_equals_gpt_oss_router(device):
    """GPT-OSS's router after its logits (top-k of the logits, a softmax over them in the logits' dtype): the
    renormalised route."""
    logits = logits_of(50, 32, seed=5, dtype=torch.bfloat16, device=device)
    _, want_chosen, _ = exact(logits, 4, True)
    weights, chosen = op(logits, 4, True, torch.bfloat16)
    assert torch.equal(chosen.cpu(), want_chosen)
    top = logits.cpu().double().gather(-1, want_chosen)
    assert torch.equal(top, torch.topk(logits.cpu().double(), 4, dim=-1).values)
    assert ulps(weights.cpu(), torch.softmax(top, dim=1)).max() <= 1


@needs_cuda
@pytest.mark.parametrize("k", [2, 8])
def test_ties_go_as_torch_topk_picks_them_on_cuda(k):
    """bfloat16 logits from few values tie often: the experts HF's router picks on the GPU (torch.topk of the
    float32 softmax), and their weights."""
    g = torch.Generator().manual_seed(6)
    logits = torch.randint(-4, 5, (4096, 128), generator=g).div(4).to("cuda", torch.bfloat16)
    weights, chosen = op(logits, k, True, torch.bfloat16)
    want, want_chosen = reference(logits, k, True, torch.bfloat16)
    # torch's order among tied values after its sort is its own: compare each token's (expert, weight) pairs
    by_expert = lambda w, c: (c.sort(-1).values, w.gather(-1, c.sort(-1).indices))
    got_c, got_w = by_expert(weights, chosen)
    want_c, want_w = by_expert(want, want_chosen)
    assert torch.equal(got_c, want_c)
    assert ulps(got_w, want_w).max() <= 1


@pytest.mark.parametrize("device", DEVICES)
def test_backward_piece_sums_repeated_slots(device):
    """A chosen expert repeated (which the forward never gives) gets each slot's gradient, as autograd sums a
    gather's: the fp64 gradient of the weights written out with the same choice."""
    logits = logits_of(3, 6, seed=7, dtype=torch.float64 if device == "cpu" else torch.float32, device=device)
    chosen = torch.tensor([[1, 1, 4], [0, 5, 0], [2, 3, 5]], device=device)
    grad = torch.randn(3, 3, generator=torch.Generator().manual_seed(8), dtype=logits.dtype).to(device)
    for renorm in (True, False):
        x = logits.detach().double().cpu().requires_grad_()
        e = torch.exp(x - x.max(-1, keepdim=True).values)
        picked = e.gather(-1, chosen.cpu())
        w = picked / (picked.sum(-1, keepdim=True) if renorm else e.sum(-1, keepdim=True))
        (want,) = torch.autograd.grad(w, x, grad.double().cpu())
        got = backward_op(grad, logits, chosen, renorm)
        assert torch.allclose(got.double().cpu(), want, rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("device", DEVICES)
def test_nan_and_infinite_logits_propagate_as_the_reference(device):
    """A NaN logit is picked first and makes the token's weights NaN, as HF's softmax does; -inf logits are never
    picked ahead of finite ones."""
    logits = logits_of(3, 16, seed=9, device=device)
    logits[0, 5] = float("nan")
    logits[1, :8] = float("-inf")
    weights, chosen = op(logits, 4, True)
    assert chosen[0, 0] == 5 and weights[0].isnan().all()
    assert (chosen[1] >= 8).all() and weights[1].isfinite().all()
