"""SwiGLU on the GPU: Bastile vs HF eager (F.silu(g) * u), torch.compile of it, and Liger Kernel (when installed).

    python benches/bench_swiglu.py            # bf16, Qwen3 MLP shapes; CSV under $OUT or bench-results/

Effective bandwidth counts the bytes an ideal kernel must move: forward reads gate and up and writes y;
forward+backward also reads dy, gate and up and writes grad_gate and grad_up.
"""
import torch
import torch.nn.functional as F
from common import BANDWIDTH_COLUMNS, bandwidth_row, chosen, parser, report, start, time_ms

import bastile  # noqa: F401  (loads torch.ops.bastile)


def hf(g, u):
    return F.silu(g) * u


def implementations():
    impls = {"bastile": torch.ops.bastile.swiglu, "eager": hf, "compile": torch.compile(hf, dynamic=False)}
    try:
        from liger_kernel.ops.swiglu import LigerSiLUMulFunction
        impls["liger"] = LigerSiLUMulFunction.apply
    except ImportError:
        pass
    return impls


def main():
    ap = parser("8192x3072,16384x6144,16384x12288", "bastile,eager,compile,liger")
    args = ap.parse_args()
    dtype = getattr(torch, args.dtype)
    size = torch.finfo(dtype).bits // 8
    copy = start()
    rows_out = []
    for shape in args.shapes.split(","):
        rows, cols = map(int, shape.split("x"))
        g = 3 * torch.randn(rows, cols, device="cuda", dtype=dtype)
        u = torch.randn_like(g)
        dy = torch.randn_like(g)
        n = g.numel()
        fwd_bytes = 3 * n * size
        fwdbwd_bytes = fwd_bytes + 5 * n * size
        ref = hf(g, u)
        for name, f in chosen(implementations(), args).items():
            # Liger's backward writes the gradients over the saved inputs: every impl gets its own copies.
            gg, ug = g.clone().requires_grad_(), u.clone().requires_grad_()
            torch.testing.assert_close(f(g, u), ref, rtol=2 ** -6, atol=1e-2)  # same function before timing
            fwd = time_ms(lambda: f(g, u))
            both = time_ms(lambda: torch.autograd.grad(f(gg, ug), (gg, ug), dy))
            rows_out.append(bandwidth_row(shape, args.dtype, name, fwd, fwd_bytes, both, fwdbwd_bytes))
            del gg, ug
    report("swiglu", rows_out, BANDWIDTH_COLUMNS, copy)


if __name__ == "__main__":
    main()
