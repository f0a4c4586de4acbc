"""Where the GPU time of one Qwen3 training step goes: torch.profiler over one step after warm-up, kernels
ranked by CUDA time and grouped into categories.

    python benches/bench_profile.py                        # Bastile, Qwen3-0.6B, seq 4096 x batch 2
    python benches/bench_profile.py --mode hf              # the same step in HF eager, for comparison
    python benches/bench_profile.py --model 1.7B --seq 8192 --batch 1 --top 40
    python benches/bench_profile.py --model 1.7B --lora 16 --warmup 10   # PEFT LoRA, as bench_e2e --lora
    python benches/bench_profile.py --smoke                # tiny model on the CPU (CPU op times): checks the script

The step is bench_e2e.py's (same model, data and optimizer; --mode is any of its modes). Wall time per step:
CUDA events around each of --warmup further steps (their mean, and each one printed). Kernel time: the duration of every kernel (and memcpy/memset)
the profiler records in one step, summed per name; "% of GPU time" is of the sum over all kernels of the
step, "% of step wall" of the unprofiled wall time per step. Categories: bastile (our kernels, named
<op>_<tags> after their family: rms_norm_*, swiglu_*, rope_*, ...), attention, GEMM (cuBLAS/CUTLASS; the fused cross-entropy's
GEMMs are cuBLAS calls through ATen and count here), optimizer, elementwise/other. Writes profile-<mode>.csv (kernels) and profile-<mode>-categories.csv under
$OUT or bench-results/ (--trace adds the Chrome trace, large).
"""
import argparse
import re
import time
from collections import defaultdict

import torch
from bench_e2e import MODES, build, sync, tokens, train_step
from common import environment, markdown, out_dir, qwen3, use_device, write_csv
from torch.autograd import DeviceType
from torch.profiler import ProfilerActivity, profile

# First match wins: attention before GEMM (cuDNN/flash attention kernels carry GEMM-like names).
CATEGORIES = [
    ("bastile", r"^(rms_norm|swiglu|geglu|rope|qk_norm_rope|fused_linear_cross_entropy)_(fwd|bwd|rows|scale)_|^bastile::"),
    ("attention", r"flash|fmha|attention|sdpa|_attn|mha"),
    ("optimizer", r"adam|multi_tensor_apply|foreach"),
    ("GEMM", r"gemm|cutlass|xmma|nvjet|cublas|wgmma|sm\d+_.*(tn|nt|nn|tt)|^aten::(mm|addmm|bmm|matmul|linear)$"),
]


def category(name: str) -> str:
    for cat, pattern in CATEGORIES:
        if re.search(pattern, name, re.IGNORECASE):
            return cat
    return "elementwise/other"


