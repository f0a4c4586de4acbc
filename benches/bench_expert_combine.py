"""A mixture of experts' combine on the GPU: Bastile's expert_combine vs the expression it replaced (each pair's
row times its routing weight, put back in pair order, summed over a token's k pairs) and torch.compile of it.

    python benches/bench_expert_combine.py       # Qwen3-30B-A3B (bf16 weights) and GLM-4.5-Air (fp32 weights)
    python benches/bench_expert_combine.py --shapes 4096x8x2048x1 --impls bastile,eager

Shape tokens x k x hidden x (1: fp32 routing weights, as Mixtral's and GLM's routers keep them; 0: the rows'
dtype, as Qwen3-MoE casts them). Effective bandwidth counts the bytes an ideal kernel moves: forward reads the
rows and weights and writes the tokens; forward+backward also reads the gradient and the rows and writes the
rows' and weights' gradients.
"""
from functools import partial

import torch
from common import Case, Impl, bandwidth_main, device

import bastile  # noqa: F401  (loads torch.ops.bastile)


def eager(order, rows, position, weights):
    """experts.py before expert_combine: the products in the rows' order, put back in pair order, summed (order,
    position's inverse, comes with the grouping, as there)."""
    pair = rows * weights.reshape(-1)[order, None]
    return torch.empty_like(pair).index_copy_(0, order, pair).view(*position.shape, -1).sum(1)


def cases(shape: str, dtype: torch.dtype) -> Case:
    tokens, k, hidden, fp32 = map(int, shape.split("x"))
    pairs = tokens * k
    rows = torch.randn(pairs, hidden, device=device(), dtype=dtype)
    position = torch.randperm(pairs, device=device()).view(tokens, k)
    weights = torch.rand(tokens, k, device=device(), dtype=torch.float32 if fp32 else dtype)
    out_size = torch.promote_types(dtype, weights.dtype).itemsize
    dy = torch.randn(tokens, hidden, device=device(), dtype=torch.promote_types(dtype, weights.dtype))
    order = torch.empty_like(position.view(-1)).scatter_(0, position.view(-1), torch.arange(pairs, device=device()))
    ref = eager(order, rows, position, weights)
    impls = {"bastile": torch.ops.bastile.expert_combine, "eager": partial(eager, order),
             "compile": partial(torch.compile(eager, dynamic=False), order)}

    def impl(f):
        leaves = (rows.clone().requires_grad_(), weights.clone().requires_grad_())
        return Impl(forward=lambda: f(rows, position, weights),
                    graph=lambda: (f(leaves[0], position, leaves[1]), leaves, dy),
                    check=lambda: torch.testing.assert_close(f(rows, position, weights), ref, rtol=2 ** -6, atol=1e-2))

    n, size = rows.numel(), rows.element_size()
    fwd = n * size + tokens * hidden * out_size
    # forward + the backward's gradient read (once per pair), rows read, the rows' gradient written
    fwdbwd = fwd + n * out_size + 2 * n * size
    return Case(shape, "TB/s", {"fwd": fwd, "fwdbwd": fwdbwd}, {name: partial(impl, f) for name, f in impls.items()})


if __name__ == "__main__":
    bandwidth_main("expert_combine", cases, "4096x8x2048x0,4096x8x4096x1", "bastile,eager,compile",
                   shape_help="tokens x k x hidden x fp32-weights (0/1), comma-separated")
