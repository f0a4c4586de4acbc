"""Bastile under data parallelism, activation checkpointing, HF's Trainer and on a second GPU.

Each check compares a patched run with the unpatched HF run built and trained the same way, on the mini
Qwen3 of test_qwen3_training.

- DDP (CPU, gloo, 2 processes spawned here): `bastile.apply()` before the model is built, each rank trains
  on its own data; per-step losses on every rank within 1e-5 relative of unpatched DDP's, final
  parameters close, and the two ranks' parameters bitwise identical (their data differ, so only the
  all-reduced gradients make them so).
- FSDP2 (`fully_shard` per decoder layer and at the root): torch 2.11 runs it on CPU with gloo, so the CPU
  test is the same parity in fp32 with the LM head tied to the embedding (the weight the fused
  cross-entropy reads is then the root's unsharded embedding). Two cases shard the LM head apart from the
  root: on its own, as torchtitan does, and with the final norm in one group kept whole after the forward,
  as accelerate 1.15 does: its weight is only gathered inside `lm_head`'s call, which the fused loss then
  runs as lm_head's forward (break it, reading the weight outside the call, and the first case fails on
  the sharded weight). A fourth runs
  the family suite's mini Qwen3-MoE, its 3-D expert parameters sharded along the experts and gathered for
  Bastile's expert path; a fifth the same with PEFT LoRA on them. On >= 2
  GPUs, NCCL with a bf16 MixedPrecisionPolicy (fp32 master weights and reduction), tied and untied: losses
  within 1e-2 relative as in the single-GPU bf16 test.
- DeepSpeed ZeRO-3 (one GPU, when deepspeed is installed): every parameter partitioned, so the LM head's
  weight is a placeholder outside lm_head's forward; fp32, tied, untied and LoRA: per-step losses within
  1e-4 relative of unpatched ZeRO-3's, the fused loss taken, trained parameters close (the head's too).
- Activation checkpointing: every op under `torch.utils.checkpoint` (reentrant and not) gives bitwise the
  outputs and gradients it gives without (the op is shown to be recomputed); HF's
  `gradient_checkpointing_enable` (default = non-reentrant, reentrant, and offloading on CUDA) on the
  patched model gives bitwise the gradients of every parameter that the same model gives without it
  (every decoder layer shown to run twice), and those are close to unpatched HF's. CPU fp32; CUDA bf16
  with eager attention (the SDPA kernels' backward is not deterministic, so it could not be bitwise).
- HF Trainer (CPU, gradient accumulation): logged losses within 1e-5 relative of an unpatched Trainer's.
- A second GPU: each op's forward and backward on cuda:1 while cuda:0 is current and cuda:1's current
  stream is a side stream whose inputs are only written after a long sleep: results equal the CPU's,
  the current device stays 0, nothing is allocated on cuda:0.
"""
import copy
import os
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import DTensor
from torch.nn.parallel import DistributedDataParallel
from torch.utils.checkpoint import checkpoint

import bastile
from conftest import CUDA, DEVICES, TRAINER_PATCHES, free_port, needs_cuda, rel_err
from peft import LoraConfig, get_peft_model
from test_experts import EXPERT_LORA
from test_families import mini
from test_qwen3_training import assert_params_close, batches, mini_qwen3, train

TWO_GPUS = CUDA and torch.cuda.device_count() >= 2
needs_two_gpus = pytest.mark.skipif(not TWO_GPUS, reason="needs 2 CUDA GPUs")
VOCAB = 2048  # the parallel runs' vocabulary: the mini Qwen3's 32000 would make its embedding 80% of the work
ALL_PATCHES = [f"{role}_qwen3" for role in bastile.patch.ROLES] + TRAINER_PATCHES


# ---------------------------------------------------------------- DDP and FSDP2, 2 processes

