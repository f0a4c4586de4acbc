"""One mixture-of-experts block alone (router, experts, shared expert where the family has one), forward and
backward: transformers' (its default experts implementation, grouped_mm) against Bastile's expert path, on the
first MoE layer of a bench_families model built from its published config.

    python benches/bench_moe_block.py --models gpt-oss-20b,qwen3-30b-a3b-attn,mixtral-8x7b-8l [--tokens 4096]

Each mode runs in a child process (bastile.apply() patches classes). Work "frozen": the block's weights take no
gradient (LoRA on the attention: the backward is the input's gradient only); "full": they take theirs too; "lora":
PEFT's LoRA r16 all-linear (the experts' 3-D parameters and the router, as bench_families' all-linear rows). Times are
medians of L2-flushed calls; "kernels ms" the GPU time of one forward + backward's kernels summed (the profiler's;
without the gaps where the GPU waits on the host, which swing from run to run with the host); "model ms" is the
block's forward + backward times the model's MoE layers (the full config, counted on the meta device), the block's
share of a training step.
"""
import argparse
import json
import sys

import torch

from bench_families import MODELS, model_class, model_config
from common import child_process, environment, failed, markdown, out_dir, sync, time_ms, write_csv

MODES = ("hf", "bastile")


def child(args) -> dict:
    result = {"model": args.model, "mode": args.mode, "work": args.work, "tokens": args.tokens}
    try:
        result["env"] = environment()
        from bastile.families import FAMILIES
        model_type = MODELS[args.model][0]
        experts = FAMILIES[model_type].name("Experts")
        if args.mode == "bastile":
            import bastile
            bastile.apply()
        device = "cpu" if args.smoke else "cuda"
        full = model_config(args.model, args.smoke)
        with torch.device("meta"):
            meta = model_class(args.model)._from_config(full)
        holds = [any(type(m).__name__ == experts for m in layer.modules()) for layer in meta.model.layers]
        # the published depth cut at the first MoE layer: transformers builds (and initialises) only those
        first = holds.index(True)
        cut = {"num_hidden_layers": first + 1}
        if getattr(full, "layer_types", None):
            cut["layer_types"] = full.layer_types[:first + 1]
        torch.manual_seed(0)
        with torch.device(device):
            net = model_class(args.model)._from_config(model_config(args.model, args.smoke, **cut),
                                                       dtype=torch.bfloat16)
        if args.work == "lora":
            from peft import LoraConfig, get_peft_model
            net = get_peft_model(net, LoraConfig(r=16, lora_alpha=32, lora_dropout=0.0, target_modules="all-linear"))

        def holds_experts(m):
            inner = getattr(m, "experts", None)  # under PEFT, its ParamWrappers around the experts
            while inner is not None and type(inner).__name__ != experts:
                inner = getattr(inner, "base_layer", None)
            return inner is not None

        block = next(m for m in net.modules() if holds_experts(m))
        if args.work != "lora":
            block.requires_grad_(args.work == "full")
        hidden = full.get_text_config().hidden_size
        x = torch.randn(1, args.tokens, hidden, device=device, dtype=torch.bfloat16, requires_grad=True)
        grad = torch.randn_like(x)

        def forward():
            out = block(x)
            return out[0] if isinstance(out, tuple) else out

        def forward_backward():
            for p in (x, *block.parameters()):
                p.grad = None
            forward().backward(grad)

        with torch.no_grad():
            result["forward_ms"] = time_ms(forward, reps=args.reps)
        result["forward_backward_ms"] = time_ms(forward_backward, reps=args.reps)
        if device == "cuda":
            torch.cuda.reset_peak_memory_stats()
            base = torch.cuda.memory_allocated()
            forward_backward()
            result["peak_extra_GiB"] = (torch.cuda.max_memory_allocated() - base) / 2 ** 30
        result["moe_layers"] = sum(holds)
        from torch.profiler import ProfilerActivity, profile
        from bench_profile import kernel_times
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            forward_backward()
            sync(device)
        kernels = kernel_times(prof, device == "cuda")
        result["kernels_ms"] = sum(us for us, _ in kernels.values()) / 1e3
        top = sorted(kernels.items(), key=lambda kv: -kv[1][0])[:args.profile]
        result["top_ms"] = [(name[:100], round(us / 1e3, 3), calls) for name, (us, calls) in top]
        result["status"] = "ok"
    except Exception as e:  # noqa: BLE001
        result["status"] = failed(e)
    return result


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", default="gpt-oss-20b,qwen3-30b-a3b-attn,mixtral-8x7b-8l")
    ap.add_argument("--modes", default=",".join(MODES))
    ap.add_argument("--work", default="frozen", choices=("frozen", "full", "lora"))
    ap.add_argument("--tokens", type=int, default=4096)
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--timeout", type=float, default=300, help="seconds per child")
    ap.add_argument("--smoke", action="store_true", help="tiny configs on the CPU")
    ap.add_argument("--profile", type=int, default=0, help="also print the N kernels of most GPU time in one call")
    ap.add_argument("--mode", choices=MODES, help="(internal) one mode in this process: prints its RESULT line")
    ap.add_argument("--model", help="(internal, with --mode)")
    args = ap.parse_args()
    if args.mode:
        print("RESULT " + json.dumps(child(args)), flush=True)
        return
    rows, env = [], ""
    for name in args.models.split(","):
        by = {}
        for mode in args.modes.split(","):
            argv = [sys.argv[0], "--mode", mode, "--model", name, "--work", args.work, "--tokens", str(args.tokens),
                    "--reps", str(args.reps), "--profile", str(args.profile)] + (["--smoke"] if args.smoke else [])
            r, _ = child_process(argv, args.timeout)
            env = r.get("env") or env
            by[mode] = r
            ok = r["status"] == "ok"
            rows.append({"model": name, "mode": mode, "work": args.work, "tokens": args.tokens, "status": r["status"],
                         "fwd ms": f"{r['forward_ms']:.3f}" if ok else "",
                         "fwd+bwd ms": f"{r['forward_backward_ms']:.3f}" if ok else "",
                         "kernels ms": f"{r['kernels_ms']:.3f}" if ok else "",
                         "peak extra GiB": f"{r['peak_extra_GiB']:.2f}" if "peak_extra_GiB" in r else "",
                         "MoE layers": r.get("moe_layers", ""),
                         "model ms": f"{r['forward_backward_ms'] * r['moe_layers']:.1f}" if ok else "", "vs hf": ""})
            print(rows[-1], flush=True)
            for kernel in r.get("top_ms", []):
                print("   ", *kernel, flush=True)
        if all(by.get(m, {}).get("status") == "ok" for m in MODES):
            rows[-1]["vs hf"] = f"{by['hf']['forward_backward_ms'] / by['bastile']['forward_backward_ms']:.2f}x"
    print(env)
    write_csv(out_dir() / "moe_block.csv", rows)
    print(markdown(rows, ["model", "mode", "work", "tokens", "status", "fwd ms", "fwd+bwd ms", "kernels ms",
                          "peak extra GiB", "MoE layers", "model ms", "vs hf"]))


if __name__ == "__main__":
    main()
