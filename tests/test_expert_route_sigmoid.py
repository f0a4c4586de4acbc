"""torch.ops.bastile.expert_route_sigmoid, the sigmoid router after its logits, against HF's routers and fp64.

The reference is transformers' own expression (Glm4MoeTopkRouter's, its groups too, and Lfm2MoeTopKRouter's): the scores'
sigmoid, the top-k of the scores plus a correction bias, their scores divided by their sum plus eps where the router
renormalises, times the routed scaling factor; gradients are fp64 autograd's. Ties go to the lower index, as
torch.topk picks on CUDA.
"""
import pytest
import torch

from conftest import DEVICES, Contract, ulps

op = torch.ops.bastile.expert_route_sigmoid
backward_op = torch.ops.bastile.expert_route_sigmoid_backward


def stats(logits):
    return torch.float64 if logits.dtype == torch.float64 else torch.float32


def reference(logits, k, bias=None, renorm=False, eps=0.0, scale=1.0, groups=1, group_k=1, dtype=None):
    """HF's sigmoid router after its logits (Glm4MoeTopkRouter.forward's, LFM2-MoE's)."""
    scores = logits.sigmoid()
    choice = scores if bias is None else scores + bias
    if group_k < groups:
        tokens, experts = choice.shape
        group_scores = choice.view(tokens, groups, experts // groups).topk(2, dim=-1)[0].sum(dim=-1)
        group_idx = torch.topk(group_scores, k=group_k, dim=-1, sorted=False)[1]
        group_mask = torch.zeros_like(group_scores).scatter_(1, group_idx, 1)
        score_mask = group_mask.unsqueeze(-1).expand(-1, groups, experts // groups).reshape(-1, experts)
        choice = choice.masked_fill(~score_mask.bool(), float("-inf"))
    chosen = torch.topk(choice, k, dim=-1).indices
    weights = scores.gather(1, chosen)
    if renorm:
        weights = weights / (weights.sum(dim=-1, keepdim=True) + eps)
    return (weights * scale).to(dtype or stats(logits)), chosen


def exact(logits, k, bias, renorm, eps, scale):
    """fp64 from the scores rounded to logits' dtype (HF's sigmoid output), the choice by a stable descending sort of
    the scores plus the bias in the promoted dtype (ties to the lower index): (weights, chosen, the fp64 leaf)."""
    x = logits.detach().double().cpu().requires_grad_()
    rounded = torch.sigmoid(x.detach()).to(logits.dtype).double()
    # the rounded values, with the gradient HF's sigmoid backward gives from its output: s (1 - s)
    scores = rounded + (x - x.detach()) * rounded * (1 - rounded)
    choice = rounded if bias is None else (rounded.to(torch.promote_types(logits.dtype, torch.float32)) + bias.cpu())
    chosen = torch.sort(choice.double(), dim=-1, descending=True, stable=True).indices[:, :k]
    weights = scores.gather(1, chosen)
    if renorm:
        weights = weights / (weights.sum(-1, keepdim=True) + eps)
    return weights * scale, chosen, x


def logits_of(tokens, experts, seed=0, dtype=torch.float32, device="cpu"):
    return torch.randn(tokens, experts, generator=torch.Generator().manual_seed(seed)).mul(2).to(device, dtype)


def bias_of(experts, seed=1, device="cpu"):
    return torch.randn(experts, generator=torch.Generator().manual_seed(seed)).mul(0.3).to(device)


def samples(device):
    # the first two differ in tokens only
    return [((logits_of(5, 8, 0, device=device).requires_grad_(), 2), {}),
            ((logits_of(7, 8, 1, device=device).requires_grad_(), 2), {}),
            ((logits_of(4, 40, 2, device=device).requires_grad_(), 6, bias_of(40, device=device), True, 1e-6, 2.5), {}),
            ((logits_of(6, 32, 3, device=device).requires_grad_(), 4, bias_of(32, device=device)),
             dict(groups=4, group_k=2))]


def empty(device):
    return [((logits_of(0, 8, device=device).requires_grad_(), 2), {}),
            ((logits_of(3, 0, device=device).requires_grad_(), 0), {})]


BAD = [
    (lambda: op(torch.zeros(4, 8, dtype=torch.int32), 2), "expert_route_sigmoid: logits must be float32, float16"),
    (lambda: op(torch.zeros(4, 8), 9), "expert_route_sigmoid: k must be in 0..experts = 8, got 9"),
    (lambda: op(torch.zeros(4, 8), 2, torch.zeros(8, dtype=torch.int32)),
     "expert_route_sigmoid: bias must be float32, float16, bfloat16 or logits' Float, got Int"),
    (lambda: op(torch.zeros(4, 8), 2, torch.zeros(7)), r"expert_route_sigmoid: bias must be \[experts\] = \[8\]"),
    (lambda: op(torch.zeros(4, 8, requires_grad=True), 2, torch.zeros(8, requires_grad=True)),
     "expert_route_sigmoid: bias requires grad, but expert_route_sigmoid does not differentiate it"),
    (lambda: op(torch.zeros(4, 8), 2, groups=3), "expert_route_sigmoid: groups must be in 1..32 and divide the 8"),
    (lambda: op(torch.zeros(4, 8), 2, groups=4, group_k=5), "expert_route_sigmoid: group_k must be in 1..groups = 4"),
    (lambda: op(torch.zeros(4, 8), 2, groups=8, group_k=2), "a group scores by its two largest experts"),
    (lambda: backward_op(torch.zeros(1, 2), torch.zeros(1, 8), torch.tensor([[0, 8]]), True, 0.0, 1.0),
     "expert_route_sigmoid: chosen holds 8, outside 0..8"),
]

def gradcheck_samples():
    """The samples in float64 but the bias, float32 as the op takes it."""
    return [((logits_of(5, 8, 0, dtype=torch.float64).requires_grad_(), 2), {}),
            ((logits_of(4, 40, 2, dtype=torch.float64).requires_grad_(), 6, bias_of(40), True, 1e-6, 2.5), {}),
            ((logits_of(6, 32, 3, dtype=torch.float64).requires_grad_(), 4, bias_of(32)), dict(groups=4, group_k=2))]


CONTRACT = Contract(op=op, samples=samples, empty=empty, reference=reference, bad=BAD,
                    gradcheck_samples=gradcheck_samples)

# (logits' dtype, weights' dtype): GLM-4.5's float32, LFM2-MoE's in the logits' dtype
DTYPES = [(torch.float32, torch.float32), (torch.bfloat16, torch.bfloat16), (torch.float16, torch.float16),
          (torch.bfloat16, torch.float32)]
# (tokens, experts, k): LFM2-8B-A1B's 32 / 4, GLM-4.5-Air's 128 / 8, experts not a warp's multiple, k beyond a warp
SHAPES = [(37, 32, 4), (41, 128, 8), (13, 45, 7), (5, 100, 40)]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype,weights_dtype", DTYPES)
@pytest.mark.parametrize("tokens,experts,k", SHAPES)
@pytest.mark.parametrize("renorm,biased", [(False, False), (True, True), (True, False)])
def test_values_and_gradients_match_fp64(device, dtype, weights_dtype, tokens, experts, k, renorm, biased):
    logits = logits_of(tokens, experts, seed=experts + k, dtype=dtype, device=device).requires_grad_()
    bias = bias_of(experts, device=device) if biased else None
    weights, chosen = op(logits, k, bias, renorm, 1e-6, 2.5, dtype=weights_dtype)
    assert (weights.dtype, chosen.dtype, weights.shape) == (weights_dtype, torch.long, (tokens, k))
    want, want_chosen, x = exact(logits, k, bias, renorm, 1e-6, 2.5)
    assert torch.equal(chosen.cpu(), want_chosen)
    assert ulps(weights.detach().cpu(), want).max() <= (4 if weights_dtype == torch.float32 else 1)
    dy = torch.randn(tokens, k, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    (grad,) = torch.autograd.grad(weights, logits, dy.to(device, weights_dtype))
    (want_grad,) = torch.autograd.grad(want, x, dy.to(weights_dtype).double())
    unit = torch.finfo(dtype).eps
    bound = unit * want_grad.abs() + 64 * torch.finfo(torch.float32).eps * dy.abs().max()
    assert ((grad.cpu().double() - want_grad).abs() <= bound).all()


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("tokens,experts,groups,group_k", [(64, 128, 1, 1), (200, 64, 8, 4), (200, 64, 4, 1),
                                                           (200, 64, 32, 4), (200, 64, 2, 2)])
def test_equals_glm_router(device, tokens, experts, groups, group_k):
    """GLM-4.5's router after its float32 logits, with n_group groups of which topk_group choose: the same experts
    (HF's top-k leaves them unsorted: compared by index) with their weights within f32 roundings, and the logits'
    gradient."""
    logits = logits_of(tokens, experts, seed=5, device=device).requires_grad_()
    bias = bias_of(experts, seed=6, device=device)
    weights, chosen = op(logits, 8, bias, True, 1e-20, 2.5, groups, group_k)
    want, want_chosen = reference(logits, 8, bias, True, 1e-20, 2.5, groups, group_k)
    by_index = lambda w, c: (c.sort(-1).values, w.gather(-1, c.sort(-1).indices))
    (got_c, got_w), (want_c, want_w) = by_index(weights, chosen), by_index(want, want_chosen)
    assert torch.equal(got_c, want_c)
    assert ulps(got_w, want_w).max() <= 4
    dy = torch.randn(tokens, 8, generator=torch.Generator().manual_seed(7)).to(device)
    (grad,) = torch.autograd.grad(got_w, logits, dy)
    (want_grad,) = torch.autograd.grad(want_w, logits, dy)
    torch.testing.assert_close(grad, want_grad, rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize("device", DEVICES)
def test_bias_of_the_logits_dtype_chooses_by_their_rounded_sum(device):
    """A bf16 bias with bf16 logits (LFM2-MoE's expert_bias after model.to(bfloat16)): the choice by the scores plus
    the bias summed in bf16, as torch sums two bf16 tensors (ties to the lower index); with float32 logits (GLM-4.5's)
    the sum is float32's."""
    logits = logits_of(300, 32, seed=9, dtype=torch.bfloat16, device=device)
    bias = bias_of(32, seed=10, device=device).bfloat16()
    _, chosen = op(logits, 4, bias, True, 1e-6, 1.0)
    choice = torch.sigmoid(logits.cpu()) + bias.cpu()
    assert choice.dtype == torch.bfloat16
    want = torch.sort(choice.float(), dim=-1, descending=True, stable=True).indices[:, :4]
    assert torch.equal(chosen.cpu(), want)
    _, chosen32 = op(logits, 4, bias.float(), True, 1e-6, 1.0)
    assert not torch.equal(chosen32, chosen)  # the rounding decides some tokens' experts here
    # GLM-4.5's float32 logits with its correction bias in bf16 (the model in bf16): the sum is float32's
    wide = logits.float()
    assert torch.equal(op(wide, 4, bias, True, 1e-6, 1.0)[1], op(wide, 4, bias.float(), True, 1e-6, 1.0)[1])


@pytest.mark.parametrize("device", DEVICES)
def test_backward_piece_sums_repeated_slots(device):
    """A chosen expert repeated gets each slot's gradient, as autograd sums a gather's."""
    logits = logits_of(3, 6, seed=7, device=device)
    chosen = torch.tensor([[1, 1, 4], [0, 5, 0], [2, 3, 5]], device=device)
    grad = torch.randn(3, 3, generator=torch.Generator().manual_seed(8)).to(device)
    for renorm in (True, False):
        x = logits.detach().double().cpu().requires_grad_()
        rounded = torch.sigmoid(x.detach()).float().double()
        s = rounded + (x - x.detach()) * rounded * (1 - rounded)
        w = s.gather(1, chosen.cpu())
        w = 2.5 * (w / (w.sum(-1, keepdim=True) + 1e-6) if renorm else w)
        (want,) = torch.autograd.grad(w, x, grad.double().cpu())
        got = backward_op(grad, logits, chosen, renorm, 1e-6, 2.5)
        torch.testing.assert_close(got.double().cpu(), want, rtol=1e-5, atol=1e-6)