def _wrap(model, strategy, device):
    if strategy == "ddp":
        return DistributedDataParallel(model)
    mp_policy = (MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
                 if device == "cuda" else MixedPrecisionPolicy())
    for layer in _layers(model):
        fully_shard(layer, mp_policy=mp_policy)
    if strategy == "fsdp_head":
        fully_shard(model.lm_head, mp_policy=mp_policy)
    if strategy == "fsdp_tail":  # accelerate 1.15's FSDP2 layout: the final norm and the head one group, kept whole
        fully_shard([model.model.norm, model.lm_head], mp_policy=mp_policy, reshard_after_forward=False)
    fully_shard(model, mp_policy=mp_policy)
    return model


def _full(p):
    """The whole parameter on every rank. FSDP2 shards dim 0; the shards are gathered with the plain c10d
    API, since DTensor.full_tensor() (functional collectives) crashed over gloo on a host with GPUs."""
    if not isinstance(p, DTensor):
        return p.detach().cpu()
    shards = [None] * dist.get_world_size()
    dist.all_gather_object(shards, p.to_local().detach().cpu())
    return torch.cat(shards)


def _layers(model):
    inner = model.get_base_model() if hasattr(model, "get_base_model") else model
    return inner.model.layers


def _build(dev, tied, family="qwen3", expert_lora=False):
    """The mini Qwen3 of test_qwen3_training, or the family suite's mini of another family (an MoE), with PEFT
    LoRA on its attention and its experts' 3-D parameters where `expert_lora`."""
    if family == "qwen3":
        return mini_qwen3(dev, torch.float32, vocab_size=VOCAB, tie_word_embeddings=tied)
    model = mini(family, dev, torch.float32, vocab_size=VOCAB, tie_word_embeddings=tied)
    return get_peft_model(model, LoraConfig(**EXPERT_LORA)) if expert_lora else model


def _unpatched_then_patched(jobs, dev):
    """(job, mode, spec, model) for each job's model built unpatched, then after apply() as users do; a
    job's spec is (its own setting, whether the head is tied[, the model's family])."""
    for job, spec in jobs.items():
        for mode in ("hf", "bastile"):
            bastile.reset()
            if mode == "bastile":
                assert set(ALL_PATCHES) <= set(bastile.apply())
            yield job, mode, spec, _build(dev, *spec[1:])


def _parallel_worker(rank, world, port, out, device, jobs, steps):
    """For each job (strategy, tie), trains unpatched then patched (apply() before building, as users do);
    saves each mode's per-step losses, rank 0's full parameters, whether this rank's parameters equal
    rank 0's, and whether the patched model's loss took the fused path."""
    if device == "cuda":
        torch.cuda.set_device(rank)
        dev = torch.device("cuda", rank)
    else:
        torch.set_num_threads(1)  # two ranks on a small CPU
        dev = torch.device("cpu")
        # gloo binds to the address the host name resolves to, unreachable on isolated machines: loopback.
        os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    dist.init_process_group("nccl" if device == "cuda" else "gloo", init_method=f"tcp://127.0.0.1:{port}",
                            rank=rank, world_size=world, timeout=timedelta(minutes=3))
    try:
        data = batches(steps, 1, 2, 64, dev, 0.3, seed=1 + rank)
        results = {job: {} for job in jobs}
        for job, mode, (strategy, *_), model in _unpatched_then_patched(jobs, dev):
            model = _wrap(model, strategy, device)
            inner = model.module if strategy == "ddp" else model
            fused = bastile.roles.head._fused_loss_applies(inner, data[0][0][1])
            experts = [type(m).forward.__name__ for m in inner.modules() if type(m).__name__.endswith("Experts")]
            fused_adapters = sorted(n for n, why in bastile.lora_modules(inner).items() if why == "fused")
            losses = train(model, data)
            params = {n: _full(p) for n, p in model.named_parameters()}
            same_as_rank0 = True
            for p in params.values():
                q = p.to(dev).clone()
                dist.broadcast(q, 0)
                same_as_rank0 &= torch.equal(q.cpu(), p)
            results[job][mode] = {"losses": losses, "same_as_rank0": same_as_rank0, "fused_loss": fused,
                                  "experts": experts, "fused_adapters": fused_adapters,
                                  "params": params if rank == 0 else None}
        bastile.reset()
        torch.save(results, out / f"rank{rank}.pt")
    finally:
        dist.destroy_process_group()
    # Now skip the interpreter's shutdown: after the save and destroy_process_group() above, it aborted a rank
    # now and then (std::terminate at exit, 1 run in 9 here), which would fail a run whose results are in.
    os._exit(0)


