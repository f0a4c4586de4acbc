"""bastile.apply(offload_checkpoints=True): under gradient checkpointing the layers' saved inputs wait for the
backward in host memory, and each layer's dense MLP runs over chunks of tokens (long_context.py).

Each case trains a mini model with HF's gradient checkpointing twice, patched with the switch off and on:
- offloading alone (chunks longer than the batch) gives bitwise the losses and gradients of the run without,
  every layer's input went through the host copies and came back, and the device tensors they were copied
  from are freed after the forward (the checkpoints keep them without the switch);
- with the MLP in chunks the gradients are those of the whole MLP summed over chunks (fp32 within 1e-5,
  bf16 within 1e-2 relative), the MLP runs once per chunk in the forward and once in the backward (the
  checkpoint's recomputation never runs it), with PEFT LoRA, packed rows, the Gated DeltaNet family,
  reentrant checkpointing (which recomputes the MLP too), a 4-bit (QLoRA) base and TRL's SFTTrainer
  (gradient_checkpointing=True, packing);
- a LoRA dropout's masks are drawn again in the backward as the forward drew them;
- the switch off builds neither; bad settings and a host that cannot pin memory raise clear errors.
CPU fp32 in CI; CUDA bf16 with eager attention (SDPA's backward is not deterministic, so not bitwise).
The mini models' tensors are smaller than what long_context offloads by default (_MIN_BYTES): the tests
offload every tensor.
"""
import copy
import gc
import weakref

import pytest
import torch
from transformers.modeling_layers import GradientCheckpointingLayer

import bastile
from bastile import data, long_context
from conftest import DEVICES, needs_cuda, rel_err
from test_data import sequences
from test_families import mini

LORA_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
SEQ, BATCH, CHUNK = 64, 2, 48  # 128 tokens: three chunks


@pytest.fixture(autouse=True)
def offload_everything(monkeypatch):
    monkeypatch.setattr(long_context, "_MIN_BYTES", 1)


@pytest.fixture
def stashes(monkeypatch):
    """Every _Stash made while the test runs."""
    made = []

    class Recorded(long_context._Stash):
        def __init__(self):
            super().__init__()
            made.append(self)
    monkeypatch.setattr(long_context, "_Stash", Recorded)
    return made


def model_for(family, device, lora, dropout=0.0, reentrant=False):
    cpu = device == "cpu"
    model = mini(family, device, torch.float32 if cpu else torch.bfloat16,
                 **({} if cpu else {"attn_implementation": "eager"}))
    if lora:
        from peft import LoraConfig, get_peft_model
        model = get_peft_model(model, LoraConfig(r=4, lora_alpha=8, lora_dropout=dropout, target_modules=LORA_TARGETS))
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": reentrant})
    return model


def batch_for(packed, device):
    if packed:
        rows = data.PackedDataset(sequences(12, seed=3), capacity=SEQ * BATCH)
        return {k: v.to(device) if torch.is_tensor(v) else v for k, v in data.collate([rows[0]]).items()}
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, 512, (BATCH, SEQ), generator=g)
    return {"input_ids": ids.to(device), "labels": ids.to(device)}


def step(model, batch):
    model.zero_grad(set_to_none=True)
    loss = model(**batch).loss
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def decoder_layers(model):
    return [m for m in model.modules() if isinstance(m, GradientCheckpointingLayer)]


def count_mlp_calls(model):
    calls = []
    for layer in decoder_layers(model):
        layer.mlp.register_forward_pre_hook(lambda *_: calls.append(1))
    return calls


CASES = [("llama", False, False, False), ("qwen3", True, False, False), ("llama", True, True, False),
         ("qwen3_5_text", False, True, False), ("llama", True, False, True)]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("family,lora,packed,reentrant", CASES, ids=[
    f"{f}-{'lora' if l else 'full'}-{'packed' if p else 'padded'}{'-reentrant' if r else ''}" for f, l, p, r in CASES])
