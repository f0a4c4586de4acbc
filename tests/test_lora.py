"""PEFT LoRA adapters inside the patched attention and MLP (python_shim/bastile/lora.py) against HF + PEFT.

CPU (fp32, in CI): mini models with LoRA on all seven projections, 20 AdamW steps, per-step loss within
1e-5 relative of HF + PEFT and adapters close, with and without dropout; every case that keeps PEFT's
path gives PEFT's result; PEFT workflows (save/reload, merge, checkpointing, compile). The fused nodes'
gradients against autograd of the PEFT expression in fp64. CUDA (bf16): losses within 1e-2.
"""
import copy
import functools

import pytest
import torch
from torch import nn
from torch.nn import functional as F

from peft import LoraConfig, PeftModel, get_peft_model

import bastile
from bastile import lora
from conftest import as_near_exact, needs_cuda
from bastile.families import FAMILIES as TRAITS
from test_families import NEW, in_fp64, mini, multimodal_batch, norm_recomputation, qwen2_vl_multimodal, qwen3_vl_multimodal
from test_qwen3_training import assert_params_close, batches, train

SEVEN = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
FAMILIES = ["qwen3", "llama", "qwen2", "mistral", "qwen3_moe", "gpt_oss", *NEW]  # qwen2, glm4: q/k/v with bias
ATTENTION = {"q_proj", "k_proj", "v_proj", "o_proj", "qkv_proj"}
DELTA_NET = ["in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a", "out_proj"]  # Qwen3.5's Gated DeltaNet
SHORT_CONV = ["in_proj", "out_proj"]  # LFM2's short convolution
GROUPED_DELTA_NET = ["in_proj_qkvz", "in_proj_ba", "out_proj"]  # Qwen3-Next's
LR = 1e-3
STEPS = 20  # of one batch: adapters alone learn it within them, so the losses compared are not constants


def targets(family):
    """Every linear projection of the attention (and Gated DeltaNet or short convolution) and the dense MLP (Phi-3's
    and GLM-4's fused ones), by the family's names; the MoE families' attention only (PEFT would also wrap their
    experts' parameters, which are not projections of a patched MLP)."""
    t = TRAITS[family]
    attention = ["qkv_proj"] if t.attention.fused_qkv else SEVEN[:3]
    attention += [t.attention.output] + ((GROUPED_DELTA_NET if t.grouped_projections else DELTA_NET)
                                         if t.linear_attention else []) + (SHORT_CONV if t.short_conv else [])
    mlp = ["gate_up_proj", "down_proj"] if t.mlp.fused_gate_up else list(t.mlp.projections)
    return list(dict.fromkeys(attention + ([] if t.mlp.experts and family not in DENSE_MINI else mlp)))


DENSE_MINI = {"gemma4_text"}  # MoE families whose mini has no experts (Gemma 4's enable_moe_block is off)


def with_lora(model, seed=1, **config):
    """`model` (a copy) with PEFT LoRA adapters; init_lora_weights=False gives B != 0, so the adapters
    change the outputs from the first step."""
    torch.manual_seed(seed)
    kw = dict(r=8, lora_alpha=16, lora_dropout=0.0, target_modules=SEVEN, init_lora_weights=False)
    return get_peft_model(copy.deepcopy(model), LoraConfig(**{**kw, **config}))


def adapters(model):
    return {n: p for n, p in model.named_parameters() if "lora_" in n}


def assert_losses_close(losses, ref, tol, what="", exact=None):
    """Each step's loss within `tol` of the reference's; `exact`: a function giving the reference's losses in
    fp64, to which a step farther apart than that is held instead (as_near_exact)."""
    for step, (a, b) in enumerate(zip(losses, ref)):
        if exact is not None and abs(a - b) > tol * abs(b):
            e = exact()[step]
            assert as_near_exact(a, b, e), f"{what} step {step}: {a} vs {b}, in fp64 {e}"
            continue
        assert abs(a - b) <= tol * abs(b), f"{what} step {step}: {a} vs {b}"
    assert ref[-1] < ref[0]  # it learned: the comparison is not of constants