def run_parallel(out, device, jobs, steps, world=2):
    """{job: [rank 0's results, rank 1's]} of _parallel_worker in `world` fresh processes (one launch for
    all jobs: starting the processes costs more than a job)."""
    mp.spawn(_parallel_worker, args=(world, free_port(), out, device, jobs, steps), nprocs=world, join=True)
    ranks = [torch.load(out / f"rank{r}.pt") for r in range(world)]
    return {job: [r[job] for r in ranks] for job in jobs}


def assert_parity(ranks, loss_tol, param_tol):
    for rank, r in enumerate(ranks):
        worst = max(abs(a - b) / abs(b) for a, b in zip(r["bastile"]["losses"], r["hf"]["losses"]))
        assert worst < loss_tol, (f"rank {rank}: per-step losses differ by {worst:.2e} relative\n"
                                  f"{r['bastile']['losses']}\n{r['hf']['losses']}")
    assert ranks[0]["hf"]["losses"] != ranks[1]["hf"]["losses"], "ranks saw the same data: the test is vacuous"
    assert_params_close(ranks[0]["bastile"]["params"], ranks[0]["hf"]["params"], param_tol)


CPU_JOBS = {"ddp": ("ddp", False), "fsdp_tied": ("fsdp", True), "fsdp_lm_head_sharded": ("fsdp_head", False),
            "fsdp_tail": ("fsdp_tail", False), "fsdp_moe": ("fsdp", True, "qwen3_moe"),
            "fsdp_moe_lora": ("fsdp", True, "qwen3_moe", True)}
CUDA_JOBS = {"fsdp_tied": ("fsdp", True), "fsdp_untied": ("fsdp", False)}


@pytest.fixture(scope="module")
def cpu_runs(tmp_path_factory):
    return run_parallel(tmp_path_factory.mktemp("cpu_runs"), "cpu", CPU_JOBS, steps=4)


@pytest.fixture(scope="module")
def cuda_runs(tmp_path_factory):
    return run_parallel(tmp_path_factory.mktemp("cuda_runs"), "cuda", CUDA_JOBS, steps=10)


def test_ddp_cpu_matches_hf(cpu_runs):
    ranks = cpu_runs["ddp"]
    assert ranks[0]["bastile"]["fused_loss"]
    assert_parity(ranks, 1e-5, 1e-4)
    for mode in ("hf", "bastile"):
        assert ranks[1][mode]["same_as_rank0"], f"{mode}: DDP ranks' parameters differ after training"


@pytest.mark.parametrize("job", ["fsdp_tied", "fsdp_lm_head_sharded", "fsdp_tail"])
def test_fsdp2_cpu_matches_hf(cpu_runs, job):
    ranks = cpu_runs[job]
    assert ranks[0]["bastile"]["fused_loss"]
    assert_parity(ranks, 1e-5, 1e-4)


def test_fsdp2_cpu_moe_matches_hf(cpu_runs):
    """Qwen3-MoE's mini under FSDP2: each layer's 3-D expert parameters sharded along the experts, gathered
    for Bastile's expert path (its one autograd node keeps them for the backward, as F.linear keeps a weight)
    and their gradients reduce-scattered: the losses and trained parameters of unpatched FSDP2."""
    ranks = cpu_runs["fsdp_moe"]
    assert ranks[0]["bastile"]["fused_loss"]
    assert ranks[0]["bastile"]["experts"] and all(n.startswith("mlp.experts") for n in ranks[0]["bastile"]["experts"])
    assert not any(n.startswith("mlp.experts") for n in ranks[0]["hf"]["experts"])
    assert_parity(ranks, 1e-5, 1e-4)


