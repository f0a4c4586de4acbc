"""TRL's preference and distillation trainers under DDP, with and without Bastile's head (the `log_probs` patch)
or divergence (the `divergence` patch).

TRL reported (trl#7245) that DPO and KTO skipped DDP's gradient all-reduce on their fused-loss path in earlier
releases: the loss called the unwrapped model, so DDP never saw the backward. Bastile's head sits on that path.
DistillationTrainer calls the student's backbone and head itself, inside DDP's forward through its
_forward_redirection, and divides each rank's summed divergence by the global token count over the ranks
(num_items_in_batch / num_processes): Bastile's divergence sits on that path.
Each trainer runs 2 optimizer steps on the mini Qwen3 in fp32 on the CPU, two ranks over gloo (spawned here, as
test_distributed does), then once in one process on the global batch (the two ranks' micro-batches together),
HF's path and Bastile's alike. The test asserts, for each:

- the ranks' trained parameters are bitwise equal (their data differ, so only all-reduced gradients make them so);
- they equal the one-process run's within 1e-5 (relative and absolute): DDP averages the ranks' gradients, and
  DPO's and KTO's losses are means over the rank's sequences, so with equal micro-batches the average of the
  ranks' losses is the global batch's loss: the same gradient, up to rounding (distillation's loss is the rank's
  summed divergence over the global token count, times the ranks: their average is the global batch's loss
  whatever each rank's count);
- every rank logs the one-process run's loss at each step (TRL all-gathers it), and KTO's KL estimate is positive
  (so the pairs it is taken over matter: kl_pairs_of_the_ranks);
- compute_loss got the DDP-wrapped model at every step, and on Bastile's path Bastile's head (divergence, for
  distillation) ran inside DDP's forward with gradients once per step (the policy's forward), and elsewhere only
  without gradients (the reference's, KTO's KL pass); on HF's path it never ran.

A trainer is one more entry in TRAINERS.
"""
import contextvars
import functools
import os
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Callable

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.nn.parallel import DistributedDataParallel

import bastile
from conftest import TRAINER_PATCHES, free_port
from test_families import mini

trl = pytest.importorskip("trl")
pytest.importorskip("datasets")
# After the skips: test_trl needs TRL.
from test_trl import DISTILLATION, STUDENT, TEACHER, dataset, tokenizer  # noqa: E402

WORLD = 2
PER_RANK = 2  # sequences per rank per step (KTO's KL term needs 2 or more)
STEPS = 2
TOL = 1e-5
# The second model (the reference): another draw, ten times wider than the policy's start, so its next-token
# distributions are peaked where the policy's are near uniform. On random completions it then scores below the
# policy, and KTO's KL estimate (clamped at 0) is positive and depends on which pairs it is taken over.
PARTNER = dict(seed=1, initializer_range=0.2)
# Plain SGD: AdamW would turn rounding-level gradient differences (the two runs pad to different lengths and add
# in another order) into learning-rate-sized steps, while SGD moves each parameter by lr times its gradient, so
# the runs agree to rounding and a rank's unreduced gradient (its own half of the batch) moves it far off.
COMMON = dict(max_steps=STEPS, logging_steps=1, report_to="none", save_strategy="no", use_cpu=True, bf16=False,
              learning_rate=1.0, optim="sgd", lr_scheduler_type="constant", seed=0, disable_tqdm=True,
              dataloader_num_workers=0)
PREFERENCE = dict(max_length=32)  # the preference trainers' sequences (prompt and completion)


def kl_pairs_of_the_ranks(trainer):
    """KTO estimates its KL term from (prompt, completion) pairs mismatched within each run of
    per_device_train_batch_size rows of the dataset, rotating the completions by one. In one process on the
    global batch, rotate within each rank's micro-batch instead, so the KL pairs are the ranks' (and their mean
    over the global batch the mean of the ranks' means, which the trainer all-gathers)."""
    def rotate(rows):
        rows["KL_completion_ids"] = [rows["completion_ids"][-1]] + rows["completion_ids"][:-1]
        return rows
    trainer.train_dataset = trainer.train_dataset.map(rotate, batched=True, batch_size=PER_RANK)


def sequences(inputs):
    """The (token ids, attention mask) of the sequences compute_loss gets: a preference trainer's."""
    return inputs["input_ids"], inputs["attention_mask"]


def prompts_and_completions(inputs):
    """DistillationTrainer's: each prompt (left-padded) followed by its generated completion (right-padded)."""
    return (torch.cat([inputs["prompt_ids"], inputs["completion_ids"]], 1),
            torch.cat([inputs["prompt_mask"], inputs["completion_mask"]], 1))