def train_seeded(model, data, seed=7):
    torch.manual_seed(seed)  # the dropout masks
    return train(model, data, LR)


def fused_names(model):
    return {n for n, why in bastile.lora_modules(model).items() if why == "fused"}


# Gemma 2 without its final-logit softcap: with both softcaps its 20 steps amplify rounding noise past the
# tolerances (first-step gradients agree as Llama's, to 2.5e-6; the losses, to 1.6e-5 by step 20, and to
# 3e-7 without that softcap). The head's softcap is compared with HF's in test_families.py.
QUIET = {"gemma2": dict(final_logit_softcapping=None)}
# Gemma 4's mini (attention scaled by 1 over normed q and k) is chaotic over 20 steps: HF's own eager and SDPA
# attention drift 1e-3 apart by step 20 while its first 6 agree to 1e-6. It is compared over those 6. Qwen3.5's
# drifts 2e-5 from its own float64 run (on the exact delta rule) by step 15, Bastile's as much, 5e-6 by step 10.
# LFM2-MoE's with dropout: at step 9 a last-bit difference sends a token to other experts (1e-7 apart before and
# after, 1.4e-5 at that step alone); it is compared over 8.
STEPS_OF = {"gemma4_text": 6, "qwen3_5_text": 10, "qwen3_5_moe_text": 10, "qwen3_next": 10, "lfm2_moe": 8}


@pytest.mark.parametrize("dropout", [0.0, 0.1])
@pytest.mark.parametrize("family", FAMILIES)
def test_training_matches_peft_cpu_fp32(family, dropout):
    ref = with_lora(mini(family, "cpu", torch.float32, **QUIET.get(family, {})), lora_dropout=dropout,
                    target_modules=targets(family))
    model, hf = copy.deepcopy(ref), copy.deepcopy(ref)
    data = batches(1, 1, 2, 48, "cpu", ignore_fraction=0.1) * STEPS_OF.get(family, STEPS)
    ref_losses = train_seeded(ref, data)
    bastile.apply(model=model)
    report = bastile.lora_modules(model)
    assert {n.rsplit(".", 1)[-1] for n in report} == set(targets(family)), report
    assert set(report.values()) == {"fused"}, report
    losses = train_seeded(model, data)

    @functools.cache
    def peft_in_fp64():  # PEFT's own steps, unpatched, for a step farther apart than 1e-5
        bastile.reset()
        return train_seeded(in_fp64(hf), data)
    # (not with dropout: its masks are drawn per dtype)
    assert_losses_close(losses, ref_losses, 1e-5, family, None if dropout else peft_in_fp64)
    assert_params_close(adapters(model), adapters(ref), 5e-4)
    # Dropout draws its masks from the RNG as PEFT does, so the same seed gives the same run.
    if dropout:
        again = copy.deepcopy(ref)
        fresh = with_lora(mini(family, "cpu", torch.float32, **QUIET.get(family, {})), lora_dropout=dropout,
                          target_modules=targets(family))
        again.load_state_dict(fresh.state_dict())
        assert train_seeded(again, data) == losses


QWEN_VL = {"qwen3_vl": qwen3_vl_multimodal, "qwen2_5_vl": lambda: qwen2_vl_multimodal("qwen2_5_vl"),
           "qwen2_vl": lambda: qwen2_vl_multimodal("qwen2_vl")}