def test_fsdp2_cpu_moe_expert_lora_matches_peft(cpu_runs):
    """The same with PEFT LoRA on the experts' 3-D parameters: the expert path keeps the adapters' own (sharded,
    then gathered) weights for the backward and makes the factors again from them there; the losses and trained
    parameters of unpatched FSDP2 over PEFT."""
    ranks = cpu_runs["fsdp_moe_lora"]
    fused = ranks[0]["bastile"]["fused_adapters"]
    assert any(n.endswith(".mlp.experts") for n in fused) and not ranks[0]["hf"]["fused_adapters"]
    assert_parity(ranks, 1e-5, 1e-4)


@needs_two_gpus
@pytest.mark.parametrize("job", list(CUDA_JOBS))
def test_fsdp2_cuda_bf16_matches_hf(cuda_runs, job):
    ranks = cuda_runs[job]
    assert ranks[0]["bastile"]["fused_loss"]
    assert_parity(ranks, 1e-2, 3e-2)


# ---------------------------------------------------------------- DeepSpeed ZeRO-3, one GPU

ZERO3_STEPS = 6
ZERO3_LR = 3e-3
ZERO3_JOBS = {"untied": (None, False), "tied": (None, True), "lora": (8, False)}  # (LoRA rank, tied head)
# Every parameter partitioned (the default keeps those under 1e5 elements whole, the mini model's head among
# them); DeepSpeed's optimizer as torch's AdamW, so no DeepSpeed extension is compiled.
ZERO3_CONFIG = {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 1,
                "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0},
                "optimizer": {"type": "AdamW", "params": {"lr": ZERO3_LR, "torch_adam": True}}}


def _zero3_worker(rank, port, out, jobs):
    """For each job, trains under ZeRO-3 unpatched then patched; saves the per-step losses, whether the LM
    head was partitioned when each step began, whether the loss took the fused path (no logits), and the
    gathered initial and final parameters."""
    import deepspeed
    from peft import LoraConfig, get_peft_model
    from test_lora import SEVEN

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK="0", LOCAL_RANK="0", WORLD_SIZE="1")
    torch.cuda.set_device(0)
    deepspeed.init_distributed(dist_backend="nccl")
    data = batches(ZERO3_STEPS, 1, 2, 64, torch.device("cuda", 0), 0.3)
    results = {job: {} for job in jobs}
    for job, mode, (rank_lora, *_), model in _unpatched_then_patched(jobs, "cuda"):
        if rank_lora:
            model = get_peft_model(model, LoraConfig(r=rank_lora, lora_alpha=16, target_modules=SEVEN))
        engine, *_ = deepspeed.initialize(model=model, config=ZERO3_CONFIG,
                                          model_parameters=[p for p in model.parameters() if p.requires_grad])
        head = model.get_output_embeddings()
        with deepspeed.zero.GatheredParameters(list(model.parameters())):
            initial = {n: p.detach().cpu().clone() for n, p in model.named_parameters()}
        partitioned, logits, losses = [], [], []
        for (ids, labels), in data:
            partitioned.append(head.weight.numel() == 0)
            output = engine(input_ids=ids, labels=labels)
            logits.append(output.logits is not None)
            engine.backward(output.loss)
            engine.step()
            losses.append(output.loss.item())
        with deepspeed.zero.GatheredParameters(list(model.parameters())):
            params = {n: p.detach().cpu().clone() for n, p in model.named_parameters()}
        results[job][mode] = {"losses": losses, "partitioned": all(partitioned), "logits": any(logits),
                              "initial": initial, "params": params}
        engine.destroy()
    bastile.reset()
    torch.save(results, out / "zero3.pt")
    dist.destroy_process_group()
    os._exit(0)  # as _parallel_worker: no interpreter shutdown after the results are saved


