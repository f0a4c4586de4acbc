"""RoPE on the GPU: Bastile vs HF eager apply_rotary_pos_emb, torch.compile of it, and Liger Kernel (when
installed), with q and k given as HF builds them: transposed views of [batch, seq, heads, head_dim] storage.

    python benches/bench_rope.py            # bf16, the issue's shapes; CSV under $OUT or bench-results/

Shapes are batch x seq x q_heads x k_heads x head_dim. Effective bandwidth counts the bytes an ideal kernel
must move: the forward reads q, k, cos and sin and writes q_embed, k_embed; the backward moves as much again
(reads the output gradients and the tables, writes the input gradients). `cases(shape, dtype)` is what
bench_kernels.py measures too.
"""
from functools import partial

import torch
from common import Case, Impl, bandwidth_main, device
from transformers import Qwen3Config
from transformers.models.qwen3 import modeling_qwen3
from transformers.models.qwen3.modeling_qwen3 import Qwen3RotaryEmbedding

import bastile  # noqa: F401  (loads torch.ops.bastile)

HF_APPLY = modeling_qwen3.apply_rotary_pos_emb


def implementations():
    impls = {"bastile": lambda q, k, cos, sin: torch.ops.bastile.rope(q, k, cos, sin, 1), "hf_eager": HF_APPLY,
             "torch_compile": torch.compile(HF_APPLY, dynamic=False)}
    try:
        from liger_kernel.ops.rope import LigerRopeFunction
        # Takes HF's [batch, heads, seq, head_dim] views; rotates its (contiguous) copies in place.
        impls["liger"] = lambda q, k, cos, sin: LigerRopeFunction.apply(q, k, cos, sin)
    except ImportError:
        pass
    return impls


def tables(batch, seq, dim, dtype, per_batch):
    """cos, sin from HF's Qwen3RotaryEmbedding: [1, seq, dim] for one sequence per row (HF's default position
    ids), [batch, seq, dim] for packed rows whose positions restart."""
    cfg = Qwen3Config(hidden_size=4 * dim, num_attention_heads=4, num_key_value_heads=2, head_dim=dim,
                      max_position_embeddings=max(seq, 4096))
    emb = Qwen3RotaryEmbedding(cfg).to(device())
    if per_batch:
        pos = torch.stack([torch.cat([torch.arange(seq // (b + 2)), torch.arange(seq - seq // (b + 2))])
                           for b in range(batch)])
    else:
        pos = torch.arange(seq)[None]
    return emb(torch.empty(1, dtype=dtype, device=device()), pos.to(device()))


def cases(shape: str, dtype: torch.dtype, per_batch_tables: bool = False) -> Case:
    """shape: batch x seq x q_heads x k_heads x head_dim."""
    b, s, hq, hk, d = map(int, shape.split("x"))
    qs = torch.randn(b, s, hq, d, device=device(), dtype=dtype)
    ks = torch.randn(b, s, hk, d, device=device(), dtype=dtype)
    cos, sin = tables(b, s, d, dtype, per_batch_tables)
    gq = torch.randn(b, hq, s, d, device=device(), dtype=dtype)
    gk = torch.randn(b, hk, s, d, device=device(), dtype=dtype)
    qg, kg = qs.clone().requires_grad_(), ks.clone().requires_grad_()
    size = qs.element_size()
    fwd_bytes = 2 * (qs.numel() + ks.numel()) * size + 2 * cos.numel() * size
    ref = HF_APPLY(qs.transpose(1, 2), ks.transpose(1, 2), cos, sin)

    def impl(f):
        q, k = qs.clone().transpose(1, 2), ks.clone().transpose(1, 2)  # its own: Liger rotates them in place

        def check():  # on copies: Liger rotates its inputs in place
            out = f(qs.clone().transpose(1, 2), ks.clone().transpose(1, 2), cos, sin)
            for a, r in zip(out, ref):
                torch.testing.assert_close(a, r, rtol=2 ** -6, atol=2 ** -4)  # a bf16 unit at |x| < 16: compile rounds its fused math once

        return Impl(forward=lambda: f(q, k, cos, sin),
                    graph=lambda: (f(qg.transpose(1, 2), kg.transpose(1, 2), cos, sin), (qg, kg), (gq, gk)),
                    check=check)

    return Case(shape, "TB/s", {"fwd": fwd_bytes, "fwdbwd": 2 * fwd_bytes},
                {name: partial(impl, f) for name, f in implementations().items()})


if __name__ == "__main__":
    bandwidth_main("rope", cases, "2x4096x16x8x128,1x8192x32x8x128", "bastile,hf_eager,torch_compile,liger",
                   "BxSxHqxHkxD, comma-separated", {"--per-batch-tables": "cos/sin [B, S, D] (packed rows)"})
