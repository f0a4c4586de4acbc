"""Shared benchmark helpers: options, CUDA-event timing with L2 flushed, peak memory, environment report,
the kernel cases' runner, Qwen3 configurations, tables and charts."""
import argparse
import csv
import importlib.metadata
import json
import math
import os
import signal
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Dict, Optional

import torch

# torch.compile keeps one graph per shape and grad mode of a function; a benchmark sweeps more than the
# default 8 and must not fall back to eager silently.
torch._dynamo.config.recompile_limit = 64

# Where the benchmarks run: CUDA when present; "cpu" only for the --smoke runs that check the scripts.
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def use_device(device: str):
    global DEVICE
    DEVICE = device


def device() -> str:
    return DEVICE


def cuda() -> bool:
    return DEVICE == "cuda"


def _version(dist: str) -> str:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return "absent"


def environment() -> str:
    if cuda():
        p = torch.cuda.get_device_properties(0)
        where = f"GPU {p.name} ({p.multi_processor_count} SMs, {p.total_memory / 2 ** 30:.0f} GiB)"
    else:
        where = "CPU (no GPU: a smoke run, figures meaningless)"
    return (f"{where}, torch {torch.__version__}, CUDA {torch.version.cuda}, transformers {_version('transformers')}, "
            f"triton {_version('triton')}, liger-kernel {_version('liger-kernel')}")


_flush = None


def time_ms(fn, reps: int = 50, warmup: int = 10) -> float:
    """Median milliseconds of fn() on the current stream; L2 is flushed before every repetition and
    the flush is outside the timed region. On the CPU (smoke runs) a plain wall-clock median."""
    if not cuda():
        for _ in range(warmup):
            fn()
        times = []
        for _ in range(reps):
            t0 = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t0) * 1e3)
        return statistics.median(times)
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


def copy_bandwidth_tbs() -> Optional[float]:
    """Device-to-device copy of 1 GiB, bytes read + written, for the roofline (None on the CPU)."""
    if not cuda():
        return None
    a = torch.empty(2 ** 30, dtype=torch.uint8, device="cuda")
    b = torch.empty_like(a)
    ms = time_ms(lambda: b.copy_(a), reps=20)
    return 2 * a.numel() / ms / 1e9


def write_csv(path, rows):
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=list({k: None for r in rows for k in r}), restval="")
        w.writeheader()
        w.writerows(rows)


def out_dir() -> Path:
    return Path(os.environ.get("OUT") or os.environ.get("BENCH_OUT") or "bench-results")


def markdown(rows, cols) -> str:
    lines = ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    lines += ["| " + " | ".join(str(r[c]) for c in cols) + " |" for r in rows]
    return "\n".join(lines)


def parser(shapes: str, impls: str, shape_help: str = "comma-separated") -> argparse.ArgumentParser:
    """The options every kernel benchmark takes: --dtype, --shapes, --impls (a subset, comma-separated),
    --device (cpu only checks the script)."""
    ap = argparse.ArgumentParser()
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--shapes", default=shapes, help=shape_help)
    ap.add_argument("--impls", default=impls, help="comma-separated subset")
    ap.add_argument("--device", default=DEVICE, help="cuda; cpu only checks that the script runs")
    return ap


def with_rounds(ap: argparse.ArgumentParser, default: int = 3) -> argparse.ArgumentParser:
    """Adds --rounds, for drivers that time through measure_rounds."""
    ap.add_argument("--rounds", type=int, default=default, help="rounds per shape, each in a rotated order")
    return ap


def parse(ap: argparse.ArgumentParser) -> argparse.Namespace:
    args = ap.parse_args()
    use_device(args.device)
    return args


def chosen(impls: dict, args) -> dict:
    """The implementations named by --impls, in the benchmark's order."""
    wanted = args.impls.split(",")
    return {name: f for name, f in impls.items() if name in wanted}


