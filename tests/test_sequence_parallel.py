"""Bastile under sequence parallelism: each rank holds a slice of every sequence, and the engine exchanges the
slices inside the attention call.

- DeepSpeed's Ulysses (ALST, accelerate's `sp_backend="deepspeed"`; CPU, gloo, 2 and 4 processes spawned here):
  the engine's own pieces as HF's Trainer runs them: UlyssesSPAttentionHF.register_with_transformers (its
  all-to-all around the "sdpa" attention function), UlyssesSPDataLoaderAdapter (each rank's slice of the
  batch, the labels shifted before slicing) and transformers' deepspeed_sp_compute_loss (the ranks' losses
  weighted by their token counts); the ranks' gradients averaged, as DeepSpeed's engine averages them. For
  rows of one sequence each, the loss and every parameter's gradient equal HF's one-process run on the whole
  batch within 1e-5 / 1e-4 (fp32), with and without Bastile, including a batch in which a rank's slice has no
  label (a long prompt). For packed rows (position ids restarting), HF's SDPA under Ulysses attends across the
  packed sequences (the engine drops the masks; only its flash-attention core reads the gathered positions),
  so there Bastile under Ulysses must equal HF under Ulysses: Bastile's varlen kernel, which would attend
  within the rank's slice alone, gives the call to the engine (varlen.local). And the whole user path on 2
  processes: HF's Trainer with accelerate's ParallelismConfig(sp_backend="deepspeed") and DeepSpeed's engine
  (ZeRO-0), Bastile's logged losses and parameter updates those of HF's model under it; TRL's SFTTrainer
  likewise, Bastile's log-prob head in TRL's fused head, its logs those of TRL alone under the engine.
- torch's ring context parallelism (accelerate's `cp_backend="torch"`, FSDP2; 2 CUDA GPUs, NCCL: its ring
  attention takes CUDA's SDPA kernels only): accelerate's Accelerator with ParallelismConfig(cp_size=2) and
  maybe_context_parallel, the batch sliced head-and-tail (load balancing, so a rank's position ids restart)
  with the labels shifted before slicing as HF's Trainer does; the same parity with the one-process run.

The patched runs take Bastile's head and norm/rotation kernels (the ops they dispatch are asserted).
"""
import os
import sys
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import bastile
from conftest import CUDA, free_port
from test_families import Dispatched
from test_qwen3_training import mini_qwen3

SEQ = 32  # divisible by 4 ranks, and by 2 x 2 head-and-tail chunks
VOCAB = 512
HEADS = dict(num_attention_heads=8, num_key_value_heads=4, head_dim=32, hidden_size=256)  # heads split 4 ways
LOSS_TOL, GRAD_TOL = 1e-5, 1e-4
PATCHED_OPS = {"fused_linear_cross_entropy", "qk_norm_rope", "rms_norm", "swiglu"}
# bastile-offload: HF's gradient checkpointing with Bastile's offload_checkpoints (saved layer inputs in host memory
# on CUDA) and its tiled MLP (chunks of 8 tokens: a rank's slice is longer)
MODES = ("hf", "bastile", "bastile-offload")


def model(dev, mode="hf", **overrides):
    """The mini Qwen3 of the mode, built after apply() as users do."""
    bastile.reset()
    if mode != "hf":
        bastile.apply(**(dict(offload_checkpoints=True, mlp_chunk=8) if mode == "bastile-offload" else {}))
    m = mini_qwen3(dev, torch.float32, vocab_size=VOCAB, **{**HEADS, **overrides})
    if mode == "bastile-offload":
        m.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    return m


