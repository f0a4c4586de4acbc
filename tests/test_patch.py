"""bastile.apply()/reset() on HF models: identical losses, gradients and outputs; exact restoration."""
import copy

import pytest
import torch
import transformers
from transformers import LlamaConfig, LlamaForCausalLM, Qwen3Config, Qwen3ForCausalLM
from transformers.models.llama import modeling_llama
from transformers.models.qwen3 import modeling_qwen3
from transformers.models.qwen3_moe import modeling_qwen3_moe

import bastile
from bastile.families import Mlp
from conftest import CUDA, DEVICES, EXPERTS_PATCHES, NO_TRAINERS, TRAINER_PATCHES, patch_names

ROLES = ["norm", "mlp", "attention", "decoder", "head"]
# What the patches replace, read before any test patches anything.
TARGETS = {
    (modeling_qwen3.Qwen3RMSNorm, "forward"), (modeling_qwen3.Qwen3MLP, "forward"),
    (modeling_qwen3.Qwen3Attention, "forward"), (modeling_qwen3.Qwen3ForCausalLM, "forward"),
    (modeling_llama.LlamaRMSNorm, "forward"), (modeling_llama.LlamaMLP, "forward"),
    (modeling_llama.LlamaAttention, "forward"), (modeling_llama.LlamaForCausalLM, "forward"),
    (modeling_qwen3.Qwen3Model, "forward"), (modeling_llama.LlamaModel, "forward"),
    (modeling_qwen3.Qwen3DecoderLayer, "forward"), (modeling_llama.LlamaDecoderLayer, "forward"),
}
ORIGINALS = {(owner, attr): owner.__dict__[attr] for owner, attr in TARGETS}


def tiny_qwen3(seed=0, attn="eager", **kw):
    torch.manual_seed(seed)
    cfg = Qwen3Config(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=128,
                      attn_implementation=attn, **kw)
    return Qwen3ForCausalLM(cfg)


def tiny_llama(seed=0):
    torch.manual_seed(seed)
    cfg = LlamaConfig(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
                      attn_implementation="sdpa")
    return LlamaForCausalLM(cfg)


def test_apply_reset_round_trip_restores_original_objects():
    names = bastile.apply()
    assert sorted(names) == sorted([f"{role}_{fam}" for role in ROLES for fam in bastile.supported_families()]
                                   + TRAINER_PATCHES + EXPERTS_PATCHES)
    assert bastile.get_patched_ops() == sorted(names)
    for owner, attr in TARGETS:
        assert owner.__dict__[attr] is not ORIGINALS[owner, attr], (owner, attr)
    assert bastile.apply() == names  # twice is harmless
    assert bastile.reset(["attention_llama"]) == ["attention_llama"]
    assert modeling_llama.LlamaAttention.__dict__["forward"] is ORIGINALS[modeling_llama.LlamaAttention, "forward"]
    assert "attention_llama" not in bastile.get_patched_ops()
    assert bastile.reset(["rope_qwen3"]) == ["attention_qwen3"]  # the kernel-named alias of earlier releases
    assert modeling_qwen3.Qwen3Attention.__dict__["forward"] is ORIGINALS[modeling_qwen3.Qwen3Attention, "forward"]
    bastile.reset()
    assert bastile.get_patched_ops() == []
    for (owner, attr), original in ORIGINALS.items():
        assert owner.__dict__[attr] is original, (owner, attr)


# mlp_qwen3_moe has two targets: the dense MLP of mlp_only layers and the experts.
MOE_MLP = [(modeling_qwen3_moe.Qwen3MoeMLP, "forward"), (modeling_qwen3_moe.Qwen3MoeExperts, "forward"),
           (modeling_qwen3_moe.Qwen3MoeTopKRouter, "forward")]
MOE_ORIGINALS = {t: t[0].__dict__[t[1]] for t in MOE_MLP}
ONLY_MLP = dict(norm=False, attention=False, head=False, decoder=False, **NO_TRAINERS)


def replacement(name, target):
    return next(p.replacement for p in bastile.patch.PATCHES if p.name == name and p.target == target)


