"""Qwen3 full fine-tuning, end to end: tokens/s, ms/step, peak memory and loss of five ways to run the same
training, each mode in its own process (patches swap HF classes and functions; a fresh process also makes
the peak memory the mode's own).

    python benches/bench_e2e.py --part 1                  # one piece of the matrix that fits a 10-minute call (PARTS)
    python benches/bench_e2e.py --models 0.6B,1.7B --seqs 4096 --batch 2 --modes hf,bastile
    python benches/bench_e2e.py --merge p1/e2e-part1.csv p2/e2e-part2.csv   # one CSV and the charts of several runs
    python benches/bench_e2e.py --models 1.7B --seqs 4096 --lora 16   # LoRA fine-tuning (PEFT) instead
    python benches/bench_e2e.py --smoke                   # tiny model, 2 steps, on the CPU: checks the script only

Modes: hf (HF eager), liger (liger_kernel.transformers.apply_liger_kernel_to_qwen3() with its defaults, fused
linear cross-entropy included, before the model is built), compile (torch.compile of the model), bastile
(bastile.apply()), bastile_compile (both). The model: random init from the published Qwen3 configs
(common.QWEN3: 0.6B, 1.7B, 4B; nothing downloaded), built directly on the GPU in bf16, SDPA attention, fused
AdamW (lr 1e-4), the same seed (same initial weights) and the same random tokens in every mode; labels =
input ids. With --lora R: PEFT LoRA (r=R, lora_alpha=2R, no dropout, PEFT's defaults otherwise: adapters in
fp32) on all seven projections, applied with get_peft_model after the mode's patches, AdamW over the adapters.
--steps steps (default 10), of which the first --warmup (default 3, compilation included) are
not timed. Batch: --batch, else 2 (4B: 1), the issue's setting at seq 4096.

Reported per mode: tokens/s and ms/step over the timed steps; peak GiB = torch.cuda.max_memory_allocated
over the whole child process (weights, gradients, AdamW states and activations: what a user's run needs;
max_memory_reserved beside it); the losses of the first and last step, and the last one relative to hf's
("!" past 2%: beyond bf16 noise over so few steps); in the CSV also every step's time (step_ms: from one
step's start to the next's on the GPU's timeline, events that add no synchronisation; a step as long as
the host's time for it is host-bound). OOM is a result; a child past --timeout seconds is
killed and reported as "timeout". Writes e2e[-part<n>].csv, .log (every child's output) and three charts
(tokens/s, peak GiB, ms/step) under $OUT or bench-results/.

A part runs at most --budget-s seconds (540 with --part), starts no child past it and gives the running child
only what is left, so a 10-minute device call always returns its CSV; what did not run says "not run
(budget)". Parts 1-2 hold the issue's target settings (seq 4096); the rest sweep seq 1024-16384.
"""
import argparse
import json
import math
import time
from pathlib import Path

import torch
from common import (QWEN3, child_process, environment, grouped_bars, markdown, out_dir, pyplot, qwen3, read_csv,
                    use_device, write_csv)

MODES = ("hf", "liger", "compile", "bastile", "bastile_compile")
RUN_ORDER = ("hf", "bastile", "liger", "compile", "bastile_compile")  # a budget cut drops compile modes first
LR = 1e-4
LORA_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
LOSS_TOLERANCE = 0.02

# (model, seq, batch) settings per part, all five modes each, meant to fit one 10-minute device call
# (measured on the H100: 15-20 s per eager child, 40-50 s for bastile_compile, 80-120 s for plain compile;
# --budget-s guards it).
PARTS = {
    1: [("0.6B", 4096, 2), ("1.7B", 4096, 2)],
    2: [("4B", 4096, 1), ("0.6B", 1024, 2)],
    3: [("0.6B", 2048, 2), ("0.6B", 8192, 2)],
    4: [("0.6B", 16384, 2), ("1.7B", 1024, 2)],
    5: [("1.7B", 2048, 2), ("1.7B", 8192, 2)],
    6: [("1.7B", 16384, 2), ("4B", 1024, 1)],
    7: [("4B", 2048, 1), ("4B", 8192, 1)],
    8: [("4B", 16384, 1)],
}


def default_batch(model: str) -> int:
    return 1 if model == "4B" else 2


# --- one mode, in its own process -------------------------------------------------------------------------