def start() -> float:
    """Prints the environment and the device copy bandwidth (the roofline), and returns the latter."""
    print(environment(), flush=True)
    copy = copy_bandwidth_tbs()
    if copy is not None:
        print(f"device copy: {copy:.2f} TB/s", flush=True)
    return copy


BANDWIDTH_COLUMNS = ["shape", "impl", "fwd_ms", "fwd_TBps", "fwdbwd_ms", "fwdbwd_TBps"]


def bandwidth_row(shape: str, dtype: str, impl: str, fwd_ms: float, fwd_bytes: int, fwdbwd_ms: float,
                  fwdbwd_bytes: int) -> dict:
    """One printed result of a memory-bound op: times and effective bandwidths."""
    row = {"shape": shape, "dtype": dtype, "impl": impl,
           "fwd_ms": fmt(fwd_ms, 4), "fwd_TBps": fmt(throughput(fwd_ms, fwd_bytes), 2),
           "fwdbwd_ms": fmt(fwdbwd_ms, 4), "fwdbwd_TBps": fmt(throughput(fwdbwd_ms, fwdbwd_bytes), 2)}
    print(row, flush=True)
    return row


def report(stem: str, rows, columns, copy: Optional[float] = None):
    """Writes `<stem>.csv` under out_dir() and prints the markdown table under the environment line."""
    write_csv(out_dir() / f"{stem}.csv", rows)
    print()
    print(environment(), *([f"| device copy {copy:.2f} TB/s"] if copy is not None else []))
    print(markdown(rows, columns))


# --- Kernel cases: what bench_<op>.py defines and both it and bench_kernels.py measure -------------------

PASSES = ("fwd", "bwd", "fwdbwd")
PASS_NAMES = {"fwd": "fwd", "bwd": "bwd", "fwdbwd": "fwd+bwd"}


@dataclass
class Impl:
    """One implementation of an op on one case's inputs; every callable makes one call."""
    forward: Optional[Callable[[], Any]] = None   # on inputs that do not require grad
    graph: Optional[Callable[[], tuple]] = None   # forward on leaves that do: -> (outputs, leaves, grad_outputs)
    check: Optional[Callable[[], None]] = None    # raises when the result differs from HF's
    timed: Dict[str, Callable[[], Any]] = field(default_factory=dict)  # pass -> callable timed as it is