# An image+text batch makes Qwen3-VL's mini chaotic sooner: HF's own eager and SDPA attention drift 1.6e-5 apart by
# step 17 (1.2e-6 through step 13); it is compared over 12 steps.
@pytest.mark.parametrize("model_type", list(QWEN_VL))
@pytest.mark.parametrize("image,steps", [(False, STEPS), (True, 12)], ids=["text", "image"])
def test_qwen_vl_training_matches_peft_cpu_fp32(model_type, image, steps):
    """PEFT LoRA on the seven projections of the language model of Qwen3-VL, Qwen2.5-VL or Qwen2-VL: every adapter
    there in Bastile's fused nodes, and the AdamW steps of a text-only or image+text batch as HF + PEFT's. Of the
    vision towers only Qwen2.5-VL's has modules of those names, its blocks' MLP (HF's forward): PEFT's path."""
    ref = with_lora(QWEN_VL[model_type]())
    model = copy.deepcopy(ref)
    inputs, labels = multimodal_batch(model_type, image)

    def run(net):
        opt = torch.optim.AdamW(net.parameters(), lr=LR)
        losses = []
        for _ in range(steps):
            loss = net(**inputs, labels=labels).loss
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            losses.append(loss.item())
        return losses

    ref_losses = run(ref)
    bastile.apply(model=model)
    report = bastile.lora_modules(model)
    text = {n: why for n, why in report.items() if ".language_model." in n}
    assert {n.rsplit(".", 1)[-1] for n in text} == set(SEVEN) and set(text.values()) == {"fused"}, report
    vision = {n: why for n, why in report.items() if n not in text}
    assert bool(vision) == (model_type == "qwen2_5_vl")
    assert all(".visual.blocks." in n and ".mlp." in n and why != "fused" for n, why in vision.items()), vision
    assert_losses_close(run(model), ref_losses, 1e-5, model_type)
    assert_params_close(adapters(model), adapters(ref), 5e-4)


@pytest.mark.parametrize("family", ["qwen3", "gemma3_text"])
def test_norm_outputs_are_recomputed_under_lora(family):
    """With adapters on every projection (the fused nodes save x for A's gradient), the norm outputs are not
    kept either, and the step's gradients are those of the step that keeps them."""
    model = with_lora(mini(family, "cpu", torch.float32), target_modules=targets(family))
    bastile.apply(model=model)
    (ids, labels), = batches(1, 1, 2, 48, "cpu", ignore_fraction=0.1)[0]
    kept, calls, grads, plain = norm_recomputation(model, family, ids, labels)
    assert kept == 0 and set(calls) == {1}, calls
    assert grads.keys() == plain.keys() and any("lora_A" in n for n in grads)
    for name, g in plain.items():
        assert torch.equal(grads[name], g), name


def test_gemma4_per_layer_input_projections_fuse():
    """Gemma 4's per-layer-input gate and projection (in its decoder layer) with LoRA adapters: fused (the gate
    in a projection node, the projection with the GELU-tanh product), training as PEFT's."""
    per_layer = ["per_layer_input_gate", "per_layer_projection"]
    ref = with_lora(mini("gemma4_text", "cpu", torch.float32), target_modules=SEVEN + per_layer)
    model = copy.deepcopy(ref)
    data = batches(1, 1, 2, 48, "cpu", ignore_fraction=0.1) * STEPS_OF["gemma4_text"]
    ref_losses = train_seeded(ref, data)
    bastile.apply(model=model)
    report = bastile.lora_modules(model)
    assert {n for n in report if n.rsplit(".", 1)[-1] in per_layer} and set(report.values()) == {"fused"}, report
    assert_losses_close(train_seeded(model, data), ref_losses, 1e-5, "gemma4_text")
    assert_params_close(adapters(model), adapters(ref), 5e-4)


@pytest.mark.parametrize("how", ["hook", "replaced forward"])
def test_hooked_base_layer_runs_its_module(how):
    """A projection whose base layer's forward is hooked or replaced on the instance (accelerate's
    offloading replaces it) is called as a module, which a fused node reading its weights would skip:
    the hook runs on every call and training matches PEFT's."""
    ref = with_lora(mini("qwen3", "cpu", torch.float32))
    model = copy.deepcopy(ref)
    bastile.apply(model=model)
    calls = []
    for m in (ref, model):
        base = m.base_model.model.model.layers[0].self_attn.q_proj.base_layer
        if how == "hook":
            base.register_forward_hook(lambda *_: calls.append(1))
        else:
            base.forward = lambda x, base=base: calls.append(1) or nn.Linear.forward(base, x)
    report = bastile.lora_modules(model)
    assert report["base_model.model.model.layers.0.self_attn.q_proj"] == "forward hooked or replaced", report
    data = batches(1, 1, 2, 48, "cpu", ignore_fraction=0.1) * 3
    assert_losses_close(train_seeded(model, data), train_seeded(ref, data), 1e-5)
    assert len(calls) == 2 * 3


