"""bastile.apply()/reset() on HF models: identical losses and gradients, exact restoration."""
import copy

import pytest
import torch
from transformers import Qwen3Config, Qwen3ForCausalLM
from transformers.models.llama import modeling_llama
from transformers.models.qwen3 import modeling_qwen3

import bastile
from conftest import DEVICES


def tiny_qwen3(seed=0, **kw):
    torch.manual_seed(seed)
    cfg = Qwen3Config(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=128,
                      attn_implementation="eager", **kw)
    return Qwen3ForCausalLM(cfg)


def test_apply_reset_round_trip_restores_original_objects():
    originals = {cls: cls.__dict__["forward"] for cls in (modeling_qwen3.Qwen3RMSNorm, modeling_llama.LlamaRMSNorm)}
    names = bastile.apply()
    assert {"rms_norm_qwen3", "rms_norm_llama", "rms_norm_qwen2", "rms_norm_mistral"} <= set(names)
    assert bastile.get_patched_ops() == sorted(names)
    assert modeling_qwen3.Qwen3RMSNorm.forward is not originals[modeling_qwen3.Qwen3RMSNorm]
    assert bastile.apply() == names  # twice is harmless
    assert bastile.reset(["rms_norm_llama"]) == ["rms_norm_llama"]
    assert modeling_llama.LlamaRMSNorm.__dict__["forward"] is originals[modeling_llama.LlamaRMSNorm]
    assert "rms_norm_llama" not in bastile.get_patched_ops()
    bastile.reset()
    assert bastile.get_patched_ops() == []
    for cls, fwd in originals.items():
        assert cls.__dict__["forward"] is fwd
    with pytest.raises(ValueError, match="not active"):
        bastile.reset(["rms_norm_qwen3"])


def test_apply_selects_by_model_and_rejects_unknown():
    model = tiny_qwen3()
    assert bastile.apply(model=model) == ["rms_norm_qwen3"]
    assert bastile.apply(rms_norm=False) == []

    class Other:
        class config:
            model_type = "gpt2"

    with pytest.raises(ValueError, match="supported: llama, mistral, qwen2, qwen3"):
        bastile.apply(model=Other())
    assert bastile.get_patched_ops() == ["rms_norm_qwen3"]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("apply_before_build", [True, False])
def test_tiny_qwen3_same_loss_and_gradients(device, apply_before_build):
    ref = tiny_qwen3().to(device)
    ids = torch.randint(0, 512, (2, 24), device=device)
    ref_loss = ref(input_ids=ids, labels=ids).loss
    ref_loss.backward()
    if apply_before_build:
        bastile.apply()
        model = tiny_qwen3().to(device)
    else:
        model = copy.deepcopy(ref)
        model.zero_grad()
        bastile.apply(model=model)
    loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    assert abs(loss.item() - ref_loss.item()) <= 1e-5 * abs(ref_loss.item())
    for (name, p), (_, q) in zip(model.named_parameters(), ref.named_parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-4, atol=1e-6, msg=name)
    # The patched model really runs Bastile: every norm's forward is ours.
    assert all(type(m).forward is modeling_qwen3.Qwen3RMSNorm.forward for m in model.modules()
               if isinstance(m, modeling_qwen3.Qwen3RMSNorm))
    assert modeling_qwen3.Qwen3RMSNorm.forward.__module__ == "bastile.patch"
