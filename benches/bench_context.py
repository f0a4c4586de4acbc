"""Long context over every visible GPU with ring context parallelism: Llama-3-8B and Qwen3-8B, LoRA r16, HF and
Bastile; for each context length of a ladder, tokens/s and peak GiB per GPU, until a step runs out of memory.

    make bench-context                                                  # both models, both modes, then the table
    torchrun --nproc_per_node 2 benches/bench_context.py --model llama3-8b --mode bastile   # one launch
    python benches/bench_context.py --report                            # the launches' CSVs as one table

The engine is torch's context_parallel (what accelerate's `cp_backend="torch"` enters for each step) with
accelerate's hook on the attention modules that drops HF's mask for is_causal: each rank holds two chunks of
every sequence (head and tail, torch's load balancing) and the ranks pass K/V around a ring inside SDPA. The
model is replicated (no FSDP2: the 8B's bf16 weights fit every GPU), the LoRA gradients all-reduced (averaged),
as DDP or FSDP2 would. Random init from the published configs (tests/configs), bf16 weights, SDPA, HF's
gradient checkpointing (non-reentrant) in both modes; Bastile's with offload_checkpoints (the layers' saved
inputs in pinned host memory). One batch of one sequence of random tokens per context; the labels shifted before
slicing, as HF's Trainer does; at each context --warmup untimed steps (the allocators' first blocks of its sizes,
device and pinned host), then --steps timed ones.
"""
import argparse
import csv
import gc
import os
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
from common import environment, failed, markdown, out_dir, published, write_csv

MODELS = {"llama3-8b": ("meta-llama--Llama-3.1-8B-Instruct", "LlamaConfig", "LlamaForCausalLM"),
          "qwen3-8b": ("Qwen--Qwen3-8B", "Qwen3Config", "Qwen3ForCausalLM")}
MODES = ("hf", "bastile")
TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
LADDER = (16384, 32768, 65536, 131072)  # tokens of the one sequence, over all GPUs
COLUMNS = ["model", "mode", "gpus", "context", "status", "tokens_per_s", "s_per_step", "peak_GiB", "loss"]


def parse():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", choices=MODELS)
    ap.add_argument("--mode", choices=MODES)
    ap.add_argument("--contexts", default=",".join(map(str, LADDER)), help="comma-separated, ascending")
    ap.add_argument("--warmup", type=int, default=1, help="untimed steps first, at each context")
    ap.add_argument("--steps", type=int, default=1, help="timed steps per context")
    ap.add_argument("--report", action="store_true", help="print the table of the launches' CSVs and exit")
    return ap.parse_args()


def build(name: str, mode: str, device):
    import transformers
    from peft import LoraConfig, get_peft_model

    import bastile
    folder, config_cls, model_cls = MODELS[name]
    if mode == "bastile":
        bastile.apply(offload_checkpoints=True)
    cfg = getattr(transformers, config_cls)(**{**published(folder), "max_position_embeddings": 1 << 20},
                                            attn_implementation="sdpa")
    torch.manual_seed(0)  # the same weights on every rank
    with torch.device(device):
        model = getattr(transformers, model_cls)(cfg).to(torch.bfloat16)
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.enable_input_require_grads()
    model = get_peft_model(model, LoraConfig(r=16, lora_alpha=32, target_modules=TARGETS, lora_dropout=0.0))
    model.config.use_cache = False
    return model.train()


def step(model, opt, mesh, context: int, vocab: int, device):
    from torch.distributed.tensor.experimental import context_parallel

    g = torch.Generator().manual_seed(context)
    ids = torch.randint(0, vocab, (1, context), generator=g).to(device)
    shift_labels = torch.nn.functional.pad(ids, (0, 1), value=-100)[:, 1:].contiguous()
    positions = torch.arange(context, device=device)[None]
    buffers = [ids, shift_labels, positions]
    with context_parallel(mesh, buffers=buffers, buffer_seq_dims=[1, 1, 1], no_restore_buffers=set(buffers)):
        loss = model(input_ids=ids, labels=ids, shift_labels=shift_labels, position_ids=positions).loss
        loss.backward()
    for p in model.parameters():
        if p.grad is not None:
            dist.all_reduce(p.grad, op=dist.ReduceOp.AVG)
    opt.step()
    opt.zero_grad(set_to_none=True)
    total = loss.detach().float()
    dist.all_reduce(total, op=dist.ReduceOp.AVG)
    return float(total)


def main():
    args = parse()
    if args.report:
        rows = []
        for path in sorted(out_dir().glob("context_*.csv")):
            with open(path) as f:
                rows += list(csv.DictReader(f))
        print(markdown(rows, COLUMNS))
        return
    from accelerate.big_modeling import _attach_context_parallel_hooks
    from torch.distributed.device_mesh import init_device_mesh

    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
    device = torch.device("cuda", torch.cuda.current_device())
    dist.init_process_group("nccl", timeout=timedelta(minutes=2))
    mesh = init_device_mesh("cuda", (world,), mesh_dim_names=("cp",))
    model = build(args.model, args.mode, device)
    _attach_context_parallel_hooks(model)
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-5)
    vocab = model.config.vocab_size
    rows = []
    for context in map(int, args.contexts.split(",")):
        row = dict(model=args.model, mode=args.mode, gpus=world, context=context)
        try:
            for _ in range(args.warmup):  # the allocators' (device and pinned host) first blocks of this size
                step(model, opt, mesh, context, vocab, device)
            torch.cuda.reset_peak_memory_stats()
            torch.cuda.synchronize()
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            for _ in range(args.steps):
                loss = step(model, opt, mesh, context, vocab, device)
            end.record()
            torch.cuda.synchronize()
            seconds = start.elapsed_time(end) / 1e3 / args.steps
            peak = torch.tensor(torch.cuda.max_memory_allocated() / 2**30, device=device)
            dist.all_reduce(peak, op=dist.ReduceOp.MAX)
            row.update(status="ok", tokens_per_s=round(context / seconds), s_per_step=round(seconds, 2),
                       peak_GiB=round(float(peak), 2), loss=round(loss, 4))
        except Exception as e:  # noqa: BLE001 (OOM ends the ladder; the row says what happened)
            row["status"] = failed(e)
        rows.append(row)
        if rank == 0:
            print(row, flush=True)
        if row["status"] != "ok":
            break
        gc.collect()
        torch.cuda.empty_cache()
    if rank == 0:
        write_csv(out_dir() / f"context_{args.model}_{args.mode}_{world}gpu.csv", rows)
        print(environment())
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