def test_multi_target_role_applies_and_resets_as_one_name():
    assert sorted(bastile.apply(families=["qwen3_moe"], **ONLY_MLP)) == patch_names("qwen3_moe", ["mlp"])
    assert bastile.get_patched_ops() == patch_names("qwen3_moe", ["mlp"])
    assert modeling_qwen3_moe.Qwen3MoeExperts.forward.__name__ == "mlp.experts[qwen3_moe]"
    assert modeling_qwen3_moe.Qwen3MoeTopKRouter.forward.__name__ == "mlp.router[qwen3_moe]"
    assert modeling_qwen3_moe.Qwen3MoeMLP.forward is replacement("mlp_qwen3_moe", "Qwen3MoeMLP.forward")
    assert sorted(bastile.apply(families=["qwen3_moe"], **ONLY_MLP)) == patch_names("qwen3_moe", ["mlp"])  # twice is harmless
    assert bastile.reset(["mlp_qwen3_moe", *EXPERTS_PATCHES]) == ["mlp_qwen3_moe", *EXPERTS_PATCHES]
    for (owner, attr), original in MOE_ORIGINALS.items():
        assert owner.__dict__[attr] is original, (owner, attr)
    assert bastile.get_patched_ops() == []


@pytest.mark.parametrize("first", ["head_mistral", "head_ministral3"])
def test_a_wrapper_of_two_families_is_held_by_both(first):
    """Mistral 3's multimodal head, declared by the mistral and ministral3 families: patched once, held by both
    patches, Bastile's while either is active and HF's again when the last is reset, in either order."""
    from transformers.models.mistral3 import modeling_mistral3
    cls = modeling_mistral3.Mistral3ForConditionalGeneration
    original = cls.__dict__["forward"]
    bastile.apply(families=["mistral", "ministral3"], head=True, norm=False, mlp=False, attention=False,
                  decoder=False, **NO_TRAINERS)
    patched = cls.__dict__["forward"]
    assert patched is not original and patched.__name__ == "head.forward[mistral]"
    second = ({"head_mistral", "head_ministral3"} - {first}).pop()
    assert bastile.reset([first]) == [first]
    assert cls.__dict__["forward"] is patched
    assert bastile.reset([second]) == [second]
    assert cls.__dict__["forward"] is original
    assert bastile.get_patched_ops() == []


def test_multi_target_role_missing_one_target(monkeypatch):
    """With a model, a missing target refuses the whole call; without, the targets present are patched
    under the one name and reset restores exactly them."""
    from test_families import mini
    model = mini("qwen3_moe", "cpu", torch.float32)
    monkeypatch.delattr(modeling_qwen3_moe, "Qwen3MoeExperts")  # the model holds the class; the module lacks it
    with pytest.raises(RuntimeError, match=r"mlp_qwen3_moe \(Qwen3MoeExperts.forward\)"):
        bastile.apply(model=model)
    assert bastile.get_patched_ops() == []
    assert modeling_qwen3_moe.Qwen3MoeMLP.__dict__["forward"] is MOE_ORIGINALS[MOE_MLP[0]]
    assert sorted(bastile.apply(families=["qwen3_moe"], **ONLY_MLP)) == patch_names("qwen3_moe", ["mlp"])
    assert len(bastile.patch._active["mlp_qwen3_moe"]) == 2
    assert modeling_qwen3_moe.Qwen3MoeMLP.forward is replacement("mlp_qwen3_moe", "Qwen3MoeMLP.forward")
    assert modeling_qwen3_moe.Qwen3MoeTopKRouter.forward is replacement("mlp_qwen3_moe", "Qwen3MoeTopKRouter.forward")
    bastile.reset()
    monkeypatch.undo()
    for (owner, attr), original in MOE_ORIGINALS.items():
        assert owner.__dict__[attr] is original, (owner, attr)


def test_transformers_outside_the_tested_range(monkeypatch, recwarn):
    """Below the tested releases apply() refuses before patching; above them it patches and warns once per
    release; within them (a patch release of the newest too) it is silent."""
    from bastile.versions import TRANSFORMERS_NEWEST, TRANSFORMERS_OLDEST
    major, minor = map(int, TRANSFORMERS_OLDEST.split(".")[:2])
    monkeypatch.setattr(transformers, "__version__", f"{major}.{minor - 1}.3")
    with pytest.raises(RuntimeError, match=rf"transformers {major}\.{minor - 1}\.3 is older .*nothing was patched"):
        bastile.apply()
    assert bastile.get_patched_ops() == []
    newest_major, newest_minor = map(int, TRANSFORMERS_NEWEST.split(".")[:2])
    for within in (TRANSFORMERS_OLDEST, f"{newest_major}.{newest_minor}.9.dev0"):
        monkeypatch.setattr(transformers, "__version__", within)
        assert bastile.apply(families="qwen3", **ONLY_MLP) == ["mlp_qwen3"]
    assert not [w for w in recwarn if "bastile" in str(w.message)]
    newer = f"{newest_major}.{newest_minor + 1}.0"
    monkeypatch.setattr(transformers, "__version__", newer)
    assert bastile.apply(families="qwen3", **ONLY_MLP) == ["mlp_qwen3"]
    assert bastile.apply(families="llama", **ONLY_MLP) == ["mlp_llama"]
    warned = [str(w.message) for w in recwarn if "bastile" in str(w.message)]
    assert len(warned) == 1 and f"transformers {newer} is newer" in warned[0], warned