def test_offload_and_tiling_equal_the_run_without(family, lora, packed, reentrant, device, stashes):
    model = model_for(family, device, lora, reentrant=reentrant)
    batch = batch_for(packed, device)
    tokens = batch["input_ids"].numel()
    bastile.apply(model=model)
    loss, grads = step(model, batch)
    assert not stashes

    bastile.apply(offload_checkpoints=True, mlp_chunk=tokens)  # offloading alone
    got_loss, got = step(model, batch)
    torch.testing.assert_close(got_loss, loss, rtol=0, atol=0)
    assert got.keys() == grads.keys()
    for name, want in grads.items():
        torch.testing.assert_close(got[name], want, rtol=0, atol=0, msg=lambda m: f"{name}: {m}")
    (stash,) = stashes
    hidden = model.config.hidden_size
    inputs = [s for s in stash.saved if tuple(s.host.shape) == (*batch["input_ids"].shape, hidden)]
    assert len(inputs) >= len(decoder_layers(model)), "a layer's input stayed on the device"
    assert all(s.taken for s in stash.saved), "an offloaded tensor never came back"

    bastile.apply(mlp_chunk=CHUNK)  # and the MLP in chunks
    calls = count_mlp_calls(model)
    got_loss, got = step(model, batch)
    chunks = -(-tokens // CHUNK)
    # reentrant checkpointing recomputes the whole layer, the MLP's forward included
    assert len(calls) == (3 if reentrant else 2) * chunks * len(decoder_layers(model))
    tol = 1e-5 if device == "cpu" else 1e-2
    assert rel_err(got_loss, loss) < tol
    for name, want in grads.items():
        assert rel_err(got[name], want) < tol, f"{name}: {rel_err(got[name], want):.2e}"


@pytest.mark.parametrize("device", DEVICES)
def test_offloaded_inputs_are_freed_after_the_forward(device):
    """The layers' inputs outlive the forward only in the checkpoints: with offloading, only in host copies."""
    alive = {}
    for offload in (False, True):
        bastile.reset()
        model = model_for("llama", device, lora=False)
        bastile.apply(model=model, offload_checkpoints=offload)
        refs = []
        for layer in decoder_layers(model):
            layer.register_forward_pre_hook(lambda _, args: refs.append(weakref.ref(args[0])))
        loss = model(**batch_for(False, device)).loss
        gc.collect()
        alive[offload] = sum(r() is not None for r in refs)
        loss.backward()
    assert alive == {False: len(decoder_layers(model)), True: 0}


def test_tiled_mlp_draws_the_forwards_dropout_masks_again():
    """The tiled node's gradients with LoRA dropout: those of the same chunks run one by one under autograd,
    from the same RNG state."""
    bastile.apply()
    model = model_for("llama", "cpu", lora=True, dropout=0.5)
    mlp = decoder_layers(model)[0].mlp
    with torch.no_grad():  # PEFT's B starts at zero, where no mask would show
        for name, p in mlp.named_parameters():
            if "lora_B" in name:
                p.normal_()
    params = [p for p in mlp.parameters() if p.requires_grad]
    x = torch.randn(1, 40, model.config.hidden_size, requires_grad=True)
    w = torch.randn(1, 40, model.config.hidden_size)

    torch.manual_seed(7)
    out = long_context.tiled_mlp(mlp, x, 16)
    got = torch.autograd.grad((out * w).sum(), [x, *params])
    torch.manual_seed(7)
    want_out = torch.cat([mlp(x[:, s:s + 16]) for s in range(0, 40, 16)], dim=1)
    want = torch.autograd.grad((want_out * w).sum(), [x, *params])
    torch.testing.assert_close(out, want_out, rtol=0, atol=0)
    for g, e in zip(got, want):
        torch.testing.assert_close(g, e, rtol=1e-4, atol=1e-6)
    torch.manual_seed(8)
    assert not torch.equal(long_context.tiled_mlp(mlp, x, 16), out), "no dropout: the test shows nothing"


def test_switch_off_builds_neither(stashes, monkeypatch):
    def tiled(*_):
        raise AssertionError("the MLP was tiled")
    monkeypatch.setattr(long_context, "tiled_mlp", tiled)
    model = model_for("llama", "cpu", lora=False)
    batch = batch_for(False, "cpu")
    bastile.apply(mlp=True)
    step(model, batch)
    bastile.apply(offload_checkpoints=True)
    bastile.apply(offload_checkpoints=False)
    step(model, batch)
    assert not stashes
    bastile.apply(offload_checkpoints=True)
    bastile.apply()  # keeps the setting
    step(model, batch)
    assert len(stashes) == 1
    bastile.reset()  # and then its default
    bastile.apply()
    step(model, batch)
    assert len(stashes) == 1
    model.gradient_checkpointing_disable()  # nothing without checkpointing
    bastile.apply(offload_checkpoints=True)
    step(model, batch)
    assert len(stashes) == 1


@pytest.mark.parametrize("kwargs,pattern", [
    (dict(offload_checkpoints=True, mlp_chunk=0), "mlp_chunk must be a positive"),
    (dict(offload_checkpoints=True, mlp_chunk=2.5), "mlp_chunk must be a positive"),
    (dict(offload_checkpoints=True, mlp_chunk=True), "mlp_chunk must be a positive"),
    (dict(mlp_chunk=64), "offload_checkpoints=True, which is off"),
])
def test_bad_settings_are_refused(kwargs, pattern, stashes):
    with pytest.raises(ValueError, match=pattern):
        bastile.apply(**kwargs)
    assert not bastile.get_patched_ops()
    model = model_for("llama", "cpu", lora=False)
    bastile.apply()
    step(model, batch_for(False, "cpu"))
    assert not stashes


def test_trl_sft_with_checkpointing_and_offload(tmp_path, stashes, monkeypatch):
    """TRL's SFTTrainer, gradient_checkpointing=True, packed LoRA: the same logs with offloading and tiling."""
    pytest.importorskip("trl")
    from test_trl import assert_same_logs, logged
    config = dict(loss_type="nll", packing=True, lora=True, gradient_checkpointing=True)
    bastile.apply()
    want = logged("sft", "llama", tmp_path, **config)
    tiled = []
    real = long_context.tiled_mlp
    monkeypatch.setattr(long_context, "tiled_mlp", lambda *a: tiled.append(1) or real(*a))
    bastile.apply(offload_checkpoints=True, mlp_chunk=100)
    got = logged("sft", "llama", tmp_path, **config)
    assert stashes and tiled
    assert_same_logs(got, want)


def test_4bit_base(tmp_path, stashes):
    """QLoRA: a bitsandbytes 4-bit base prepared by PEFT for checkpointing; its weights are never copied (they
    are parameters), the adapters' gradients close to those of the run without."""
    from peft import prepare_model_for_kbit_training
    from test_qlora import qlora, quantized
    model = qlora(prepare_model_for_kbit_training(quantized("llama", tmp_path), use_gradient_checkpointing=True,
                                                  gradient_checkpointing_kwargs={"use_reentrant": False}))
    bastile.apply(model=model)
    batch = batch_for(False, "cpu")
    loss, grads = step(model, batch)
    bastile.apply(offload_checkpoints=True, mlp_chunk=CHUNK)
    calls = count_mlp_calls(model)
    got_loss, got = step(model, batch)
    assert stashes and len(calls) == 2 * 3 * len(decoder_layers(model))
    assert rel_err(got_loss, loss) < 1e-5
    assert got.keys() == grads.keys()
    for name, want in grads.items():
        assert rel_err(got[name], want) < 1e-5, f"{name}: {rel_err(got[name], want):.2e}"


@needs_cuda
def test_a_host_that_cannot_pin_is_a_clear_error(monkeypatch):
    model = model_for("llama", "cuda", lora=False)
    batch = batch_for(False, "cuda")
    bastile.apply(model=model, offload_checkpoints=True)
    real = torch.empty

    def empty(*args, pin_memory=False, **kwargs):
        if pin_memory:
            raise RuntimeError("CUDA error: out of memory")
        return real(*args, **kwargs)
    monkeypatch.setattr(torch, "empty", empty)
    with pytest.raises(RuntimeError, match="offload_checkpoints could not pin .* bytes of host memory"):
        model(**batch)
    monkeypatch.setattr(torch, "empty", real)
    step(model, batch)  # and the model trains on
