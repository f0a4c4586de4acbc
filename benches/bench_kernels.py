"""Every Bastile kernel against its peers at the shapes of Qwen3-0.6B, 1.7B, 4B and 8B: HF's eager expression,
torch.compile of it, and Liger Kernel when it is installed; forward, backward and forward+backward.

    python benches/bench_kernels.py                              # every op at the four sizes, bf16, batch 2 x seq 4096
    python benches/bench_kernels.py --models 0.6B,1.7B           # a subset of sizes (--ops, --impls, --passes likewise)
    python benches/bench_kernels.py --merge a/kernels.csv b/kernels.csv   # one CSV and the charts of several runs
    python benches/bench_kernels.py --smoke                      # tiny shapes on the CPU: checks the script only

Shapes per size (tokens = batch x seq): rms_norm tokens x hidden; swiglu tokens x intermediate; rope and
qk_norm_rope batch x seq x heads x kv_heads x 128; fused_linear_cross_entropy tokens x hidden x vocab 151936.
The cases (inputs, implementations, bytes or FLOPs) are each op's `cases()` in benches/bench_<op>.py.
geglu, GPT-OSS's expert activation, has no Qwen3 shape: benches/bench_geglu.py times it at GPT-OSS's.

Per pass: median ms (CUDA events, L2 flushed before each repetition, warm-up and compilation excluded:
common.time_ms), the fastest of --rounds rounds (3) that each start with the next implementation
(common.measure_rounds), effective TB/s (bytes an ideal kernel moves) or, for the cross-entropy, TFLOP/s (2NHV
forward, 6NHV forward+backward; none for its backward, which the fused implementations do not run as GEMMs),
and the peak memory allocated during one call beyond what was allocated before it. "fwd" runs on inputs that
need no gradient; "bwd" is the backward alone, repeated over one retained graph; "fwd+bwd" the forward on
inputs that need gradients and the backward. Every implementation's output is checked against HF's first
(a mismatch is flagged in the "check" column, not fatal).

Writes kernels.csv and kernels_<op>.png (time, throughput, peak memory per pass; bars per size and
implementation) under $OUT or bench-results/. 91 s on the H100 for everything in one round (mostly torch.compile);
`--budget-s` stops starting new cases past that many seconds, so that a time-limited run still writes what
it measured.
"""
import argparse
import time

import torch
from common import (PASS_NAMES, PASSES, QWEN3, fmt, free, grouped_bars, markdown, measure_rounds, out_dir, pyplot,
                    qwen3, read_csv, start, throughput, use_device, with_rounds, write_csv)

import bench_fused_linear_cross_entropy
import bench_qk_norm_rope
import bench_rms_norm
import bench_rope
import bench_swiglu


def heads(c, b, s):
    return f"{b}x{s}x{c['num_attention_heads']}x{c['num_key_value_heads']}x{c['head_dim']}", {}


# op -> (its benchmark module, (Qwen3 config, batch, seq) -> (shape, extra arguments of cases()))
OPS = {
    "rms_norm": (bench_rms_norm, lambda c, b, s: (f"{b * s}x{c['hidden_size']}", {})),
    "swiglu": (bench_swiglu, lambda c, b, s: (f"{b * s}x{c['intermediate_size']}", {})),
    "rope": (bench_rope, heads),
    "qk_norm_rope": (bench_qk_norm_rope, heads),
    "fused_linear_cross_entropy": (bench_fused_linear_cross_entropy,
                                   lambda c, b, s: (f"{b * s}x{c['hidden_size']}", {"vocab": c["vocab_size"]})),
}
# The per-op scripts' names for the peers -> one name here.
ALIASES = {"hf_eager": "eager", "torch_compile": "compile"}
IMPLS = "bastile,eager,compile,liger"


def run(args) -> list:
    dtype = getattr(torch, args.dtype)
    start()
    t0 = time.perf_counter()
    rows, skipped = [], []
    wanted = args.impls.split(",")
    passes = [p for p in PASSES if p in args.passes.split(",")]
    for model in args.models.split(","):
        for op in args.ops.split(","):
            module, shape_of = OPS[op]
            if args.budget_s and time.perf_counter() - t0 > args.budget_s:
                skipped.append(f"{op} {model}")
                continue
            shape, extra = shape_of(qwen3(model), args.batch, args.seq)
            t_case = time.perf_counter()
            case = module.cases(shape, dtype, **extra)
            names = [name for name in case.impls if ALIASES.get(name, name) in wanted]
            results = measure_rounds(case, names, passes, args.rounds, strict=False, reps=args.reps,
                                     warmup=args.warmup)
            for name, r in results.items():
                impl = ALIASES.get(name, name)
                row = {"op": op, "model": model, "shape": case.shape, "dtype": args.dtype, "impl": impl,
                       "unit": case.unit, "check": r["check"]}
                for p in passes:
                    ms, peak = r.get(p, (None, None))
                    row.update({f"{p}_ms": fmt(ms, 4), f"{p}_tput": fmt(throughput(ms, case.work.get(p)), 2),
                                f"{p}_peak_GiB": fmt(peak, 3)})
                rows.append(row)
                print(row, flush=True)
            del case
            free()
            print(f"-- {op} {model}: {time.perf_counter() - t_case:.0f} s", flush=True)
            write_csv(out_dir() / "kernels.csv", rows)  # as it goes: a cut-off run keeps what it measured
    print(f"total {time.perf_counter() - t0:.0f} s", flush=True)
    if skipped:
        print(f"not run (past --budget-s {args.budget_s}): {', '.join(skipped)}", flush=True)
    return rows


