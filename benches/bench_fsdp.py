"""Qwen3-1.7B fine-tuning steps under FSDP2, without and with Bastile: tokens/s and ms per step, peak
memory per GPU, and the losses (which must agree).

    make bench-fsdp [NPROC=2] [FSDP_ARGS="--seq 8192"]           # both modes, one torchrun each, then the table
    torchrun --nproc_per_node 2 benches/bench_fsdp.py --mode hf     # one mode; writes fsdp_hf.csv under out_dir()
    torchrun --nproc_per_node 2 benches/bench_fsdp.py --mode bastile
    python benches/bench_fsdp.py --report                           # both modes' CSVs as one table
    torchrun --nproc_per_node 2 benches/bench_fsdp.py --tiny --device cpu    # smoke test on CPU (gloo)

Without --mode, both modes run one after the other in the same processes (the smoke test does that);
the benchmark proper runs each mode in its own launch, so neither inherits the other's allocator state.

Setup, what FSDP2 fine-tuning recipes use (torchtitan's defaults): Qwen3-1.7B's published config with a
random init (no download), built in fp32 directly on the device from one seed (identical across ranks and
modes), `fully_shard` on every decoder layer and at the root (the LM head is tied to the embedding, so it
lives in the root's group); MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=fp32), i.e. fp32 master
weights, gradients and AdamW states, bf16 compute; fused AdamW; SDPA attention; random tokens, different
on every rank; batch x seq tokens per GPU. `bastile.apply()` is called before the model is built.
--checkpointing adds HF's activation checkpointing (non-reentrant) on every decoder layer.
"""
import argparse
import csv
import gc
import os
import sys
from datetime import timedelta

import torch
import torch.distributed as dist
from common import environment, markdown, out_dir, train_steps, write_csv
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
import transformers
from transformers import Qwen3Config, Qwen3ForCausalLM

import bastile

# Qwen3-1.7B (config.json of Qwen/Qwen3-1.7B).
QWEN3_1_7B = dict(hidden_size=2048, num_hidden_layers=28, num_attention_heads=16, num_key_value_heads=8, head_dim=128,
                  intermediate_size=6144, vocab_size=151936, tie_word_embeddings=True, rope_theta=1e6,
                  rms_norm_eps=1e-6, max_position_embeddings=40960)
TINY = dict(QWEN3_1_7B, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
            intermediate_size=128, vocab_size=512)
MODES = ("hf", "bastile")
LOSS_TOL = 2e-2  # bf16 compute: relative per-step loss difference allowed between the modes


def parse():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--mode", choices=MODES, help="one mode per launch; both in turn if absent")
    ap.add_argument("--report", action="store_true", help="print the table of both modes' CSVs and exit")
    ap.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    ap.add_argument("--tiny", action="store_true", help="a 2-layer model with hidden 64 and seq 128: a smoke test")
    ap.add_argument("--seq", type=int, help="tokens per sequence (default 4096; 128 with --tiny)")
    ap.add_argument("--batch", type=int, default=1, help="sequences per GPU")
    ap.add_argument("--warmup", type=int, help="untimed steps first (default 5; 2 with --tiny)")
    ap.add_argument("--steps", type=int, help="timed steps (default 20; 3 with --tiny)")
    ap.add_argument("--checkpointing", action="store_true", help="activation checkpointing on every decoder layer")
    ap.add_argument("--lr", type=float, default=1e-4)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    defaults = dict(seq=128, warmup=2, steps=3) if args.tiny else dict(seq=4096, warmup=5, steps=20)
    for k, v in defaults.items():
        if getattr(args, k) is None:
            setattr(args, k, v)
    return args


def stem(args, mode):
    return f"fsdp{'_tiny' if args.tiny else ''}_{mode}"


def build(args, device):
    """The sharded model and its optimizer; the same parameters in every mode and on every rank."""
    cfg = Qwen3Config(**(TINY if args.tiny else QWEN3_1_7B), attn_implementation="sdpa")
    torch.manual_seed(args.seed)
    with device:
        model = Qwen3ForCausalLM(cfg).train()
    if args.checkpointing:
        model.gradient_checkpointing_enable()
    mp_policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    for layer in model.model.layers:
        fully_shard(layer, mp_policy=mp_policy)
    fully_shard(model, mp_policy=mp_policy)
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, fused=device.type == "cuda")
    return model, opt


def sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize()
    dist.barrier()


