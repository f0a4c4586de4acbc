"""RMSNorm on the GPU: Bastile vs HF eager, torch.compile of HF, and Liger Kernel (when installed).

    python benches/bench_rms_norm.py            # bf16, the issue's shapes; CSV under $OUT or bench-results/

Effective bandwidth counts the bytes an ideal kernel must move: forward reads x and w and writes y;
forward+backward also reads dy and x again and writes dx and dw.
"""
import types

import torch
from common import BANDWIDTH_COLUMNS, bandwidth_row, chosen, parser, report, start, time_ms
from transformers.models.qwen3.modeling_qwen3 import Qwen3RMSNorm

import bastile

EPS = 1e-6
HF_FORWARD = Qwen3RMSNorm.forward


def hf(x, w):
    return HF_FORWARD(types.SimpleNamespace(weight=w, variance_epsilon=EPS), x)


def implementations():
    impls = {"bastile": lambda x, w: torch.ops.bastile.rms_norm(x, w, EPS), "hf_eager": hf,
             "torch_compile": torch.compile(hf, dynamic=False)}
    try:
        from liger_kernel.ops.rms_norm import LigerRMSNormFunction
        impls["liger"] = lambda x, w: LigerRMSNormFunction.apply(x, w, EPS, 0.0, "llama", False)
    except ImportError:
        pass
    return impls


def main():
    ap = parser("8192x1024,16384x2048,16384x4096,65536x128", "bastile,hf_eager,torch_compile,liger")
    args = ap.parse_args()
    dtype = getattr(torch, args.dtype)
    size = torch.finfo(dtype).bits // 8
    copy = start()
    rows_out = []
    for shape in args.shapes.split(","):
        rows, cols = map(int, shape.split("x"))
        x = torch.randn(rows, cols, device="cuda", dtype=dtype)
        w = (1 + 0.1 * torch.randn(cols, device="cuda")).to(dtype)
        g = torch.randn_like(x)
        xg, wg = x.clone().requires_grad_(), w.clone().requires_grad_()
        fwd_bytes = 2 * rows * cols * size + cols * size
        fwdbwd_bytes = fwd_bytes + 3 * rows * cols * size + 2 * cols * size
        for name, f in chosen(implementations(), args).items():
            ref = hf(x, w)
            torch.testing.assert_close(f(x, w), ref, rtol=2 ** -6, atol=1e-2)  # same function before timing
            fwd = time_ms(lambda: f(x, w))
            both = time_ms(lambda: torch.autograd.grad(f(xg, wg), (xg, wg), g))
            rows_out.append(bandwidth_row(shape, args.dtype, name, fwd, fwd_bytes, both, fwdbwd_bytes))
    report("rms_norm", rows_out, BANDWIDTH_COLUMNS, copy)


if __name__ == "__main__":
    main()
