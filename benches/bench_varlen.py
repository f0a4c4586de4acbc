"""Attention over one packed row, forward + backward: the backends the installed torch offers.

    python benches/bench_varlen.py [--tokens 8192] [--rows 5]

Qwen3-1.7B's heads (16 query, 8 key/value, head_dim 128), bf16; rows of `--tokens` tokens filled with
sequences of the SFT distribution (benches/bench_packing.py's `lengths`, a different draw per row).
Backends: torch's varlen_attn (flash, what bastile.varlen runs); SDPA with HF's block-diagonal boolean
mask (what HF's SDPA path runs on packed rows); FlexAttention (compiled) with a document mask; and, as the
cost of ignoring the bounds, SDPA causal over the whole row. Median ms over the rows, fwd+bwd each. Also
the host time of deriving the bounds from restarting position ids (`bastile.varlen.sequences`, one host
read), with the GPU idle, for batches that come without them.
"""
import argparse
import statistics
import time

import torch
import torch.nn.functional as F
from torch.nn.attention.flex_attention import create_block_mask, flex_attention
from torch.nn.attention.varlen import varlen_attn

from bastile import varlen
from bench_packing import lengths
from common import time_ms

HQ, HKV, D = 16, 8, 128


def row(tokens: int, seed: int) -> list:
    out, pool = [], iter(lengths(10_000, seed))
    while sum(out) < tokens:
        out.append(min(int(next(pool)), tokens - sum(out)))
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tokens", type=int, default=8192)
    ap.add_argument("--rows", type=int, default=5)
    args = ap.parse_args()
    flex = torch.compile(flex_attention)
    times = {k: [] for k in ("varlen_attn (flash)", "SDPA + block-diagonal mask", "FlexAttention, document mask",
                             "SDPA causal, whole row (bounds ignored)")}
    for seed in range(args.rows):
        lens = row(args.tokens, seed)
        t = args.tokens
        q, k, v = (torch.randn(t, h, D, device="cuda", dtype=torch.bfloat16, requires_grad=True)
                   for h in (HQ, HKV, HKV))
        cu = torch.zeros(len(lens) + 1, dtype=torch.int32)
        cu[1:] = torch.tensor(lens).cumsum(0)
        cu = cu.cuda()
        doc = torch.repeat_interleave(torch.arange(len(lens), device="cuda"), torch.tensor(lens, device="cuda"))
        i = torch.arange(t, device="cuda")
        mask = ((doc[:, None] == doc[None, :]) & (i[None, :] <= i[:, None]))[None, None]
        block = create_block_mask(lambda b, h, qi, ki: (doc[qi] == doc[ki]) & (ki <= qi), None, None, t, t)
        qh, kh, vh = (x.detach().transpose(0, 1)[None].requires_grad_() for x in (q, k, v))
        g = torch.randn(t, HQ, D, device="cuda", dtype=torch.bfloat16)
        gh = g.transpose(0, 1)[None]
        cases = {
            "varlen_attn (flash)": lambda: varlen_attn(q, k, v, cu, cu, max(lens), max(lens), window_size=(-1, 0)).backward(g),
            "SDPA + block-diagonal mask": lambda: F.scaled_dot_product_attention(qh, kh, vh, attn_mask=mask, enable_gqa=True).backward(gh),
            "FlexAttention, document mask": lambda: flex(qh, kh, vh, block_mask=block, enable_gqa=True).backward(gh),
            "SDPA causal, whole row (bounds ignored)": lambda: F.scaled_dot_product_attention(qh, kh, vh, is_causal=True, enable_gqa=True).backward(gh),
        }
        for name, fn in cases.items():
            times[name].append(time_ms(fn, reps=20, warmup=5))
        print(f"row {seed}: {len(lens)} sequences, longest {max(lens)}, sum of squares / tokens^2 "
              f"{sum(n * n for n in lens) / t ** 2:.3f}", flush=True)
    positions = torch.cat([torch.arange(n) for n in row(args.tokens, 0)])[None].cuda()
    host = []
    for _ in range(50):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        varlen.sequences(positions, 1)
        host.append((time.perf_counter() - t0) * 1e3)
    print(f"bounds from position ids [1, {args.tokens}] (varlen.sequences, GPU idle): "
          f"{statistics.median(host):.3f} ms host time, median of 50")
    print(f"\n{args.tokens} tokens per row, {HQ}/{HKV} heads x {D}, bf16, fwd+bwd, median of {args.rows} rows\n")
    print("| backend | ms |\n|---|---|")
    for name, ts in times.items():
        print(f"| {name} | {statistics.median(ts):.3f} |")


if __name__ == "__main__":
    main()
