"""Qwen3.5's gated RMSNorm on the GPU: Bastile vs HF eager (Qwen3_5RMSNormGated), torch.compile of HF, and fla's
FusedRMSNormGated (when installed).

    python benches/bench_rms_norm_gated.py      # bf16, head_v_dim 128; CSV under $OUT or bench-results/

Shapes are rows x head_v_dim, rows = tokens x 32 value heads (Qwen3.5's Gated DeltaNet): 1024, 4096 and 16384
tokens. Effective bandwidth counts the bytes an ideal kernel must move: forward reads x, z and w and writes y;
forward+backward also reads dy, x and z again and writes dx, dz and dw; the "copy" row copies as many bytes.
"""
import types
from functools import partial

import torch
from common import Case, Impl, bandwidth_main, copy_impl, device
from transformers.models.qwen3_5.modeling_qwen3_5 import Qwen3_5RMSNormGated

import bastile  # noqa: F401  (loads torch.ops.bastile)

EPS = 1e-6
HF_FORWARD = Qwen3_5RMSNormGated.forward


def hf(x, z, w):
    return HF_FORWARD(types.SimpleNamespace(weight=w, variance_epsilon=EPS, activation="silu"), x, z)


def implementations(w):
    impls = {"bastile": lambda x, z, w: torch.ops.bastile.rms_norm_gated(x, z, w, EPS), "hf_eager": hf,
             "torch_compile": torch.compile(hf, dynamic=False)}
    try:
        from fla.modules import FusedRMSNormGated
        fla = FusedRMSNormGated(w.shape[0], eps=EPS).to(device=w.device, dtype=w.dtype)
        impls["fla"] = lambda x, z, w: torch.func.functional_call(fla, {"weight": w}, (x, z))
    except ImportError:
        pass
    return impls


def cases(shape: str, dtype: torch.dtype) -> Case:
    """shape: rows x head_v_dim."""
    rows, cols = map(int, shape.split("x"))
    x = torch.randn(rows, cols, device=device(), dtype=dtype)
    z = 3 * torch.randn(rows, cols, device=device(), dtype=dtype)
    w = (1 + 0.1 * torch.randn(cols, device=device())).to(dtype)
    g = torch.randn_like(x)
    leaves = (x.clone().requires_grad_(), z.clone().requires_grad_(), w.clone().requires_grad_())
    n, size = rows * cols, x.element_size()
    fwd_bytes = 3 * n * size + cols * size
    ref = hf(x, z, w)

    def impl(f):
        return Impl(forward=lambda: f(x, z, w), graph=lambda: (f(*leaves), leaves, g),
                    check=lambda: torch.testing.assert_close(f(x, z, w), ref, rtol=2 ** -6, atol=1e-2))

    work = {"fwd": fwd_bytes, "fwdbwd": fwd_bytes + 5 * n * size + 2 * cols * size}
    return Case(shape, "TB/s", work,
                {**{name: partial(impl, f) for name, f in implementations(w).items()}, "copy": copy_impl(work)})


if __name__ == "__main__":
    bandwidth_main("rms_norm_gated", cases, "32768x128,131072x128,524288x128", "bastile,hf_eager,torch_compile,fla,copy")
