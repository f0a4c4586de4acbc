"""The experts' grouped GEMMs. `--op swiglu`: gate/up with the gated activation, Bastile's expert_swiglu (one
kernel on Hopper) against what bastile.experts ran before it, torch's grouped GEMM (CUTLASS) then the `swiglu` op,
and torch's grouped GEMM alone (the product without the activation). `--op linear`: the plain product (down's, and
a LoRA'd gate/up's, and the inputs' gradients through each), Bastile's expert_linear against torch's grouped GEMM.

    python benches/bench_expert_swiglu.py            # Qwen3-30B-A3B, Qwen3.5-35B-A3B, Mixtral-8x7B at 4096 tokens
    python benches/bench_expert_swiglu.py --shapes 4096x8x128x2048x768x1
    python benches/bench_expert_swiglu.py --op linear   # down at those models' shapes, Qwen3's gate/up, their dX, GPT-OSS's

Shape tokens x top-k x experts x in x inter x skew (`--op linear`: x out x skew [x n]; n: the weight N-major, as
the backward reads the stored weight for the inputs' gradient): the token-expert pairs are routed
at random, evenly (skew 0) or with expert weights u^4 (skew 1, a few experts many rows, some none). TFLOP/s count
2 * pairs * in * 2 * inter (2 * pairs * in * out) per call; the H200's bf16 dense rate is ~790.
"""
import argparse

import torch
from torch.nn import functional as F
from common import environment, markdown, out_dir, time_ms, write_csv

import bastile  # noqa: F401  (loads torch.ops.bastile)

SHAPES = {"swiglu": "4096x8x128x2048x768x0,4096x8x128x2048x768x1,4096x8x256x2048x512x0,4096x2x8x4096x14336x0",
          "linear": "4096x8x128x768x2048x0,4096x8x128x768x2048x1,4096x8x256x512x2048x0,4096x2x8x14336x4096x0,"
                    "4096x8x128x2048x1536x0,4096x8x128x2048x768x0xn,4096x8x128x1536x2048x0xn,4096x8x256x2048x512x0xn,"
                    "4096x2x8x4096x14336x0xn,4096x2x8x28672x4096x0xn,4096x4x32x2880x5760x0xn,4096x4x32x2880x2880x0xn,"
                    "4096x4x32x5760x2880x0"}


def routed(tokens, k, experts, hidden, skew):
    """The pairs' rows x and each expert's end."""
    g = torch.Generator().manual_seed(0)
    p = torch.rand(experts, generator=g) ** 4 if skew else torch.ones(experts)
    counts = torch.multinomial(p, tokens * k, replacement=True, generator=g).bincount(minlength=experts)
    return torch.randn(tokens * k, hidden, device="cuda", dtype=torch.bfloat16), counts.cumsum(0).int().cuda()


def linear_case(shape: str):
    *sizes, major = shape.split("x") if shape.endswith("xn") else (*shape.split("x"), "k")
    tokens, k, experts, hidden, out, skew = map(int, sizes)
    x, offsets = routed(tokens, k, experts, hidden, skew)
    weight = torch.randn(experts, out, hidden, device="cuda", dtype=torch.bfloat16) / hidden ** 0.5
    if major == "n":
        weight = weight.transpose(-2, -1).contiguous().transpose(-2, -1)
    impls = {"bastile": lambda: torch.ops.bastile.expert_linear(x, weight, offsets),
             "grouped_mm": lambda: F.grouped_mm(x, weight.transpose(-2, -1), offs=offsets)}
    torch.testing.assert_close(impls["bastile"](), impls["grouped_mm"](), rtol=2 ** -7, atol=1e-2)
    return 2 * tokens * k * hidden * out, impls


def case(shape: str):
    tokens, k, experts, hidden, inter, skew = map(int, shape.split("x"))
    x, offsets = routed(tokens, k, experts, hidden, skew)
    weight = torch.randn(experts, 2 * inter, hidden, device="cuda", dtype=torch.bfloat16) / hidden ** 0.5
    flop = 2 * tokens * k * hidden * 2 * inter

    def before():
        gate_up = F.grouped_mm(x, weight.transpose(-2, -1), offs=offsets)
        return gate_up, torch.ops.bastile.swiglu(gate_up[:, :inter], gate_up[:, inter:])

    impls = {"bastile": lambda: torch.ops.bastile.expert_swiglu(x, weight, offsets),
             "grouped_mm+swiglu": before,
             "grouped_mm": lambda: F.grouped_mm(x, weight.transpose(-2, -1), offs=offsets)}
    mine, theirs = impls["bastile"](), before()
    torch.testing.assert_close(mine[0], theirs[0], rtol=2 ** -7, atol=1e-2)
    torch.testing.assert_close(mine[1], theirs[1], rtol=2 ** -6, atol=2e-2)
    return flop, impls


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--op", choices=list(SHAPES), default="swiglu")
    ap.add_argument("--shapes", help=f"default: {SHAPES}")
    ap.add_argument("--rounds", type=int, default=3, help="each implementation's fastest of this many rounds")
    args = ap.parse_args()
    print(environment())
    rows = []
    for shape in (args.shapes or SHAPES[args.op]).split(","):
        flop, impls = (case if args.op == "swiglu" else linear_case)(shape)
        best = {name: min(time_ms(fn, reps=30) for _ in range(args.rounds)) for name, fn in impls.items()}
        for name, ms in best.items():
            rows.append({"shape": shape, "impl": name, "ms": f"{ms:.4f}", "TFLOP/s": f"{flop / ms / 1e9:.0f}"})
        torch.cuda.empty_cache()
    write_csv(out_dir() / f"expert_{args.op}.csv", rows)
    print(markdown(rows, ["shape", "impl", "ms", "TFLOP/s"]))


if __name__ == "__main__":
    main()