@pytest.fixture(scope="module")
def zero3_runs(tmp_path_factory):
    pytest.importorskip("deepspeed")
    out = tmp_path_factory.mktemp("zero3")
    mp.spawn(_zero3_worker, args=(free_port(), out, ZERO3_JOBS), nprocs=1, join=True)
    return torch.load(out / "zero3.pt")


@needs_cuda
@pytest.mark.parametrize("job", list(ZERO3_JOBS))
def test_deepspeed_zero3_matches_hf(zero3_runs, job):
    """ZeRO-3 keeps lm_head's weight an empty placeholder outside lm_head's forward, which the fused loss
    never calls. Inside the engine's forward the patched model reads it through lm_head, which gathers it,
    and its losses and trained parameters (the head's included, whose gradient ZeRO-3 reduces from the
    fused op) follow unpatched ZeRO-3's."""
    hf, ours = zero3_runs[job]["hf"], zero3_runs[job]["bastile"]
    assert hf["partitioned"] and ours["partitioned"], "the head was not partitioned: the test is vacuous"
    assert hf["logits"] and not ours["logits"], "the patched loss did not take the fused path"
    worst = max(abs(a - b) / abs(b) for a, b in zip(ours["losses"], hf["losses"]))
    assert worst < 1e-4, f"per-step losses differ by {worst:.2e} relative\n{ours['losses']}\n{hf['losses']}"
    if not ZERO3_JOBS[job][0]:  # the head trains, and moves far more than the tolerance below: a lost gradient shows
        head = ([n for n in hf["params"] if n.endswith("lm_head.weight")] or ["model.embed_tokens.weight"])[0]
        assert (hf["params"][head] - hf["initial"][head]).norm() > 1e-2 * hf["initial"][head].norm()
    assert_params_close(ours["params"], hf["params"], 1e-3)


# ---------------------------------------------------------------- activation checkpointing, per op

def _op_cases(device, dtype):
    """(name, fn, inputs, needs_grad) per op at the mini Qwen3's sizes; fn returns a tuple of tensors."""
    g = torch.Generator().manual_seed(0)

    def t(*shape, scale=1.0):
        return (torch.randn(*shape, generator=g) * scale).to(device=device, dtype=dtype)

    angles = torch.arange(64).unsqueeze(-1) * 10000 ** (-torch.arange(32) / 32)
    angles = torch.cat([angles, angles], -1)
    cos, sin = (f(angles).to(device=device, dtype=dtype) for f in (torch.cos, torch.sin))
    target = torch.randint(0, 1000, (128,), generator=g)
    target[::5] = -100
    return [
        ("rms_norm", lambda x, w: (bastile.rms_norm(x, w, 1e-6),), [t(2, 64, 256), t(256)], [True, True]),
        ("swiglu", lambda a, b: (bastile.swiglu(a, b),), [t(2, 64, 768), t(2, 64, 768)], [True, True]),
        ("rope", bastile.rope, [t(2, 4, 64, 64), t(2, 2, 64, 64), cos, sin], [True, True, False, False]),
        ("qk_norm_rope", lambda q, k, qw, kw, c, s: bastile.qk_norm_rope(q, k, qw, kw, c, s, 1e-6),
         [t(2, 64, 4, 64), t(2, 64, 2, 64), t(64), t(64), cos, sin], [True, True, True, True, False, False]),
        ("fused_linear_cross_entropy", lambda h, w, y: (bastile.fused_linear_cross_entropy(h, w, y),),
         [t(128, 256), t(1000, 256, scale=0.05), target.to(device)], [True, True, False]),
    ]


def _fwd_bwd(fn, inputs, needs_grad, wrap=lambda f, *xs: f(*xs)):
    """Outputs and input gradients of fn under `wrap`, with a fixed cotangent per output."""
    xs = [x.detach().clone().requires_grad_(r) for x, r in zip(inputs, needs_grad)]
    outs = wrap(fn, *xs)
    g = torch.Generator().manual_seed(1)
    cotangents = [torch.randn(o.shape, generator=g).to(o) for o in outs]
    torch.autograd.backward(outs, cotangents)
    return [o.detach() for o in outs], [x.grad for x, r in zip(xs, needs_grad) if r]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("reentrant", [False, True], ids=["non_reentrant", "reentrant"])
