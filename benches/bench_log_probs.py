"""Per-token LM heads, forward + backward: TRL's chunked log-prob head against Bastile's.

    python3 benches/bench_log_probs.py [--tokens 8192] [--hidden 2048 1024]

bf16, vocab 151936 (Qwen3), random hidden, weight and targets. The per-token loss is summed with random
upstream gradients (as GRPO's or DPO's losses weigh tokens), except `mean` (SFT's uniform mean, whose
gradients Bastile forms in the forward). Rows:
- TRL `ChunkedLogProbFunction` (trl.kernels), log_probs only, and with entropy and is_top1 (SFTTrainer's
  outputs; entropy gets no gradient, as SFTTrainer logs it detached);
- Bastile `fused_linear_log_probs` (the head TRL runs under bastile.apply()), with all its fields: weighted
  log_probs (backward makes the logits again), the same plus an entropy gradient (GRPO's entropy bonus), and
  SFT's loss -sum(log_probs) / tokens with uniform_grad (gradients formed in the forward);
- Bastile `fused_linear_cross_entropy(reduction="none")` (the row losses; its backward makes the logits again);
- Bastile `fused_linear_cross_entropy` (mean);
- the three bare GEMMs (logits, grad_hidden, grad_weight): the floor.
Median ms of 10 after 3 warm-up (L2 flushed), and the peak memory above the inputs.
"""
import argparse

import torch

import bastile
from common import time_ms

VOCAB = 151936


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tokens", type=int, default=8192)
    ap.add_argument("--hidden", type=int, nargs="+", default=[2048, 1024])
    args = ap.parse_args()
    from trl.kernels import ChunkedLogProbFunction
    from trl.trainer.utils import _CHUNKED_LOGPROB_CHUNK_SIZE as chunk
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}, bf16, vocab {VOCAB}\n")
    print("| tokens × hidden | head | ms | peak extra GiB |\n|---|---|---|---|")
    for hd in args.hidden:
        g = torch.Generator(device="cuda").manual_seed(0)
        h = torch.randn(args.tokens, hd, device="cuda", dtype=torch.bfloat16, generator=g).requires_grad_()
        w = (torch.randn(VOCAB, hd, device="cuda", dtype=torch.bfloat16, generator=g) * hd ** -0.5).requires_grad_()
        t = torch.randint(0, VOCAB, (args.tokens,), device="cuda", generator=g)
        up = torch.randn(args.tokens, device="cuda", generator=g)

        def trl(outputs):
            def run():
                lp, *_ = ChunkedLogProbFunction.apply(h, w, None, t, 1.0, chunk, None, 1.0, outputs)
                (lp * up).sum().backward()
            return run

        def head(uniform=False, entropy=False):
            def run():
                out = bastile.fused_linear_log_probs(h, w, t, uniform_grad=uniform)
                loss = -out.log_probs.sum() / args.tokens if uniform else (out.log_probs * up).sum()
                (loss + out.entropy.sum() if entropy else loss).backward()
            return run

        def none():
            (bastile.fused_linear_cross_entropy(h, w, t, reduction="none") * up).sum().backward()

        def mean():
            bastile.fused_linear_cross_entropy(h, w, t).backward()

        def gemms():
            z = h.detach() @ w.detach().T
            z @ w.detach()
            z.T @ h.detach()
        cases = [("TRL ChunkedLogProbFunction, log_probs", trl(("log_probs",))),
                 ("TRL ChunkedLogProbFunction, + entropy, is_top1", trl(("log_probs", "entropy", "is_top1"))),
                 ("Bastile fused_linear_log_probs, weighted log_probs", head()),
                 ("Bastile fused_linear_log_probs, weighted log_probs + entropy", head(entropy=True)),
                 ("Bastile fused_linear_log_probs, SFT nll (uniform_grad)", head(uniform=True)),
                 ("Bastile fused_linear_cross_entropy, reduction none", none),
                 ("Bastile fused_linear_cross_entropy, mean", mean),
                 ("3 bare GEMMs", gemms)]
        for name, fn in cases:
            h.grad = w.grad = None
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            base = torch.cuda.memory_allocated()
            ms = time_ms(fn, reps=10, warmup=3)
            peak = (torch.cuda.max_memory_allocated() - base) / 2 ** 30
            print(f"| {args.tokens} × {hd} | {name} | {ms:.2f} | {peak:.2f} |", flush=True)


if __name__ == "__main__":
    main()