def batch(case, seq=SEQ):
    """(input_ids, labels, position_ids) of 2 rows: `plain` rows with a few labels ignored; `prompt`, the first
    SEQ // 2 + 1 labels of each row ignored (a 4-way slice of the shifted labels then has none on rank 0 and
    1); `packed`, rows of 3 sequences each (position ids restarting; SEQ tokens)."""
    g = torch.Generator().manual_seed(3)
    ids = torch.randint(0, VOCAB, (2, seq), generator=g)
    labels = ids.clone()
    labels[torch.rand(2, seq, generator=g) < 0.2] = -100
    positions = torch.arange(seq).expand(2, -1).clone()
    if case == "prompt":
        labels[:, :seq // 2 + 1] = -100
    if case == "packed":
        for row, cuts in enumerate(((0, 7, 20, SEQ), (0, 13, 18, SEQ))):
            for a, b in zip(cuts, cuts[1:]):
                positions[row, a:b] = torch.arange(b - a)
    return ids, labels, positions


def one_process(case, dev="cpu", seq=SEQ, **overrides):
    """HF's loss and gradients on the whole batch, in this process (no engine). Without a cache: HF's decoder
    makes one in training where config.use_cache says so, and then attends across packed rows' sequences."""
    m = model(dev, **overrides)
    ids, labels, positions = (t.to(dev) for t in batch(case, seq))
    loss = m(input_ids=ids, labels=labels, position_ids=positions, use_cache=False).loss
    loss.backward()
    return float(loss.detach()), {n: p.grad.detach().cpu() for n, p in m.named_parameters()}


def assert_ran(runs, mode, case):
    """HF's run dispatched no Bastile op; Bastile's its head, norms, rotation and MLP, the offloading run its MLP
    over chunks (more calls than the whole MLP's)."""
    run = runs[(mode, case)]
    assert (PATCHED_OPS <= run["ops"]) if mode != "hf" else not run["ops"], run["ops"]
    if mode == "bastile-offload":
        assert run["mlp_calls"] > runs[("bastile", case)]["mlp_calls"], "the tiled MLP did not run"


def assert_matches(run, ref, what):
    loss, grads = ref
    assert abs(run["loss"] - loss) <= LOSS_TOL * abs(loss), f"{what}: loss {run['loss']} vs {loss}"
    for name, g in grads.items():
        err = (run["grads"][name] - g).norm() / g.norm().clamp_min(1e-12)
        assert err <= GRAD_TOL, f"{what}: {name}'s gradient differs by {err:.2e} relative"


# ---------------------------------------------------------------- DeepSpeed's Ulysses, CPU

ULYSSES_CASES = ("plain", "prompt", "packed")


def _cpu_rank():
    """A spawned rank on this small CPU, gloo on the loopback; DeepSpeed's CPU backend builds its shared-memory op at
    first use, with the ninja installed beside the interpreter."""
    torch.set_num_threads(1)
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    os.environ["PATH"] = f"{os.path.dirname(sys.executable)}{os.pathsep}{os.environ['PATH']}"


def _ulysses_worker(rank, world, port, out):
    import deepspeed
    from deepspeed.runtime.sequence_parallel.ulysses_sp import UlyssesSPAttentionHF, UlyssesSPDataLoaderAdapter
    from deepspeed.utils import groups
    from torch.utils.data import DataLoader
    from transformers.integrations.deepspeed import deepspeed_sp_compute_loss

    _cpu_rank()
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                            timeout=timedelta(minutes=3))
    deepspeed.init_distributed("gloo")
    pc = type("ParallelismConfig", (), {"sp_backend": "deepspeed", "sp_size": world, "sp_enabled": True})
    try:
        # once per process (it wraps the registry's "sdpa"), for both modes' models, which have one config
        mpu = UlyssesSPAttentionHF.register_with_transformers(
            model_name_or_path=model("cpu"), core_attn_implementation="sdpa", sequence_parallel_size=world,
            micro_batch_size=2, seq_length_is_variable=True)
        groups.mpu = mpu  # what DeepSpeed's engine does with the mpu it is given
        results = {}
        for mode in MODES:
            m = model("cpu", mode)
            for case in ULYSSES_CASES:
                ids, labels, positions = batch(case)
                rows = [{"input_ids": ids, "labels": labels, "position_ids": positions}]
                loader = UlyssesSPDataLoaderAdapter(
                    DataLoader(rows, batch_size=None), sp_rank=mpu.get_sequence_parallel_rank(),
                    sp_group=mpu.get_sequence_parallel_group(), sp_world_size=world, device="cpu")
                # the slices are views of the batch on the CPU; HF's Trainer copies them to the GPU
                inputs = {k: v.contiguous() for k, v in next(iter(loader)).items()}
                m.zero_grad(set_to_none=True)
                with Dispatched() as ops:
                    loss = deepspeed_sp_compute_loss(None, m, inputs, False, pc)
                    loss.backward()
                grads = {}
                for n, p in m.named_parameters():
                    g = p.grad.detach().clone()
                    dist.all_reduce(g)
                    grads[n] = g / world
                results[(mode, case)] = {"loss": float(loss.detach()), "grads": grads, "ops": ops.ops,
                                         "mlp_calls": sum(c.startswith("swiglu") for c in ops.calls)}
        bastile.reset()
        if rank == 0:
            torch.save(results, out / f"ulysses{world}.pt")
    finally:
        dist.destroy_process_group()
    os._exit(0)  # as test_distributed's workers: no interpreter shutdown after the results are saved