def test_op_checkpoint_bitwise(device, reentrant):
    dtype = torch.float32 if device == "cpu" else torch.bfloat16
    for name, fn, inputs, needs_grad in _op_cases(device, dtype):
        calls = []

        def counted(*xs):
            calls.append(1)
            return fn(*xs)

        outs, grads = _fwd_bwd(fn, inputs, needs_grad)
        ck_outs, ck_grads = _fwd_bwd(counted, inputs, needs_grad,
                                     lambda f, *xs: checkpoint(f, *xs, use_reentrant=reentrant))
        assert len(calls) == 2, f"{name}: checkpoint ran the op {len(calls)} times, expected forward + recompute"
        for a, b in zip(outs + grads, ck_outs + ck_grads):
            torch.testing.assert_close(b, a, rtol=0, atol=0, msg=lambda m: f"{name}: {m}")


# ---------------------------------------------------------------- activation checkpointing, HF models

def _grads(model, ids, labels):
    model.zero_grad(set_to_none=True)
    model(input_ids=ids, labels=labels).loss.backward()
    return {n: p.grad.clone() for n, p in model.named_parameters()}


CHECKPOINTING = {"default": {}, "non_reentrant": {"gradient_checkpointing_kwargs": {"use_reentrant": False}},
                 "reentrant": {"gradient_checkpointing_kwargs": {"use_reentrant": True}},
                 "offload": {"offload": True}}


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("how", list(CHECKPOINTING))
def test_hf_gradient_checkpointing(device, how, monkeypatch):
    if how == "offload" and device == "cpu":
        pytest.skip("offloading moves activations from an accelerator to the host")
    cpu = device == "cpu"
    dtype = torch.float32 if cpu else torch.bfloat16
    ref = mini_qwen3(device, dtype, attn_implementation="sdpa" if cpu else "eager")
    (ids, labels), = batches(1, 1, 2, 64, device, 0.3)[0]
    hf_grads = _grads(ref, ids, labels)
    model = copy.deepcopy(ref)
    assert bastile.apply(model=model) == ALL_PATCHES
    plain = _grads(model, ids, labels)

    layer_calls = []
    for layer in model.model.layers:
        # a pre-hook: non-reentrant recomputation stops inside the layer once it has what the backward needs
        layer.mlp.register_forward_pre_hook(lambda *_: layer_calls.append(1))
    model.gradient_checkpointing_enable(**CHECKPOINTING[how])
    fused = []
    real = bastile.lora.swiglu_down
    monkeypatch.setattr(bastile.lora, "swiglu_down", lambda *a: fused.append(1) or real(*a))
    checkpointed = _grads(model, ids, labels)
    assert len(layer_calls) == 2 * len(model.model.layers), "the decoder layers were not recomputed"
    # A recomputed layer keeps its activation: the fused down projection would run in the recomputation.
    assert not fused

    # HF's own rounding differs from the fused ops' (bf16: by about 1% of a gradient's norm).
    tol = 1e-5 if cpu else 3e-2
    for name, want in plain.items():
        torch.testing.assert_close(checkpointed[name], want, rtol=0, atol=0, msg=lambda m: f"{name}: {m}")
        assert rel_err(want, hf_grads[name]) < tol, f"{name}: {rel_err(want, hf_grads[name]):.2e} from HF's"


# ---------------------------------------------------------------- HF Trainer

