"""Every supported family other than Qwen3 (tests/test_qwen3_training.py), as a mini random-init model
trained patched and unpatched from the same seed, and generating patched and unpatched.

CPU (fp32, in CI): per-step loss within 1e-5 relative over 20 AdamW steps, parameters within 1e-4;
greedy generation gives the same tokens. CUDA (bf16): losses within 1e-2 relative.
"""
import copy

import pytest
import torch
import transformers

import bastile
from conftest import needs_cuda
from test_qwen3_training import assert_params_close, batches, train

COMMON = dict(vocab_size=2048, hidden_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
              max_position_embeddings=256, tie_word_embeddings=False, attn_implementation="sdpa")
CONFIGS = {
    "llama": ("LlamaConfig", "LlamaForCausalLM", dict(intermediate_size=256)),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM", dict(intermediate_size=256)),
    "mistral": ("MistralConfig", "MistralForCausalLM", dict(intermediate_size=256, head_dim=32)),
    # router aux loss on, so that the patched forward must add it as HF does; layer 1 is a dense MLP
    "qwen3_moe": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM",
                  dict(head_dim=32, moe_intermediate_size=64, num_experts=8, num_experts_per_tok=2,
                       output_router_logits=True, router_aux_loss_coef=0.01, norm_topk_prob=True,
                       intermediate_size=256, mlp_only_layers=[1])),
    "gpt_oss": ("GptOssConfig", "GptOssForCausalLM",
                dict(head_dim=32, intermediate_size=64, num_local_experts=4, num_experts_per_tok=2,
                     output_router_logits=True, sliding_window=16, layer_types=["sliding_attention", "full_attention"],
                     attn_implementation="eager")),  # sdpa lacks GPT-OSS's attention sinks
}
FAMILIES = list(CONFIGS)
# Qwen3's own training tests use a larger model (test_qwen3_training.py); this one is for the LoRA tests.
MINI = {**CONFIGS, "qwen3": ("Qwen3Config", "Qwen3ForCausalLM", dict(intermediate_size=256, head_dim=32))}
LR = 2e-3  # the tiny models learn within 20 steps (the loss falls from ln(vocab))


def mini(family, device, dtype, seed=0, **overrides):
    config_cls, model_cls, extra = MINI[family]
    torch.manual_seed(seed)
    cfg = getattr(transformers, config_cls)(**{**COMMON, **extra, **overrides})
    model = getattr(transformers, model_cls)(cfg)
    return model.to(device=device, dtype=dtype).train()


# Modules of each mini model that a patch must reach, with the replacement their class must then carry.
def _reached(model):
    family, layers = model.config.model_type, model.model.layers
    if family == "qwen3_moe":
        return [(layers[1].mlp, "forward", bastile.hf.swiglu_mlp_forward),  # the mlp_only layer
                (layers[0].mlp.experts, "_apply_gate", bastile.hf.swiglu_apply_gate),
                (model.model.norm, "forward", bastile.hf.rms_norm_forward)]
    if family == "gpt_oss":
        return [(model.model.norm, "forward", bastile.hf.rms_norm_cast_after_weight_forward),
                (layers[0].input_layernorm, "forward", bastile.hf.rms_norm_cast_after_weight_forward),
                (layers[0].mlp.experts, "_apply_gate", bastile.hf.gpt_oss_apply_gate)]
    return []


def patched_copy(ref, family):
    model = copy.deepcopy(ref)
    names = bastile.apply(model=model, log_probs=False)
    assert names and all(n.endswith("_" + family) for n in names)
    for module, attr, replacement in _reached(model):
        assert getattr(type(module), attr) is replacement, (type(module).__name__, attr)
    return model, names


@pytest.fixture(autouse=True)
def _restore():
    yield
    bastile.reset()


@pytest.mark.parametrize("family", FAMILIES)
def test_training_matches_hf_cpu_fp32(family):
    ref = mini(family, "cpu", torch.float32)
    data = batches(20, 1, 2, 48, "cpu", ignore_fraction=0.1)
    ref_losses = train(ref, data, LR)
    bastile.reset()
    model, names = patched_copy(mini(family, "cpu", torch.float32), family)
    # Training with labels goes through the fused cross-entropy: no logits are formed.
    ids, labels = data[0][0]
    assert model(input_ids=ids, labels=labels).logits is None
    model.zero_grad(set_to_none=True)
    model.load_state_dict(mini(family, "cpu", torch.float32).state_dict())
    losses = train(model, data, LR)
    for step, (a, b) in enumerate(zip(losses, ref_losses)):
        assert abs(a - b) <= 1e-5 * abs(b), f"{family} step {step}: {a} vs {b}"
    assert ref_losses[-1] < ref_losses[0]  # it learned something: the comparison is not of constants
    # Adam turns last-bit gradient differences of near-zero elements into whole steps: in norm, not per element.
    assert_params_close(model, ref, 5e-4)


@pytest.mark.parametrize("family", FAMILIES)
def test_generation_matches_hf(family):
    ref = mini(family, "cpu", torch.float32).eval()
    ref.config.output_router_logits = False  # HF's own generate fails with it (the mask covers the whole cache)
    prompt = torch.randint(0, COMMON["vocab_size"], (2, 12), generator=torch.Generator().manual_seed(3))
    kw = dict(max_new_tokens=6, do_sample=False, pad_token_id=0)
    expected = ref.generate(prompt, **kw)
    model, _ = patched_copy(ref, family)
    torch.testing.assert_close(model.generate(prompt, **kw), expected, rtol=0, atol=0)


def test_families_patch_the_ops_they_list():
    """Each family's patches replace what they name, and reset puts the originals back."""
    for family in FAMILIES:
        before = {p.name for p in bastile.patch.PATCHES if p.family == family}
        names = bastile.apply(families=[family], log_probs=False)
        assert set(names) == set(before), family
        for name in names:
            replaced = bastile.patch._active[name]
            targets = [p for p in bastile.patch.PATCHES if p.name == name]
            assert len(replaced) == len(targets), name
            for (owner, attr, original), patch in zip(replaced, targets):
                if isinstance(patch.replacement, bastile.patch.Wrap):  # made from the original, around it
                    assert getattr(owner, attr).__wrapped__ is original, (name, patch.target)
                else:
                    assert getattr(owner, attr) is patch.replacement, (name, patch.target)
        bastile.reset()
    assert bastile.get_patched_ops() == []


def test_mini_models_have_what_the_patches_target():
    """The mini configs build the modules the multi-target patches are for (else the training tests
    would not exercise them)."""
    moe = mini("qwen3_moe", "cpu", torch.float32)
    assert type(moe.model.layers[0].mlp).__name__ == "Qwen3MoeSparseMoeBlock"
    assert type(moe.model.layers[1].mlp).__name__ == "Qwen3MoeMLP"
    assert type(mini("gpt_oss", "cpu", torch.float32).model.norm).__name__ == "GptOssRMSNorm"


@needs_cuda
@pytest.mark.parametrize("family", FAMILIES)
def test_training_matches_hf_cuda_bf16(family):
    ref = mini(family, "cuda", torch.bfloat16)
    data = batches(20, 1, 2, 48, "cuda", ignore_fraction=0.1)
    model = copy.deepcopy(ref)
    ref_losses = train(ref, data, LR)
    bastile.apply(model=model)
    losses = train(model, data, LR)
    for step, (a, b) in enumerate(zip(losses, ref_losses)):
        assert abs(a - b) <= 1e-2 * abs(b), f"{family} step {step}: {a} vs {b}"
