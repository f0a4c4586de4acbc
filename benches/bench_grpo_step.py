"""A GRPO policy step on the H100: forward + backward of TRL's fused LM head over generated completions,
TRL's head against Bastile's, each in its own process.

    python3 benches/bench_grpo_step.py [--model 1.7B] [--batch 16] [--prompt 256] [--completion 768]

Random-init Qwen3 in bf16 (SDPA, gradient checkpointing as TRL's default, fused AdamW), a batch of
prompt + completion rows. The step is what GRPOTrainer's compute_loss does for the policy (beta 0):
`model(..., labels=completion labels, fused_lm_head=True)` on the head TRL adds (`add_fused_lm_head`, outputs
log_probs and entropy, temperature 1.0), the clipped-ratio loss -min(r A, clip(r) A) with r = exp(logp -
old_logp) (old = detached logp: TRL's single-iteration case), summed over completion tokens and divided by
their count, then the optimizer step. Modes: `trl` (HF's model, TRL's head), `bastile` (bastile.apply(): our
kernels and head), `bastile_trl_head` (bastile.apply(log_probs=False): our kernels, TRL's head). Median ms
per step after --warmup steps, tokens/s over prompt + completion tokens, peak GiB.
"""
import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import environment, qwen3  # noqa: E402

MODES = ["trl", "bastile_trl_head", "bastile"]


def child(args) -> dict:
    if args.mode != "trl":
        import bastile
        bastile.apply(log_probs=args.mode == "bastile")
    from transformers import Qwen3Config, Qwen3ForCausalLM
    from trl.trainer.utils import add_fused_lm_head
    torch.manual_seed(0)
    with torch.device(args.device):
        model = Qwen3ForCausalLM._from_config(Qwen3Config(**qwen3(args.model)), dtype=torch.bfloat16,
                                              attn_implementation="sdpa")
    model.gradient_checkpointing_enable()
    model.config.use_cache = False
    model.train()
    add_fused_lm_head(model, outputs=("log_probs", "entropy"))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-6, fused=args.device == "cuda")
    g = torch.Generator().manual_seed(0)
    rows = args.prompt + args.completion
    ids = torch.randint(0, model.config.vocab_size, (args.batch, rows), generator=g).to(args.device)
    labels = ids.clone()
    labels[:, :args.prompt] = -100
    advantages = torch.randn(args.batch, 1, generator=g).to(args.device)
    times = []
    for step in range(args.warmup + args.steps):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        with torch.autocast(args.device, dtype=torch.bfloat16):
            out = model(input_ids=ids, labels=labels, fused_lm_head=True)
        logp, mask = out.log_probs, out.label_mask
        ratio = torch.exp(logp - logp.detach())
        per_token = -torch.min(ratio * advantages, ratio.clamp(0.8, 1.28) * advantages)
        loss = (per_token * mask).sum() / mask.sum().clamp(min=1)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    ms = sorted(times[args.warmup:])[len(times[args.warmup:]) // 2] * 1e3
    return dict(mode=args.mode, ms=ms, tokens_per_s=args.batch * rows / ms * 1e3,
                peak_GiB=torch.cuda.max_memory_allocated() / 2 ** 30, loss=loss.item(), env=environment())


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="1.7B")
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--prompt", type=int, default=256)
    ap.add_argument("--completion", type=int, default=768)
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--modes", default=",".join(MODES))
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--mode", help="(internal) run one mode in this process")
    args = ap.parse_args()
    if args.mode:
        print("RESULT " + json.dumps(child(args)), flush=True)
        return
    results = []
    for mode in args.modes.split(","):
        cmd = [sys.executable, __file__, "--mode", mode] + [f"--{k}={getattr(args, k)}" for k in
                                                          ("model", "batch", "prompt", "completion", "steps", "warmup")]
        out = subprocess.run(cmd, capture_output=True, text=True)
        line = next((l for l in reversed(out.stdout.splitlines()) if l.startswith("RESULT ")), None)
        results.append(json.loads(line[7:]) if line else {"mode": mode, "error": (out.stdout + out.stderr)[-1500:]})
    env = next((r["env"] for r in results if "env" in r), "")
    print(f"{env}; Qwen3-{args.model}, batch {args.batch} × ({args.prompt} prompt + {args.completion} completion)\n")
    print("| mode | ms/step | tokens/s | peak GiB | loss |\n|---|---|---|---|---|")
    for r in results:
        if "error" in r:
            print(f"| {r['mode']} | error: {' '.join(r['error'].split())[-300:]} | | | |")
        else:
            print(f"| {r['mode']} | {r['ms']:.1f} | {r['tokens_per_s']:,.0f} | {r['peak_GiB']:.2f} | {r['loss']:.4f} |")


if __name__ == "__main__":
    main()
