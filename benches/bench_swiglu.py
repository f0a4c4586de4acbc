"""SwiGLU on the GPU: Bastile vs HF eager (F.silu(g) * u), torch.compile of it, and Liger Kernel (when installed);
with --gelu Gemma's GEGLU-tanh (HF's gelu_pytorch_tanh(g) * u, Liger's GEGLU).

    python benches/bench_swiglu.py            # bf16, Qwen3 MLP shapes; CSV under $OUT or bench-results/
    python benches/bench_swiglu.py --gelu --shapes 8192x6912,4096x10240   # Gemma 3 1B's and 4B's MLPs

Effective bandwidth counts the bytes an ideal kernel must move: forward reads gate and up and writes y;
forward+backward also reads dy, gate and up and writes grad_gate and grad_up. `cases(shape, dtype)` is
what bench_kernels.py measures too.
"""
from functools import partial

import torch
import torch.nn.functional as F
from common import Case, Impl, bandwidth_main, device

import bastile  # noqa: F401  (loads torch.ops.bastile)


def hf(g, u):
    return F.silu(g) * u


def hf_gelu(g, u):
    return F.gelu(g, approximate="tanh") * u  # GELUTanh's


def implementations(gelu: bool):
    reference = hf_gelu if gelu else hf
    impls = {"bastile": lambda g, u: torch.ops.bastile.swiglu(g, u, "gelu_tanh" if gelu else "silu"),
             "eager": reference, "compile": torch.compile(reference, dynamic=False)}
    try:
        if gelu:
            from liger_kernel.ops.geglu import LigerGELUMulFunction
            impls["liger"] = LigerGELUMulFunction.apply
        else:
            from liger_kernel.ops.swiglu import LigerSiLUMulFunction
            impls["liger"] = LigerSiLUMulFunction.apply
    except ImportError:
        pass
    return impls


def cases(shape: str, dtype: torch.dtype, gelu: bool = False) -> Case:
    """shape: tokens x intermediate."""
    rows, cols = map(int, shape.split("x"))
    g = 3 * torch.randn(rows, cols, device=device(), dtype=dtype)
    u = torch.randn_like(g)
    dy = torch.randn_like(g)
    n, size = g.numel(), g.element_size()
    ref = (hf_gelu if gelu else hf)(g, u)

    def impl(f):
        # Liger's backward writes the gradients over the saved inputs: every impl gets its own copies.
        leaves = (g.clone().requires_grad_(), u.clone().requires_grad_())
        return Impl(forward=lambda: f(g, u), graph=lambda: (f(*leaves), leaves, dy),
                    check=lambda: torch.testing.assert_close(f(g, u), ref, rtol=2 ** -6, atol=1e-2))

    return Case(shape, "TB/s", {"fwd": 3 * n * size, "fwdbwd": 8 * n * size},
                {name: partial(impl, f) for name, f in implementations(gelu).items()})


if __name__ == "__main__":
    bandwidth_main("swiglu", cases, "8192x3072,16384x6144,16384x12288", "bastile,eager,compile,liger",
                   switches={"--gelu": "GELU-tanh (Gemma's GEGLU) instead of SiLU"})
