"""The main job: a short Qwen3 fine-tune (random init, random tokens), with and without Bastile,
on whatever device is present. Prints per-mode loss and tokens/s and how far the losses differ.

    python benches/train_qwen3.py [--steps 20]
"""
import argparse

import torch
from common import markdown, train_steps
from transformers import Qwen3Config, Qwen3ForCausalLM

import bastile


def config(device):
    if device == "cuda":  # Qwen3-0.6B's widths, fewer layers, so it runs anywhere in seconds
        return dict(hidden_size=1024, intermediate_size=3072, num_hidden_layers=6, num_attention_heads=16,
                    num_key_value_heads=8, head_dim=128, vocab_size=151936), 4, 1024, torch.bfloat16
    return dict(hidden_size=256, intermediate_size=768, num_hidden_layers=4, num_attention_heads=4,
                num_key_value_heads=2, head_dim=64, vocab_size=32000), 4, 128, torch.float32


def train(mode, device, steps, seed=0):
    bastile.reset()
    if mode == "bastile":
        bastile.apply()
    cfg, batch, seq, dtype = config(device)
    torch.manual_seed(seed)
    model = Qwen3ForCausalLM(Qwen3Config(**cfg, max_position_embeddings=seq, attn_implementation="sdpa"))
    model = model.to(device=device, dtype=dtype).train()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=device == "cuda")
    gen = torch.Generator().manual_seed(seed + 1)
    data = torch.randint(0, cfg["vocab_size"], (steps, batch, seq), generator=gen).to(device)
    warm = 2
    losses, elapsed, peak = train_steps(model, opt, data, warm, device, sync)
    losses = [l.item() for l in losses]
    bastile.reset()
    return losses, batch * seq * (steps - warm) / elapsed, peak


def sync(device):
    if device == "cuda":
        torch.cuda.synchronize()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    args = ap.parse_args()
    cfg, batch, seq, dtype = config(args.device)
    print(f"Qwen3 {cfg['num_hidden_layers']} layers, hidden {cfg['hidden_size']}, vocab {cfg['vocab_size']}, "
          f"batch {batch} x seq {seq}, {dtype}, {args.steps} AdamW steps on {args.device} "
          f"({torch.cuda.get_device_name() if args.device == 'cuda' else 'CPU'}), torch {torch.__version__}")
    results = {}
    for mode in ("hf", "bastile"):
        results[mode] = train(mode, args.device, args.steps)
        print(f"{mode}: losses {' '.join(f'{l:.4f}' for l in results[mode][0])}", flush=True)
    ref = results["hf"][0]
    rows = [{"mode": m, "final loss": f"{l[-1]:.5f}", "tokens/s": f"{tps:,.0f}",
             "peak GiB": f"{peak:.2f}", "max rel loss diff vs hf": f"{max(abs(a - b) / abs(b) for a, b in zip(l, ref)):.2e}"}
            for m, (l, tps, peak) in results.items()]
    print(markdown(rows, list(rows[0])))


if __name__ == "__main__":
    main()
