"""Qwen3 attention's q/k RMSNorm + rotary embedding on the GPU: Bastile vs HF eager (q_norm, k_norm,
apply_rotary_pos_emb), torch.compile of it, and Liger Kernel (LigerRMSNorm + LigerRope, when installed); with
--gemma Gemma 3's (1 + w) q/k norms (HF's Gemma3RMSNorm, Liger's gemma casting mode with offset 1).

    python benches/bench_qk_norm_rope.py        # bf16, B x S x Hq x Hk x D shapes; CSV under $OUT or bench-results/
    python benches/bench_qk_norm_rope.py --gemma --shapes 2x4096x4x1x256,1x4096x8x4x256   # Gemma 3 1B's, 4B's

Every implementation takes q [B, S, Hq, D] and k [B, S, Hk, D] (the projections' views) and returns HF's
[B, H, S, D] layout. Effective bandwidth counts the bytes an ideal kernel must move: the forward reads q,
k, cos and sin and writes both outputs; forward+backward also reads the output gradients, q, k, cos and
sin again and writes the input gradients (weights are negligible); the "copy" row copies as many bytes.
`cases(shape, dtype)` is what bench_kernels.py measures too.
"""
import types
from functools import partial

import torch
from common import Case, Impl, bandwidth_main, copy_impl, device
from transformers.models.gemma3.modeling_gemma3 import Gemma3RMSNorm
from transformers.models.qwen3.modeling_qwen3 import Qwen3RMSNorm, apply_rotary_pos_emb

import bastile  # noqa: F401  (loads torch.ops.bastile)

EPS = 1e-6
HF_NORM = Qwen3RMSNorm.forward


def hf(q, k, qw, kw, cos, sin):
    qn = HF_NORM(types.SimpleNamespace(weight=qw, variance_epsilon=EPS), q).transpose(1, 2)
    kn = HF_NORM(types.SimpleNamespace(weight=kw, variance_epsilon=EPS), k).transpose(1, 2)
    return apply_rotary_pos_emb(qn, kn, cos, sin)


def _gemma_norm(x, w):
    return Gemma3RMSNorm.forward(types.SimpleNamespace(weight=w, eps=EPS, _norm=lambda t: Gemma3RMSNorm._norm(
        types.SimpleNamespace(eps=EPS), t)), x)


def hf_gemma(q, k, qw, kw, cos, sin):
    return apply_rotary_pos_emb(_gemma_norm(q, qw).transpose(1, 2), _gemma_norm(k, kw).transpose(1, 2), cos, sin)


def implementations(gemma: bool):
    rounding = (True, 1.0) if gemma else (False, 0.0)

    def ours(q, k, qw, kw, cos, sin):
        qo, ko = torch.ops.bastile.qk_norm_rope(q, k, qw, kw, cos, sin, EPS, *rounding)
        return qo.transpose(1, 2), ko.transpose(1, 2)

    reference = hf_gemma if gemma else hf
    impls = {"bastile": ours, "hf_eager": reference, "torch_compile": torch.compile(reference, dynamic=False)}
    try:
        from liger_kernel.ops.rms_norm import LigerRMSNormFunction
        from liger_kernel.ops.rope import LigerRopeFunction
        offset, mode = (1.0, "gemma") if gemma else (0.0, "llama")

        def liger(q, k, qw, kw, cos, sin):
            qn = LigerRMSNormFunction.apply(q, qw, EPS, offset, mode, False).transpose(1, 2)
            kn = LigerRMSNormFunction.apply(k, kw, EPS, offset, mode, False).transpose(1, 2)
            return LigerRopeFunction.apply(qn, kn, cos, sin)

        impls["liger"] = liger
    except ImportError:
        pass
    return impls


def cases(shape: str, dtype: torch.dtype, gemma: bool = False) -> Case:
    """shape: batch x seq x q_heads x k_heads x head_dim."""
    b, s, hq, hk, d = map(int, shape.split("x"))
    dev = device()
    q = torch.randn(b, s, hq, d, device=dev, dtype=dtype)
    k = torch.randn(b, s, hk, d, device=dev, dtype=dtype)
    qw = ((0 if gemma else 1) + 0.1 * torch.randn(d, device=dev)).to(dtype)
    kw = ((0 if gemma else 1) + 0.1 * torch.randn(d, device=dev)).to(dtype)
    ang = torch.arange(s, device=dev)[:, None] * 10000 ** (-torch.arange(0, d, 2, device=dev) / d)
    ang = torch.cat([ang, ang], -1)[None]
    cos, sin = ang.cos().to(dtype), ang.sin().to(dtype)
    gq = torch.randn(b, hq, s, d, device=dev, dtype=dtype)
    gk = torch.randn(b, hk, s, d, device=dev, dtype=dtype)
    leaves = [t.clone().requires_grad_() for t in (q, k, qw, kw)]
    size = q.element_size()
    qk_bytes = (q.numel() + k.numel()) * size
    cs_bytes = 2 * cos.numel() * size
    fwd_bytes = 2 * qk_bytes + cs_bytes
    ref = (hf_gemma if gemma else hf)(q, k, qw, kw, cos, sin)

    def impl(f):
        def check():
            for a, r in zip(f(q, k, qw, kw, cos, sin), ref):
                torch.testing.assert_close(a, r, rtol=2 ** -6, atol=2 ** -4)  # a bf16 unit at |x| < 16: compile rounds its fused math once

        return Impl(forward=lambda: f(q, k, qw, kw, cos, sin), graph=lambda: (f(*leaves, cos, sin), leaves, (gq, gk)),
                    check=check)

    work = {"fwd": fwd_bytes, "fwdbwd": fwd_bytes + 3 * qk_bytes + cs_bytes}
    return Case(shape, "TB/s", work,
                {**{name: partial(impl, f) for name, f in implementations(gemma).items()}, "copy": copy_impl(work)})


if __name__ == "__main__":
    bandwidth_main("qk_norm_rope", cases, "2x4096x16x8x128,1x8192x32x8x128",
                   "bastile,hf_eager,torch_compile,liger,copy", "BxSxHqxHkxD, comma-separated",
                   switches={"--gemma": "Gemma 3's (1 + w) q/k norms instead of Qwen3's"})