@pytest.fixture(scope="module", params=(2, 4), ids=lambda w: f"{w}ranks")
def ulysses(request, tmp_path_factory):
    pytest.importorskip("deepspeed")
    world, out = request.param, tmp_path_factory.mktemp("ulysses")
    mp.spawn(_ulysses_worker, args=(world, free_port(), out), nprocs=world, join=True)
    return torch.load(out / f"ulysses{world}.pt")


@pytest.fixture(scope="module")
def references():
    return {case: one_process(case) for case in ("plain", "prompt")}


@pytest.mark.parametrize("case", ("plain", "prompt"))
@pytest.mark.parametrize("mode", MODES)
def test_ulysses_matches_one_process(ulysses, references, mode, case):
    assert_matches(ulysses[(mode, case)], references[case], f"Ulysses, {mode}, {case}")
    assert_ran(ulysses, mode, case)


def test_ulysses_packed_rows_go_to_the_engine(ulysses):
    """Packed rows: Bastile under Ulysses as HF under Ulysses (not its varlen kernel over a rank's slice), which
    attends across the packed sequences (the engine drops HF's masks and its SDPA core reads no positions), unlike
    the one-process run."""
    hf, patched = ulysses[("hf", "packed")], ulysses[("bastile", "packed")]
    assert_matches(patched, (hf["loss"], hf["grads"]), "Ulysses, packed rows, Bastile vs HF")
    assert PATCHED_OPS <= patched["ops"]
    _, grads = one_process("packed")
    worst = max(float((hf["grads"][n] - g).norm() / g.norm()) for n, g in grads.items() if g.norm() > 0)
    assert worst > 1e-2, f"Ulysses's gradients within {worst:.1e} of the one-process run's: the rows are not packed"


class Rows(torch.utils.data.Dataset):
    """4 rows of SEQ tokens, each with its labels (a fifth ignored) and position ids: 2 steps of 2."""

    def __init__(self):
        g = torch.Generator().manual_seed(5)
        self.rows = []
        for _ in range(4):
            ids = torch.randint(0, VOCAB, (SEQ,), generator=g)
            labels = ids.clone()
            labels[torch.rand(SEQ, generator=g) < 0.2] = -100
            self.rows.append(dict(input_ids=ids, labels=labels, position_ids=torch.arange(SEQ)))

    def __len__(self):
        return len(self.rows)

    def __getitem__(self, i):
        return self.rows[i]


