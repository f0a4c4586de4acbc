"""RMSNorm on the GPU: Bastile vs HF eager, torch.compile of HF, and Liger Kernel (when installed); with --gemma
Gemma's (1 + w) norm (HF's Gemma3RMSNorm, Liger's gemma casting mode with offset 1).

    python benches/bench_rms_norm.py            # bf16, the issue's shapes; CSV under $OUT or bench-results/
    python benches/bench_rms_norm.py --gemma --shapes 8192x1152,4096x2560   # Gemma 3 1B's and 4B's widths

Effective bandwidth counts the bytes an ideal kernel must move: forward reads x and w and writes y;
forward+backward also reads dy and x again and writes dx and dw; the "copy" row copies as many bytes.
`cases(shape, dtype)` is what bench_kernels.py measures too.
"""
import types
from functools import partial

import torch
from common import Case, Impl, bandwidth_main, copy_impl, device
from transformers.models.gemma3.modeling_gemma3 import Gemma3RMSNorm
from transformers.models.qwen3.modeling_qwen3 import Qwen3RMSNorm

import bastile  # noqa: F401  (loads torch.ops.bastile)

EPS = 1e-6
HF_FORWARD = Qwen3RMSNorm.forward


def hf(x, w):
    return HF_FORWARD(types.SimpleNamespace(weight=w, variance_epsilon=EPS), x)


def hf_gemma(x, w):
    return Gemma3RMSNorm.forward(types.SimpleNamespace(weight=w, eps=EPS, _norm=lambda t: Gemma3RMSNorm._norm(
        types.SimpleNamespace(eps=EPS), t)), x)


def implementations(gemma: bool):
    reference = hf_gemma if gemma else hf
    impls = {"bastile": (lambda x, w: torch.ops.bastile.rms_norm(x, w, EPS, True, 1.0)) if gemma
             else (lambda x, w: torch.ops.bastile.rms_norm(x, w, EPS)),
             "hf_eager": reference, "torch_compile": torch.compile(reference, dynamic=False)}
    try:
        from liger_kernel.ops.rms_norm import LigerRMSNormFunction
        offset, mode = (1.0, "gemma") if gemma else (0.0, "llama")
        impls["liger"] = lambda x, w: LigerRMSNormFunction.apply(x, w, EPS, offset, mode, False)
    except ImportError:
        pass
    return impls


def cases(shape: str, dtype: torch.dtype, gemma: bool = False) -> Case:
    """shape: rows x hidden."""
    rows, cols = map(int, shape.split("x"))
    x = torch.randn(rows, cols, device=device(), dtype=dtype)
    w = ((0 if gemma else 1) + 0.1 * torch.randn(cols, device=device())).to(dtype)
    g = torch.randn_like(x)
    leaves = (x.clone().requires_grad_(), w.clone().requires_grad_())
    size = x.element_size()
    fwd_bytes = 2 * rows * cols * size + cols * size
    ref = (hf_gemma if gemma else hf)(x, w)

    def impl(f):
        return Impl(forward=lambda: f(x, w), graph=lambda: (f(*leaves), leaves, g),
                    check=lambda: torch.testing.assert_close(f(x, w), ref, rtol=2 ** -6, atol=1e-2))

    work = {"fwd": fwd_bytes, "fwdbwd": fwd_bytes + 3 * rows * cols * size + 2 * cols * size}
    return Case(shape, "TB/s", work,
                {**{name: partial(impl, f) for name, f in implementations(gemma).items()}, "copy": copy_impl(work)})


if __name__ == "__main__":
    bandwidth_main("rms_norm", cases, "8192x1024,16384x2048,16384x4096,65536x128", "bastile,hf_eager,torch_compile,liger,copy",
                   switches={"--gemma": "Gemma's (1 + w) norm instead of Llama's"})