def build(mode: str, model: str, device: str, seed: int = 0, lora: int = 0):
    """The model and its optimizer as `mode` runs them. Patches come first: Liger swaps HF's classes,
    which only models built afterwards use."""
    if mode == "liger":
        from liger_kernel.transformers import apply_liger_kernel_to_qwen3
        apply_liger_kernel_to_qwen3()
    if mode.startswith("bastile"):
        import bastile
        bastile.apply()
    from transformers import Qwen3Config, Qwen3ForCausalLM
    cfg = Qwen3Config(**qwen3(model), use_cache=False)
    torch.manual_seed(seed)
    with torch.device(device):  # initialised where it trains, in bf16: seconds, not minutes
        net = Qwen3ForCausalLM._from_config(cfg, dtype=torch.bfloat16, attn_implementation="sdpa")
    if lora:
        from peft import LoraConfig, get_peft_model
        net = get_peft_model(net, LoraConfig(r=lora, lora_alpha=2 * lora, lora_dropout=0.0, target_modules=LORA_TARGETS))
    net.train()
    opt = torch.optim.AdamW([p for p in net.parameters() if p.requires_grad], lr=LR, fused=device == "cuda")
    if mode.endswith("compile"):
        net = torch.compile(net)
    return net, opt


def tokens(vocab: int, steps: int, batch: int, seq: int, device: str, seed: int = 0) -> torch.Tensor:
    """The same random tokens in every mode: [steps, batch, seq]."""
    gen = torch.Generator().manual_seed(seed + 1)
    return torch.randint(0, vocab, (steps, batch, seq), generator=gen).to(device)


def train_step(net, opt, ids) -> torch.Tensor:
    loss = net(input_ids=ids, labels=ids).loss
    loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
    return loss.detach()


def sync(device: str):
    if device == "cuda":
        torch.cuda.synchronize()


def mark(device: str):
    """A timestamp that adds no synchronisation: an event on the GPU's timeline, else the host clock."""
    if device != "cuda":
        return time.perf_counter()
    event = torch.cuda.Event(enable_timing=True)
    event.record()
    return event


def interval_ms(a, b) -> float:
    return a.elapsed_time(b) if isinstance(a, torch.cuda.Event) else (b - a) * 1e3


def child(args) -> dict:
    """Trains one mode; the result as a dict (status "ok", "OOM", "skipped: ...", "error: ...")."""
    result = {"model": args.model, "seq": args.seq, "batch": args.batch, "mode": args.mode}
    t_start = time.perf_counter()
    try:
        result["env"] = environment()
        net, opt = build(args.mode, args.model, args.device, args.seed, args.lora)
        data = tokens(qwen3(args.model)["vocab_size"], args.steps, args.batch, args.seq, args.device, args.seed)
        losses, marks = [], []
        sync(args.device)
        t0 = time.perf_counter()
        for i in range(args.steps):
            if i == args.warmup:
                sync(args.device)
                t_warm = time.perf_counter()
            marks.append(mark(args.device))
            losses.append(train_step(net, opt, data[i]))
        marks.append(mark(args.device))
        sync(args.device)
        elapsed = time.perf_counter() - t_warm
        timed = args.steps - args.warmup
        losses = [l.item() for l in losses]
        result.update(status="ok", tokens_per_s=args.batch * args.seq * timed / elapsed, ms_per_step=elapsed / timed * 1e3,
                      warmup_s=t_warm - t0, losses=losses,
                      step_ms=[interval_ms(a, b) for a, b in zip(marks, marks[1:])])
        if args.device == "cuda":
            result.update(peak_alloc_GiB=torch.cuda.max_memory_allocated() / 2 ** 30,
                          peak_reserved_GiB=torch.cuda.max_memory_reserved() / 2 ** 30)
    except torch.OutOfMemoryError:
        result["status"] = "OOM"
    except ImportError as e:
        result["status"] = f"skipped: {e.name or e} not installed" if args.mode == "liger" else f"error: {e}"
    except Exception as e:  # noqa: BLE001  (compile wraps an OOM in its own exceptions)
        text = " ".join(f"{type(e).__name__}: {e}".split())
        result["status"] = "OOM" if "out of memory" in text.lower() else f"error: {text[:300]}"
    result["child_s"] = time.perf_counter() - t_start
    return result


# --- the parent: one child per mode, the table and the charts -------------------------------------------------

def run_child(args, model: str, seq: int, batch: int, mode: str, timeout: float):
    """(result dict, the child's output)."""
    return child_process([str(Path(__file__).resolve()), "--mode", mode, "--model", model, "--seq", str(seq),
                          "--batch", str(batch), "--steps", str(args.steps), "--warmup", str(args.warmup),
                          "--device", args.device, "--seed", str(args.seed), "--lora", str(args.lora)], timeout)


def num(x):
    try:
        return float(x)
    except (TypeError, ValueError):
        return math.nan