def test_apply_selects_roles_and_model_and_rejects_unknown():
    model = tiny_qwen3()
    assert bastile.apply(model=model, mlp=False, head=False, decoder=False) == [
        "norm_qwen3", "attention_qwen3"] + TRAINER_PATCHES
    assert bastile.apply(norm=False, mlp=False, attention=False, head=False, decoder=False) == TRAINER_PATCHES
    bastile.reset(TRAINER_PATCHES)
    # the kernel-named keywords of earlier releases select their roles
    assert bastile.apply(families=["llama"], rms_norm=False, decoder=False, **NO_TRAINERS) == [
        "mlp_llama", "attention_llama", "head_llama"]
    with pytest.raises(ValueError, match="disagree, but they name one part of the 'mlp' role, its experts"):
        bastile.apply(moe=True, geglu=False)

    class Other:
        class config:
            model_type = "gpt2"

    with pytest.raises(ValueError, match="supported: ernie4_5, ernie4_5_moe, gemma, gemma2, gemma3, gemma3_text, gemma4, gemma4_text, glm4, glm4_moe, gpt_oss, granite, "
                                         "granitemoe, lfm2, lfm2_moe, llama, ministral3, mistral, mistral3, mixtral, olmo2, olmo3, olmoe, phi3, "
                                         "qwen2, qwen2_5_vl, qwen2_5_vl_text, qwen2_moe, qwen2_vl, qwen2_vl_text, qwen3, qwen3_5, qwen3_5_moe, qwen3_5_moe_text, qwen3_5_text, qwen3_moe, qwen3_next, qwen3_vl, qwen3_vl_moe, "
                                         "qwen3_vl_moe_text, qwen3_vl_text, smollm3"):
        bastile.apply(model=Other())
    with pytest.raises(ValueError, match="unknown families"):
        bastile.apply(families=["gpt2"])
    assert bastile.get_patched_ops() == ["attention_llama", "attention_qwen3", "head_llama", "mlp_llama", "norm_qwen3"]


def test_turning_one_role_off_leaves_the_others():
    """Roles are disjoint: each keyword switches its own targets only (the attention keeps its LoRA nodes
    and varlen kernel whatever the MLP or norms do, and the other way round)."""
    for role in ROLES:
        names = bastile.apply(families="llama", **NO_TRAINERS, **{role: False})
        assert sorted(names) == sorted(f"{r}_llama" for r in ROLES if r != role)
        bastile.reset()


def same_loss_and_grads(make, device, apply_before_build, **apply_kw):
    ref = make().to(device).train()
    ids = torch.randint(0, 512, (2, 24), device=device)
    labels = ids.clone()
    labels[0, :5] = -100
    ref_loss = ref(input_ids=ids, labels=labels).loss
    ref_loss.backward()
    if apply_before_build:
        bastile.apply(**apply_kw)
        model = make().to(device).train()
    else:
        model = copy.deepcopy(ref)
        model.zero_grad()
        bastile.apply(model=model, **apply_kw)
    out = model(input_ids=ids, labels=labels)
    out.loss.backward()
    assert out.logits is None  # training with labels: the logits are never formed
    assert abs(out.loss.item() - ref_loss.item()) <= 1e-5 * abs(ref_loss.item())
    for (name, p), (_, q) in zip(model.named_parameters(), ref.named_parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-4, atol=1e-6, msg=name)
    return model


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("apply_before_build", [True, False])
def test_tiny_qwen3_same_loss_and_gradients(device, apply_before_build):
    model = same_loss_and_grads(tiny_qwen3, device, apply_before_build)
    # The patched model really runs Bastile.
    assert type(model).forward.__module__ == "bastile.roles.head"
    for m in model.modules():
        if isinstance(m, (modeling_qwen3.Qwen3RMSNorm, modeling_qwen3.Qwen3MLP, modeling_qwen3.Qwen3Attention)):
            assert type(m).forward.__module__.startswith("bastile.roles.")


@pytest.mark.parametrize("device", DEVICES)
def test_tiny_llama_same_loss_and_gradients(device):
    same_loss_and_grads(tiny_llama, device, True)
    assert modeling_llama.LlamaAttention.forward.__module__ == "bastile.roles.attention"


