"""QLoRA end to end: tokens/s, peak memory and losses of HF + PEFT, + Liger and + Bastile training LoRA adapters
over the same 4-bit base, each mode in its own process; and the dequantization kernel against bitsandbytes'.

    python benches/bench_qlora.py                         # every model of MODELS, three modes, and the kernel
    python benches/bench_qlora.py --models llama3-8b --modes hf,bastile
    python benches/bench_qlora.py --kernel-only
    python benches/bench_qlora.py --smoke                 # tiny configs on the CPU: checks the script only

Models (MODELS): random init from the published configs (nothing downloaded), saved once in bf16 and loaded
back with BitsAndBytesConfig(load_in_4bit, nf4, double quantization, bf16 compute), as users load a QLoRA
base; SDPA attention. PEFT LoRA r=16 (alpha 32, no dropout, adapters in PEFT's fp32) on the seven projections
of every layer, AdamW over the adapters, labels = input ids. A model with `checkpointing` runs HF's gradient
checkpointing (non-reentrant). Modes: hf, liger (Liger Kernel's apply function for the model type, its
defaults, before the model is loaded), bastile (bastile.apply()). --steps steps (default 10), the first
--warmup (3) not timed; peak GiB = torch.cuda.max_memory_allocated over the child. The kernel part times
bastile.dequantize_4bit and bitsandbytes.functional.dequantize_4bit on the model's weights, in GB/s of bytes
read (codes and scales) and written. Writes qlora.csv and .log under $OUT or bench-results/.
"""
import os
import time
from pathlib import Path

import torch
from common import environment, failed, markdown, modes_main, modes_parser, out_dir, run_modes, time_ms, train_random, write_csv

MODES = ("hf", "liger", "bastile")
LORA = 16
LR = 1e-5
SEVEN = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]

# name -> (model_type, config class, config, seq, batch, checkpointing)
MODELS = {
    "llama3-8b": ("llama", "LlamaConfig",
                  dict(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
                       num_key_value_heads=8, vocab_size=128256, max_position_embeddings=8192, rms_norm_eps=1e-5,
                       rope_parameters={"rope_type": "default", "rope_theta": 5e5}, bos_token_id=128000,
                       eos_token_id=128001),
                  4096, 1, False),
    "qwen3-8b": ("qwen3", "Qwen3Config",
                 dict(hidden_size=4096, intermediate_size=12288, num_hidden_layers=36, num_attention_heads=32,
                      num_key_value_heads=8, head_dim=128, vocab_size=151936, max_position_embeddings=40960,
                      rms_norm_eps=1e-6, rope_parameters={"rope_type": "default", "rope_theta": 1e6},
                      tie_word_embeddings=False),
                 16384, 1, True),
}
TINY = dict(hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
            head_dim=32, vocab_size=512)


def config(name, smoke):
    import transformers
    model_type, config_cls, cfg, *_ = MODELS[name]
    cfg = {**cfg, **TINY} if smoke else cfg
    return getattr(transformers, config_cls)(**cfg, use_cache=False)


def checkpoint(name, smoke) -> Path:
    """The model's random-init bf16 checkpoint, written once."""
    path = Path(os.environ.get("BENCH_QLORA_DIR", "/tmp/bench-qlora")) / (name + ("-tiny" if smoke else ""))
    if not (path / "config.json").exists():
        import transformers
        cfg = config(name, smoke)
        torch.manual_seed(0)
        with torch.device("cuda" if torch.cuda.is_available() and not smoke else "cpu"):
            net = transformers.AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16)
        net.save_pretrained(path)
    return path


def load(name, device, smoke):
    from transformers import AutoModelForCausalLM, BitsAndBytesConfig
    # On the CPU (smoke) bitsandbytes computes in fp32: its bf16 CPU path is an inference kernel.
    dtype = torch.float32 if device == "cpu" else torch.bfloat16
    quant = BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_use_double_quant=True,
                               bnb_4bit_compute_dtype=dtype)
    return AutoModelForCausalLM.from_pretrained(checkpoint(name, smoke), quantization_config=quant, dtype=dtype,
                                                device_map=device, attn_implementation="sdpa")


