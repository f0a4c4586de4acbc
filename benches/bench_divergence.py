"""The distillation head, forward + backward: TRL's chunked divergence against Bastile's fused_linear_divergence.

    python3 benches/bench_divergence.py [--tokens 8192] [--student 2048] [--teacher 4096] [--beta 0.5 0 1]

bf16, vocab 151936 (Qwen3), random hidden states and heads; the teacher's side under no gradient. Rows:
- TRL `_chunked_divergence_loss` (trl.trainer.distillation_trainer, what DistillationTrainer calls: the valid
  positions compacted, ChunkedDivergenceFunction on them; its backward projects both heads again);
- Bastile's replacement of it (bastile.apply(divergence=True)): fused_linear_divergence with the mask;
- the four bare GEMMs (both logits in f32 from bf16, grad_hidden, grad_weight): the floor.
Median ms of 10 after 3 warm-up (L2 flushed), and the peak memory above the inputs. Every position is valid
(the mask is all ones) so that both do the same work.
"""
import argparse

import torch

import bastile
from common import time_ms

VOCAB = 151936


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tokens", type=int, default=8192)
    ap.add_argument("--student", type=int, default=2048)
    ap.add_argument("--teacher", type=int, default=4096)
    ap.add_argument("--beta", type=float, nargs="+", default=[0.5, 0.0, 1.0])
    args = ap.parse_args()
    from trl.trainer import distillation_trainer
    trl_loss = distillation_trainer._chunked_divergence_loss
    bastile.apply(divergence=True, log_probs=False, families=[])
    ours = distillation_trainer._chunked_divergence_loss
    bastile.reset()
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}, bf16, vocab {VOCAB}, "
          f"{args.tokens} tokens, student {args.student}, teacher {args.teacher}\n")
    print("| beta | head | ms | peak extra GiB |\n|---|---|---|---|")
    g = torch.Generator(device="cuda").manual_seed(0)
    bf = dict(device="cuda", dtype=torch.bfloat16)
    sh = torch.randn(1, args.tokens, args.student, **bf, generator=g).requires_grad_()
    sw = (torch.randn(VOCAB, args.student, **bf, generator=g) * args.student ** -0.5).requires_grad_()
    th = torch.randn(1, args.tokens, args.teacher, **bf, generator=g)
    tw = torch.randn(VOCAB, args.teacher, **bf, generator=g) * args.teacher ** -0.5
    mask = torch.ones(1, args.tokens, dtype=torch.long, device="cuda")

    def head(fn, beta):
        def run():
            loss, _, _ = fn(sh, th, sw, tw, mask, beta)
            loss.backward()
        return run

    def gemms():
        s = torch.mm(sh[0].detach(), sw.detach().T, out_dtype=torch.float32)
        t = torch.mm(th[0], tw.T, out_dtype=torch.float32)
        del t
        d = s.to(torch.bfloat16)
        d @ sw.detach()
        d.T @ sh[0].detach()

    for beta in args.beta:
        for name, fn in [("TRL _chunked_divergence_loss", head(trl_loss, beta)),
                         ("Bastile fused_linear_divergence", head(ours, beta)), ("4 bare GEMMs", gemms)]:
            sh.grad = sw.grad = None
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            base = torch.cuda.memory_allocated()
            ms = time_ms(fn, reps=10, warmup=3)
            peak = (torch.cuda.max_memory_allocated() - base) / 2 ** 30
            print(f"| {beta} | {name} | {ms:.2f} | {peak:.2f} |", flush=True)


if __name__ == "__main__":
    main()