def run(mode, args, device):
    """Trains warmup + steps steps; returns the result row (the same on every rank)."""
    bastile.reset()
    if mode == "bastile":
        bastile.apply()
    model, opt = build(args, device)
    rank, world = dist.get_rank(), dist.get_world_size()
    gen = torch.Generator().manual_seed(args.seed + 1 + rank)
    total = args.warmup + args.steps
    data = torch.randint(0, model.config.vocab_size, (total, args.batch, args.seq), generator=gen).to(device)
    losses, elapsed, peak = train_steps(model, opt, data, args.warmup, device, sync)
    stats = torch.tensor([elapsed, peak], dtype=torch.float64, device=device)
    dist.all_reduce(stats, dist.ReduceOp.MAX)  # the slowest rank's time, the largest peak
    mean_losses = torch.stack(losses).double()
    dist.all_reduce(mean_losses)  # the loss over all ranks' tokens (each rank's is a mean over as many)
    mean_losses = (mean_losses / world).tolist()
    elapsed, peak = stats.tolist()
    del model, opt, data, losses
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
    bastile.reset()
    tokens = args.batch * args.seq * args.steps
    return {"mode": mode, "gpus": world, "batch x seq": f"{args.batch}x{args.seq}",
            "checkpointing": args.checkpointing, "tokens/s/GPU": f"{tokens / elapsed:,.0f}",
            "ms/step": f"{elapsed / args.steps * 1e3:.1f}", "peak GiB/GPU": f"{peak:.2f}",
            "final loss": f"{mean_losses[-1]:.5f}", "losses": " ".join(f"{l:.6f}" for l in mean_losses)}


COLUMNS = ["mode", "gpus", "batch x seq", "checkpointing", "tokens/s/GPU", "ms/step", "peak GiB/GPU", "final loss",
           "max rel loss diff vs hf"]


def report(rows, args) -> bool:
    """Prints both modes as one table, writes it as CSV; False if the losses disagree."""
    ref = [float(l) for l in rows["hf"]["losses"].split()]
    agree = True
    for row in rows.values():
        diff = max(abs(float(l) - r) / abs(r) for l, r in zip(row["losses"].split(), ref))
        row["max rel loss diff vs hf"] = f"{diff:.2e}"
        agree &= diff < LOSS_TOL
    table = [rows[m] for m in MODES]
    print(markdown(table, COLUMNS))
    write_csv(out_dir() / f"{stem(args, 'both')}.csv", table)
    if not agree:
        print(f"LOSSES DISAGREE: a per-step difference over {LOSS_TOL:.0e} relative")
    return agree


def read(mode, args):
    with open(out_dir() / f"{stem(args, mode)}.csv") as f:
        return next(csv.DictReader(f))


def main():
    args = parse()
    if args.report:
        sys.exit(0 if report({m: read(m, args) for m in MODES}, args) else 1)
    for k, v in dict(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", LOCAL_WORLD_SIZE="1", MASTER_ADDR="127.0.0.1",
                     MASTER_PORT="29511").items():
        os.environ.setdefault(k, v)  # not under torchrun: one process
    if args.device == "cuda":
        local = int(os.environ.get("LOCAL_RANK", 0))
        torch.cuda.set_device(local)
        device = torch.device("cuda", local)
        dist.init_process_group("nccl", device_id=device, timeout=timedelta(minutes=10))
    else:
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // int(os.environ.get("LOCAL_WORLD_SIZE", 1))))
        device = torch.device("cpu")
        dist.init_process_group("gloo", timeout=timedelta(minutes=10))
    first = dist.get_rank() == 0
    cfg = TINY if args.tiny else QWEN3_1_7B
    if first:
        where = (f"{environment()}, NCCL {'.'.join(map(str, torch.cuda.nccl.version()))}" if args.device == "cuda"
                 else f"CPU (gloo), torch {torch.__version__}")
        print(f"{where}, transformers {transformers.__version__}, {dist.get_world_size()} ranks")
        print(f"Qwen3{'' if args.tiny else '-1.7B'} ({cfg['num_hidden_layers']} layers, hidden {cfg['hidden_size']}, "
              f"vocab {cfg['vocab_size']}, tied head), FSDP2 per layer + root, bf16 compute / fp32 master, "
              f"fused AdamW, SDPA, {args.batch}x{args.seq} tokens per GPU, {args.warmup} warm-up + {args.steps} "
              f"timed steps{', activation checkpointing' if args.checkpointing else ''}", flush=True)
    rows = {}
    try:
        for mode in [args.mode] if args.mode else MODES:
            rows[mode] = run(mode, args, device)
            if first:
                print(f"{mode}: losses {rows[mode]['losses']}", flush=True)
                print(markdown([rows[mode]], COLUMNS[:-1]), flush=True)
                write_csv(out_dir() / f"{stem(args, mode)}.csv", [rows[mode]])
    finally:
        dist.destroy_process_group()
    if first and not args.mode and not report(rows, args):
        sys.exit(1)


if __name__ == "__main__":
    main()