def _ulysses_trainer_worker(rank, world, port, out, kind, mode):
    """HF's Trainer (kind "trainer") or TRL's SFTTrainer ("sft") with accelerate's
    ParallelismConfig(sp_backend="deepspeed") and a ZeRO-0 DeepSpeed config: the whole user path (accelerate
    registers Ulysses and wraps the dataloader, DeepSpeed's engine averages the gradients, the Trainer calls
    deepspeed_sp_compute_loss; SFT's loss is TRL's fused head, Bastile's log-prob head under the log_probs patch).
    The Trainer's SGD at lr 1, so the trained parameters show the gradients."""
    import deepspeed
    from accelerate.parallelism_config import ParallelismConfig
    from accelerate.utils import DeepSpeedSequenceParallelConfig
    from transformers import Trainer, TrainingArguments

    _cpu_rank()
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(port))
    deepspeed.init_distributed("gloo")
    sp = ParallelismConfig(sp_backend="deepspeed", sp_size=world, sp_handler=DeepSpeedSequenceParallelConfig(
        sp_seq_length_is_variable=True, sp_attn_implementation="sdpa"))
    engine = dict(parallelism_config=sp, deepspeed={"train_micro_batch_size_per_gpu": "auto",
                                                    "gradient_accumulation_steps": "auto",
                                                    "zero_optimization": {"stage": 0}})
    if kind == "sft":
        import trl
        from test_trl import COMMON, dataset, tokenizer
        # every batch padded to 64 tokens: the adapter gathers the ranks' batches, which gloo takes of one size only
        args = trl.SFTConfig(max_length=64, pad_to_multiple_of=64, output_dir=str(out / kind / mode),
                             **{**COMMON, "per_device_train_batch_size": 2}, **engine)
        trainer = trl.SFTTrainer(model("cpu", mode), args=args, train_dataset=dataset("sft"),
                                 processing_class=tokenizer())
    else:
        args = TrainingArguments(
            output_dir=str(out / kind / mode), max_steps=2, per_device_train_batch_size=2, learning_rate=1.0,
            optim="sgd", lr_scheduler_type="constant", logging_steps=1, report_to="none", save_strategy="no",
            use_cpu=True, seed=0, disable_tqdm=True, dataloader_num_workers=0, **engine)
        trainer = Trainer(model=model("cpu", mode), args=args, train_dataset=Rows())
    initial = {n: p.detach().clone() for n, p in trainer.model.named_parameters()}
    with Dispatched() as ops:
        trainer.train()
    if rank == 0:
        from test_trl import logs_of
        torch.save({"logs": logs_of(trainer), "ops": ops.ops,
                    "updates": {n: p.detach() - initial[n] for n, p in trainer.model.named_parameters()}},
                   out / f"{kind}_{mode}.pt")
    bastile.reset()
    dist.destroy_process_group()
    os._exit(0)


TRAINER_RUNS = [("trainer", mode) for mode in MODES] + [("sft", "hf"), ("sft", "bastile")]


@pytest.fixture(scope="module")
def ulysses_trainer(tmp_path_factory):
    pytest.importorskip("deepspeed")
    out = tmp_path_factory.mktemp("ulysses_trainer")
    for kind, mode in TRAINER_RUNS:  # a process group each: DeepSpeed makes its sequence-parallel groups once
        mp.spawn(_ulysses_trainer_worker, args=(2, free_port(), out, kind, mode), nprocs=2, join=True)
    return {run: torch.load(out / f"{run[0]}_{run[1]}.pt") for run in TRAINER_RUNS}


@pytest.mark.parametrize("mode", MODES[1:])
def test_ulysses_trainer_matches_hf(ulysses_trainer, mode):
    """Bastile through HF's Trainer under Ulysses: the logged losses of HF's model under the same engine within
    1e-5, the parameters' updates over the 2 steps (SGD at lr 1: the gradients summed) within 1e-4 (relative, in
    norm), Bastile's ops dispatched."""
    run, hf = ulysses_trainer[("trainer", mode)], ulysses_trainer[("trainer", "hf")]
    losses, want = [e["loss"] for e in run["logs"]], [e["loss"] for e in hf["logs"]]
    assert len(losses) == 2 and not hf["ops"] and PATCHED_OPS <= run["ops"], run["ops"]
    for a, b in zip(losses, want):
        assert abs(a - b) <= LOSS_TOL * abs(b), (losses, want)
    for name, update in hf["updates"].items():
        assert update.norm() > 0, f"{name} was not trained"
        err = (run["updates"][name] - update).norm() / update.norm()
        assert err <= GRAD_TOL, f"{name}'s update differs by {err:.2e} relative"


def test_ulysses_sft_logs_match_trl_alone(ulysses_trainer):
    """TRL's SFTTrainer under Ulysses with Bastile (its log-prob head in TRL's fused head): every figure TRL logs
    (loss, entropy, token accuracy, token counts) as with TRL alone under the same engine."""
    from test_trl import assert_same_logs

    run, trl_alone = ulysses_trainer[("sft", "bastile")], ulysses_trainer[("sft", "hf")]
    assert "fused_linear_log_probs" in run["ops"] and not trl_alone["ops"], run["ops"]
    assert_same_logs(run["logs"], trl_alone["logs"])