def annotate(rows):
    """loss_vs_hf: each mode's last loss relative to hf's at the same model, seq and batch ("!" past 2%)."""
    for r in rows:
        ref = next((h for h in rows if h["mode"] == "hf" and h["status"] == "ok" and h["loss_last"]
                    and (h["model"], str(h["seq"]), str(h["batch"])) == (r["model"], str(r["seq"]), str(r["batch"]))), None)
        if r["status"] != "ok" or not r["loss_last"]:  # (merged rows may come without losses)
            r["loss_vs_hf"] = ""
        elif ref is None:
            r["loss_vs_hf"] = "no hf"
        else:
            rel = (num(r["loss_last"]) - num(ref["loss_last"])) / num(ref["loss_last"])
            r["loss_vs_hf"] = f"{rel:+.3%}" + (" !" if abs(rel) > LOSS_TOLERANCE else "")
    return rows


def row_of(result: dict, model: str, seq: int, batch: int, mode: str) -> dict:
    losses = result.get("losses") or []

    def f(key, digits):
        return "" if key not in result else f"{result[key]:.{digits}f}"

    return {"model": model, "seq": seq, "batch": batch, "mode": mode, "status": result["status"],
            "tokens_per_s": f("tokens_per_s", 0), "ms_per_step": f("ms_per_step", 1),
            "peak_alloc_GiB": f("peak_alloc_GiB", 2), "peak_reserved_GiB": f("peak_reserved_GiB", 2),
            "loss_first": f"{losses[0]:.5f}" if losses else "", "loss_last": f"{losses[-1]:.5f}" if losses else "",
            "loss_vs_hf": "", "warmup_s": f("warmup_s", 1), "child_s": f("child_s", 1),
            "losses": " ".join(f"{l:.5f}" for l in losses),
            "step_ms": " ".join(f"{m:.1f}" for m in result.get("step_ms") or [])}


COLUMNS = {"model": "model", "seq": "seq", "batch": "batch", "mode": "mode", "status": "status",
           "tokens_per_s": "tokens/s", "ms_per_step": "ms/step", "peak_alloc_GiB": "peak alloc GiB",
           "peak_reserved_GiB": "peak reserved GiB", "loss_first": "loss step 1", "loss_last": "loss last step",
           "loss_vs_hf": "last loss vs hf", "warmup_s": "warm-up s"}


def table(rows) -> str:
    return markdown([{v: r.get(k, "") for k, v in COLUMNS.items()} for r in rows], list(COLUMNS.values()))


def short(status: str) -> str:
    return status.split(":")[0].split(" (")[0]


def charts(rows, stem: str):
    plt = pyplot()
    if plt is None:
        return
    groups = list(dict.fromkeys((r["model"], str(r["seq"]), str(r["batch"])) for r in rows))
    groups.sort(key=lambda g: (list(QWEN3).index(g[0]), int(g[1]), int(g[2])))
    modes = [m for m in MODES if any(r["mode"] == m for r in rows)]
    by = {(r["model"], str(r["seq"]), str(r["batch"]), r["mode"]): r for r in rows}
    labels = [f"{m}\n{s}x{b}" for m, s, b in groups]
    for key, title in [("tokens_per_s", "tokens/s (higher is better)"), ("peak_alloc_GiB", "peak allocated GiB (whole run)"),
                       ("ms_per_step", "ms per step (lower is better)")]:
        fig, ax = plt.subplots(figsize=(max(6.0, 1.3 * len(groups) * len(modes) / 3), 4.5))

        def value(label, mode):
            r = by.get((*groups[labels.index(label)], mode))
            if r is None:
                return None
            return num(r[key]) if r["status"] == "ok" else short(r["status"])

        grouped_bars(ax, labels, modes, value, f"Qwen3 fine-tuning step, bf16: {title}", title, labels=True)
        ax.set_ylim(top=ax.get_ylim()[1] * 1.12)  # room for the labels
        ax.legend(fontsize=7)
        ax.set_xlabel("model, seq x batch", fontsize=8)
        fig.tight_layout()
        path = out_dir() / f"{stem}_{key}.png"
        fig.savefig(path, dpi=110)
        plt.close(fig)
        print(f"wrote {path}", flush=True)


def report(rows, stem: str):
    annotate(rows)
    write_csv(out_dir() / f"{stem}.csv", rows)
    print()
    envs = {r.get("env") for r in rows if r.get("env")}
    for env in envs:
        print(env)
    print("peak alloc = torch.cuda.max_memory_allocated over the whole process: weights, gradients, AdamW states, "
          "activations; tokens/s and ms/step over the timed steps")
    print(table(rows))
    print(f"\nwrote {out_dir() / f'{stem}.csv'}", flush=True)
    charts(rows, stem)


