"""QLoRA: PEFT LoRA over bitsandbytes 4-bit base layers inside the fused nodes (python_shim/bastile/lora.py),
against PEFT's own path on the same quantized model.

CPU (fp32 compute, in CI; bitsandbytes runs its 4-bit layers on the CPU): mini Qwen3 and Llama saved and
reloaded in 4 bits, NF4 and FP4, nested scales or not, LoRA r8 on the seven projections: every projection
fused and PEFT's LoRA forward never called, adapter gradients of step 1 within 1e-3 and 6 AdamW steps'
losses within 1e-4 of PEFT's. prepare_model_for_kbit_training with checkpointing, adapters saved and
reloaded, TRL's SFTTrainer(peft_config=...) on a 4-bit model with packed rows, and LLM.int8 bases, which
keep PEFT's path. Mini Qwen3-MoE, GPT-OSS and Mixtral in 4 bits (their experts unquantized), LoRA on the
experts or all-linear. CUDA (bf16): the same run within bf16's reach.
"""
import pytest
import torch

bnb = pytest.importorskip("bitsandbytes")
from peft import LoraConfig, PeftModel, get_peft_model, prepare_model_for_kbit_training  # noqa: E402
from peft.tuners.lora import bnb as peft_bnb  # noqa: E402
from transformers import AutoModelForCausalLM, BitsAndBytesConfig  # noqa: E402

import bastile  # noqa: E402
from bastile.experts import WEIGHT_PLUS_DELTA  # noqa: E402
from conftest import needs_cuda  # noqa: E402
from test_experts import EXPERT_LORA  # noqa: E402
from test_families import Dispatched, mini  # noqa: E402
from test_lora import SEVEN, adapters, assert_losses_close  # noqa: E402
from test_qwen3_training import assert_params_close, batches, train  # noqa: E402

LR = 1e-3
STEPS = 6
VARIANTS = [("nf4", True), ("nf4", False), ("fp4", True), ("fp4", False)]


def quantized(family, tmp_path, quant_type="nf4", nested=True, device="cpu", dtype=torch.float32, bits=4):
    """The mini model of `family`, saved and loaded back in 4 bits (`bits=8`: LLM.int8) as users load one."""
    path = tmp_path / f"{family}-{dtype}"
    if not path.exists():
        mini(family, "cpu", dtype).save_pretrained(path)
    config = (BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type=quant_type, bnb_4bit_use_double_quant=nested,
                                 bnb_4bit_compute_dtype=dtype) if bits == 4 else BitsAndBytesConfig(load_in_8bit=True))
    return AutoModelForCausalLM.from_pretrained(path, quantization_config=config, dtype=dtype,
                                                device_map=device).train()


def qlora(model, seed=1):
    """PEFT LoRA r8 on the seven projections; init_lora_weights=False gives B != 0."""
    torch.manual_seed(seed)
    return get_peft_model(model, LoraConfig(r=8, lora_alpha=16, target_modules=SEVEN, init_lora_weights=False))


@pytest.fixture
def peft_forwards(monkeypatch):
    """Counts the calls of PEFT's 4-bit LoRA forward."""
    calls = []
    real = peft_bnb.Linear4bit.forward
    monkeypatch.setattr(peft_bnb.Linear4bit, "forward", lambda self, *a, **k: calls.append(1) or real(self, *a, **k))
    return calls


def first_grads(model, data):
    ids, labels = data[0][0]
    model(input_ids=ids, labels=labels).loss.backward()
    grads = {n: p.grad.clone() for n, p in adapters(model).items()}
    model.zero_grad(set_to_none=True)
    return grads


def assert_all_fused(model):
    report = bastile.lora_modules(model)
    assert len(report) == 7 * model.config.num_hidden_layers, report
    assert set(report.values()) == {"fused"}, report