def tables(rows) -> str:
    out = []
    for op in dict.fromkeys(r["op"] for r in rows):
        sel = [r for r in rows if r["op"] == op]
        unit = sel[0]["unit"]
        passes = [p for p in PASSES if f"{p}_ms" in sel[0]]
        cols = ["model", "shape", "impl"] + [c for p in passes for c in (f"{PASS_NAMES[p]} ms", f"{PASS_NAMES[p]} {unit}")]
        cols += ["peak extra GiB (" + " / ".join(PASS_NAMES[p] for p in passes) + ")", "check"]
        table = [{"model": r["model"], "shape": r["shape"], "impl": r["impl"], "check": r["check"],
                  **{f"{PASS_NAMES[p]} ms": r[f"{p}_ms"] for p in passes},
                  **{f"{PASS_NAMES[p]} {unit}": r[f"{p}_tput"] for p in passes},
                  cols[-2]: " / ".join(r[f"{p}_peak_GiB"] or "-" for p in passes)} for r in sel]
        out.append(f"### {op} ({sel[0]['dtype']})\n\n" + markdown(table, cols))
    return "\n\n".join(out)


def value(v):
    if v in (None, ""):
        return None
    try:
        return float(v)
    except ValueError:
        return v  # OOM


def charts(rows):
    plt = pyplot()
    if plt is None:
        return
    for op in dict.fromkeys(r["op"] for r in rows):
        sel = [r for r in rows if r["op"] == op]
        models = sorted(dict.fromkeys(r["model"] for r in sel), key=list(QWEN3).index)
        impls = list(dict.fromkeys(r["impl"] for r in sel))
        passes = [p for p in PASSES if f"{p}_ms" in sel[0]]
        by = {(r["model"], r["impl"]): r for r in sel}
        unit = sel[0]["unit"]
        fig, axes = plt.subplots(3, len(passes), figsize=(4.5 * len(passes), 9), squeeze=False)
        for j, p in enumerate(passes):
            for i, (col, label) in enumerate([("ms", "ms (lower is better)"), ("tput", unit),
                                              ("peak_GiB", "peak extra GiB")]):
                grouped_bars(axes[i][j], models, impls,
                             lambda m, s: value(by.get((m, s), {}).get(f"{p}_{col}")),
                             f"{op} {PASS_NAMES[p]}: {label}" if i == 0 else f"{PASS_NAMES[p]}: {label}", label)
        axes[0][0].legend(fontsize=7)
        shape = {r["model"]: r["shape"] for r in reversed(sel)}
        shapes = ", ".join(f"{m}: {shape[m]}" for m in models)
        fig.suptitle(f"{op}, {sel[0]['dtype']}, Qwen3 shapes: {shapes}", fontsize=9)
        fig.tight_layout()
        path = out_dir() / f"kernels_{op}.png"
        fig.savefig(path, dpi=110)
        plt.close(fig)
        print(f"wrote {path}", flush=True)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--models", default="0.6B,1.7B,4B,8B", help=f"comma-separated: {', '.join(m for m in QWEN3 if m != 'tiny')}")
    ap.add_argument("--ops", default=",".join(OPS), help="comma-separated subset")
    ap.add_argument("--impls", default=IMPLS, help="comma-separated subset; also gemm3, bastile_bf16_wgrad (cross-entropy)")
    ap.add_argument("--passes", default=",".join(PASSES), help="comma-separated subset of fwd,bwd,fwdbwd")
    ap.add_argument("--batch", type=int, default=2)
    ap.add_argument("--seq", type=int, default=4096)
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--reps", type=int, help="timed repetitions (default: 50, cross-entropy 20)")
    ap.add_argument("--warmup", type=int, help="untimed calls first (default: 10, cross-entropy 3)")
    ap.add_argument("--budget-s", type=float, default=0, help="start no case past this many seconds (0: no limit)")
    with_rounds(ap)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--smoke", action="store_true", help="tiny model, batch 2 x seq 32, 3 repetitions, on the CPU")
    ap.add_argument("--merge", nargs="+", metavar="CSV", help="combine kernels.csv files of several runs and chart them")
    args = ap.parse_args()
    if args.merge:
        rows = read_csv(args.merge)
        write_csv(out_dir() / "kernels.csv", rows)
    else:
        if args.smoke:
            args.models, args.batch, args.seq, args.reps, args.warmup, args.rounds = "tiny", 2, 32, 3, 1, 1
            args.device = "cpu"
        use_device(args.device)
        rows = run(args)
    if not rows:
        return
    print()
    print(tables(rows))
    print(f"\nwrote {out_dir() / 'kernels.csv'}", flush=True)
    charts(rows)


if __name__ == "__main__":
    main()
