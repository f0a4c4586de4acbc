"""The distillation head, forward + backward: TRL's chunked divergence against Bastile's fused_linear_divergence;
with --step, a whole distillation step.

    python3 benches/bench_divergence.py [--tokens 8192] [--student 2048] [--teacher 4096] [--beta 0.5 0 1]
    python3 benches/bench_divergence.py --step [--seq 4096] [--steps 6] [--warmup 2]

bf16, vocab 151936 (Qwen3), random hidden states and heads; the teacher's side under no gradient. Rows:
- TRL `_chunked_divergence_loss` (trl.trainer.distillation_trainer, what DistillationTrainer calls: the valid
  positions compacted, ChunkedDivergenceFunction on them; its backward projects both heads again);
- Bastile's replacement of it (bastile.apply(divergence=True)): fused_linear_divergence with the mask;
- the four bare GEMMs (both logits in f32 from bf16, grad_hidden, grad_weight): the floor.
Median ms of 10 after 3 warm-up (L2 flushed), and the peak memory above the inputs. Every position is valid
(the mask is all ones) so that both do the same work.

--step: what DistillationTrainer's training step computes (its _compute_loss), on a Qwen3-1.7B student (full
fine-tune, AdamW) and a Qwen3-8B teacher (eval, no gradient), random init from the published configs, bf16, one
sequence of --seq random tokens whose last 3/4 are the completion: both backbones' last hidden states over the
completion, `_chunked_divergence_loss` (beta 0.5), backward, optimizer step. `trl`: HF's models and TRL's loss;
`bastile`: after bastile.apply() (both models' Qwen3 layers and the loss). Tokens/s over the whole sequence and the
peak memory.
"""
import argparse

import torch

import bastile
from common import qwen3, time_ms

VOCAB = 151936


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tokens", type=int, default=8192)
    ap.add_argument("--student", type=int, default=2048)
    ap.add_argument("--teacher", type=int, default=4096)
    ap.add_argument("--beta", type=float, nargs="+", default=[0.5, 0.0, 1.0])
    ap.add_argument("--step", action="store_true", help="a whole distillation step, TRL's and Bastile's")
    ap.add_argument("--seq", type=int, default=4096)
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--warmup", type=int, default=2)
    args = ap.parse_args()
    if args.step:
        return step(args)
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


def step(args):
    import time

    from transformers import Qwen3Config, Qwen3ForCausalLM
    from trl.trainer import distillation_trainer
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}, bf16, Qwen3-1.7B student (full, AdamW), "
          f"Qwen3-8B teacher, {args.seq} tokens (completion {3 * args.seq // 4}), beta 0.5\n")
    print("| mode | tokens/s | peak GiB | last loss |\n|---|---|---|---|")
    tokens = torch.randint(0, 151936, (1, args.seq), generator=torch.Generator().manual_seed(0)).cuda()
    keep = 3 * args.seq // 4
    mask = torch.ones(1, keep, dtype=torch.long, device="cuda")
    for mode in ("trl", "bastile"):
        if mode == "bastile":
            bastile.apply()
        torch.manual_seed(0)
        with torch.device("cuda"):  # initialised where they run: on the CPU, the 8B takes minutes
            student = Qwen3ForCausalLM._from_config(Qwen3Config(**qwen3("1.7B")), dtype=torch.bfloat16).train()
            teacher = Qwen3ForCausalLM._from_config(Qwen3Config(**qwen3("8B")), dtype=torch.bfloat16).eval()
        opt = torch.optim.AdamW(student.parameters(), lr=1e-6)
        loss_fn = distillation_trainer._chunked_divergence_loss  # the patched one under bastile.apply()

        def hidden(model):
            return model.base_model(input_ids=tokens, use_cache=False).last_hidden_state[:, :-1][:, -keep:]

        def run():
            with torch.no_grad():
                t = hidden(teacher)
            loss, _, _ = loss_fn(hidden(student), t, student.lm_head.weight, teacher.lm_head.weight, mask, 0.5)
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            return loss
        torch.cuda.reset_peak_memory_stats()
        for _ in range(args.warmup):
            run()
        torch.cuda.synchronize()
        start = time.perf_counter()
        for _ in range(args.steps):
            loss = run()
        torch.cuda.synchronize()
        rate = args.steps * args.seq / (time.perf_counter() - start)
        peak = torch.cuda.max_memory_allocated() / 2 ** 30
        print(f"| {mode} | {rate:,.0f} | {peak:.2f} | {loss.item():.5f} |", flush=True)
        del student, teacher, opt
        torch.cuda.empty_cache()
        bastile.reset()


if __name__ == "__main__":
    main()