@pytest.mark.parametrize("quant_type,nested", VARIANTS)
@pytest.mark.parametrize("family", ["qwen3", "llama"])
def test_training_matches_peft_cpu(family, quant_type, nested, tmp_path, peft_forwards):
    ref = qlora(quantized(family, tmp_path, quant_type, nested))
    model = qlora(quantized(family, tmp_path, quant_type, nested))
    data = batches(1, 1, 2, 48, "cpu", ignore_fraction=0.1) * STEPS
    want = first_grads(ref, data)
    ref_losses = train(ref, data, LR)
    bastile.apply(model=model)
    assert_all_fused(model)
    peft_forwards.clear()
    assert_params_close(first_grads(model, data), want, 1e-3)
    with Dispatched() as dispatched:
        losses = train(model, data, LR)
    assert not peft_forwards, "PEFT's LoRA forward ran"
    assert "dequantize_4bit" in dispatched.ops
    assert_losses_close(losses, ref_losses, 1e-4, f"{family} {quant_type} nested={nested}")
    assert_params_close(adapters(model), adapters(ref), 1e-3)


@pytest.mark.parametrize("reentrant", [False, True])
def test_kbit_preparation_checkpointing_and_saved_adapters(reentrant, tmp_path):
    """prepare_model_for_kbit_training with gradient checkpointing trains as PEFT does, and the adapters
    saved from the patched model reload into an unpatched one with the same outputs."""
    kw = dict(use_gradient_checkpointing=True, gradient_checkpointing_kwargs={"use_reentrant": reentrant})
    ref = qlora(prepare_model_for_kbit_training(quantized("llama", tmp_path), **kw))
    model = qlora(prepare_model_for_kbit_training(quantized("llama", tmp_path), **kw))
    bastile.apply(model=model)
    assert_all_fused(model)
    data = batches(1, 1, 2, 48, "cpu", ignore_fraction=0.1) * STEPS
    assert_losses_close(train(model, data, LR), train(ref, data, LR), 1e-4)
    # Outputs in train mode (nothing drops out): in eval mode without grad, bitsandbytes repacks 4-bit weights
    # for its bf16 CPU inference kernel where the CPU has AVX512-BF16, which rounds differently.
    ids = data[0][0][0]
    with torch.no_grad():
        expected = model(input_ids=ids).logits
    model.save_pretrained(tmp_path / "adapters")
    bastile.reset()
    reloaded = PeftModel.from_pretrained(quantized("llama", tmp_path), tmp_path / "adapters", is_trainable=True)
    with torch.no_grad():
        torch.testing.assert_close(reloaded(input_ids=ids).logits, expected, rtol=1e-5, atol=1e-5)


def test_saved_tensor_hooks_leave_4bit_weights_alone(tmp_path):
    """Under saved-tensor hooks that copy what is saved (as torch's save_on_cpu does from a GPU, or activation
    offloading), the nodes still read the 4-bit weights they were given: a copy would be a plain uint8 tensor
    without its quant_state."""
    ref = qlora(quantized("qwen3", tmp_path))
    model = qlora(quantized("qwen3", tmp_path))
    bastile.apply(model=model)
    data = batches(1, 1, 2, 48, "cpu", ignore_fraction=0.1)
    want = first_grads(ref, data)
    copy = lambda t: torch.empty(t.shape, dtype=t.dtype).copy_(t)
    with torch.autograd.graph.saved_tensors_hooks(copy, lambda t: t):
        got = first_grads(model, data)
    assert_params_close(got, want, 1e-3)


def test_trl_sft_on_a_4bit_model_with_packing(tmp_path):
    """TRL's SFTTrainer(peft_config=...) on a 4-bit model (TRL prepares it for k-bit training), packed rows:
    the logs of TRL alone."""
    trl = pytest.importorskip("trl")
    from test_trl import COMMON, assert_same_logs, dataset, tokenizer

    def logs():
        t = trl.SFTTrainer(quantized("llama", tmp_path), processing_class=tokenizer(), train_dataset=dataset("sft"),
                           args=trl.SFTConfig(max_length=64, packing=True, output_dir=str(tmp_path / "out"), **COMMON),
                           peft_config=LoraConfig(r=4, lora_alpha=8, task_type="CAUSAL_LM", target_modules=SEVEN))
        torch.manual_seed(0)
        t.train()
        if bastile.get_patched_ops():
            assert_all_fused(t.model)
        return [{k: v for k, v in e.items() if k in ("loss", "grad_norm")} for e in t.state.log_history if "loss" in e]

    want = logs()
    bastile.apply()
    assert_same_logs(logs(), want)