@pytest.mark.parametrize("device", DEVICES)
def test_inference_outputs_match_hf(device):
    """Without labels (or in eval mode) the patched forward is HF's: logits, tuples, logits_to_keep,
    the loss in evaluation, and generation."""
    ref = tiny_qwen3().to(device).eval()
    model = copy.deepcopy(ref)
    bastile.apply(model=model)
    ids = torch.randint(0, 512, (2, 16), device=device)
    with torch.no_grad():
        a, b = model(input_ids=ids), ref(input_ids=ids)
        torch.testing.assert_close(a.logits, b.logits, rtol=1e-5, atol=1e-5)
        a, b = model(input_ids=ids, labels=ids), ref(input_ids=ids, labels=ids)
        torch.testing.assert_close(a.logits, b.logits, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(a.loss, b.loss, rtol=1e-5, atol=0)
        t = model(input_ids=ids, return_dict=False, logits_to_keep=1)
        assert isinstance(t, tuple) and t[0].shape == (2, 1, 512)
        torch.testing.assert_close(t[0], b.logits[:, -1:], rtol=1e-5, atol=1e-5)
    kw = dict(max_new_tokens=6, do_sample=False, pad_token_id=0)
    assert torch.equal(model.generate(ids, **kw), ref.generate(ids, **kw))


@pytest.mark.parametrize("family", ["qwen3", "qwen3_moe"])
def test_training_tuple_has_hf_layout(family):
    """return_dict=False in training with labels: HF's tuple, with None where HF has the logits (the fused
    loss makes none), so `loss, logits = out[:2]` never binds the cache or the router's logits. (A cache is
    asked for: a training forward makes none unless asked, tests/test_families.py says why.)"""
    from test_families import mini
    ref = mini(family, "cpu", torch.float32)
    ids = torch.randint(0, 512, (2, 16))
    kw = dict(input_ids=ids, labels=ids, return_dict=False, use_cache=True, output_router_logits=family == "qwen3_moe")
    b = ref(**kw)
    bastile.apply(model=ref)
    a = ref(**kw)
    logits_at = 2 if family == "qwen3_moe" else 1  # after the MoE aux loss
    assert len(a) == len(b) and a[logits_at] is None and b[logits_at].shape == (2, 16, ref.config.vocab_size)
    torch.testing.assert_close(a[0], b[0], rtol=1e-5, atol=0)
    assert [type(t) for i, t in enumerate(a) if i != logits_at] == [type(t) for i, t in enumerate(b) if i != logits_at]


def test_custom_loss_function_is_respected():
    model = tiny_qwen3().train()
    model.loss_function = lambda logits, labels, vocab_size, **kw: logits.float().mean() * 0 + 42.0
    bastile.apply(model=model)
    ids = torch.randint(0, 512, (1, 8))
    out = model(input_ids=ids, labels=ids)
    assert out.loss.item() == 42.0 and out.logits is not None


@pytest.mark.parametrize("how", ["hook", "replaced forward", "zero3 placeholder"])
def test_hooked_lm_head_runs_as_hf(how):
    """The fused loss never calls lm_head, so a head whose forward is hooked or replaced (a user's hook,
    accelerate's offloading) runs HF's head and loss, with a warning: the hook sees the logits. So does a
    DeepSpeed ZeRO-3 head whose weight is still the empty placeholder (here a stand-in: the weight filled
    by a pre-hook and emptied after the forward, as ZeRO-3 does); tests/test_distributed.py has the real
    ZeRO-3, where the weight is gathered and the fused loss runs."""
    ref = tiny_qwen3().train()
    model = copy.deepcopy(ref)
    bastile.apply(model=model)
    seen = []
    for m in (ref, model):
        if how == "hook":
            m.lm_head.register_forward_hook(lambda mod, args, out: seen.append(out.shape))
        elif how == "replaced forward":
            m.lm_head.forward = lambda x, head=m.lm_head: seen.append(x.shape) or torch.nn.Linear.forward(head, x)
        else:
            full, head = m.lm_head.weight.data, m.lm_head
            head.weight.ds_id, head.weight.data = 0, torch.empty(0)
            head.register_forward_pre_hook(lambda mod, args: setattr(mod.weight, "data", full))
            head.register_forward_hook(lambda mod, args, out: seen.append(out.shape)
                                       or setattr(mod.weight, "data", torch.empty(0)))
    ids = torch.randint(0, 512, (2, 12))
    with pytest.warns(UserWarning, match="lm_head.s forward is hooked or replaced"):
        out = model(input_ids=ids, labels=ids)
    expected = ref(input_ids=ids, labels=ids)
    assert len(seen) == 2 and out.logits is not None
    torch.testing.assert_close(out.loss, expected.loss, rtol=1e-5, atol=0)


def test_warmup_and_clear_cache():
    bastile.clear_autotune_cache()
    x, w = torch.randn(3, 8), torch.randn(8)
    torch.testing.assert_close(bastile.rms_norm(x, w), w * x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6))
    if not CUDA:
        return
    bastile.warmup_all_kernels()
    bastile.warmup_all_kernels(torch.device("cuda", 0))
    x, w = x.cuda(), w.cuda()
    y = bastile.rms_norm(x, w)
    bastile.clear_autotune_cache()
    torch.testing.assert_close(bastile.rms_norm(x, w), y, rtol=0, atol=0)