def test_peft_default_init_and_apply_before_get_peft_model():
    """The common setup: bastile.apply() on the classes, then get_peft_model with PEFT's defaults
    (B = 0, so only the adapters' gradients tell whether the nodes run right)."""
    base = mini("qwen3", "cpu", torch.float32)
    bastile.apply()
    torch.manual_seed(1)
    model = get_peft_model(copy.deepcopy(base), LoraConfig(r=4, target_modules=SEVEN))
    bastile.reset()
    torch.manual_seed(1)
    ref = get_peft_model(copy.deepcopy(base), LoraConfig(r=4, target_modules=SEVEN))
    data = batches(1, 1, 2, 32, "cpu", ignore_fraction=0.0) * STEPS
    ref_losses = train(ref, data, LR)
    bastile.apply()
    assert len(fused_names(model)) == 14
    assert_losses_close(train(model, data, LR), ref_losses, 1e-5)
    assert_params_close(adapters(model), adapters(ref), 5e-4)


def _peft_variants():
    """(name, config, edit): setups that keep PEFT's own path for some modules, and why."""
    two = lambda m: (m.add_adapter("second", LoraConfig(r=4, target_modules=["q_proj"], init_lora_weights=False)),
                     m.base_model.set_adapter(["default", "second"]))

    def quantized(m):  # a stand-in for a bitsandbytes base layer: another Linear type under the adapter
        class QuantLinear(nn.Linear):
            pass
        proj = m.base_model.model.model.layers[0].self_attn.k_proj
        old = proj.base_layer
        proj.base_layer = QuantLinear(old.in_features, old.out_features, bias=False)
        proj.base_layer.load_state_dict(old.state_dict())
        proj.base_layer.requires_grad_(False)

    def gelu(m):  # an MLP the patched forward runs as HF's (exact GELU): its projections are modules
        for layer in m.base_model.model.model.layers:
            layer.mlp.act_fn = nn.GELU()

    return [
        ("gelu_mlp", {}, gelu, "activation GELU is neither SiLU nor GELU-tanh"),
        ("dora", dict(use_dora=True), None, "variant"),
        ("lora_bias", dict(lora_bias=True), None, "LoRA bias"),
        ("two_adapters", {}, two, "2 active adapters"),
        ("quantized_base", {}, quantized, "QuantLinear"),
        ("lm_head_and_embeddings", dict(target_modules=["lm_head", "embed_tokens", "q_proj"]), None, "not patched"),
    ]


@pytest.mark.parametrize("name,config,edit,why", _peft_variants(), ids=[v[0] for v in _peft_variants()])
def test_what_keeps_peft_path_gives_peft_result(name, config, edit, why):
    ref = with_lora(mini("qwen3", "cpu", torch.float32), **config)
    if edit:
        edit(ref)
    model = copy.deepcopy(ref)
    data = batches(1, 1, 2, 32, "cpu", ignore_fraction=0.0) * STEPS
    ref_losses = train(ref, data, LR)
    bastile.apply(model=model)
    report = bastile.lora_modules(model)
    assert any(why in r for r in report.values()), report
    assert_losses_close(train(model, data, LR), ref_losses, 1e-5, name)
    assert_params_close(adapters(model), adapters(ref), 5e-4)