def build(mode, name, device, smoke):
    model_type, *_, checkpointing = MODELS[name]
    if mode == "liger":
        from liger_kernel.transformers.monkey_patch import MODEL_TYPE_TO_APPLY_LIGER_FN
        MODEL_TYPE_TO_APPLY_LIGER_FN[model_type]()
    if mode == "bastile":
        import bastile
        bastile.apply()
    from peft import LoraConfig, get_peft_model
    net = load(name, device, smoke)
    if checkpointing:
        net.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    net = get_peft_model(net, LoraConfig(r=LORA, lora_alpha=2 * LORA, lora_dropout=0.0, target_modules=SEVEN))
    net.train()
    if mode == "bastile":
        import bastile
        report = bastile.lora_modules(net)
        assert set(report.values()) == {"fused"}, {k: v for k, v in report.items() if v != "fused"}
    opt = torch.optim.AdamW([p for p in net.parameters() if p.requires_grad], lr=LR, fused=device == "cuda")
    return net, opt, net.config.vocab_size


def child(args) -> dict:
    *_, seq, batch, checkpointing = MODELS[args.model]
    seq, batch = (64, 2) if args.smoke else (seq, batch)
    result = {"model": args.model, "mode": args.mode, "seq": seq, "batch": batch, "checkpointing": checkpointing}
    try:
        result["env"] = environment()
        t0 = time.perf_counter()
        net, opt, vocab = build(args.mode, args.model, args.device, args.smoke)
        result["load_s"] = time.perf_counter() - t0
        train_random(result, net, opt, vocab, batch, seq, args)
    except Exception as e:  # noqa: BLE001
        result["status"] = failed(e)
    return result


def kernel_rows(args) -> list:
    """bastile.dequantize_4bit against bitsandbytes' on the weights of a Llama-3-8B layer (q/k/v together)."""
    import bitsandbytes.functional as BF
    import bastile
    shapes = {"q,k,v (one launch)": [(4096, 4096), (1024, 4096), (1024, 4096)], "gate": [(14336, 4096)],
              "down": [(4096, 14336)]}
    rows = []
    for what, parts in shapes.items():
        ws = []
        for rows_, cols in ([(r // 32, c // 32) for r, c in parts] if args.smoke else parts):
            w, state = BF.quantize_4bit(torch.randn(rows_, cols, dtype=torch.bfloat16, device=args.device) * 0.02,
                                        blocksize=64, quant_type="nf4", compress_statistics=True)
            w.quant_state = state
            ws.append(w)
        n = sum(w.quant_state.shape.numel() for w in ws)
        moved = n // 2 + n // 64 + n * 2  # codes, nested scale codes, bf16 out
        ours = time_ms(lambda: bastile.dequantize_4bit(*ws))
        theirs = time_ms(lambda: [BF.dequantize_4bit(w, w.quant_state) for w in ws])
        same = all(torch.equal(a, b) for a, b in zip(bastile.dequantize_4bit(*ws).split([w.quant_state.shape[0] for w in ws]),
                                                      [BF.dequantize_4bit(w, w.quant_state) for w in ws]))
        for impl, ms in (("bastile", ours), ("bitsandbytes", theirs)):
            rows.append({"weights": what, "elements": n, "impl": impl, "ms": f"{ms:.4f}",
                         "GB/s": f"{moved / ms / 1e6:.0f}", "equal": str(same)})
    return rows


def row(result, name, mode):
    losses = result.get("losses") or []
    return {"model": name, "mode": mode, "seq x batch": f"{result.get('seq', '')} x {result.get('batch', '')}",
            "checkpointing": str(result.get("checkpointing", "")), "status": result["status"],
            "tokens/s": f"{result['tokens_per_s']:.0f}" if "tokens_per_s" in result else "",
            "peak GiB": f"{result['peak_alloc_GiB']:.2f}" if "peak_alloc_GiB" in result else "",
            "loss first": f"{losses[0]:.4f}" if losses else "", "loss last": f"{losses[-1]:.4f}" if losses else "",
            "losses": " ".join(f"{l:.5f}" for l in losses)}


def parent(args):
    if not args.models_only:
        kernels = kernel_rows(args)
        write_csv(out_dir() / "qlora_kernel.csv", kernels)
        print(markdown(kernels, list(kernels[0])), flush=True)
    if args.kernel_only:
        return
    show = lambda result: print(f"  loaded in {result.get('load_s', 0):.0f} s", flush=True)
    rows, env = run_modes(__file__, args, args.models.split(","), args.modes.split(","), row, "qlora",
                          ["--smoke"] if args.smoke else [], prepare=lambda name: checkpoint(name, args.smoke),
                          show=show)
    print(env, flush=True)
    print(markdown(rows, [c for c in rows[0] if c != "losses"]), flush=True)


def main():
    ap = modes_parser(__doc__, MODES, timeout=300)
    ap.add_argument("--models", default=",".join(MODELS))
    ap.add_argument("--kernel-only", action="store_true")
    ap.add_argument("--models-only", action="store_true")
    modes_main(ap.parse_args(), child, parent)


if __name__ == "__main__":
    main()
