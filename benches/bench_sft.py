"""SFT on mixed-length data: TRL's SFTTrainer alone, with Liger, with Bastile, and Bastile's own loader in a
plain loop; real (non-pad) tokens per second.

    python benches/bench_sft.py                                   # Qwen3-1.7B and 0.6B, packed rows of 4096
    python benches/bench_sft.py --models 1.7B --padded            # also padded batches of 8 sequences
    python benches/bench_sft.py --smoke                           # tiny model on the CPU: checks the script
    python benches/bench_sft.py --models 1.7B --full-rows --modes trl,trl_liger,trl_bastile [--lora]

The data: random token sequences with the issue's lengths (log-normal, median about 245, mean about 370,
capped at 4095; benches/bench_packing.py's `lengths`). The model: random-init Qwen3 in bf16, SDPA, fused
AdamW, TRL's defaults (gradient checkpointing, bf16 autocast, lr 2e-5, logging every 10 steps) with
max_length 4096. Packed: `packing=True` (best fit decreasing, padding-free: TRL flattens each batch of 2
rows into one row of up to 8192 tokens, with cu_seq_lens), batch 2. Padded: batch 8, padded to the longest.
The plain loop: `bastile.data.PackedDataset(capacity=4096)`, `collate`, `prefetch`, batch 2, the same
checkpointing, optimizer and learning rate. `--full-rows`: every sequence 4096 tokens, no packing (TRL's
plain batches of 2 full rows). `--lora`: PEFT LoRA r=16, alpha 32, on the seven projections (TRL's
peft_config). Each (model, mode) runs in its own process; timed from the end of step `--warmup` to the end
of the last, one synchronisation at each end.
"""
import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_packing import lengths  # noqa: E402
from common import environment, qwen3  # noqa: E402

MODES = ["trl", "trl_liger", "trl_bastile", "bastile_loop"]
# Also: trl_bastile_trl_head, bastile.apply(log_probs=False): Bastile's kernels with TRL's own LM head.
PADDED = ["trl_padded", "trl_bastile_padded"]
CAPACITY = 4096
LR = 2e-5  # TRL's default


def sequences(n: int, vocab: int, seed: int = 0, full_rows: bool = False) -> list:
    gen = torch.Generator().manual_seed(seed)
    sizes = [CAPACITY] * n if full_rows else lengths(n, seed)
    return [torch.randint(0, vocab, (int(n),), generator=gen).tolist() for n in sizes]


def tokenizer():
    """A two-token tokenizer: the data is already token ids; TRL reads pad and eos from it."""
    from tokenizers import Tokenizer
    from tokenizers.models import WordLevel
    from transformers import PreTrainedTokenizerFast
    return PreTrainedTokenizerFast(tokenizer_object=Tokenizer(WordLevel({"<pad>": 0, "<eos>": 1}, unk_token="<pad>")),
                                   pad_token="<pad>", eos_token="<eos>")


def build(model: str, device: str, bastile_on: bool, log_probs: bool = True):
    if bastile_on:
        import bastile
        bastile.apply(log_probs=log_probs)
    from transformers import Qwen3Config, Qwen3ForCausalLM
    torch.manual_seed(0)
    with torch.device(device):
        return Qwen3ForCausalLM._from_config(Qwen3Config(**qwen3(model)), dtype=torch.bfloat16,
                                             attn_implementation="sdpa")


class Clock:
    """Wall time from the end of step `warmup` to the end of the last step, and the real tokens of the
    batches in between."""

    def __init__(self, warmup: int, device: str):
        self.warmup, self.device, self.tokens, self.t0 = warmup, device, [], None

    def sync(self):
        if self.device == "cuda":
            torch.cuda.synchronize()

    def step_done(self, step: int):  # step counts from 1
        if step == self.warmup:
            self.sync()
            self.t0 = time.perf_counter()

    def result(self, steps: int) -> dict:
        self.sync()
        elapsed = time.perf_counter() - self.t0
        real = sum(self.tokens[self.warmup:steps])
        return dict(tokens_per_s=real / elapsed, ms_per_step=elapsed / (steps - self.warmup) * 1e3,
                    real_tokens=real)


def run_trl(args, mode: str, clock: Clock) -> list:
    from datasets import Dataset
    from transformers import TrainerCallback
    from trl import SFTConfig, SFTTrainer
    padded = mode.endswith("_padded")
    net = build(args.model, args.device, "bastile" in mode, log_probs=not mode.endswith("trl_head"))
    ds = Dataset.from_dict({"input_ids": sequences(args.n, net.config.vocab_size, full_rows=args.full_rows)})
    peft = {}
    if args.lora:
        from peft import LoraConfig
        peft["peft_config"] = LoraConfig(r=16, lora_alpha=32, task_type="CAUSAL_LM", target_modules=[
            "q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"])
    cfg = SFTConfig(output_dir=tempfile.mkdtemp(), max_steps=args.steps, per_device_train_batch_size=8 if padded else 2,
                    max_length=CAPACITY, packing=not (padded or args.full_rows), use_liger_kernel=mode == "trl_liger",
                    optim="adamw_torch_fused", report_to="none", save_strategy="no", seed=0,
                    use_cpu=args.device == "cpu", bf16=args.device == "cuda")
    trainer = SFTTrainer(net, args=cfg, train_dataset=ds, processing_class=tokenizer(), **peft)
    collate = trainer.data_collator

    def counting(examples):
        batch = collate(examples)
        mask = batch.get("attention_mask")
        clock.tokens.append(int(mask.sum()) if mask is not None else batch["input_ids"].numel())
        return batch
    trainer.data_collator = counting

    class Steps(TrainerCallback):
        def on_step_end(self, _args, state, _control, **_):
            clock.step_done(state.global_step)
    trainer.add_callback(Steps())
    trainer.train()
    return [e["loss"] for e in trainer.state.log_history if "loss" in e]


