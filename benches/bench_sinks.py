"""GPT-OSS's sink attention, forward + backward: Bastile's (bastile.sinks), HF's eager, and torch's flash kernel
without sinks (the same kernel Bastile's runs, its row factor left out: the ceiling).

    python benches/bench_sinks.py [--seqs 4096,16384] [--batch 1]

gpt-oss-20b's heads (64 query, 8 key/value, head_dim 64), bf16, its two layer kinds: full causal and a
128-token sliding window. Median ms of fwd+bwd (L2 flushed) and the peak memory over the inputs (GiB) of one
fwd+bwd. HF's eager keeps [batch, heads, seq, seq + 1] probabilities: it runs to 8192 tokens.
"""
import argparse
import types

import torch
from torch.nn.attention.varlen import varlen_attn
from transformers.models.gpt_oss import modeling_gpt_oss as hf

from bastile import sinks
from common import environment, markdown, peak_extra_gib, time_ms

HQ, HKV, D, WINDOW = 64, 8, 64, 128
SCALE = D ** -0.5


def cases(batch, seq, window):
    g = torch.Generator(device="cuda").manual_seed(0)
    q, k, v = (torch.randn(batch, seq, h, D, device="cuda", dtype=torch.bfloat16, generator=g).requires_grad_()
               for h in (HQ, HKV, HKV))
    s = torch.randn(HQ, device="cuda", dtype=torch.bfloat16, generator=g).requires_grad_()
    dy = torch.randn_like(q)
    left = -1 if window is None else window - 1
    cu = torch.arange(0, (batch + 1) * seq, seq, dtype=torch.int32, device="cuda")
    tokens = [t.detach().reshape(-1, *t.shape[2:]).requires_grad_() for t in (q, k, v)]

    def bastile():
        sinks.attention(q, k, v, s, SCALE, window).backward(dy)

    def flash():
        varlen_attn(*tokens, cu, cu, seq, seq, scale=SCALE, window_size=(left, 0)).backward(dy.reshape(-1, HQ, D))

    def eager():
        i = torch.arange(seq, device="cuda")
        offset = i[:, None] - i[None, :]
        seen = (offset >= 0) & ((offset < window) if window else True)
        mask = torch.where(seen, 0.0, torch.finfo(torch.bfloat16).min).to(torch.bfloat16)[None, None]
        module = types.SimpleNamespace(num_key_value_groups=HQ // HKV, sinks=s, training=True)
        out = hf.eager_attention_forward(module, *(t.transpose(1, 2) for t in (q, k, v)), mask, scaling=SCALE)[0]
        out.backward(dy)
    impls = {"bastile (sinks)": bastile, "flash, no sinks": flash}
    if seq <= 8192:
        impls["HF eager (sinks)"] = eager
    return impls


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--seqs", default="4096,16384")
    ap.add_argument("--batch", type=int, default=1)
    args = ap.parse_args()
    rows = []
    for seq in map(int, args.seqs.split(",")):
        for window in (None, WINDOW):
            impls = cases(args.batch, seq, window)
            flash_ms = None
            for name, fn in impls.items():
                gib = peak_extra_gib(fn)
                ms = time_ms(fn, reps=20, warmup=3)
                flash_ms = ms if name.startswith("flash") else flash_ms
                rows.append({"seq": f"{args.batch}x{seq}", "layer": "full" if window is None else f"window {window}",
                             "impl": name, "fwd+bwd ms": f"{ms:.3f}", "peak GiB": f"{gib:.2f}"})
                print(rows[-1], flush=True)
            for r in rows[-len(impls):]:
                r["vs flash"] = f"{float(r['fwd+bwd ms']) / flash_ms:.2f}x"
    print(f"\n{environment()}\n{HQ}/{HKV} heads x {D}, bf16\n")
    print(markdown(rows, ["seq", "layer", "impl", "fwd+bwd ms", "vs flash", "peak GiB"]))


if __name__ == "__main__":
    main()
