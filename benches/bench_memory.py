"""Where a model of bench_families.py keeps its memory in one training step under a mode: the static part (weights,
adapters, optimizer state after a first step), the forward's activations (per layer, and what each child of one
layer keeps), and the peaks of the forward, backward and optimizer step.

    python benches/bench_memory.py --model qwen3-30b-a3b                  # Bastile, LoRA all-linear, 4096 x 1
    python benches/bench_memory.py --model glm4.5-air-8l --mode hf --layer 1
"""
import argparse

import torch
from bench_families import MODELS, build

GiB, MiB = 2 ** 30, 2 ** 20


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="qwen3-30b-a3b", choices=sorted(MODELS))
    ap.add_argument("--mode", default="bastile")
    ap.add_argument("--layer", type=int, default=3, help="the decoder layer whose children are measured")
    args = ap.parse_args()
    net, opt, vocab = build(args.mode, args.model, "cuda", False, False)
    seq, batch = MODELS[args.model][5:]
    ids = [torch.randint(0, vocab, (batch, seq), device="cuda") for _ in range(2)]

    loss = net(input_ids=ids[0], labels=ids[0]).loss  # the first step creates the optimizer state
    loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
    torch.cuda.synchronize()
    static = torch.cuda.memory_allocated()
    print(f"static after a step (weights, adapters, optimizer state): {static / GiB:.2f} GiB")

    layers = next(m for n, m in net.named_modules() if n.endswith(".layers"))
    kept = {}
    for name, child in layers[args.layer].named_children():
        child.register_forward_pre_hook(lambda m, i, n=name: kept.__setitem__(n, -torch.cuda.memory_allocated()))
        child.register_forward_hook(lambda m, i, o, n=name: kept.__setitem__(n, kept[n] + torch.cuda.memory_allocated()))

    torch.cuda.reset_peak_memory_stats()
    loss = net(input_ids=ids[1], labels=ids[1]).loss
    torch.cuda.synchronize()
    activations = torch.cuda.memory_allocated() - static
    print(f"forward: peak {torch.cuda.max_memory_allocated() / GiB:.2f} GiB, activations {activations / GiB:.2f} GiB "
          f"({activations / MiB / len(layers):.0f} MiB a layer over {len(layers)})")
    for name, b in kept.items():
        print(f"  layer {args.layer}'s {name}: {b / MiB:.1f} MiB kept (its output included)")
    for phase, run in (("backward", loss.backward), ("optimizer", opt.step)):
        torch.cuda.reset_peak_memory_stats()
        run()
        torch.cuda.synchronize()
        print(f"{phase}: peak {torch.cuda.max_memory_allocated() / GiB:.2f} GiB, after {torch.cuda.memory_allocated() / GiB:.2f}")


if __name__ == "__main__":
    main()