@dataclass(frozen=True)
class Spec:
    """One trainer: its class and config, the keyword of its second model (PARTNER), test_trl's dataset kind, its
    own settings, what the one-process run changes in the built trainer to see the global batch as the ranks do,
    the logged figures that must be positive at every step (what that change is for must be at work), the
    overrides of the trained model's and of the second model's mini configs, where compute_loss's inputs hold the
    sequences, and the function of bastile.trainers that is Bastile's part of the loss."""
    trainer: str
    config: str
    partner: str
    data: str
    settings: dict = field(default_factory=dict)
    one_process: Callable = lambda trainer: None
    positive: tuple = ()
    model: dict = field(default_factory=dict)
    partner_model: dict = field(default_factory=dict)
    sequences: Callable = sequences
    bastile: str = "fused_linear_log_probs"


TRAINERS = {
    "dpo": Spec("DPOTrainer", "DPOConfig", "ref_model", "preference", PREFERENCE),
    # Sequential order: KTO's KL pairs are fixed by the dataset's order (the trainer refuses another).
    "kto": Spec("KTOTrainer", "KTOConfig", "ref_model", "unpaired",
                dict(PREFERENCE, train_sampling_strategy="sequential"), kl_pairs_of_the_ranks, positive=("kl",)),
    # On-policy: each rank's student generates its completions, greedily (test_trl's DISTILLATION), so the ranks'
    # and the one-process run's are the same function of the same weights and their sequences can be compared.
    # test_trl's teacher, twice as wide as the student (PARTNER's seed and scale); the JSD (beta 0.5), both
    # distributions' terms.
    "distillation": Spec("DistillationTrainer", "DistillationConfig", "teacher_model", "prompts",
                         dict(DISTILLATION, beta=0.5), model=STUDENT, partner_model=TEACHER,
                         sequences=prompts_and_completions, bastile="fused_linear_divergence"),
}
# (trainer, mode): each trained two ways, TRL's own head and Bastile's.
JOBS = [(kind, mode) for kind in TRAINERS for mode in ("hf", "bastile")]

# Set while DistributedDataParallel.forward runs, in the workers.
_in_ddp = contextvars.ContextVar("in_ddp", default=False)


def _ddp_forward(forward):
    @functools.wraps(forward)
    def wrapper(self, *args, **kwargs):
        token = _in_ddp.set(True)
        try:
            return forward(self, *args, **kwargs)
        finally:
            _in_ddp.reset(token)
    return wrapper


def train(kind, mode, out, per_device):
    """Trains `kind` for STEPS steps with `per_device` sequences a step (Bastile applied first in mode "bastile",
    before the models are built) and returns the initial and trained parameters, the logged step records, each
    step's sequences (their unpadded token ids, sorted) and whether compute_loss got the DDP-wrapped model,
    and, per call of Bastile's head (spec.bastile), whether it ran inside DDP's forward and with gradients."""
    spec = TRAINERS[kind]
    bastile.reset()
    if mode == "bastile":
        assert set(TRAINER_PATCHES) <= set(bastile.apply())
    head = []
    real = getattr(bastile.trainers, spec.bastile)

    def counting(*args, **kwargs):
        head.append((_in_ddp.get(), torch.is_grad_enabled()))
        return real(*args, **kwargs)

    setattr(bastile.trainers, spec.bastile, counting)
    try:
        config = getattr(trl, spec.config)(output_dir=str(out), per_device_train_batch_size=per_device,
                                           **COMMON, **spec.settings)
        rows = STEPS * WORLD * PER_RANK  # the whole dataset: one epoch of STEPS global batches
        model = mini("qwen3", "cpu", torch.float32, **spec.model)
        start = {n: p.detach().clone() for n, p in model.named_parameters()}
        partner = mini("qwen3", "cpu", torch.float32, **{**PARTNER, **spec.partner_model}).eval()
        trainer = getattr(trl, spec.trainer)(model, **{spec.partner: partner},
                                             args=config, train_dataset=dataset(spec.data, rows),
                                             processing_class=tokenizer())
        if per_device != PER_RANK:
            spec.one_process(trainer)
        steps = []
        compute_loss = trainer.compute_loss

        def recording(model, inputs, *args, **kwargs):
            ids = [row[mask.bool()].tolist() for row, mask in zip(*spec.sequences(inputs))]
            steps.append((sorted(ids), isinstance(model, DistributedDataParallel)))
            return compute_loss(model, inputs, *args, **kwargs)

        trainer.compute_loss = recording
        trainer.train()
        params = {n: p.detach().clone() for n, p in model.named_parameters()}  # the module DDP wrapped
    finally:
        setattr(bastile.trainers, spec.bastile, real)
        bastile.reset()
    return {"params": params, "start": start, "steps": steps, "head": head,
            "logs": [e for e in trainer.state.log_history if "loss" in e]}