def test_disabled_adapters_and_eval_give_peft_outputs():
    ref = with_lora(mini("llama", "cpu", torch.float32), lora_dropout=0.2)
    model = copy.deepcopy(ref)
    bastile.apply(model=model)
    ids = torch.randint(0, 2048, (2, 16), generator=torch.Generator().manual_seed(0))
    for m in (ref, model):
        m.eval()  # dropout off: deterministic outputs
    torch.testing.assert_close(model(input_ids=ids).logits, ref(input_ids=ids).logits, rtol=1e-5, atol=1e-5)
    with model.disable_adapter(), ref.disable_adapter():
        assert not fused_names(model)
        torch.testing.assert_close(model(input_ids=ids).logits, ref(input_ids=ids).logits, rtol=1e-5, atol=1e-5)


def test_save_reload_merge_and_checkpointing(tmp_path):
    """Adapters trained patched reload into an unpatched model with the same outputs; merge_and_unload
    gives them too; gradient checkpointing trains as without it."""
    base = mini("qwen3", "cpu", torch.float32)
    model = with_lora(base)
    bastile.apply(model=model)
    data = batches(1, 1, 2, 32, "cpu", ignore_fraction=0.0) * STEPS
    plain = copy.deepcopy(model)
    checkpointed = copy.deepcopy(model)
    checkpointed.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    assert_losses_close(train(checkpointed, data, LR), train(plain, data, LR), 1e-5, "checkpointing")
    plain.eval()
    ids = data[0][0][0]
    expected = plain(input_ids=ids).logits
    plain.save_pretrained(tmp_path)
    bastile.reset()
    reloaded = PeftModel.from_pretrained(copy.deepcopy(base), tmp_path).eval()
    torch.testing.assert_close(reloaded(input_ids=ids).logits, expected, rtol=1e-5, atol=1e-5)
    merged = reloaded.merge_and_unload()
    torch.testing.assert_close(merged(input_ids=ids).logits, expected, rtol=1e-4, atol=1e-4)


def test_compile_fullgraph_matches_eager():
    model = with_lora(mini("qwen3", "cpu", torch.float32))
    ref = copy.deepcopy(model)
    bastile.apply(model=model)
    ids = torch.randint(0, 2048, (2, 16), generator=torch.Generator().manual_seed(0))
    expected = ref(input_ids=ids, labels=ids).loss
    expected.backward()
    loss = torch.compile(model, fullgraph=True)(input_ids=ids, labels=ids).loss
    loss.backward()
    torch.testing.assert_close(loss, expected, rtol=1e-5, atol=0)
    assert_params_close({n: p.grad for n, p in adapters(model).items()},
                        {n: p.grad for n, p in adapters(ref).items()}, 1e-5)


# The nodes in fp64 against autograd of PEFT's expression: base(x) + s * B(A(dropout(x))), per projection.

def _peft_expression(x, W, b, A, B, s, p):
    drop = F.dropout(x, p) if p else x
    return F.linear(x, W, b) + F.linear(F.linear(drop, A), B) * s


def _fp64(*shape, grad=False):
    return torch.randn(*shape, dtype=torch.float64, requires_grad=grad)


