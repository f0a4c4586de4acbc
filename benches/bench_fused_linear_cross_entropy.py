"""Fused linear cross-entropy on the GPU: Bastile vs HF eager (F.linear + f32 cross-entropy), torch.compile
of it, Liger Kernel (when installed), and "gemm3", the three bare GEMMs of the same shapes (logits,
grad_hidden, grad_weight), the floor any fused implementation stands on.

    python benches/bench_fused_linear_cross_entropy.py    # bf16, Qwen3 vocab; CSV under $OUT or bench-results/

Forward+backward only (training is what the fusion is for). TFLOP/s counts the three GEMMs: 6 N H V.
Peak extra memory: torch.cuda.max_memory_allocated during one fwd+bwd, less what was allocated before.
`cases(shape, dtype)` is what bench_kernels.py measures too (there also the forward alone, 2 N H V, on
inputs that need no gradient, and the backward alone).
"""
import argparse
import json
import os
import subprocess
import sys
from functools import partial

import torch
import torch.nn.functional as F
from common import (Case, Impl, chosen, device, environment, fmt, measure_rounds, parse, parser, report, throughput,
                    with_rounds)

import bastile

VOCAB = 151936


def eager(h, w, t):
    return F.cross_entropy(F.linear(h, w).float(), t)


# Bastile with the logits from cuBLAS and a pass over them (its path before its own Hopper GEMM): "bastile"
# in a child process with BASTILE_CROSS_ENTROPY_GEMM=cublas, which the library reads once a process.
CUBLAS = "bastile_cublas"


def implementations():
    impls = {
        "bastile": lambda h, w, t: bastile.fused_linear_cross_entropy(h, w, t),
        "bastile_bf16_wgrad": lambda h, w, t: bastile.fused_linear_cross_entropy(h, w, t, fp32_weight_grad=False),
        "eager": eager,
        "compile": torch.compile(eager, dynamic=False),
    }
    try:
        from liger_kernel.ops.fused_linear_cross_entropy import LigerFusedLinearCrossEntropyFunction

        def liger(h, w, t):
            out = LigerFusedLinearCrossEntropyFunction.apply(h, w, t)
            return out[0] if isinstance(out, tuple) else out  # newer versions also return z-loss, accuracy

        impls["liger"] = liger
    except ImportError:
        pass
    return impls


def gemm3(h, w, g_logits):
    """The GEMMs a fused loss cannot avoid: logits, grad_hidden, grad_weight."""
    torch.mm(h, w.t())
    torch.mm(g_logits, w)
    torch.mm(g_logits.t(), h)


def cases(shape: str, dtype: torch.dtype, vocab: int = VOCAB) -> Case:
    """shape: tokens x hidden; the weight is [vocab, hidden], every tenth target ignored."""
    n, hdim = map(int, shape.split("x"))
    h = torch.randn(n, hdim, device=device(), dtype=dtype)
    w = (torch.randn(vocab, hdim, device=device()) / hdim ** 0.5).to(dtype)
    t = torch.randint(0, vocab, (n,), device=device())
    t[::10] = -100
    leaves = (h.detach().requires_grad_(), w.detach().requires_grad_())  # the same storage, for training
    reference = []

    def impl(f):
        def check():  # the loss, without and with gradients (fused impls form them in the forward)
            if not reference:
                with torch.no_grad():
                    reference.append(eager(h, w, t).float())
            torch.testing.assert_close(f(h, w, t).float(), reference[0], rtol=2e-3, atol=2e-3)
            torch.testing.assert_close(f(*leaves, t).detach().float(), reference[0], rtol=2e-3, atol=2e-3)

        return Impl(forward=lambda: f(h, w, t), graph=lambda: (f(*leaves, t), leaves, None), check=check)

    def bare():
        g_logits = torch.randn(n, vocab, device=device(), dtype=dtype) * 1e-3
        return Impl(timed={"fwdbwd": lambda: gemm3(h, w, g_logits)})

    flops = 2 * n * hdim * vocab
    return Case(f"{shape}x{vocab}", "TFLOP/s", {"fwd": flops, "bwd": None, "fwdbwd": 3 * flops},
                {"gemm3": bare, **{name: partial(impl, f) for name, f in implementations().items()}},
                reps=20, warmup=3)


def main():
    ap = with_rounds(parser("8192x1024,8192x4096,32768x2048", "gemm3,bastile,bastile_cublas,bastile_bf16_wgrad,eager,compile,liger",
                            "NxH, comma-separated"), default=2)
    ap.add_argument("--vocab", type=int, default=VOCAB)
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = parse(ap)
    dtype = getattr(torch, args.dtype)
    if not args.child:
        print(environment(), flush=True)
    rows = []
    for shape in args.shapes.split(","):
        case = cases(shape, dtype, args.vocab)
        results = measure_rounds(case, list(chosen(case.impls, args)), ("fwdbwd",), args.rounds)
        for name, r in results.items():
            ms, peak = r["fwdbwd"]
            rows.append({"shape": case.shape, "dtype": args.dtype, "impl": CUBLAS if args.child else name,
                         "fwdbwd_ms": fmt(ms, 3), "TFLOPs": fmt(throughput(ms, case.work["fwdbwd"]), 1),
                         "peak_extra_GiB": fmt(peak, 3)})
            print(("ROW " + json.dumps(rows[-1])) if args.child else rows[-1], flush=True)
        del case
    if args.child:
        return
    if CUBLAS in args.impls.split(","):
        torch.cuda.empty_cache()
        argv = [sys.executable, __file__, "--child", "--impls", "bastile", "--shapes", args.shapes, "--dtype",
                args.dtype, "--rounds", str(args.rounds), "--vocab", str(args.vocab), "--device", args.device]
        out = subprocess.run(argv, env={**os.environ, "BASTILE_CROSS_ENTROPY_GEMM": "cublas"}, check=True,
                             stdout=subprocess.PIPE, text=True).stdout
        rows += [json.loads(line[4:]) for line in out.splitlines() if line.startswith("ROW ")]
        rows.sort(key=lambda r: args.shapes.split(",").index(r["shape"].rsplit("x", 1)[0]))  # stable: by shape
    report("fused_linear_cross_entropy", rows, ["shape", "impl", "fwdbwd_ms", "TFLOPs", "peak_extra_GiB"])


if __name__ == "__main__":
    main()