def _worker(rank, port, out, jobs):
    """One rank: every job under DDP (the Trainer wraps the model, as `torchrun` would have it), results saved."""
    torch.set_num_threads(1)  # two ranks on a small CPU
    # gloo binds to the address the host name resolves to, unreachable on isolated machines: loopback.
    os.environ.update(GLOO_SOCKET_IFNAME="lo", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      LOCAL_RANK=str(rank), WORLD_SIZE=str(WORLD))
    DistributedDataParallel.forward = _ddp_forward(DistributedDataParallel.forward)
    dist.init_process_group("gloo", rank=rank, world_size=WORLD, timeout=timedelta(minutes=3))
    try:
        results = {job: train(*job, out / f"{'_'.join(job)}_rank{rank}", PER_RANK) for job in jobs}
        torch.save(results, out / f"rank{rank}.pt")
    finally:
        dist.destroy_process_group()
    os._exit(0)  # as test_distributed's workers: no interpreter shutdown after the results are saved


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """{job: {"ranks": [rank 0's results, rank 1's], "one": the one-process run's}}; one launch of the ranks
    for all jobs (starting them costs more than a job)."""
    out = tmp_path_factory.mktemp("trl_ddp")
    mp.spawn(_worker, args=(free_port(), out, JOBS), nprocs=WORLD, join=True)
    ranks = [torch.load(out / f"rank{r}.pt") for r in range(WORLD)]
    return {job: {"ranks": [r[job] for r in ranks], "one": train(*job, out / "_".join(job), WORLD * PER_RANK)}
            for job in JOBS}


@pytest.mark.parametrize("kind,mode", JOBS, ids=["-".join(job) for job in JOBS])
def test_ddp_matches_one_process_on_the_global_batch(runs, kind, mode):
    ranks, one = runs[kind, mode]["ranks"], runs[kind, mode]["one"]
    assert len(one["steps"]) == STEPS and all(len(r["steps"]) == STEPS for r in ranks)
    for step in range(STEPS):
        rank_ids = [r["steps"][step][0] for r in ranks]
        assert rank_ids[0] != rank_ids[1], "the ranks saw the same data: the test is vacuous"
        assert sorted(rank_ids[0] + rank_ids[1]) == one["steps"][step][0], \
            f"step {step}: the one-process batch is not the ranks' micro-batches together"
    assert all(ddp for r in ranks for _, ddp in r["steps"]), "compute_loss got the unwrapped model"

    calls = [r["head"] for r in ranks]
    if mode == "bastile":
        # The policy's forward with gradients, once per step, inside DDP; every other call (the reference's, KTO's
        # KL pass) without gradients.
        for rank_calls in calls:
            assert rank_calls.count((True, True)) == STEPS, f"Bastile's head under DDP: {rank_calls}"
            assert all(not grad for inside, grad in rank_calls if not inside)
        assert one["head"], "Bastile's head never ran in the one-process run"
    else:
        assert calls == [[], []] and one["head"] == []

    # The logged figures are all-gathered: every rank logs the global batch's loss.
    for r in ranks:
        assert len(r["logs"]) == len(one["logs"]) == STEPS
        for step, (got, ref) in enumerate(zip(r["logs"], one["logs"])):
            assert got["loss"] == pytest.approx(ref["loss"], rel=TOL), f"step {step}: {got} vs {ref}"
            assert all(e[k] > 0 for e in (got, ref) for k in TRAINERS[kind].positive), f"step {step}: {got}"

    want = one["params"]
    for name, p in ranks[0]["params"].items():
        torch.testing.assert_close(ranks[1]["params"][name], p, rtol=0, atol=0,
                                   msg=lambda m: f"{name}: the ranks' parameters differ: {m}")
        torch.testing.assert_close(p, want[name], rtol=TOL, atol=TOL,
                                   msg=lambda m: f"{name}: DDP differs from one process on the global batch: {m}")
    # Training moved the weights far beyond the tolerance, so a rank's own (unreduced) gradient would show.
    moved = max((want[n] - s).abs().max().item() for n, s in one["start"].items())
    assert moved > 100 * TOL, f"the largest parameter change is {moved:.2e}: the test is vacuous"
