"""Qwen3.5's gated delta rule on the GPU: Bastile vs HF's chunked PyTorch path (transformers' fallback without
flash-linear-attention) and fla's chunk_gated_delta_rule (when installed; fla 0.6 refuses its backward on Hopper
with Triton < 3.7.1), beside the softmax attention of the same model (SDPA, causal, 16 heads x 256), the
yardstick the issue sets.

    python benches/bench_gated_delta_rule.py [--shapes 4096,16384] [--rounds 1]   # bf16; CSV under $OUT or bench-results/

A shape is the tokens of one sequence; heads as Qwen3.5-9B's linear attention: 16 key heads, 32 value heads, K = V
= 128, q and k l2-normalized in the op. TFLOP/s is nominal, the same count for every implementation: the
forward of the chunked form with chunks of 64 tokens (per token and value head, 64 K for q k^T and k k^T over half
the chunk each, 32 (K + 2 V) for the triangular products, 3 K V for the state's read, write and output: 2 FLOPs a
multiply-add), three times that for forward+backward; SDPA's is 2 x 2 x T^2/2 x 16 x 256, times 3.5 with backward.
"""
import torch
import torch.nn.functional as F
from common import (Case, Impl, chosen, device, environment, fmt, markdown, measure_rounds, out_dir, parse, parser,
                    start, throughput, with_rounds, write_csv)
from transformers.models.qwen3_5.modeling_qwen3_5 import torch_chunk_gated_delta_rule

import bastile  # noqa: F401  (loads torch.ops.bastile)

K_HEADS, V_HEADS, K, V, CHUNK = 16, 32, 128, 128, 64
ATTN_HEADS, ATTN_DIM = 16, 256


def nominal_flops(tokens: int) -> float:
    return 2.0 * tokens * V_HEADS * (CHUNK * K + CHUNK / 2 * (K + 2 * V) + 3 * K * V)


def hf(q, k, v, g, beta):
    rep = V_HEADS // K_HEADS
    return torch_chunk_gated_delta_rule(q.repeat_interleave(rep, 2), k.repeat_interleave(rep, 2), v, g, beta,
                                        use_qk_l2norm_in_kernel=True)[0]


def implementations() -> dict:
    impls = {"bastile": lambda q, k, v, g, beta: torch.ops.bastile.gated_delta_rule(q, k, v, g, beta, K ** -0.5,
                                                                                     None, None, True)[0],
             "hf_chunk": hf}
    try:
        from fla.ops.gated_delta_rule import chunk_gated_delta_rule
        rep = V_HEADS // K_HEADS
        impls["fla"] = lambda q, k, v, g, beta: chunk_gated_delta_rule(
            q.repeat_interleave(rep, 2), k.repeat_interleave(rep, 2), v, g, beta, use_qk_l2norm_in_kernel=True)[0]
    except ImportError:
        pass
    return impls


def close(a, b):
    err = ((a.double() - b.double()).norm() / b.double().norm()).item()
    assert err < 2e-2, f"relative error {err:.3g} against HF's"


def cases(shape: str, dtype: torch.dtype) -> Case:
    tokens = int(shape)
    gen = torch.Generator(device=device()).manual_seed(0)
    r = lambda *s: torch.randn(*s, device=device(), generator=gen)
    q, k = r(1, tokens, K_HEADS, K).to(dtype), r(1, tokens, K_HEADS, K).to(dtype)
    v = r(1, tokens, V_HEADS, V).to(dtype)
    g = -F.softplus(r(1, tokens, V_HEADS))
    beta = torch.sigmoid(r(1, tokens, V_HEADS)).to(dtype)
    args = (q, k, v, g, beta)
    leaves = tuple(t.clone().requires_grad_() for t in args)
    do = r(1, tokens, V_HEADS, V).to(dtype)
    ref = hf(*args)

    def impl(f):
        return Impl(forward=lambda: f(*args), graph=lambda: (f(*leaves), leaves, do), check=lambda: close(f(*args), ref))

    def sdpa():
        qa, ka, va = (r(1, ATTN_HEADS, tokens, ATTN_DIM).to(dtype).requires_grad_() for _ in range(3))
        f = lambda: F.scaled_dot_product_attention(qa, ka, va, is_causal=True)
        return Impl(forward=lambda: f().detach(), graph=lambda: (f(), (qa, ka, va), torch.ones_like(qa)))

    impls = {name: (lambda f=f: impl(f)) for name, f in implementations().items()}
    return Case(shape, "TFLOP/s", {"fwd": nominal_flops(tokens), "fwdbwd": 3 * nominal_flops(tokens)},
                {**impls, "sdpa": sdpa}, reps=5, warmup=2)


COLUMNS = ["tokens", "impl", "fwd_ms", "fwd_TFLOPs", "fwdbwd_ms", "fwdbwd_TFLOPs"]


if __name__ == "__main__":
    args = parse(with_rounds(parser("4096,16384", "bastile,hf_chunk,fla,sdpa", "tokens, comma-separated"), 1))
    dtype = getattr(torch, args.dtype)
    start()
    rows = []
    for shape in args.shapes.split(","):
        case = cases(shape, dtype)
        tokens = int(shape)
        sdpa_flops = {"fwd": 2 * 2 * tokens ** 2 / 2 * ATTN_HEADS * ATTN_DIM}
        sdpa_flops["fwdbwd"] = 3.5 * sdpa_flops["fwd"]
        for name, res in measure_rounds(case, list(chosen(case.impls, args)), ("fwd", "fwdbwd"), args.rounds,
                                        strict=False).items():
            work = sdpa_flops if name == "sdpa" else case.work
            row = {"tokens": shape, "dtype": args.dtype, "impl": name}
            for p in ("fwd", "fwdbwd"):
                row[f"{p}_ms"] = fmt(res[p][0], 3)
                row[f"{p}_TFLOPs"] = fmt(throughput(res[p][0], work[p]), 1)
            print(row, flush=True)
            rows.append(row)
        del case
    write_csv(out_dir() / "gated_delta_rule.csv", rows)
    print()
    print(environment())
    print(markdown(rows, COLUMNS))