def _trainer_run(tmp_path, patched):
    """Logged step records (loss, grad_norm) and the parameters before and after a 4-step Trainer run on CPU
    with gradient accumulation over 2 micro-batches (so num_items_in_batch reaches the loss)."""
    pytest.importorskip("accelerate", reason="transformers' Trainer needs accelerate")
    from transformers import Trainer, TrainingArguments

    bastile.reset()
    if patched:
        bastile.apply()  # before the model is built
    model = mini_qwen3("cpu", torch.float32)
    assert (type(model).forward.__module__ == "bastile.roles.head") == patched
    dataset = [{"input_ids": ids[i], "labels": labels[i]}
               for [(ids, labels)] in batches(8, 1, 2, 64, "cpu", 0.3) for i in range(2)]
    args = TrainingArguments(output_dir=str(tmp_path / f"patched_{patched}"), use_cpu=True, report_to="none",
                             save_strategy="no", max_steps=4, per_device_train_batch_size=2,
                             gradient_accumulation_steps=2, learning_rate=1e-3, logging_steps=1, seed=0,
                             disable_tqdm=True)
    start = {n: p.detach().clone() for n, p in model.named_parameters()}
    trainer = Trainer(model=model, args=args, train_dataset=dataset)
    trainer.train()
    bastile.reset()
    logs = [h for h in trainer.state.log_history if "loss" in h]
    return logs, start, {n: p.detach().clone() for n, p in model.named_parameters()}


def test_trainer_cpu_matches_hf(tmp_path):
    runs = {}
    for patched in (False, True):
        runs[patched] = _trainer_run(tmp_path, patched)
    (hf_logs, hf_start, hf_end), (logs, start, end) = runs[False], runs[True]
    assert len(logs) == len(hf_logs) == 4
    for got, want in zip(logs, hf_logs):
        assert abs(got["loss"] - want["loss"]) / want["loss"] < 1e-5, f"{logs}\n{hf_logs}"
        assert abs(got["grad_norm"] - want["grad_norm"]) / want["grad_norm"] < 1e-4, f"{logs}\n{hf_logs}"
    for name in start:
        assert torch.equal(start[name], hf_start[name]), f"{name}: the two runs started apart"
        assert not torch.equal(end[name], start[name]), f"{name}: not trained"
    assert_params_close(end, hf_end, 1e-4)


# ---------------------------------------------------------------- a second GPU

@needs_two_gpus
def test_ops_on_second_gpu_side_stream():
    torch.cuda.set_device(0)
    before = torch.cuda.memory_allocated(0)
    side = torch.cuda.Stream(device=1)
    for (name, fn, cpu_inputs, needs_grad), (_, _, inputs, _) in zip(_op_cases("cpu", torch.float32),
                                                                     _op_cases("cuda:1", torch.float32)):
        want_outs, want_grads = _fwd_bwd(fn, cpu_inputs, needs_grad)
        torch.cuda.synchronize(1)

        def late(fn, *xs):
            """Inputs become valid on `side` only after a long sleep; until then they hold NaN, so an op
            on any other stream reads NaN. The op is called with cuda:0 current."""
            with torch.cuda.stream(side):
                staged = [torch.full_like(x, float("nan")) if x.is_floating_point() else x.clone() for x in xs]
                torch.cuda._sleep(100_000_000)
                for s, x in zip(staged, xs):
                    s.copy_(x)  # differentiable: the gradients reach xs
                with torch.cuda.device(0):
                    assert torch.cuda.current_stream(1) == side
                    outs = fn(*staged)
                    assert torch.cuda.current_device() == 0, f"{name} left cuda:{torch.cuda.current_device()} current"
                    return outs

        with torch.cuda.stream(side):  # the backward runs on the forward's stream
            outs, grads = _fwd_bwd(fn, inputs, needs_grad, late)
        side.synchronize()
        assert torch.cuda.current_device() == 0
        for got, want in zip(outs + grads, want_outs + want_grads):
            assert got.device == torch.device("cuda", 1), f"{name}: result on {got.device}"
            assert rel_err(got, want) < 1e-5, f"{name}: cuda:1 differs from the CPU by {rel_err(got, want):.2e}"
    assert torch.cuda.memory_allocated(0) == before, "something was allocated on cuda:0"
