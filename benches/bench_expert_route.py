"""A mixture of experts' router after its logits on the GPU: Bastile's expert_route vs HF's expression (Qwen3-MoE's
router: softmax in float32, top-k, the top-k divided by their sum, cast) and torch.compile of it.

    python benches/bench_expert_route.py      # Qwen3-30B-A3B, Mixtral, GPT-OSS-20b, Qwen3-Next, 16k tokens
    python benches/bench_expert_route.py --shapes 4096x128x8x1x0 --impls bastile,eager

Shape tokens x experts x k x renorm (0/1) x fp32 weights (1: Mixtral's router keeps them in float32; 0: the logits'
dtype, as Qwen3-MoE casts them). Effective bandwidth counts the bytes an ideal kernel moves: forward reads the
logits and writes the weights and experts; forward+backward also reads the weights' gradient and the logits again
and writes the logits' gradient. At these sizes the calls are launch-bound: the times are the measure.
"""
from functools import partial

import torch
from common import Case, Impl, bandwidth_main, device

import bastile  # noqa: F401  (loads torch.ops.bastile)


def eager(logits, k, renorm, dtype):
    """transformers' Qwen3MoeTopKRouter.forward after its logits."""
    probs = torch.softmax(logits, dtype=torch.float, dim=-1)
    top, chosen = torch.topk(probs, k, dim=-1)
    if renorm:
        top /= top.sum(dim=-1, keepdim=True)
    return top.to(dtype), chosen


def cases(shape: str, dtype: torch.dtype) -> Case:
    tokens, experts, k, renorm, fp32 = map(int, shape.split("x"))
    weights_dtype = torch.float32 if fp32 else dtype
    logits = torch.randn(tokens, experts, device=device(), dtype=dtype)
    dy = torch.randn(tokens, k, device=device(), dtype=weights_dtype)
    ref = eager(logits, k, bool(renorm), weights_dtype)
    impls = {"bastile": torch.ops.bastile.expert_route, "eager": eager,
             "compile": torch.compile(eager, dynamic=False)}

    def check(f):
        weights, chosen = f(logits, k, bool(renorm), weights_dtype)
        torch.testing.assert_close(weights.gather(-1, chosen.argsort(-1)), ref[0].gather(-1, ref[1].argsort(-1)),
                                   rtol=2 ** -7, atol=1e-6)

    def impl(f):
        leaves = (logits.clone().requires_grad_(),)
        return Impl(forward=lambda: f(logits, k, bool(renorm), weights_dtype),
                    graph=lambda: (f(leaves[0], k, bool(renorm), weights_dtype)[:1], leaves, (dy,)),
                    check=lambda: check(f))

    size, w_size = logits.element_size(), dy.element_size()
    fwd = tokens * experts * size + tokens * k * (w_size + 8)
    fwdbwd = fwd + tokens * k * (w_size + 8) + 2 * tokens * experts * size
    return Case(shape, "TB/s", {"fwd": fwd, "fwdbwd": fwdbwd}, {name: partial(impl, f) for name, f in impls.items()})


if __name__ == "__main__":
    bandwidth_main("expert_route", cases, "4096x128x8x1x0,4096x8x2x1x1,4096x32x4x1x0,4096x512x10x1x0,16384x128x8x0x0",
                   "bastile,eager,compile", shape_help="tokens x experts x k x renorm (0/1) x fp32-weights (0/1)")