def kernel_times(prof, on_cuda: bool) -> dict:
    """name -> (microseconds, calls). CUDA: the device's kernel/memcpy/memset records. CPU (smoke): the ops'
    self time, so that nested ops are not counted twice."""
    times = defaultdict(lambda: [0.0, 0])
    if on_cuda:
        for e in prof.events():
            if e.device_type == DeviceType.CUDA:
                times[e.name][0] += e.time_range.elapsed_us()
                times[e.name][1] += 1
    else:
        for e in prof.key_averages():
            if e.self_cpu_time_total > 0:
                times[e.key] = [e.self_cpu_time_total, e.count]
    return dict(times)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--mode", default="bastile", choices=MODES)
    ap.add_argument("--model", default="0.6B", help="0.6B, 1.7B, 4B, 8B")
    ap.add_argument("--seq", type=int, default=4096)
    ap.add_argument("--batch", type=int, default=2)
    ap.add_argument("--warmup", type=int, default=3, help="steps before the profiled one (compilation happens there)")
    ap.add_argument("--top", type=int, default=25)
    ap.add_argument("--lora", type=int, default=0, metavar="R", help="PEFT LoRA of rank R, as bench_e2e --lora")
    ap.add_argument("--trace", action="store_true", help="also write the Chrome trace (tens of MB)")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--smoke", action="store_true", help="tiny model, seq 64, on the CPU")
    args = ap.parse_args()
    if args.smoke:
        args.model, args.seq, args.device, args.warmup = "tiny", 64, "cpu", 1
    use_device(args.device)
    on_cuda = args.device == "cuda"
    print(environment(), flush=True)
    print(f"Qwen3-{args.model}, {args.mode}, seq {args.seq} x batch {args.batch}, bf16, fused AdamW, SDPA"
          + (f", LoRA r={args.lora}" if args.lora else ""), flush=True)

    net, opt = build(args.mode, args.model, args.device, lora=args.lora)
    data = tokens(qwen3(args.model)["vocab_size"], 2 * args.warmup + 1, args.batch, args.seq, args.device)
    for i in range(args.warmup):
        train_step(net, opt, data[i])
    sync(args.device)
    if on_cuda:  # wall time of each step, unprofiled
        events = [torch.cuda.Event(enable_timing=True) for _ in range(args.warmup + 1)]
        events[0].record()
        for i in range(args.warmup):
            train_step(net, opt, data[args.warmup + i])
            events[i + 1].record()
        sync(args.device)
        steps_ms = [a.elapsed_time(b) for a, b in zip(events, events[1:])]
        step_ms = sum(steps_ms) / args.warmup
        print("unprofiled steps (ms): " + " ".join(f"{t:.1f}" for t in steps_ms), flush=True)
        # From an idle GPU, the host's time to issue a step against the step's time: close, the step is
        # bound by the host (Python, dispatch, launches), not by the GPU.
        t0 = time.perf_counter()
        train_step(net, opt, data[0])
        issued = time.perf_counter() - t0
        sync(args.device)
        print(f"one step from an idle GPU: issued in {issued * 1e3:.1f} ms, done in "
              f"{(time.perf_counter() - t0) * 1e3:.1f} ms", flush=True)
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if on_cuda else [])
    with profile(activities=activities) as prof:
        train_step(net, opt, data[-1])
        sync(args.device)
    times = kernel_times(prof, on_cuda)
    total = sum(t for t, _ in times.values())

    stem = f"profile-{args.mode}" + (f"-lora{args.lora}" if args.lora else "")
    kernels = sorted(times.items(), key=lambda kv: -kv[1][0])
    rows = [{"kernel": name, "category": category(name), "calls": calls, "total_us": f"{us:.1f}",
             "pct": f"{100 * us / total:.2f}"} for name, (us, calls) in kernels]
    write_csv(out_dir() / f"{stem}.csv", rows)
    cats = defaultdict(lambda: [0.0, 0, 0])
    for name, (us, calls) in kernels:
        c = cats[category(name)]
        c[0] += us
        c[1] += calls
        c[2] += 1
    cat_rows = [{"category": c, "total_ms": f"{us / 1e3:.3f}", "pct": f"{100 * us / total:.1f}",
                 **({"pct_of_step_wall": f"{us / 10 / step_ms:.1f}"} if on_cuda else {}), "calls": calls, "kernels": n}
                for c, (us, calls, n) in sorted(cats.items(), key=lambda kv: -kv[1][0])]
    write_csv(out_dir() / f"{stem}-categories.csv", cat_rows)
    if args.trace:
        prof.export_chrome_trace(str(out_dir() / f"{stem}-trace.json"))

    what = "kernel" if on_cuda else "CPU op (self time)"
    print(f"\none step: {what} time {total / 1e3:.2f} ms"
          + (f", wall {step_ms:.2f} ms (mean of {args.warmup} unprofiled steps), "
             f"{args.batch * args.seq / step_ms * 1e3:,.0f} tokens/s" if on_cuda else ""))
    print(f"\n### Top {args.top} by {what} time ({args.mode})\n")
    top = [{"#": i + 1, what: (r["kernel"][:100] + "…") if len(r["kernel"]) > 100 else r["kernel"],
            "category": r["category"], "calls": r["calls"], "ms": f"{float(r['total_us']) / 1e3:.3f}",
            "% of GPU time" if on_cuda else "% of CPU time": r["pct"],
            **({"% of step wall": f"{float(r['total_us']) / 10 / step_ms:.2f}"} if on_cuda else {})}
           for i, r in enumerate(rows[:args.top])]
    print(markdown(top, list(top[0])))
    print(f"\n### By category ({args.mode})\n")
    print(markdown(cat_rows, list(cat_rows[0])))
    print(f"\nwrote {out_dir() / f'{stem}.csv'}, {out_dir() / f'{stem}-categories.csv'}", flush=True)


if __name__ == "__main__":
    main()