def parent(args):
    if args.part:
        settings = PARTS[args.part]
    else:
        settings = [(m, s, args.batch or default_batch(m)) for m in args.models.split(",") for s in map(int, args.seqs.split(","))]
    modes = [m for m in RUN_ORDER if m in args.modes.split(",")]
    stem = (f"e2e-part{args.part}" if args.part else "e2e") + (f"-lora{args.lora}" if args.lora else "")
    budget = args.budget_s if args.budget_s is not None else (540 if args.part else 0)
    print(f"torch {torch.__version__}, {len(settings)} settings x {len(modes)} modes, {args.steps} steps "
          f"({args.warmup} warm-up), child timeout {args.timeout} s, budget {f'{budget:.0f} s' if budget else 'none'}", flush=True)
    t0 = time.perf_counter()
    rows, log = [], []
    for model, seq, batch in settings:
        for mode in modes:
            left = budget - (time.perf_counter() - t0) if budget else math.inf
            if left < 20:  # too little to start a process, import torch and train
                result, out = {"status": "not run (budget)"}, ""
            else:
                result, out = run_child(args, model, seq, batch, mode, min(args.timeout, left))
            rows.append(row_of(result, model, seq, batch, mode))
            rows[-1]["env"] = result.get("env", "")
            log.append(f"===== {model} seq {seq} batch {batch} {mode}: {result['status']}\n{out}")
            print(f"{model} seq {seq} x {batch} {mode}: {result['status']}"
                  + (f", {num(rows[-1]['tokens_per_s']):,.0f} tokens/s, peak {rows[-1]['peak_alloc_GiB'] or '-'} GiB, "
                     f"last loss {rows[-1]['loss_last']}, child {rows[-1]['child_s']} s" if result["status"] == "ok" else ""),
                  flush=True)
            if result["status"].startswith("error") or result["status"].startswith("timeout"):
                print("\n".join(out.splitlines()[-15:]), flush=True)
            write_csv(out_dir() / f"{stem}.csv", rows)  # as it goes
            (out_dir() / f"{stem}.log").write_text("\n".join(log))
    print(f"total {time.perf_counter() - t0:.0f} s", flush=True)
    report(rows, stem)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--part", type=int, choices=sorted(PARTS), help="one piece of the matrix (see PARTS)")
    ap.add_argument("--models", default="0.6B,1.7B,4B", help="comma-separated: 0.6B, 1.7B, 4B, 8B")
    ap.add_argument("--seqs", default="1024,2048,4096,8192,16384", help="comma-separated sequence lengths")
    ap.add_argument("--batch", type=int, help="sequences per step (default 2; 4B: 1)")
    ap.add_argument("--modes", default=",".join(MODES), help="comma-separated subset")
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--warmup", type=int, default=3, help="steps not timed (compilation happens there)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--lora", type=int, default=0, metavar="R", help="PEFT LoRA of rank R on the seven projections")
    ap.add_argument("--timeout", type=float, default=300, help="seconds per child")
    ap.add_argument("--budget-s", type=float, help="seconds for the whole run (default: 540 with --part, else none)")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--smoke", action="store_true", help="tiny model, seqs 32 and 64, 2 steps, on the CPU")
    ap.add_argument("--merge", nargs="+", metavar="CSV", help="combine the CSVs of several runs and chart them")
    ap.add_argument("--mode", choices=MODES, help="(internal) run one mode in this process and print its RESULT line")
    ap.add_argument("--model", help="(internal, with --mode)")
    ap.add_argument("--seq", type=int, help="(internal, with --mode)")
    args = ap.parse_args()
    if args.smoke:
        args.models, args.seqs, args.batch, args.steps, args.warmup, args.device = "tiny", "32,64", 2, 2, 1, "cpu"
    if args.steps <= args.warmup:
        ap.error("--steps must exceed --warmup")
    use_device(args.device)
    if args.mode:
        result = child(args)
        print("RESULT " + json.dumps(result), flush=True)
    elif args.merge:  # a setting measured twice: the later file's row
        rows = {(r["model"], r["seq"], r["batch"], r["mode"]): r for r in read_csv(args.merge)}
        report(sorted(rows.values(), key=lambda r: (list(QWEN3).index(r["model"]), int(r["seq"]), int(r["batch"]),
                                                      MODES.index(r["mode"]))), "e2e")
    else:
        parent(args)


if __name__ == "__main__":
    main()