def test_short_convolutions_refused_under_an_engine(monkeypatch):
    """LFM2's short convolutions carry the sequence across a rank's slice and no engine exchanges them; accelerate
    refuses only linear attention under Ulysses. An engine's attention function registered as DeepSpeed registers
    its own (an instance override of "sdpa"): the patched LFM2 raises, naming the module, rather than train."""
    from test_families import mini
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    bastile.reset()
    bastile.apply()
    m = mini("lfm2", "cpu", torch.float32)
    ids = torch.randint(0, m.config.vocab_size, (1, 8))
    m(input_ids=ids, labels=ids).loss.backward()  # without an engine

    def engine(*args, **kwargs):
        raise AssertionError("the convolution runs first: the engine's attention is never called")

    monkeypatch.setitem(ALL_ATTENTION_FUNCTIONS, "sdpa", engine)
    with pytest.raises(RuntimeError, match="Lfm2ShortConv under sequence parallelism"):
        m(input_ids=ids, labels=ids)


# ---------------------------------------------------------------- torch's ring context parallelism, 2 GPUs

needs_two_gpus = pytest.mark.skipif(not (CUDA and torch.cuda.device_count() >= 2), reason="needs 2 CUDA GPUs")
RING_CASES = ("plain", "prompt")
# as many key/value heads as query heads: fp32 SDPA with grouped heads (enable_gqa) takes the math kernel on CUDA,
# which the ring does not take over
RING = dict(num_key_value_heads=HEADS["num_attention_heads"])
# fp32 takes SDPA's memory-efficient kernel, whose log-sum-exp the ring merges padded to 32 rows: its load-balanced
# steps take a quarter of a rank's slice, so 32 x 4 tokens a rank
RING_SEQ = 256


def _ring_worker(rank, world, port, out):
    from accelerate import Accelerator, FullyShardedDataParallelPlugin
    from accelerate.parallelism_config import ParallelismConfig

    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(port))
    torch.cuda.set_device(rank)
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    results = {}
    for mode in MODES:
        accelerator = Accelerator(parallelism_config=ParallelismConfig(cp_size=world),
                                  fsdp_plugin=FullyShardedDataParallelPlugin(fsdp_version=2))
        m = model("cuda", mode, **RING)
        opt = torch.optim.SGD(m.parameters(), lr=0.0)
        m, opt = accelerator.prepare(m, opt)
        for case in RING_CASES:
            ids, labels, positions = (t.cuda() for t in batch(case, RING_SEQ))
            shift_labels = torch.nn.functional.pad(labels, (0, 1), value=-100)[:, 1:].contiguous()
            count = (shift_labels != -100).sum()
            buffers = [ids, labels, shift_labels, positions]
            opt.zero_grad(set_to_none=True)
            with Dispatched() as ops, accelerator.maybe_context_parallel(
                    buffers=buffers, buffer_seq_dims=[1] * 4, no_restore_buffers=set(buffers)):
                # each rank's summed loss over the batch's count: FSDP2 averages the ranks' gradients
                loss = m(input_ids=ids, labels=labels, shift_labels=shift_labels, position_ids=positions,
                         num_items_in_batch=count).loss
                accelerator.backward(loss * world)
            total = loss.detach().clone()
            dist.all_reduce(total)
            grads = {n: p.grad.full_tensor().cpu() for n, p in m.named_parameters()}
            results[(mode, case)] = {"loss": float(total), "grads": grads, "ops": ops.ops,
                                     "mlp_calls": sum(c.startswith("swiglu") for c in ops.calls),
                                     "positions": positions.cpu()}
        accelerator.free_memory()
    bastile.reset()
    if rank == 0:
        torch.save(results, out / "ring.pt")
    dist.destroy_process_group()
    os._exit(0)


@pytest.fixture(scope="module")
def ring(tmp_path_factory):
    out = tmp_path_factory.mktemp("ring")
    mp.spawn(_ring_worker, args=(2, free_port(), out), nprocs=2, join=True)
    return torch.load(out / "ring.pt")


@needs_two_gpus
@pytest.mark.parametrize("case", RING_CASES)
@pytest.mark.parametrize("mode", MODES)
def test_ring_context_parallel_matches_one_process(ring, mode, case):
    run = ring[(mode, case)]
    positions = run["positions"][0]
    assert (positions.diff() != 1).any(), "the slice is contiguous: Bastile's varlen rule is not exercised"
    assert_matches(run, one_process(case, "cuda", RING_SEQ, **RING), f"ring CP, {mode}, {case}")
    assert_ran(ring, mode, case)
