"""Qwen3.5's short convolution on the GPU: Bastile vs HF's causal_conv1d_fn (its PyTorch path, F.conv1d, without
the causal-conv1d package), and torch.compile of it.

    python benches/bench_causal_conv1d.py      # bf16, kernel 4, SiLU; CSV under $OUT or bench-results/

Shapes are tokens x channels of one sequence, channels as Qwen3.5-9B's q/k/v projection (2 x 16 x 128 + 32 x 128 =
8192). Bastile takes channels-last x [1, T, C]; HF takes the same storage as its [1, C, T] view, as its
GatedDeltaNet transposes it. Effective bandwidth counts the bytes an ideal kernel moves: the forward reads x and
writes y; forward+backward also reads x and dy again and writes dx (the weight's bytes are negligible).
"""
from functools import partial

import torch
from common import Case, Impl, bandwidth_main, copy_impl, device
from transformers.models.qwen3_5.modeling_qwen3_5 import causal_conv1d_fn

import bastile  # noqa: F401  (loads torch.ops.bastile)

WIDTH = 4


def hf(x, w):
    return causal_conv1d_fn(x.transpose(1, 2), w, None, activation="silu").transpose(1, 2)


def implementations():
    return {"bastile": lambda x, w: torch.ops.bastile.causal_conv1d(x, w, None, None, True), "hf_eager": hf,
            "torch_compile": torch.compile(hf, dynamic=False)}


def cases(shape: str, dtype: torch.dtype) -> Case:
    """shape: tokens x channels."""
    tokens, channels = map(int, shape.split("x"))
    x = torch.randn(1, tokens, channels, device=device(), dtype=dtype)
    w = (0.5 * torch.randn(channels, WIDTH, device=device())).to(dtype)
    dy = torch.randn_like(x)
    leaves = (x.clone().requires_grad_(), w.clone().requires_grad_())
    n, size = x.numel(), x.element_size()
    ref = hf(x, w)

    def impl(f):
        return Impl(forward=lambda: f(x, w), graph=lambda: (f(*leaves), leaves, dy),
                    check=lambda: torch.testing.assert_close(f(x, w), ref, rtol=2 ** -6, atol=1e-2))

    work = {"fwd": 2 * n * size, "fwdbwd": 5 * n * size}
    return Case(shape, "TB/s", work,
                {**{name: partial(impl, f) for name, f in implementations().items()}, "copy": copy_impl(work)})


if __name__ == "__main__":
    bandwidth_main("causal_conv1d", cases, "4096x8192,16384x8192", "bastile,hf_eager,torch_compile,copy")
