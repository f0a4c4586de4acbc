"""Shared benchmark helpers: options, CUDA-event timing with L2 flushed, environment report, tables."""
import argparse
import csv
import os
import statistics
import sys
from pathlib import Path
from typing import Optional

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "python_shim"))


def environment() -> str:
    p = torch.cuda.get_device_properties(0)
    return (f"GPU {p.name} ({p.multi_processor_count} SMs), torch {torch.__version__}, "
            f"CUDA {torch.version.cuda}")


_flush = None


def time_ms(fn, reps: int = 50, warmup: int = 10) -> float:
    """Median milliseconds of fn() on the current stream; L2 is flushed before every repetition and
    the flush is outside the timed region."""
    global _flush
    if _flush is None:
        _flush = torch.empty(256 * 2 ** 20, dtype=torch.uint8, device="cuda")
    for _ in range(warmup):
        fn()
    starts = [torch.cuda.Event(enable_timing=True) for _ in range(reps)]
    ends = [torch.cuda.Event(enable_timing=True) for _ in range(reps)]
    for s, e in zip(starts, ends):
        _flush.zero_()
        s.record()
        fn()
        e.record()
    torch.cuda.synchronize()
    return statistics.median(s.elapsed_time(e) for s, e in zip(starts, ends))


def copy_bandwidth_tbs() -> float:
    """Device-to-device copy of 1 GiB, bytes read + written, for the roofline."""
    a = torch.empty(2 ** 30, dtype=torch.uint8, device="cuda")
    b = torch.empty_like(a)
    ms = time_ms(lambda: b.copy_(a), reps=20)
    return 2 * a.numel() / ms / 1e9


def write_csv(path, rows):
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=list(rows[0]))
        w.writeheader()
        w.writerows(rows)


def out_dir() -> Path:
    return Path(os.environ.get("OUT") or os.environ.get("BENCH_OUT") or "bench-results")


def markdown(rows, cols) -> str:
    lines = ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    lines += ["| " + " | ".join(str(r[c]) for c in cols) + " |" for r in rows]
    return "\n".join(lines)


def parser(shapes: str, impls: str, shape_help: str = "comma-separated") -> argparse.ArgumentParser:
    """The options every kernel benchmark takes: --dtype, --shapes, --impls (a subset, comma-separated)."""
    ap = argparse.ArgumentParser()
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--shapes", default=shapes, help=shape_help)
    ap.add_argument("--impls", default=impls, help="comma-separated subset")
    return ap


def chosen(impls: dict, args) -> dict:
    """The implementations named by --impls, in the benchmark's order."""
    wanted = args.impls.split(",")
    return {name: f for name, f in impls.items() if name in wanted}


def start() -> float:
    """Prints the environment and the device copy bandwidth (the roofline), and returns the latter."""
    print(environment(), flush=True)
    copy = copy_bandwidth_tbs()
    print(f"device copy: {copy:.2f} TB/s", flush=True)
    return copy


BANDWIDTH_COLUMNS = ["shape", "impl", "fwd_ms", "fwd_TBps", "fwdbwd_ms", "fwdbwd_TBps"]


def bandwidth_row(shape: str, dtype: str, impl: str, fwd_ms: float, fwd_bytes: int, fwdbwd_ms: float,
                  fwdbwd_bytes: int) -> dict:
    """One printed result of a memory-bound op: times and effective bandwidths."""
    row = {"shape": shape, "dtype": dtype, "impl": impl,
           "fwd_ms": f"{fwd_ms:.4f}", "fwd_TBps": f"{fwd_bytes / fwd_ms / 1e9:.2f}",
           "fwdbwd_ms": f"{fwdbwd_ms:.4f}", "fwdbwd_TBps": f"{fwdbwd_bytes / fwdbwd_ms / 1e9:.2f}"}
    print(row, flush=True)
    return row


def report(stem: str, rows, columns, copy: Optional[float] = None):
    """Writes `<stem>.csv` under out_dir() and prints the markdown table under the environment line."""
    write_csv(out_dir() / f"{stem}.csv", rows)
    print()
    print(environment(), *([f"| device copy {copy:.2f} TB/s"] if copy is not None else []))
    print(markdown(rows, columns))
