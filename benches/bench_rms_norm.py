"""RMSNorm on the GPU: Bastile vs HF eager, torch.compile of HF, and Liger Kernel (when installed).

    python benches/bench_rms_norm.py            # bf16, the issue's shapes; CSV under $OUT or bench-results/

Effective bandwidth counts the bytes an ideal kernel must move: forward reads x and w and writes y;
forward+backward also reads dy and x again and writes dx and dw.
"""
import argparse
import types

import torch
from common import copy_bandwidth_tbs, environment, markdown, out_dir, time_ms, write_csv
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
    ap = argparse.ArgumentParser()
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--shapes", default="8192x1024,16384x2048,16384x4096,65536x128")
    ap.add_argument("--impls", default="bastile,hf_eager,torch_compile,liger", help="comma-separated subset")
    args = ap.parse_args()
    dtype = getattr(torch, args.dtype)
    size = torch.finfo(dtype).bits // 8
    print(environment(), flush=True)
    copy = copy_bandwidth_tbs()
    print(f"device copy: {copy:.2f} TB/s", flush=True)
    rows_out = []
    for shape in args.shapes.split(","):
        rows, cols = map(int, shape.split("x"))
        x = torch.randn(rows, cols, device="cuda", dtype=dtype)
        w = (1 + 0.1 * torch.randn(cols, device="cuda")).to(dtype)
        g = torch.randn_like(x)
        xg, wg = x.clone().requires_grad_(), w.clone().requires_grad_()
        fwd_bytes = 2 * rows * cols * size + cols * size
        fwdbwd_bytes = fwd_bytes + 3 * rows * cols * size + 2 * cols * size
        for name, f in implementations().items():
            if name not in args.impls.split(","):
                continue
            ref = hf(x, w)
            torch.testing.assert_close(f(x, w), ref, rtol=2 ** -6, atol=1e-2)  # same function before timing
            fwd = time_ms(lambda: f(x, w))
            both = time_ms(lambda: torch.autograd.grad(f(xg, wg), (xg, wg), g))
            rows_out.append({
                "shape": shape, "dtype": args.dtype, "impl": name,
                "fwd_ms": f"{fwd:.4f}", "fwd_TBps": f"{fwd_bytes / fwd / 1e9:.2f}",
                "fwdbwd_ms": f"{both:.4f}", "fwdbwd_TBps": f"{fwdbwd_bytes / both / 1e9:.2f}",
            })
            print(rows_out[-1], flush=True)
    write_csv(out_dir() / "rms_norm.csv", rows_out)
    print()
    print(environment(), f"| device copy {copy:.2f} TB/s")
    print(markdown(rows_out, ["shape", "impl", "fwd_ms", "fwd_TBps", "fwdbwd_ms", "fwdbwd_TBps"]))


if __name__ == "__main__":
    main()