def copy_impl(work: Dict[str, float]) -> Callable[[], Impl]:
    """The "copy" row: a device-to-device copy of as many bytes as each pass's ideal kernel moves (half read,
    half written), the ceiling of a memory-bound op at that size, launch and wave tail included."""
    def impl():
        buffers = {p: (torch.empty(int(n) // 2, dtype=torch.uint8, device=device()),
                       torch.empty(int(n) // 2, dtype=torch.uint8, device=device())) for p, n in work.items()}
        return Impl(timed={p: (lambda a=a, b=b: b.copy_(a)) for p, (a, b) in buffers.items()})
    return impl


@dataclass
class Case:
    """One op at one shape: its implementations (built when measured, dropped after, so that per-impl
    copies and compiled graphs do not pile up) and the work of one call per pass, in bytes an ideal
    kernel moves (unit TB/s) or in FLOPs (TFLOP/s); a pass without work gets no throughput."""
    shape: str
    unit: str
    work: Dict[str, Optional[float]]
    impls: Dict[str, Callable[[], Impl]]
    reps: int = 50
    warmup: int = 10

    def __post_init__(self):
        if "bwd" not in self.work and self.work.get("fwd") is not None and self.work.get("fwdbwd") is not None:
            self.work["bwd"] = self.work["fwdbwd"] - self.work["fwd"]


def peak_extra_gib(fn) -> Optional[float]:
    """Peak memory allocated during one fn() beyond what was allocated before it (None on the CPU)."""
    if not cuda():
        fn()
        return None
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    fn()
    torch.cuda.synchronize()
    return (torch.cuda.max_memory_allocated() - before) / 2 ** 30


def _pass_fn(impl: Impl, name: str):
    if name in impl.timed:
        return impl.timed[name]
    if impl.graph is None:
        return impl.forward if name == "fwd" else None
    if name == "fwd":
        return impl.forward
    if name == "fwdbwd":
        return lambda: torch.autograd.grad(*impl.graph())
    outputs, leaves, grads = impl.graph()  # bwd: backward alone, over one retained graph
    return lambda: torch.autograd.grad(outputs, leaves, grads, retain_graph=True)


def free():
    if cuda():
        torch.cuda.synchronize()
        torch.cuda.empty_cache()


def measure(case: Case, name: str, passes=PASSES, strict: bool = True, reps: Optional[int] = None,
            warmup: Optional[int] = None) -> dict:
    """Times one implementation of a case: {"check": "ok" | "FAIL ..." | "ERROR ...", pass: (ms, peak extra
    GiB)}, ms "OOM" where it ran out of memory. Its result is checked against HF's first. strict re-raises a
    mismatch or an error; otherwise they are recorded (a long run survives a peer that fails at one shape)."""
    def failed(e):
        if strict:
            raise e
        text = " ".join(f"{type(e).__name__}: {e}".split())[:160]
        print(f"{case.shape} {name}: {text}", flush=True)
        return text

    out = {"check": "ok"}
    try:
        impl = case.impls[name]()
        if impl.check is not None:
            try:
                impl.check()
            except AssertionError as e:
                out["check"] = "FAIL " + failed(e)
    except torch.OutOfMemoryError:
        free()
        return {"check": "OOM", **{p: ("OOM", None) for p in passes}}
    except Exception as e:  # noqa: BLE001
        free()
        return {"check": "ERROR " + failed(e), **{p: ("ERROR", None) for p in passes}}
    for p in passes:
        fn = None
        try:
            fn = _pass_fn(impl, p)
            if fn is not None:
                ms = time_ms(fn, reps or case.reps, case.warmup if warmup is None else warmup)
                out[p] = (ms, peak_extra_gib(fn))
        except torch.OutOfMemoryError:
            out[p] = ("OOM", None)
        except Exception as e:  # noqa: BLE001
            out["check"] = "ERROR " + failed(e)
            out[p] = ("ERROR", None)
        del fn
        free()
    del impl
    free()
    return out


def fmt(x, digits: int) -> str:
    return x if isinstance(x, str) else "" if x is None else f"{x:.{digits}f}"


def throughput(ms, work):
    """Bytes or FLOPs per call and milliseconds -> TB/s or TFLOP/s (None where not defined)."""
    if work is None or not isinstance(ms, float) or ms <= 0:
        return None
    return work / ms / 1e9


def measure_rounds(case: Case, names: list, passes, rounds: int, **options) -> dict:
    """measure() of every implementation in `rounds` rounds, each round starting with the next one (the
    implementation timed first after a shape's inputs were made measured up to 11% slower than in a later
    round, H100; passes bound by the host varied up to 2x between runs of one build): {name: {"check": the
    first round's failure or "ok", pass: (ms, peak extra GiB)}} of the fastest round per pass, an
    "OOM"/"ERROR" only where no round has a time. options go to measure()."""
    runs = {name: [] for name in names}
    for r in range(max(rounds, 1)):
        first = r % len(names)
        for name in names[first:] + names[:first]:
            runs[name].append(measure(case, name, passes, **options))
    best = {}
    for name in names:
        best[name] = {"check": next((run["check"] for run in runs[name] if run["check"] != "ok"), "ok")}
        for p in passes:
            results = [run[p] for run in runs[name]]
            timed = [x for x in results if isinstance(x[0], float)]
            best[name][p] = min(timed, key=lambda x: x[0]) if timed else results[0]
    return best


def bandwidth_main(stem: str, cases, shapes: str, impls: str, shape_help: str = "comma-separated",
                   switches: Optional[Dict[str, str]] = None):
    """The whole driver of a memory-bound op's benchmark: fwd and fwd+bwd of every implementation at
    every shape (--rounds rounds, see measure_rounds), a markdown table with ms and effective TB/s, and
    `<stem>.csv` under out_dir(). switches: extra on/off options (flag -> help), passed to cases() as
    keyword arguments."""
    ap = with_rounds(parser(shapes, impls, shape_help))
    for flag, text in (switches or {}).items():
        ap.add_argument(flag, action="store_true", help=text)
    args = parse(ap)
    options = {k: getattr(args, k) for k in (f.lstrip("-").replace("-", "_") for f in switches or {})}
    dtype = getattr(torch, args.dtype)
    copy = start()
    rows = []
    for shape in args.shapes.split(","):
        case = cases(shape, dtype, **options)
        results = measure_rounds(case, list(chosen(case.impls, args)), ("fwd", "fwdbwd"), args.rounds)
        for name, r in results.items():
            rows.append(bandwidth_row(shape, args.dtype, name, r["fwd"][0], case.work["fwd"], r["fwdbwd"][0],
                                      case.work["fwdbwd"]))
        del case
        free()
    report(stem, rows, BANDWIDTH_COLUMNS, copy)


# --- Qwen3 -----------------------------------------------------------------------------------------------

# The published configs (Qwen/Qwen3-*/config.json): widths, depths, heads, tying. Shared by all sizes:
QWEN3_COMMON = dict(head_dim=128, vocab_size=151936, rms_norm_eps=1e-6, max_position_embeddings=40960,
                    rope_parameters={"rope_type": "default", "rope_theta": 1e6}, hidden_act="silu")
QWEN3 = {
    "0.6B": dict(hidden_size=1024, intermediate_size=3072, num_hidden_layers=28, num_attention_heads=16,
                 num_key_value_heads=8, tie_word_embeddings=True),
    "1.7B": dict(hidden_size=2048, intermediate_size=6144, num_hidden_layers=28, num_attention_heads=16,
                 num_key_value_heads=8, tie_word_embeddings=True),
    "4B": dict(hidden_size=2560, intermediate_size=9728, num_hidden_layers=36, num_attention_heads=32,
               num_key_value_heads=8, tie_word_embeddings=True),
    "8B": dict(hidden_size=4096, intermediate_size=12288, num_hidden_layers=36, num_attention_heads=32,
               num_key_value_heads=8, tie_word_embeddings=False),
    # --smoke only: checks the scripts on a CPU in seconds.
    "tiny": dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, tie_word_embeddings=True, head_dim=32, vocab_size=512),
}


def qwen3(name: str) -> dict:
    """The Qwen3Config arguments of a size in QWEN3."""
    return {**QWEN3_COMMON, **QWEN3[name]}


# --- Charts ----------------------------------------------------------------------------------------------

def pyplot():
    """matplotlib.pyplot on the Agg backend, or None (with a message) where matplotlib is absent."""
    try:
        import matplotlib
    except ImportError:
        print("matplotlib is not installed: no charts (the CSV has every figure)", flush=True)
        return None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    return plt


def grouped_bars(ax, groups, series, value, title: str = "", ylabel: str = "", labels: bool = False):
    """Bars per group (x) and series (one colour each); value(group, series) is a number, None (no bar),
    or a string (no bar, the string written where the bar would stand: OOM, timeout, ...); labels: the
    numbers above the bars."""
    width = 0.8 / max(len(series), 1)
    numbers = [v for g in groups for s in series if isinstance(v := value(g, s), (int, float))]
    if not numbers and not any(isinstance(value(g, s), str) for g in groups for s in series):
        ax.text(0.5, 0.5, "not defined", transform=ax.transAxes, ha="center", va="center", color="gray")
    top = max(numbers or [1.0])
    for i, s in enumerate(series):
        xs = [j + (i - (len(series) - 1) / 2) * width for j in range(len(groups))]
        vals = [value(g, s) for g in groups]
        ax.bar(xs, [v if isinstance(v, (int, float)) else 0 for v in vals], width, label=s)
        for x, v in zip(xs, vals):
            if isinstance(v, str) and v:
                ax.text(x, top * 0.02, v, rotation=90, ha="center", va="bottom", fontsize=7, color="red")
            elif labels and isinstance(v, (int, float)):
                ax.text(x, v, f"{v:,.3g}" if v < 1000 else f"{v:,.0f}", rotation=90, ha="center", va="bottom", fontsize=6)
    ax.set_xticks(range(len(groups)))
    ax.set_xticklabels(groups, fontsize=8)
    ax.set_title(title, fontsize=9)
    ax.set_ylabel(ylabel, fontsize=8)
    ax.tick_params(axis="y", labelsize=7)
    ax.grid(axis="y", alpha=0.3)


def read_csv(paths) -> list:
    rows = []
    for path in paths:
        with open(path, newline="") as f:
            rows += list(csv.DictReader(f))
    return rows


def sync(device):
    if device == "cuda":
        torch.cuda.synchronize()


def published(folder: str, whole: bool = False) -> dict:
    """A published config.json of the test corpus (tests/configs/<folder>): its language model's where it is a
    multimodal model's, unless `whole`."""
    raw = json.loads((Path(__file__).resolve().parent.parent / "tests" / "configs" / folder / "config.json").read_text())
    return raw if whole else raw.get("text_config", raw)


def train_random(result: dict, net, opt, vocab: int, batch: int, seq: int, args, pad: str = ""):
    """args.steps steps on random tokens (the first args.warmup not timed): tokens/s (real tokens, pads not
    counted), peak GiB and losses into result. `pad` "right": each row's length drawn from seq / 4 to seq, padded
    on the right to seq (the attention mask; labels -100 at the pads, as HF's collators give them); "both": an RL
    trainer's rows, a prompt of seq / 8 to seq / 2 tokens padded on the left to seq / 2, then a completion as
    long padded on the right (labels -100 at the pads and the prompt, whose loss no RL trainer takes)."""
    gen = torch.Generator().manual_seed(1)
    data, tokens = [], 0
    for step in range(args.steps):
        ids = torch.randint(0, vocab, (batch, seq), generator=gen)
        mask, labels = torch.ones_like(ids), ids.clone()
        half, i = seq // 2, torch.arange(seq)
        if pad == "right":
            mask = (i < torch.randint(seq // 4, seq + 1, (batch, 1), generator=gen)).long()
        elif pad == "both":
            prompt, completion = torch.randint(seq // 8, half + 1, (2, batch, 1), generator=gen)
            mask = ((i >= half - prompt) & (i < half + completion)).long()
            labels[:, :half] = -100
        data.append({k: t.to(args.device) for k, t in
                     dict(input_ids=ids, attention_mask=mask, labels=labels.masked_fill(mask == 0, -100)).items()}
                    if pad else ids.to(args.device))
        tokens += int(mask.sum()) if step >= args.warmup else 0
    losses, elapsed, peak = train_steps(net, opt, data, args.warmup, args.device, sync)
    result.update(status="ok", tokens_per_s=tokens / elapsed, peak_alloc_GiB=peak, losses=[l.item() for l in losses])


def failed(e: Exception) -> str:
    """The status of a run that raised: out of memory, skipped (a library or model it needs is missing), or the
    error."""
    if isinstance(e, torch.OutOfMemoryError):
        return "OOM"
    if isinstance(e, (ImportError, LookupError)):
        return f"skipped: {e}"
    return "error: " + " ".join(f"{type(e).__name__}: {e}".split())[:300]


def train_steps(model, opt, batches, warmup: int, device, sync):
    """Trains a causal LM on each batch (token ids, inputs and labels; or a dict of the model's arguments), timing
    the steps after `warmup` between two calls of sync(). Returns the losses (0-dim tensors), the seconds of the
    timed steps and the peak GiB allocated on CUDA (nan elsewhere)."""
    cuda = torch.device(device).type == "cuda"
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    losses = []
    for step, batch in enumerate(batches):
        if step == warmup:
            sync(device)
            t0 = time.perf_counter()
        loss = model(**(batch if isinstance(batch, dict) else dict(input_ids=batch, labels=batch))).loss
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.detach())
    sync(device)
    elapsed = time.perf_counter() - t0
    return losses, elapsed, torch.cuda.max_memory_allocated() / 2 ** 30 if cuda else float("nan")


def child_process(argv, timeout: float):
    """Runs `python argv...` in its own process session; (the dict of its last `RESULT {json}` line, its
    output). A child past `timeout` seconds is killed with its compile workers: {"status": "timeout (N s)"}."""
    proc = subprocess.Popen([sys.executable, *argv], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)
    try:
        out, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        out, _ = proc.communicate()
        return {"status": f"timeout ({timeout:.0f} s)"}, out
    for line in reversed(out.splitlines()):
        if line.startswith("RESULT "):
            return json.loads(line[len("RESULT "):]), out
    return {"status": f"error: exit {proc.returncode}, no result"}, out


def run_modes(script: str, args, names, modes, row, stem: str, extra=(), prepare=None, show=None):
    """Runs `script --mode M --model N` (with args' steps, warmup and device, and `extra`) in a child
    process per model and mode, within args.budget_s (0: none) and args.timeout per child; row(result, name,
    mode) makes each result's row. prepare(name) runs before a model's children, show(result) after each
    printed line. Writes <stem>.csv and .log under out_dir() as it goes; returns the rows and the last
    environment line."""
    rows, log, env = [], [], ""
    t0 = time.perf_counter()
    for name in names:
        if prepare:
            prepare(name)
        for mode in modes:
            left = args.budget_s - (time.perf_counter() - t0) if args.budget_s else math.inf
            if left < 30:
                result, out = {"status": "not run (budget)"}, ""
            else:
                argv = [script, "--mode", mode, "--model", name, "--steps", str(args.steps), "--warmup",
                        str(args.warmup), "--device", args.device, *extra]
                result, out = child_process(argv, min(args.timeout, left))
            rows.append(row(result, name, mode))
            log.append(f"===== {name} {mode}: {result['status']}\n{out}")
            r = rows[-1]
            print(f"{name} {mode}: {result['status']} {r['tokens/s']} tokens/s, peak {r['peak GiB']} GiB, "
                  f"losses {r['losses']}", flush=True)
            if show:
                show(result)
            env = result.get("env") or env
            write_csv(out_dir() / f"{stem}.csv", rows)
            (out_dir() / f"{stem}.log").write_text("\n".join(log))
    return rows, env


def modes_parser(doc: str, modes, timeout: float) -> argparse.ArgumentParser:
    """The options of a script that runs each mode in a child (run_modes); the script adds its own."""
    ap = argparse.ArgumentParser(description=doc.split("\n\n")[0])
    ap.add_argument("--modes", default=",".join(modes))
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--timeout", type=float, default=timeout, help="seconds per child")
    ap.add_argument("--budget-s", type=float, default=0, help="seconds for the whole run (0: none)")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--smoke", action="store_true", help="tiny configs, 4 steps, on the CPU")
    ap.add_argument("--mode", choices=modes, help="(internal) run one mode in this process and print its RESULT line")
    ap.add_argument("--model", help="(internal, with --mode)")
    return ap


def modes_main(args, child, parent):
    """A run_modes script's entry: the child's RESULT line with --mode, else the parent."""
    if args.smoke:
        args.steps, args.warmup, args.device = 4, 1, "cpu"
    use_device(args.device)
    if args.mode:
        print("RESULT " + json.dumps(child(args)), flush=True)
    else:
        parent(args)