@pytest.mark.parametrize("p", [0.0, 0.3])
def test_projections_node_gradients_fp64(p):
    torch.manual_seed(0)
    x = _fp64(2, 5, 24, grad=True)
    specs = [(16, 4, True), (8, 2, False), (8, None, True)]  # (out, rank or no adapter, bias)
    mods = []
    for out, rank, bias in specs:
        base = nn.Linear(24, out, bias=bias, dtype=torch.float64).requires_grad_(False)
        mods.append((base.weight, base.bias, _fp64(rank, 24, grad=True) if rank else None,
                     _fp64(out, rank, grad=True) if rank else None, 1.5 if rank else 0.0, p if rank else 0.0))
    leaves = [x] + [t for m in mods for t in m[2:4] if t is not None]
    cot = [torch.randn(2, 5, out, dtype=torch.float64) for out, _, _ in specs]

    torch.manual_seed(3)
    ref = [_peft_expression(x, *m) if m[2] is not None else F.linear(x, m[0], m[1]) for m in mods]
    ref_grads = torch.autograd.grad(ref, leaves, cot)
    torch.manual_seed(3)
    flat = x.reshape(-1, 24)
    outs = lora._Projections.apply(flat, [m[4] for m in mods], [m[5] for m in mods], *(t for m in mods for t in m[:4]))
    outs = [o.view(2, 5, -1) for o in outs]
    grads = torch.autograd.grad(outs, leaves, cot)
    for o, r in zip(outs, ref):
        torch.testing.assert_close(o, r, rtol=1e-12, atol=1e-12)
    for g, r in zip(grads, ref_grads):
        torch.testing.assert_close(g, r, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("activation", ["silu", "gelu_tanh"])
@pytest.mark.parametrize("p", [0.0, 0.3])
def test_swiglu_down_node_gradients_fp64(p, activation):
    torch.manual_seed(0)
    gate, up = _fp64(2, 5, 32, grad=True), _fp64(2, 5, 32, grad=True)
    W, b = _fp64(12, 32), _fp64(12)
    A, B = _fp64(4, 32, grad=True), _fp64(12, 4, grad=True)
    cot = torch.randn(2, 5, 12, dtype=torch.float64)
    leaves = (gate, up, A, B)
    torch.manual_seed(3)
    act = F.silu(gate) if activation == "silu" else F.gelu(gate, approximate="tanh")
    ref = _peft_expression(act * up, W, b, A, B, 0.5, p)
    ref_grads = torch.autograd.grad(ref, leaves, cot)
    torch.manual_seed(3)
    out = lora._SwiGLUDown.apply(gate, up, W, b, A, B, 0.5, p, activation)
    grads = torch.autograd.grad(out, leaves, cot)
    torch.testing.assert_close(out, ref, rtol=1e-12, atol=1e-12)
    for g, r in zip(grads, ref_grads):
        torch.testing.assert_close(g, r, rtol=1e-12, atol=1e-12)


def test_nodes_save_no_hidden_sized_tensor_per_adapter():
    """A q/k/v node keeps its input and the [tokens, 3r] products: no fp32 copy of the input, no mask."""
    model = with_lora(mini("qwen3", "cpu", torch.float32), lora_dropout=0.1)
    bastile.apply(model=model)
    attn = model.base_model.model.model.layers[0].self_attn
    x = torch.randn(2, 16, 128, requires_grad=True)
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        lora.project(x, attn.q_proj, attn.k_proj, attn.v_proj)
    activations = [t for t in saved if t.shape[0] == 32]
    assert sorted(tuple(t.shape) for t in activations) == [(32, 24), (32, 128)], [t.shape for t in activations]
    # The patched MLP: gate/up's node keeps x and [tokens, 2r]; down's keeps gate, up and [tokens, r].
    saved.clear()
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        model.base_model.model.model.layers[0].mlp(x)
    shapes = sorted(tuple(t.shape) for t in saved if t.shape[:2] == (2, 16) or t.shape[0] == 32)
    assert shapes == [(2, 16, 256), (2, 16, 256), (32, 8), (32, 16), (32, 128)], shapes


@needs_cuda
@pytest.mark.parametrize("family", FAMILIES)
def test_training_matches_peft_cuda_bf16(family):
    ref = with_lora(mini(family, "cuda", torch.bfloat16), target_modules=targets(family))  # adapters in fp32
    assert all(p.dtype == torch.float32 for p in adapters(ref).values())
    model = copy.deepcopy(ref)
    data = batches(1, 1, 2, 48, "cuda", ignore_fraction=0.1) * STEPS
    ref_losses = train(ref, data, LR)
    bastile.apply(model=model)
    assert fused_names(model)
    assert_losses_close(train(model, data, LR), ref_losses, 1e-2, family)
    assert all(p.grad is None or p.grad.dtype == torch.float32 for p in adapters(model).values())