@pytest.mark.parametrize("targets", ["experts", "all-linear"])
@pytest.mark.parametrize("family", ["qwen3_moe", "gpt_oss", "mixtral"])
def test_moe_training_matches_peft_cpu(family, targets, tmp_path, peft_forwards):
    """QLoRA of a mixture of experts as users load one: bitsandbytes quantizes the Linear layers (the attention),
    not the experts' 3-D parameters nor the router's, which stay in the model's dtype. The 4-bit projections run
    in the fused nodes and the experts (with their adapters) on the expert path (the router's, all-linear, as
    W + delta): PEFT's 4-bit LoRA forward never runs, step 1's adapter gradients within 1e-3 and 4 AdamW steps'
    losses within 1e-4 of PEFT's on the same quantized model."""
    config = (dict(r=4, lora_alpha=8, target_modules="all-linear", init_lora_weights=False) if targets == "all-linear"
              else EXPERT_LORA)

    def peft_model():
        model = quantized(family, tmp_path)
        torch.manual_seed(1)
        return get_peft_model(model, LoraConfig(**config))

    ref, model = peft_model(), peft_model()
    assert isinstance(model.base_model.model.model.layers[0].self_attn.q_proj, peft_bnb.Linear4bit)
    data = batches(1, 1, 2, 48, "cpu", ignore_fraction=0.1) * 4
    want = first_grads(ref, data)
    ref_losses = train(ref, data, LR)
    bastile.apply(model=model)
    report = bastile.lora_modules(model)
    assert set(report.values()) <= {"fused", WEIGHT_PLUS_DELTA}, report
    # (PEFT's all-linear wraps GPT-OSS's experts in no ParamWrapper)
    assert any(n.endswith("mlp.experts") for n in report) == (targets == "experts" or family != "gpt_oss"), report
    peft_forwards.clear()
    assert_params_close(first_grads(model, data), want, 1e-3)
    with Dispatched() as dispatched:
        losses = train(model, data, LR)
    assert not peft_forwards, "PEFT's LoRA forward ran"
    assert {"dequantize_4bit", "expert_combine"} <= dispatched.ops
    assert_losses_close(losses, ref_losses, 1e-4, f"{family} {targets}")
    assert_params_close(adapters(model), adapters(ref), 1e-3)


def test_int8_bases_keep_peft_path(tmp_path):
    """LLM.int8 (Linear8bitLt) base layers are reported with the reason and run PEFT's forward."""
    ref = qlora(quantized("qwen3", tmp_path, bits=8))
    model = qlora(quantized("qwen3", tmp_path, bits=8))
    bastile.apply(model=model)
    report = bastile.lora_modules(model)
    assert set(report.values()) == {"LLM.int8 base layer (bitsandbytes Linear8bitLt): not fused"}, report
    data = batches(1, 1, 2, 48, "cpu", ignore_fraction=0.1) * 3
    assert_losses_close(train(model, data, LR), train(ref, data, LR), 1e-5)


@needs_cuda
@pytest.mark.parametrize("quant_type,nested", [("nf4", True), ("fp4", False)])
def test_training_matches_peft_cuda_bf16(quant_type, nested, tmp_path, peft_forwards):
    ref = qlora(quantized("qwen3", tmp_path, quant_type, nested, "cuda", torch.bfloat16))
    model = qlora(quantized("qwen3", tmp_path, quant_type, nested, "cuda", torch.bfloat16))
    data = batches(1, 1, 2, 64, "cuda", ignore_fraction=0.1) * STEPS
    ref_losses = train(ref, data, LR)
    bastile.apply(model=model)
    assert_all_fused(model)
    peft_forwards.clear()
    assert_losses_close(train(model, data, LR), ref_losses, 1e-2)
    assert not peft_forwards
