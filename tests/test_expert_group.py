"""torch.ops.bastile.expert_group, the token-expert pairs ordered by expert, against torch's stable sort.

The reference is the grouping transformers' grouped experts make (and Bastile's made before the op): a stable sort
of the pairs' experts, each expert's end counted from the sorted ids, and each pair's row, the sort's inverse.
"""
import pytest
import torch

from conftest import DEVICES, Contract, needs_cuda

op = torch.ops.bastile.expert_group


def reference(chosen, experts):
    expert, order = torch.sort(chosen.reshape(-1), stable=True)
    offsets = torch.bincount(expert, minlength=experts).cumsum(0).int()
    position = torch.empty_like(order).scatter_(0, order, torch.arange(len(order), device=order.device))
    return order, offsets, expert, position.view(chosen.shape)


def routed(tokens, k, experts, seed=0, distinct=True, device="cpu"):
    """[tokens, k] experts as a router picks them: k distinct experts a token (top-k), or any (repeats allowed)."""
    g = torch.Generator().manual_seed(seed)
    if distinct:
        chosen = torch.rand(tokens, experts, generator=g).topk(k, dim=-1).indices
    else:
        chosen = torch.randint(0, experts, (tokens, k), generator=g)
    return chosen.to(device)


def samples(device):
    # the first two differ in tokens only; the third routes a token to one expert twice and leaves experts unused
    return [((routed(5, 2, 8, 0, device=device), 8), {}), ((routed(7, 2, 8, 1, device=device), 8), {}),
            ((routed(3, 3, 16, 2, False, device=device), 16), {})]


def empty(device):
    return [((routed(0, 2, 8, device=device), 8), {}), ((torch.zeros(4, 0, dtype=torch.long, device=device), 8), {})]


BAD = [
    (lambda: op(routed(4, 2, 8).int(), 8), "expert_group: chosen must be int64, got Int"),
    (lambda: op(routed(4, 2, 8), -1), "expert_group: experts must be in 0..2\\^31, got -1"),
    (lambda: op(routed(4, 2, 8), 0), "expert_group: chosen has 8 pairs but there are no experts"),
    (lambda: op(torch.tensor([[0, 3], [8, 1]]), 8), "expert_group: chosen holds 8, outside 0..8"),
    (lambda: op(torch.tensor([[0, -1]]), 8), "expert_group: chosen holds -1, outside 0..8"),
]

CONTRACT = Contract(op=op, samples=samples, empty=empty, reference=reference, bad=BAD, differentiable=False)


def assert_grouped(got, chosen, experts):
    want = reference(chosen.cpu(), experts)
    assert [t.dtype for t in got] == [torch.long, torch.int32, torch.long, torch.long]
    for g, w in zip(got, want):
        assert torch.equal(g.cpu(), w)


SHAPES = [  # (tokens, k, experts, distinct)
    (1, 1, 1, True), (9, 2, 8, True), (33, 4, 64, False), (300, 1, 3, True),
    (4096, 8, 128, True),   # Qwen3-30B-A3B's 32,768 pairs: 32 spans
    (1000, 9, 512, True),   # Qwen3.5-397B-A17B's 512 experts, spans ending mid-warp
    (40000, 8, 257, False),  # more spans than the kernels' blocks (each takes more than 1,024 pairs)
]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("tokens,k,experts,distinct", SHAPES)
def test_matches_a_stable_sort(tokens, k, experts, distinct, device):
    chosen = routed(tokens, k, experts, tokens, distinct, device)
    assert_grouped(op(chosen, experts), chosen, experts)


@pytest.mark.parametrize("device", DEVICES)
def test_skewed_routing(device):
    """Every pair on one expert (a collapsed router), then on the last one: one expert's rows span every block."""
    for e in (0, 127):
        chosen = torch.full((5000, 2), e, dtype=torch.long, device=device)
        assert_grouped(op(chosen, 128), chosen, 128)


@needs_cuda
def test_cuda_refuses_more_experts_than_it_counts():
    with pytest.raises(RuntimeError, match="expert_group: 8193 experts are more than the CUDA kernels count \\(8192\\)"):
        op(torch.zeros(4, 2, dtype=torch.long, device="cuda"), 8193)
    chosen = routed(64, 2, 8192, distinct=False, device="cuda")
    assert_grouped(op(chosen, 8192), chosen, 8192)
