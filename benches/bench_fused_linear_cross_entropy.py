"""Fused linear cross-entropy on the GPU: Bastile vs HF eager (F.linear + f32 cross-entropy), torch.compile
of it, Liger Kernel (when installed), and "gemm3", the three bare GEMMs of the same shapes (logits,
grad_hidden, grad_weight), the floor any fused implementation stands on.

    python benches/bench_fused_linear_cross_entropy.py    # bf16, Qwen3 vocab; CSV under $OUT or bench-results/

Forward+backward only (training is what the fusion is for). TFLOP/s counts the three GEMMs: 6 N H V.
Peak extra memory: torch.cuda.max_memory_allocated during one fwd+bwd, less what was allocated before.
"""

import torch
import torch.nn.functional as F
from common import chosen, environment, parser, report, time_ms

import bastile

VOCAB = 151936


def eager(h, w, t):
    return F.cross_entropy(F.linear(h, w).float(), t)


def implementations():
    impls = {
        "bastile": lambda h, w, t: bastile.ops.fused_linear_cross_entropy(h, w, t),
        "bastile_bf16_wgrad": lambda h, w, t: bastile.ops.fused_linear_cross_entropy(h, w, t, fp32_weight_grad=False),
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


def peak_extra_gib(fn):
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    fn()
    torch.cuda.synchronize()
    return (torch.cuda.max_memory_allocated() - before) / 2 ** 30


def main():
    ap = parser("8192x1024,8192x4096,32768x2048", "gemm3,bastile,bastile_bf16_wgrad,eager,compile,liger",
                "NxH, comma-separated")
    ap.add_argument("--vocab", type=int, default=VOCAB)
    args = ap.parse_args()
    dtype = getattr(torch, args.dtype)
    wanted = args.impls.split(",")
    vocab = args.vocab
    print(environment(), flush=True)
    rows_out = []
    for shape in args.shapes.split(","):
        n, hdim = map(int, shape.split("x"))
        flops = 6 * n * hdim * vocab
        h = torch.randn(n, hdim, device="cuda", dtype=dtype, requires_grad=True)
        w = (torch.randn(vocab, hdim, device="cuda") / hdim ** 0.5).to(dtype).requires_grad_()
        t = torch.randint(0, vocab, (n,), device="cuda")
        t[::10] = -100

        def record(name, ms, peak):
            rows_out.append({
                "shape": f"{shape}x{vocab}", "dtype": args.dtype, "impl": name,
                "fwdbwd_ms": "OOM" if ms is None else f"{ms:.3f}",
                "TFLOPs": "" if ms is None else f"{flops / ms / 1e9:.1f}",
                "peak_extra_GiB": "" if peak is None else f"{peak:.3f}",
            })
            print(rows_out[-1], flush=True)

        if "gemm3" in wanted:
            g_logits = torch.randn(n, vocab, device="cuda", dtype=dtype) * 1e-3
            with torch.no_grad():
                record("gemm3", time_ms(lambda: gemm3(h, w, g_logits), reps=20), None)
            del g_logits
        reference = None
        for name, f in chosen(implementations(), args).items():

            def step():
                h.grad = w.grad = None
                loss = f(h, w, t)
                loss.backward()
                return loss

            try:
                loss = step()  # warm up (and compile)
                if reference is None:
                    reference = loss.detach().float()
                else:  # the same function before timing
                    torch.testing.assert_close(loss.detach().float(), reference, rtol=2e-3, atol=2e-3)
                h.grad = w.grad = None
                peak = peak_extra_gib(step)
                ms = time_ms(step, reps=20, warmup=3)
            except torch.OutOfMemoryError:
                h.grad = w.grad = None
                torch.cuda.empty_cache()
                record(name, None, None)
                continue
            h.grad = w.grad = None
            torch.cuda.empty_cache()
            record(name, ms, peak)
        del h, w, t
        torch.cuda.empty_cache()
    report("fused_linear_cross_entropy", rows_out, ["shape", "impl", "fwdbwd_ms", "TFLOPs", "peak_extra_GiB"])


if __name__ == "__main__":
    main()