@pytest.mark.parametrize("attn", ["sdpa", "eager"])
def test_patched_training_step_compiles_without_graph_breaks(attn):
    """torch.compile(fullgraph=True) raises on any graph break, so the patched forwards must be traceable."""
    bastile.apply()
    model = tiny_qwen3(attn=attn).train()
    ids = torch.randint(0, 512, (2, 16))
    ref = model(input_ids=ids, labels=ids).loss
    loss = torch.compile(lambda x: model(input_ids=x, labels=x).loss, fullgraph=True, dynamic=False)(ids)
    torch.testing.assert_close(loss, ref, rtol=1e-5, atol=0)


@pytest.mark.parametrize("compiled", [False, True])
def test_unmasked_training_step_gives_sdpa_is_causal(monkeypatch, compiled):
    """With no attention_mask, position_ids or cache, SDPA gets no mask and is_causal, under torch.compile
    too (where HF alone builds a [seq, seq] mask); so does a batch padded on the right, outside tracing (the
    decoder reads the mask on the host, which a compiled graph does not); in a compiled graph a left-padded batch
    reaches SDPA with its mask. (Eager, it runs as varlen spans, test_families'
    test_rows_padded_at_both_ends_run_as_spans_as_hf; here the recording SDPA would read as an engine's.)"""
    calls = []
    sdpa = torch.nn.functional.scaled_dot_product_attention

    def recording_sdpa(*args, attn_mask=None, is_causal=False, **kwargs):
        calls.append((attn_mask is None, is_causal))
        return sdpa(*args, attn_mask=attn_mask, is_causal=is_causal, **kwargs)

    monkeypatch.setattr(torch.nn.functional, "scaled_dot_product_attention", recording_sdpa)
    ref_model = tiny_qwen3(attn="sdpa").train()
    ids = torch.randint(0, 512, (2, 16))
    ref = ref_model(input_ids=ids, labels=ids).loss
    bastile.apply()
    model = tiny_qwen3(attn="sdpa").train()
    step = lambda **kw: model(input_ids=ids, labels=ids, **kw).loss
    if compiled:
        step = torch.compile(step, fullgraph=True, dynamic=False)
    calls.clear()
    torch.testing.assert_close(step(), ref, rtol=1e-5, atol=0)
    assert calls == [(True, True)] * 2  # one per layer
    right, left = torch.ones_like(ids), torch.ones_like(ids)
    right[0, -3:], left[0, :3] = 0, 0
    for padding, unmasked in [(right, not compiled)] + ([(left, False)] if compiled else []):
        calls.clear()
        step(attention_mask=padding)
        assert calls == [(unmasked, unmasked)] * 2


@pytest.mark.parametrize("device", DEVICES)
def test_mlp_recomputes_the_activation_instead_of_saving_it(device):
    """The patched MLP keeps gate and up for the backward, not the activation (as large as either), and
    its gradients are those of swiglu followed by the down projection, bit for bit."""
    mlp = tiny_qwen3().model.layers[0].mlp.to(device)
    x = torch.randn(2, 24, 64, device=device, requires_grad=True)
    grad = torch.randn(2, 24, 64, device=device)

    def run(forward):
        saved = []
        with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
            out = forward(mlp, x)
        grads = torch.autograd.grad(out, (x, *mlp.parameters()), grad)
        return out, grads, {(t.numel(), t.data_ptr()) for t in saved}

    unfused = lambda m, x: m.down_proj(bastile.swiglu(m.gate_proj(x), m.up_proj(x)))
    out, grads, saved = run(bastile.roles.mlp.mlp_forward(Mlp()))
    ref_out, ref_grads, ref_saved = run(unfused)
    assert torch.equal(out, ref_out)
    for a, b in zip(grads, ref_grads):
        assert torch.equal(a, b)
    activation_size = 2 * 24 * mlp.gate_proj.out_features
    assert sum(1 for n, _ in ref_saved if n == activation_size) == 3  # gate, up and the activation
    assert sum(1 for n, _ in saved if n == activation_size) == 2  # gate and up