def run_loop(args, clock: Clock) -> list:
    import bastile
    from torch.utils.data import DataLoader
    net = build(args.model, args.device, True)
    net.gradient_checkpointing_enable()
    net.train()
    opt = torch.optim.AdamW(net.parameters(), lr=LR, fused=args.device == "cuda")
    rows = bastile.data.PackedDataset(sequences(args.n, net.config.vocab_size), CAPACITY)
    loader = DataLoader(rows, batch_size=2, shuffle=True, collate_fn=bastile.data.collate,
                        generator=torch.Generator().manual_seed(0))
    losses = []
    for step, batch in enumerate(bastile.data.prefetch(loader), 1):
        clock.tokens.append(batch["input_ids"].numel())
        batch = {k: v.to(args.device, non_blocking=True) if torch.is_tensor(v) else v for k, v in batch.items()}
        with torch.autocast(args.device, dtype=torch.bfloat16, enabled=args.device == "cuda"):
            loss = net(**batch).loss
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        clock.step_done(step)
        if step % 10 == 0:
            losses.append(loss.item())  # as TRL logs: every 10 steps (one sync each)
        if step == args.steps:
            break
    return losses


def child(args) -> dict:
    result = {"model": args.model, "mode": args.mode}
    try:
        result["env"] = environment()
        clock = Clock(args.warmup, args.device)
        losses = run_loop(args, clock) if args.mode == "bastile_loop" else run_trl(args, args.mode, clock)
        result.update(status="ok", losses=losses, **clock.result(args.steps))
        if args.device == "cuda":
            result["peak_GiB"] = torch.cuda.max_memory_allocated() / 2 ** 30
    except torch.OutOfMemoryError:
        result["status"] = "OOM"
    except Exception as e:  # noqa: BLE001
        result["status"] = "error: " + " ".join(f"{type(e).__name__}: {e}".split())[:300]
    return result


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--models", default="1.7B,0.6B")
    ap.add_argument("--modes", default=",".join(MODES))
    ap.add_argument("--padded", action="store_true", help=f"also {', '.join(PADDED)}")
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--warmup", type=int, default=10)
    ap.add_argument("--n", type=int, default=6000, help="sequences in the dataset")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--timeout", type=float, default=400)
    ap.add_argument("--json", help="write the results here")
    ap.add_argument("--smoke", action="store_true", help="tiny model, 4 steps, on the CPU")
    ap.add_argument("--full-rows", action="store_true", help="sequences of 4096 tokens, no packing")
    ap.add_argument("--lora", action="store_true", help="PEFT LoRA r=16 on the seven projections")
    ap.add_argument("--mode", help="(internal) run one mode in this process")
    ap.add_argument("--model", help="(internal)")
    args = ap.parse_args()
    if args.mode:
        if args.smoke:
            torch.set_num_threads(2)
        print("RESULT " + json.dumps(child(args)), flush=True)
        return
    extra = ["--smoke", "--device", "cpu", "--n", "200"] if args.smoke else ["--device", args.device, "--n", str(args.n)]
    extra += ["--full-rows"] * args.full_rows + ["--lora"] * args.lora
    steps, warmup = (4, 2) if args.smoke else (args.steps, args.warmup)
    models = ["tiny"] if args.smoke else args.models.split(",")
    modes = args.modes.split(",") + (PADDED if args.padded else [])
    results = []
    for model in models:
        for mode in modes:
            cmd = [sys.executable, __file__, "--mode", mode, "--model", model, "--steps", str(steps),
                   "--warmup", str(warmup), *extra]
            try:
                out = subprocess.run(cmd, capture_output=True, text=True, timeout=args.timeout).stdout
                line = next((l for l in reversed(out.splitlines()) if l.startswith("RESULT ")), None)
                r = json.loads(line[7:]) if line else {"model": model, "mode": mode, "status": "no result",
                                                        "tail": out[-2000:]}
            except subprocess.TimeoutExpired:
                r = {"model": model, "mode": mode, "status": f"timeout ({args.timeout:.0f} s)"}
            results.append(r)
            print(json.dumps({k: v for k, v in r.items() if k != "env"}), flush=True)
    env = next((r["env"] for r in results if "env" in r), environment())
    print(f"\n{env}; {steps} steps, {warmup} warm-up\n")
    print("| model | mode | real tokens/s | ms/step | peak GiB | last logged loss |\n|---|---|---|---|---|---|")
    for r in results:
        if r["status"] != "ok":
            print(f"| {r['model']} | {r['mode']} | {r['status']} | | | |")
            continue
        print(f"| {r['model']} | {r['mode']} | {r['tokens_per_s']:,.0f} | {r['ms_per_step']:.0f} | "
              f"{r.get('peak_GiB', float('nan')):.2f} | {r['losses'][-1] if r['losses'] else ''} |")
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
