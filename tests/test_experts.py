"""The MoE families' experts on Bastile's path (python_shim/bastile/experts.py) against HF (+ PEFT), CPU fp32.

Mini configs route 2 of 8 (or 4) experts per token, so some experts get no token in a batch. A full fine-tune
and PEFT LoRA on the 3-D expert parameters (ParamWrapper, `target_parameters`, with B != 0): two AdamW steps'
losses within 1e-5 of HF's, the first step's gradients as the family tests compare them; neither transformers'
experts functions nor PEFT's parametrized weight run in the patched step.
"""
import contextlib
import copy
import sys

import pytest
import torch
from torch.nn import functional as F
from torch.utils._python_dispatch import TorchDispatchMode
from peft import LoraConfig, get_peft_model
from transformers import masking_utils
from transformers.integrations import moe

import bastile
from bastile import experts, long_context
from bastile.families import FAMILIES as TRAITS
from conftest import DEVICES, EXPERTS_PATCHES, NO_TRAINERS, needs_cuda, rel_err
from test_families import WRAPPED, Dispatched, route_op, adam_steps, assert_grad_close, exact_delta_rule, exact_grads, mini
from test_qwen3_training import batches

FAMILIES = ["qwen3_moe", "mixtral", "gpt_oss", "qwen3_5_moe_text", "gemma4_text", "glm4_moe", "qwen3_vl_moe_text",
            "qwen3_next", "lfm2_moe", "qwen2_moe", "olmoe", "granitemoe", "ernie4_5_moe"]
# Gemma 4's mini has no experts (test_families.py); here its MoE model: experts beside each dense MLP
OVERRIDES = {"gemma4_text": dict(enable_moe_block=True, num_experts=4, top_k_experts=2, moe_intermediate_size=32)}
EXPERT_LORA = dict(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], init_lora_weights=False,
                   target_parameters=["experts.gate_up_proj", "experts.down_proj"])


def steps(model, data):
    return adam_steps(model, [dict(input_ids=ids, labels=labels) for (ids, labels), in data])


def hf_experts_refused(monkeypatch):
    """transformers' experts functions, and PEFT's parametrization of a wrapped weight (W + s A B), raise if
    called."""
    def refuse(*args, **kwargs):
        raise AssertionError("transformers' experts function, or PEFT's parametrized weight, ran")
    for name in list(moe.ALL_EXPERTS_FUNCTIONS._global_mapping):
        monkeypatch.setitem(moe.ALL_EXPERTS_FUNCTIONS._global_mapping, name, refuse)
    monkeypatch.setattr(torch.nn.utils.parametrize, "register_parametrization", refuse)


@pytest.mark.parametrize("lora", [False, True], ids=["full", "expert_lora"])
@pytest.mark.parametrize("family", FAMILIES)
def test_experts_train_as_hf(family, lora, monkeypatch):
    data = batches(1, 1, 2, 48, "cpu", ignore_fraction=0.1) * 2
    base = WRAPPED[family]() if family in WRAPPED else mini(family, "cpu", torch.float32, **OVERRIDES.get(family, {}))
    (ids, labels), = data[0]
    # Qwen3.5's decay parameters against HF's model on the exact recurrence, as the family tests compare them
    exact = exact_grads(family, copy.deepcopy(base), lambda m: m(input_ids=ids, labels=labels).loss)
    wrap = (lambda m: get_peft_model(m, LoraConfig(**EXPERT_LORA))) if lora else (lambda m: m)
    torch.manual_seed(3)
    ref = wrap(copy.deepcopy(base))
    ref_losses, ref_grads = steps(ref, data)

    bastile.apply(model=base, **NO_TRAINERS)
    torch.manual_seed(3)
    model = wrap(base)
    if lora:
        wrappers = [m for m in model.modules() if type(m).__name__ == "ParamWrapper"]
        assert len(wrappers) >= 2, "PEFT wrapped no expert parameter: the test is vacuous"
    with monkeypatch.context() as m:
        hf_experts_refused(m)
        with Dispatched() as seen:
            losses, grads = steps(model, data)
    assert {"geglu" if family == "gpt_oss" else "swiglu"} <= seen.ops
    for step, (a, b) in enumerate(zip(losses, ref_losses)):
        assert abs(a - b) <= 1e-5 * abs(b), f"{family} step {step}: {a} vs {b}"
    assert grads.keys() == ref_grads.keys()
    for name, g in ref_grads.items():
        assert_grad_close(grads[name], g if lora else exact.get(name, g), name)
    if lora:  # the frozen experts get no gradient; their adapters do
        assert not any("experts.base_layer" in n and "lora" not in n for n in grads)
        assert any("experts" in n and "lora_B" in n for n in grads)


# PEFT's all-linear reaches Qwen3-Next's and OLMoE's routed experts and routers through transformers' weight
# conversion mapping (from v4's per-expert linears); LFM2-MoE and Qwen2-MoE have none, so their experts' parameters
# are named, and their routers, bare weights, get no adapter.
EXPERT_PARAMETERS = dict(target_parameters=["experts.gate_up_proj", "experts.down_proj"])
ALL_LINEAR = {"qwen3_moe": ({}, {"Qwen3MoeTopKRouter"}), "qwen3_next": ({}, {"Qwen3NextTopKRouter"}),
              "olmoe": ({}, {"OlmoeTopKRouter"}), "qwen2_moe": (EXPERT_PARAMETERS, set()),
              "lfm2_moe": (EXPERT_PARAMETERS, set())}


@pytest.mark.parametrize("family", list(ALL_LINEAR))
def test_all_linear_lora_trains_as_hf(family, monkeypatch):
    """PEFT's `all-linear` LoRA: adapters on every linear layer (the attention's, the Gated DeltaNet's or the short
    convolution's, the dense and shared experts' projections, the shared expert's gate) and on the routed experts' and
    the router's parameters.
    Two AdamW steps' losses as HF + PEFT's, the first step's gradients within 1e-4; the routed experts' adapters
    fused into the expert path (neither transformers' experts functions nor PEFT's parametrized weight run for
    them), the router's weight plus its delta passed to the router's forward (no parametrization registered),
    and every projection of a patched forward in a fused node."""
    data = batches(1, 1, 2, 48, "cpu", ignore_fraction=0.1) * 2
    base = mini(family, "cpu", torch.float32)
    extra, routers = ALL_LINEAR[family]
    config = LoraConfig(r=4, lora_alpha=8, target_modules="all-linear", init_lora_weights=False, **extra)
    torch.manual_seed(3)
    ref = get_peft_model(copy.deepcopy(base), copy.deepcopy(config))
    # HF's Gated DeltaNet on the exact recurrence: its chunked rule in float32 gets the gradients of the decay's
    # parameters 1e-3 off (test_families.DECAY), in_proj_ba's adapters' among them
    with monkeypatch.context() as m:
        if TRAITS[family].linear_attention:
            m.setattr(sys.modules[TRAITS[family].module], "torch_chunk_gated_delta_rule", exact_delta_rule)
        ref_losses, ref_grads = steps(ref, data)
    bastile.apply(model=base, **NO_TRAINERS)
    torch.manual_seed(3)
    model = get_peft_model(base, config)
    report = bastile.lora_modules(model)
    experts_wrapped = [n for n in report if n.endswith(".experts")]  # mlp.experts, LFM2-MoE's feed_forward.experts
    assert experts_wrapped and all(report[n] == "fused" for n in experts_wrapped), report
    projections = ("proj", "in_proj_qkvz", "in_proj_ba", "w1", "w2", "w3")  # LFM2's MLP: w1, w3, w2
    assert all(why == "fused" for n, why in report.items() if n.endswith(projections)), report
    wrapped_routers = {type(m.get_base_layer()).__name__: report[n] for n, m in model.named_modules()
                       if type(m).__name__ == "ParamWrapper" and n in report and ".experts" not in n}
    assert wrapped_routers == dict.fromkeys(routers, experts.WEIGHT_PLUS_DELTA), report
    register, parametrized = torch.nn.utils.parametrize.register_parametrization, []
    with monkeypatch.context() as m:
        hf_experts_refused(m)
        m.setattr(torch.nn.utils.parametrize, "register_parametrization", lambda module, *args, **kw:
                  parametrized.append(type(module).__name__) or register(module, *args, **kw))
        losses, grads = steps(model, data)
    assert not parametrized, parametrized
    assert losses == pytest.approx(ref_losses, rel=1e-5) and ref_losses[-1] < ref_losses[0]
    assert grads.keys() == ref_grads.keys() and any("experts" in n and "lora_B" in n for n in grads)
    for name, g in ref_grads.items():  # adapters B != 0 on every layer: fp32 rounding puts some 2e-5 apart
        assert rel_err(grads[name], g) < 1e-4, f"{name}: {rel_err(grads[name], g):.2e} of its norm apart"


def test_weight_gradients_come_in_the_parameters_layout():
    """A full fine-tune's expert weight gradients: each expert's x^T dy (fp64 reference), laid out as the stored
    parameter is ([experts, out, in] seen through its transposed view), so that autograd keeps them without a
    transposing copy of every expert's weights."""
    g = torch.Generator().manual_seed(0)
    x, dy = torch.randn(10, 16, generator=g), torch.randn(10, 8, generator=g)
    offsets = torch.tensor([3, 3, 10], dtype=torch.int32)  # expert 1 idle
    stored = torch.empty(3, 8, 16)
    got = experts.grouped_wgrad(x, dy, offsets, stored.transpose(-2, -1))
    want = torch.stack([x[a:b].double().t() @ dy[a:b].double() for a, b in [(0, 3), (3, 3), (3, 10)]])
    torch.testing.assert_close(got.double(), want, rtol=1e-6, atol=1e-6)
    assert got.transpose(-2, -1).is_contiguous()


@pytest.mark.parametrize("offload", [False, True], ids=["", "offloaded"])
@pytest.mark.parametrize("reentrant", [False, True], ids=["non_reentrant", "reentrant"])
def test_checkpointed_expert_lora_trains_as_hf(reentrant, offload, monkeypatch):
    """HF's gradient checkpointing (each layer's forward run again in the backward, the expert node's too) and
    offloaded checkpoints around the expert path with expert LoRA: HF + PEFT's losses and gradients under the
    same checkpointing (reentrant, HF's router aux loss loses its gradient: its router logits come from the
    forward run without grad, so without checkpointing the gradients differ, 5e-3 in layer 0's adapters)."""
    data = batches(1, 1, 2, 48, "cpu", ignore_fraction=0.1) * 2
    base = mini("qwen3_moe", "cpu", torch.float32)

    def checkpointed(seed, model):
        torch.manual_seed(seed)
        model = get_peft_model(model, LoraConfig(**EXPERT_LORA))
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": reentrant})
        if reentrant:
            model.enable_input_require_grads()
        return model
    ref_losses, ref_grads = steps(checkpointed(3, copy.deepcopy(base)), data)
    monkeypatch.setattr(long_context, "_MIN_BYTES", 1)  # the mini's tensors offloaded too
    bastile.apply(model=base, **NO_TRAINERS, offload_checkpoints=offload)
    model = checkpointed(3, base)
    with monkeypatch.context() as m:
        hf_experts_refused(m)
        losses, grads = steps(model, data)
    for step, (a, b) in enumerate(zip(losses, ref_losses)):
        assert abs(a - b) <= 1e-5 * abs(b), f"step {step}: {a} vs {b}"
    assert grads.keys() == ref_grads.keys()
    for name, g in ref_grads.items():
        assert_grad_close(grads[name], g, name)


def test_experts_with_no_tokens_and_a_token_routed_twice():
    """Experts that get no pair, and one token sent to one expert twice (a router that allows it): HF's eager
    experts (expert by expert), in fp64."""
    model = mini("qwen3_moe", "cpu", torch.float64)
    ex = model.model.layers[0].mlp.experts
    x = torch.randn(5, ex.gate_up_proj.shape[-1], dtype=torch.float64)
    index = torch.tensor([[3, 3], [3, 5], [5, 3], [3, 3], [5, 5]])  # experts 0-2, 4, 6, 7 idle
    weights = torch.rand(5, 2, dtype=torch.float64)
    forward = experts.experts_forward(bastile.roles.mlp.swiglu_gate(TRAITS["qwen3_moe"].mlp), concatenated=True)
    torch.testing.assert_close(forward(ex, x, index, weights), type(ex).forward.__wrapped__(ex, x, index, weights),
                               rtol=1e-12, atol=1e-12)


def test_experts_with_an_unfused_activation_differentiate_as_hf():
    """Experts whose activation no op computes (ReLU) keep HF's math in the gate, its backward autograd's; in fp64
    every sum stays fp64 (the routing weights' gradient, the expert-by-expert weights' gradients): values and
    gradients as HF's eager experts to 1e-12."""
    ex = mini("qwen3_moe", "cpu", torch.float64).model.layers[0].mlp.experts
    ex.act_fn = torch.nn.ReLU()
    torch.manual_seed(0)
    x = torch.randn(6, ex.gate_up_proj.shape[-1], dtype=torch.float64, requires_grad=True)
    index = torch.tensor([[3, 3], [3, 5], [5, 1], [0, 3], [5, 5], [1, 0]])
    weights = torch.rand(6, 2, dtype=torch.float64, requires_grad=True)
    forward = experts.experts_forward(bastile.roles.mlp.swiglu_gate(TRAITS["qwen3_moe"].mlp), concatenated=True)
    inputs = (x, weights, ex.gate_up_proj, ex.down_proj)
    got, want = (f(ex, x, index, weights) for f in (forward, type(ex).forward.__wrapped__))
    grad = torch.randn_like(want)
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)
    for g, w in zip(torch.autograd.grad(got, inputs, grad), torch.autograd.grad(want, inputs, grad)):
        torch.testing.assert_close(g, w, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("family", ["qwen3_moe", "gpt_oss"])
def test_frozen_experts_backward_sends_the_gradient_only(family, monkeypatch):
    """Frozen experts (LoRA on the attention alone): their backward makes no rows of x again (one expert_dispatch,
    the tokens' gradient's) nor the gate's output (its backward op sums the routing weights' gradient), and the
    gate's backward is its own op's, with no autograd call of its own; the hidden states' and routing weights'
    gradients those of HF's eager experts."""
    ex = mini(family, "cpu", torch.float32).model.layers[0].mlp.experts
    ex.requires_grad_(False)
    torch.manual_seed(0)
    x = torch.randn(6, ex.gate_up_proj.shape[1 if ex.is_transposed else -1], requires_grad=True)
    index = torch.tensor([[3, 3], [3, 2], [2, 1], [0, 3], [2, 2], [1, 0]])
    weights = torch.rand(6, 2, requires_grad=True)
    want = torch.autograd.grad(type(ex).forward.__wrapped__(ex, x, index, weights).sum(), (x, weights))
    bastile.apply(model=ex, **NO_TRAINERS)
    out = ex(x, index, weights).sum()
    monkeypatch.setattr(torch.autograd, "grad", None)
    with Dispatched() as seen:
        out.backward()
    gate = TRAITS[family].mlp.experts
    assert [c for c in seen.calls if c != "expert_combine"] == ["expert_dispatch", f"{gate}_backward"]
    for g, w in zip((x.grad, weights.grad), want):
        torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-6)


# each routed family, and where its router renormalises as its config says, both ways
ROUTED = [(f, renorm) for f in FAMILIES if TRAITS[f].mlp.router
          for renorm in ((True, False) if TRAITS[f].mlp.router.renorm else (None,))]


@pytest.mark.parametrize("device,dtype", [("cpu", torch.float32)] + [("cuda", torch.float32), ("cuda", torch.bfloat16)]
                         * ("cuda" in DEVICES))
@pytest.mark.parametrize("family,renorm", ROUTED)
def test_router_is_hf_router_in_one_op(family, renorm, device, dtype):
    """The router's forward: HF's logits, the same experts and their weights in HF's dtype (within f32 roundings and
    one of the dtype's units), and after the logits one op, `expert_route` (`expert_route_sigmoid` for GLM-4.5's and
    LFM2-MoE's; the correction biases drawn at random), forward and backward; the rest of the model's roles left
    HF's (Gemma 4's router norms its input). The hidden states'
    and router's gradients through weights and logits (a load-balancing term): in fp32 as HF's; in bf16, where HF
    rounds its softmax's output and backward in bf16 (GPT-OSS's softmax of the top-k) and Bastile once from f32, as
    far from HF's fp32 router as HF's bf16 one is (or within 1e-2 in norm)."""
    model = (WRAPPED[family]().to(device, dtype) if family in WRAPPED
             else mini(family, device, dtype, **OVERRIDES.get(family, {})))
    router = next(m for m in model.modules() if type(m).__name__ == TRAITS[family].name("TopKRouter"))
    if renorm is not None:
        setattr(router, TRAITS[family].mlp.router.renorm, renorm)
    # the routers' correction biases (GLM-4.5's buffer, ERNIE's moe_statics', LFM2-MoE's the block's, passed in),
    # not zeros
    block = next(m for m in model.modules() if router in (getattr(m, "gate", None), getattr(m, "router", None)))
    bias = next((b for n, b in (*router.named_buffers(), *router.named_parameters(),
                                ("expert_bias", getattr(block, "expert_bias", None)))
                 if n.endswith(("e_score_correction_bias", "expert_bias")) and b is not None), None)
    if bias is not None:
        bias.copy_(torch.randn(bias.shape, generator=torch.Generator().manual_seed(2)).mul(0.1))
    # the routers' vectors (GPT-OSS's bias, Gemma 4's scales) drawn too, not their init's zeros and ones
    with torch.no_grad():
        for p in router.parameters():
            if p.dim() == 1:
                p.copy_(torch.rand(p.shape, generator=torch.Generator().manual_seed(3)).add(0.5))
    extra = (block.expert_bias,) if getattr(block, "use_expert_bias", False) else ()
    exact = copy.deepcopy(router).float()
    hidden = model.get_input_embeddings().weight.shape[-1]
    x = torch.randn(64, hidden, generator=torch.Generator().manual_seed(0)).to(device, dtype)
    names = ["hidden"] + [n for n, p in router.named_parameters() if p.requires_grad]

    def run(module, cast=lambda t: t):
        leaves = [cast(x).detach().requires_grad_()] + [p for p in module.parameters() if p.requires_grad]
        out = module(leaves[0], *extra)
        # GraniteMoE's router under transformers 5.17 returns (experts, weights, logits); Bastile's (and 5.23's)
        # the logits first
        logits, weights, chosen = out[::-1] if out[0].dtype == torch.long else out
        dy = torch.randn(weights.shape, generator=torch.Generator().manual_seed(1)).to(device)
        # each token's experts by index (GLM-4.5's top-k leaves them unsorted), their weights alongside
        chosen, by_index = chosen.sort(-1)
        weights = weights.gather(-1, by_index)
        loss = (weights * dy.to(weights.dtype)).sum() + logits.float().softmax(-1).square().sum()
        return (logits, weights, chosen), torch.autograd.grad(loss, leaves)

    _, fp32_grads = run(exact, lambda t: t.float())
    (hf_logits, hf_weights, hf_chosen), hf_grads = run(router)
    bastile.apply(model=model, norm=False, attention=False, decoder=False, head=False, **NO_TRAINERS)
    with Dispatched() as seen:
        (logits, weights, chosen), grads = run(router)
    op = route_op(TRAITS[family])
    assert seen.calls == [op, f"{op}_backward"]
    assert torch.equal(logits, hf_logits) and torch.equal(chosen, hf_chosen)
    assert weights.dtype == hf_weights.dtype
    # one rounding, where HF's LFM2-MoE rounds its weights' sum, division and scaling in bf16
    units = 1 if dtype == torch.float32 else 4
    torch.testing.assert_close(weights, hf_weights, rtol=units * torch.finfo(weights.dtype).eps, atol=1e-6)
    for name, got, hf, want in zip(names, grads, hf_grads, fp32_grads):
        if dtype == torch.float32:
            torch.testing.assert_close(got, hf, rtol=1e-5, atol=1e-6)
        else:
            err, hf_err = rel_err(got, want), rel_err(hf, want)
            assert err <= max(2 * hf_err, 1e-2), f"{name}: {err:.2e} from fp32 (HF bf16: {hf_err:.2e})"


@needs_cuda
@pytest.mark.parametrize("family", [f for f in FAMILIES if TRAITS[f].mlp.experts == "swiglu" and f not in WRAPPED])
def test_bf16_cuda_gate_up_and_swiglu_run_as_one_op(family):
    """bf16 experts on CUDA without an adapter on gate/up: the forward groups the pairs (`expert_group`), runs gate/up's
    products and the SwiGLU (Gemma 4's GELU-tanh) as `expert_swiglu` and down's as `expert_linear`, the backward the
    inputs' gradients through down and gate/up as `expert_linear` (each the GEMM kernel on compute capability 9.0 at
    these widths, 256 and 256), and the output and the hidden states', routing weights' and experts' gradients are as
    far from HF's fp32 experts as HF's bf16 ones are (or within 1e-2 in norm)."""
    inter = "intermediate_size" if family in ("mixtral", "olmoe") else "moe_intermediate_size"
    model = mini(family, "cuda", torch.bfloat16, **{**OVERRIDES.get(family, {}), inter: 256, "hidden_size": 256})
    ex = next(m for m in model.modules() if type(m).__name__ == TRAITS[family].name("Experts"))
    torch.manual_seed(0)
    x = torch.randn(300, ex.gate_up_proj.shape[-1], device="cuda", dtype=torch.bfloat16, requires_grad=True)
    index = torch.randint(0, ex.num_experts, (300, 2), device="cuda")
    weights = torch.rand(300, 2, device="cuda", requires_grad=True)
    grad = torch.randn(300, x.shape[1], device="cuda")

    def run(module, cast=lambda t: t):
        inputs = [cast(t).detach().requires_grad_() for t in (x, weights)]
        out = module(inputs[0], index, inputs[1])
        params = [module.gate_up_proj, module.down_proj]
        return [out, *torch.autograd.grad(out, [*inputs, *params], grad.to(out.dtype))]

    hf_fp32 = run(copy.deepcopy(ex).float(), lambda t: t.float())
    hf_bf16 = run(ex)
    bastile.apply(model=ex, **NO_TRAINERS)
    with Dispatched() as seen:
        ours = run(ex)
    assert seen.calls[:5] == ["expert_group", "expert_dispatch", "expert_swiglu", "expert_linear", "expert_combine"]
    assert seen.calls[5:].count("expert_linear") == 2
    for name, got, hf, want in zip(("out", "x", "weights", "gate_up_proj", "down_proj"), ours, hf_bf16, hf_fp32):
        err, hf_err = rel_err(got, want), rel_err(hf, want)
        assert err <= max(2 * hf_err, 1e-2), f"{name}: {err:.2e} from fp32 (HF bf16: {hf_err:.2e})"


def test_experts_holding_silu_as_a_function_run_the_fused_gate():
    """LFM2-MoE's experts hold F.silu, a function, as act_fn (Mlp.expert_activation None): their gate runs the
    `swiglu` op (between the grouping, the dispatch and the combine), and the experts compute what HF's eager experts do."""
    model = mini("lfm2_moe", "cpu", torch.float32)
    ex = model.model.layers[1].feed_forward.experts
    x = torch.randn(5, ex.hidden_dim)
    index, weights = torch.tensor([[0, 3], [3, 5], [5, 7], [1, 3], [7, 0]]), torch.rand(5, 2)
    want = type(ex).forward.__wrapped__(ex, x, index, weights)
    bastile.apply(model=model, **NO_TRAINERS)
    with Dispatched() as seen:
        got = ex(x, index, weights)
    assert seen.ops == {"expert_group", "swiglu", "expert_dispatch", "expert_combine"}
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)


@needs_cuda
def test_gpt_oss_bias_gradients_are_the_same_on_every_run():
    """A full fine-tune's expert bias gradients (GPT-OSS's experts, bf16 on the GPU, 4,096 rows an expert) come
    out bit for bit the same in three backwards of one batch: each expert's rows summed as one product, not by
    atomics (index_add_ on CUDA, whose down bias gradients differed from run to run here on an H200)."""
    from transformers import GptOssConfig
    from transformers.models.gpt_oss.modeling_gpt_oss import GptOssExperts
    torch.manual_seed(0)
    config = GptOssConfig(hidden_size=1024, intermediate_size=1024, num_local_experts=8)
    ex = GptOssExperts(config).cuda().bfloat16()
    with torch.no_grad():
        ex.gate_up_proj_bias.normal_()
        ex.down_proj_bias.normal_()
    bastile.apply(model=ex, **NO_TRAINERS)
    x = torch.randn(8192, 1024, device="cuda", dtype=torch.bfloat16)
    index, weights = torch.randint(0, 8, (8192, 4), device="cuda"), torch.rand(8192, 4, device="cuda").bfloat16()
    grad = torch.randn_like(x)
    runs = []
    for _ in range(3):
        ex.zero_grad()
        ex(x, index, weights).backward(grad)
        runs.append([ex.gate_up_proj_bias.grad.clone(), ex.down_proj_bias.grad.clone()])
    for run in runs[1:]:
        assert all(torch.equal(a, b) for a, b in zip(run, runs[0]))


@needs_cuda
@pytest.mark.parametrize("rank, width", [(8, None), (16, 256)], ids=["mini", "kernel-widths"])
def test_expert_lora_bf16_cuda(rank, width):
    """bf16 on the GPU, the mini model (rank 8: the products apart, torch's grouped GEMM) and at widths the Hopper
    kernels take (hidden and expert widths 256, rank 16: the adapters' second products inside our grouped GEMMs):
    the adapters' products reach the ops as their low-rank operands, a layer's gate/up with its SwiGLU as one
    `expert_swiglu`, down's and both inputs' gradients as `expert_linear` (no product with B of their own: the
    only other grouped products are the four rank-sized ones, x A and dy B^T of both projections); the loss within
    1e-2 of HF + PEFT's, and the experts' adapters' gradients within 1e-1 of the fp32 ones in norm. The rank-sized
    products s (dy B) are rounded to bf16 token by token before the sum over an expert's tokens, as the dense LoRA
    nodes round theirs (lora.py), where PEFT sums x^T dy over tokens in fp32 first: at init (B random) those sums
    cancel, and the gate/up adapters' A is 6e-2 off where PEFT's is 1.4e-2 (H200, the mini model at rank 8)."""
    (ids, labels), = batches(1, 1, 2, 64, "cuda", ignore_fraction=0.1)[0]
    config = LoraConfig(**{**EXPERT_LORA, "r": rank})
    base = mini("qwen3_moe", "cuda", torch.bfloat16,
                **(dict(hidden_size=width, moe_intermediate_size=width) if width else {}))
    layers = sum(type(m).__name__ == "Qwen3MoeExperts" for m in base.modules())

    def first(model):
        loss = model(input_ids=ids, labels=labels).loss
        loss.backward()
        return loss.item(), {n: p.grad.float() for n, p in model.named_parameters() if p.grad is not None}

    torch.manual_seed(3)
    hf = get_peft_model(copy.deepcopy(base), copy.deepcopy(config))
    fp32 = get_peft_model(copy.deepcopy(base).float(), copy.deepcopy(config))
    fp32.load_state_dict({k: v.float() for k, v in hf.state_dict().items()})
    (hf_loss, hf_grads), (_, fp32_grads) = first(hf), first(fp32)
    bastile.apply(model=base, **NO_TRAINERS)
    ours = get_peft_model(base, copy.deepcopy(config))
    ours.load_state_dict(hf.state_dict())
    with Dispatched() as seen:
        loss, grads = first(ours)
    grouped = [c for c in zip(seen.calls, seen.tensors) if c[0] in ("expert_swiglu", "expert_linear")]
    assert sorted(grouped) == sorted([("expert_swiglu", 5)] * layers + [("expert_linear", 5)] * 3 * layers
                                        + [("expert_linear", 3)] * 4 * layers)
    assert loss == pytest.approx(hf_loss, rel=1e-2)
    lora = [n for n in fp32_grads if "experts" in n and "lora_" in n]
    assert lora
    for name in lora:
        err, hf_err = (rel_err(g[name], fp32_grads[name]) for g in (grads, hf_grads))
        assert err <= max(hf_err, 1e-1), f"{name}: {err:.2e} from fp32 (HF + PEFT bf16: {hf_err:.2e})"


@pytest.mark.parametrize("family, device, mode", [("qwen3_moe", "cpu", "default"), ("gpt_oss", "cpu", "default"),
                                                  pytest.param("qwen3_moe", "cuda", "default", marks=needs_cuda),
                                                  pytest.param("qwen3_moe", "cuda", "reduce-overhead", marks=needs_cuda)])
def test_expert_lora_layers_compile_as_eager(family, device, mode, monkeypatch):
    """PEFT LoRA on the experts' 3-D parameters, each decoder layer compiled (regional torch.compile): the adapters'
    gradients of the same model's eager step. The adapters' factors are permuted views of their
    weights, made contiguous for the grouped GEMM; Inductor laid a cast's copy of them out in the views' strides,
    which grouped_mm refused. The experts' backward traced whole (grouped weight gradients, no host read) got a
    zero gradient where their forward returned a no-op `.to`. bf16; on the CPU the products and the weight
    gradients take torch's grouped GEMM, as on CUDA. reduce-overhead (CUDA graphs): the third compiled step, the
    first that replays the recorded graphs. GPT-OSS: its experts' biases (Inductor mislowered them added in place)."""
    from torch._dynamo.utils import counters
    if device == "cpu":
        monkeypatch.setattr(experts, "_grouped_kernel", experts.grouped_operands)
    # gate_up's A and B of one size, the case where Inductor put B's copy in A's freed buffer
    base = mini(family, device, torch.bfloat16, **({"moe_intermediate_size": 64} if family == "qwen3_moe" else {}))
    bastile.apply(model=base, **NO_TRAINERS)
    torch.manual_seed(3)
    model = get_peft_model(base, LoraConfig(**{**EXPERT_LORA, "r": 8}))
    (ids, labels), = batches(1, 1, 2, 48, device, ignore_fraction=0.1)[0]

    def step():
        model(input_ids=ids, labels=labels).loss.backward()
        grads = {n: p.grad.float() for n, p in model.named_parameters() if p.grad is not None}
        model.zero_grad(set_to_none=True)
        return grads

    want = step()
    torch._dynamo.reset()
    counters.clear()
    for layer in model.get_base_model().model.layers:
        layer.compile(mode=mode)
    got = [step() for _ in range(3)][-1]
    # HF's output capturing (the router's logits) breaks the graph; the layer resumes after it rather than run eager
    assert not [k for k in counters["graph_break"] if "GenericContextWrappingVariable" in k]
    assert got.keys() == want.keys() and any("experts" in n for n in got)
    for name, g in want.items():
        assert rel_err(got[name], g) <= 2e-2, name


def test_other_adapter_states_run_peft_own_path():
    """Two active adapters (PEFT sums their deltas into the weight) and disabled adapters keep PEFT's path around
    Bastile's experts: HF + PEFT's losses."""
    (ids, labels), = batches(1, 1, 2, 48, "cpu", ignore_fraction=0.1)[0]
    base = mini("qwen3_moe", "cpu", torch.float32)

    def two_adapters(model):
        torch.manual_seed(3)
        model = get_peft_model(model, LoraConfig(**EXPERT_LORA))
        model.add_adapter("other", LoraConfig(**EXPERT_LORA))
        model.base_model.set_adapter(["default", "other"])
        return model

    def losses(model):
        with model.disable_adapter():
            off = model(input_ids=ids, labels=labels).loss.item()
        return model(input_ids=ids, labels=labels).loss.item(), off

    want = losses(two_adapters(copy.deepcopy(base)))
    bastile.apply(model=base, **NO_TRAINERS)
    assert losses(two_adapters(base)) == pytest.approx(want, rel=1e-6)


@pytest.mark.parametrize("transposed", [False, True], ids=["out_in", "in_out"])
def test_expert_path_gradients_fp64(transposed):
    """Every gradient of the expert path (hidden states, routing weights, the experts' weights and biases, the
    adapters' factors) by torch.autograd.gradcheck in fp64, with idle experts and a token sent to one expert
    twice; both stored layouts."""
    from types import SimpleNamespace
    torch.manual_seed(0)
    E, H, I, r, T, k = 5, 6, 4, 3, 7, 2
    dt = dict(dtype=torch.float64, requires_grad=True)
    shape = (lambda i, o: (E, i, o)) if transposed else (lambda i, o: (E, o, i))
    mod = SimpleNamespace(is_transposed=transposed, has_bias=True, has_gate=True, is_concatenated=True, num_experts=E,
                          gate_up_proj=torch.randn(shape(H, 2 * I), **dt), down_proj=torch.randn(shape(I, H), **dt),
                          gate_up_proj_bias=torch.randn(E, 2 * I, **dt), down_proj_bias=torch.randn(E, H, **dt))
    lora = {"gate_up_proj": (torch.randn(E, *((H, r) if transposed else (2 * I, r)), **dt),
                             torch.randn(E, *((r, 2 * I) if transposed else (r, H)), **dt), 0.5),
            "down_proj": (torch.randn(E, *((I, r) if transposed else (H, r)), **dt),
                          torch.randn(E, *((r, H) if transposed else (r, I)), **dt), 2.0)}
    index = torch.tensor([[0, 2], [2, 2], [4, 0], [0, 0], [2, 4], [4, 4], [0, 2]])  # experts 1 and 3 idle
    hidden, weights = torch.randn(T, H, **dt), torch.rand(T, k, **dt)

    def gate(_, gate_up):
        g, u = gate_up.chunk(2, dim=-1)
        return F.silu(g) * u

    forward = experts.experts_forward(experts.through_autograd(gate), concatenated=True)
    pair = lambda lhs, rhs: (lhs, rhs)  # noqa: E731  (the factors as given)

    def run(hidden, weights, w1, b1, w2, b2, l1, r1, l2, r2):
        m = SimpleNamespace(**{**vars(mod), "gate_up_proj": w1, "gate_up_proj_bias": b1, "down_proj": w2,
                               "down_proj_bias": b2})
        return forward(m, hidden, index, weights, lora={"gate_up_proj": experts.Adapter((l1, r1), pair, 0.5),
                                                        "down_proj": experts.Adapter((l2, r2), pair, 2.0)})

    inputs = (hidden, weights, mod.gate_up_proj, mod.gate_up_proj_bias, mod.down_proj, mod.down_proj_bias,
              *lora["gate_up_proj"][:2], *lora["down_proj"][:2])
    assert torch.autograd.gradcheck(run, inputs)


def test_expert_path_keeps_the_gate_input_not_the_pairs_rows():
    """For the backward the expert path keeps gate/up's output [pairs, 2 I], rank-sized products and the
    adapters' own weights; the pairs' rows of x [pairs, H], the gate's output [pairs, I], the down products
    [pairs, H] and the adapters' factors in the experts' layout are made again."""
    model = get_peft_model(mini("qwen3_moe", "cpu", torch.float32, moe_intermediate_size=48), LoraConfig(**EXPERT_LORA))
    bastile.apply(model=model.base_model.model, **NO_TRAINERS)
    block = model.base_model.model.model.layers[0].mlp
    hidden = torch.randn(7, block.experts.base_layer.base_layer.hidden_dim, requires_grad=True)
    _, weights, index = block.gate(hidden)
    pairs, I = index.numel(), block.experts.base_layer.base_layer.intermediate_dim
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    kept = []  # the saved tensors that are not the model's parameters or views of them

    def pack(t):
        if t.untyped_storage().data_ptr() not in params:
            kept.append(tuple(t.shape))
        return t
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = block.experts(hidden, index, weights)
    out.sum().backward()  # the backward's own products (the gate made again) live within it
    assert (pairs, 2 * I) in kept
    assert not {(pairs, hidden.shape[1]), (pairs, I)} & set(kept), kept
    assert all(len(shape) < 3 for shape in kept), kept  # no [experts, ., .] factor copies
    lora = [p for n, p in model.named_parameters() if "experts" in n and "lora" in n]
    assert lora and all(p.grad is not None and p.grad.abs().sum() > 0 for p in lora)


@pytest.mark.parametrize("family", ["qwen3_moe", "gpt_oss"])
def test_peft_factors_are_get_delta_factors(family):
    """The adapters' factors the expert path makes from lora_A/lora_B are PEFT's get_delta_factors, in both
    stored layouts ([experts, out, in]: Qwen3-MoE; [experts, in, out]: GPT-OSS)."""
    model = get_peft_model(mini(family, "cpu", torch.float32), LoraConfig(**EXPERT_LORA))
    wrappers = [m for m in model.modules() if type(m).__name__ == "ParamWrapper" and "Experts" in
                type(m.get_base_layer()).__name__]
    assert {w._did_swap_in_out_features for w in wrappers} == {family == "qwen3_moe"}
    for w in wrappers:
        adapter = experts.adapter_of(w)
        lhs, rhs, scale = w.get_delta_factors("default")
        got = adapter.factors(*adapter.sources)
        assert adapter.scale == scale
        assert torch.equal(got[0], lhs) and torch.equal(got[1], rhs)


def test_a_layout_the_gate_does_not_read_raises():
    """Experts declaring a gate/up layout other than the family's gate reads raise, naming the layout."""
    model = mini("qwen3_moe", "cpu", torch.float32)
    bastile.apply(model=model)
    ex = model.model.layers[0].mlp.experts
    ex.is_concatenated = False
    with pytest.raises(RuntimeError, match="is_concatenated=False; Bastile's gate reads a concatenated"):
        ex(torch.randn(3, ex.hidden_dim), torch.zeros(3, 2, dtype=torch.long), torch.ones(3, 2))


def test_lora_modules_reports_the_expert_adapters():
    """bastile.lora_modules: the experts' wrappers in the expert path are "fused"; the router's, and every
    wrapper with PEFT's own forward, say why not."""
    model = get_peft_model(mini("qwen3_moe", "cpu", torch.float32), LoraConfig(r=4, target_modules="all-linear"))
    wrapped = [n for n, m in model.named_modules() if type(m).__name__ == "ParamWrapper"]
    assert any(n.endswith("mlp.experts") for n in wrapped) and any(n.endswith("mlp.gate") for n in wrapped)
    bastile.apply(model=model.base_model.model, **NO_TRAINERS)
    report = bastile.lora_modules(model)
    assert {n for n in wrapped if report[n] == "fused"} == {n for n in wrapped if ".mlp.experts" in n}
    assert all(report[n] == experts.WEIGHT_PLUS_DELTA for n in wrapped if n.endswith("mlp.gate"))
    bastile.reset(EXPERTS_PATCHES)
    assert all(bastile.lora_modules(model)[n].startswith("PEFT's ParamWrapper") for n in wrapped)


@contextlib.contextmanager
def raising_on_syncs():
    """CUDA work queued before it finished, then torch's sync debug mode raising at any host read of the device."""
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        yield
    finally:
        torch.cuda.set_sync_debug_mode("default")


@pytest.mark.parametrize("masked", [False, True])
@pytest.mark.parametrize("device,dtype", [("cpu", torch.float32), ("cpu", torch.bfloat16)]
                         + [("cuda", torch.bfloat16)] * ("cuda" in DEVICES))
def test_load_balancing_loss_is_hf_without_a_host_sync(masked, device, dtype):
    """The heads' load-balancing loss (roles/head.py) against transformers' load_balancing_loss_func on three layers'
    router logits (2 rows of 12 tokens, 8 experts, top 2; some tokens padded where masked): the same value and
    gradients of the logits, bit for bit (the same products and sums in the same order; the counts exact in
    float32 whatever order adds them); on CUDA under torch's sync debug mode set to raise (5.17's torch.bincount
    reads a value on the host)."""
    from transformers.models.qwen3_moe.modeling_qwen3_moe import load_balancing_loss_func
    from bastile.roles.head import load_balancing_loss
    g = torch.Generator().manual_seed(5)
    logits = [torch.randn(24, 8, generator=g).to(device, dtype).requires_grad_() for _ in range(3)]
    mask = torch.ones(2, 12, dtype=torch.long)
    mask[1, :5] = 0
    mask = mask.to(device) if masked else None
    want = load_balancing_loss_func(tuple(logits), 8, 2, mask)
    want_grads = torch.autograd.grad(want, logits)
    with raising_on_syncs() if device == "cuda" else contextlib.nullcontext():
        got = load_balancing_loss(tuple(logits), 8, 2, mask)
        got_grads = torch.autograd.grad(got, logits)
    assert got.dtype == want.dtype == torch.float32 and got.device.type == device
    torch.testing.assert_close(got, want, rtol=0, atol=0)
    for a, b in zip(got_grads, want_grads):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    assert load_balancing_loss(None, 8, 2) == load_balancing_loss_func(None, 8, 2) == 0


@needs_cuda
@pytest.mark.parametrize("family", FAMILIES)
def test_training_step_makes_no_host_sync(family, monkeypatch):
    """A patched bf16 training step on CUDA (the loss with the router's load-balancing loss where the mini asks for
    it, the backward) under torch's sync debug mode set to raise: grouping the pairs, routing, the grouped products,
    the fused loss and the load-balancing loss read nothing back on the host. A first step outside the mode (lazy
    initialisation reads what it reads once). HF's masks of a decoder without layer types check the positions for
    packed rows with a host read (once a step): the test gives that check its answer for these unpacked rows."""
    monkeypatch.setattr(masking_utils, "find_packed_sequence_indices", lambda position_ids: None)
    base = WRAPPED[family]() if family in WRAPPED else mini(family, "cpu", torch.float32, **OVERRIDES.get(family, {}))
    model = base.to("cuda", torch.bfloat16)
    bastile.apply(model=model, **NO_TRAINERS)
    ids = torch.randint(0, model.config.get_text_config().vocab_size, (2, 24),
                        generator=torch.Generator().manual_seed(3)).cuda()

    def step():
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        return loss

    step()
    with raising_on_syncs():
        loss = step()
    assert torch.isfinite(loss)


def test_expert_parallelism_is_refused_before_patching():
    """transformers' expert parallelism sends a rank's pairs of other ranks' experts to a sentinel expert, which the
    expert path has no rows for: refused before anything is patched."""
    from transformers import DistributedConfig
    model = mini("qwen3_moe", "cpu", torch.float32)
    config = DistributedConfig()  # EP needs several ranks (transformers 5.23: ep_size > 1), which sets this
    config.enable_expert_parallel = True
    model.config.distributed_config = config
    with pytest.raises(bastile.families.Unsupported, match="expert parallelism"):
        bastile.apply(model=model)
    assert bastile.get_patched_ops() == []


def lower_index_topk(x, k, dim=-1, largest=True, sorted=True):
    """torch.topk (largest, sorted) with tied values in index order, as torch.topk picks them on CUDA and Bastile's
    router everywhere; torch's CPU kernel leaves equal values in its partial sort's order."""
    values, indices = torch.sort(x, dim=dim, descending=True, stable=True)
    return values.narrow(dim, 0, k), indices.narrow(dim, 0, k)


@pytest.mark.parametrize("family", ["qwen3_moe", "mixtral", "gpt_oss"])
def test_fp32_model_under_bf16_autocast(family, monkeypatch):
    """An fp32 model trained under bf16 autocast (HF's Trainer with bf16=True over fp32 weights): the forward's
    products and the routers' logits (so Qwen3-MoE's routing weights) are bf16, the backward runs without autocast.
    The loss as HF's under the same autocast up to bf16 roundings, every gradient within a few bf16 units of HF's
    in norm. bf16 logits tie: HF's top-k (its routers' and its load-balancing loss's) picks among tied values as on
    CUDA (lower_index_topk)."""
    model = mini(family, "cpu", torch.float32)
    reference = copy.deepcopy(model)
    ids = torch.randint(0, model.config.vocab_size, (2, 24), generator=torch.Generator().manual_seed(3))

    def step(m):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = m(input_ids=ids, labels=ids).loss
        loss.backward()
        return loss.item(), {n: p.grad for n, p in m.named_parameters() if p.grad is not None}

    monkeypatch.setattr(torch, "topk", lower_index_topk)  # HF's routers and load-balancing loss
    want, hf_grads = step(reference)
    bastile.apply(model=model, **NO_TRAINERS)
    got, grads = step(model)
    assert abs(got - want) <= 1e-4 * abs(want)
    assert grads.keys() == hf_grads.keys()
    for name, g in grads.items():
        assert g.dtype == torch.float32 and rel_err(g, hf_grads[name]) < 5e-2, name


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_gpt_oss_biases_are_added_by_the_ops_after_their_products(dtype):
    """GPT-OSS's expert biases join the ops that read their products (gate/up's the geglu op, in the forward and the
    backward's recompute; down's the forward's expert_combine): no pass of their own over the pairs' rows (the
    one-hot product into them, addmm_). The values are test_experts_train_as_hf's."""

    class Calls(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.calls = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            at = 4 if func._opname == "geglu_backward" else 3  # after (grad_y,) gate_up, alpha, limit; rows, position, weights
            bias = args[at] if func.namespace == "bastile" and len(args) > at else None
            self.calls.append((func._opname, bias))
            return func(*args, **(kwargs or {}))

    model = mini("gpt_oss", "cpu", dtype)
    bastile.apply(model=model, **NO_TRAINERS)
    ids = torch.randint(0, model.config.vocab_size, (2, 24), generator=torch.Generator().manual_seed(3))
    with Calls() as seen:
        model(input_ids=ids, labels=ids).loss.backward()
    layers = model.config.num_hidden_layers
    gate = [bias for name, bias in seen.calls if name in ("geglu", "geglu_backward")]
    assert len(gate) == 3 * layers and all(isinstance(b, torch.Tensor) and b.dtype == dtype for b in gate)
    combine = [bias for name, bias in seen.calls if name == "expert_combine"]
    assert len(combine) == 2 * layers and sum(isinstance(b, torch.Tensor) for b in combine) == layers
    assert "addmm_" not in {name for name, _ in seen.calls}


def test_fp32_routing_weights_make_no_fp32_intermediate_rows():
    """Mixtral's routing weights are fp32 over a bf16 model: no fp32 [pairs, intermediate] tensor is formed in the
    experts' backward (the weights scale the inputs' gradient rows where each token's k rows are summed)."""
    model = mini("mixtral", "cpu", torch.bfloat16, intermediate_size=48)
    bastile.apply(model=model, **NO_TRAINERS)
    block = model.model.layers[0].mlp
    hidden = torch.randn(9, model.config.hidden_size, dtype=torch.bfloat16, requires_grad=True)
    _, weights, index = block.gate(hidden)
    assert weights.dtype == torch.float32
    pairs, inter = index.numel(), model.config.intermediate_size
    out = block.experts(hidden, index, weights)

    class Outputs(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.fp32 = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            result = func(*args, **(kwargs or {}))
            for t in (result if isinstance(result, (tuple, list)) else [result]):
                if isinstance(t, torch.Tensor) and t.dtype == torch.float32 and t.shape == (pairs, inter):
                    self.fp32.append((str(func), tuple(t.shape)))
            return result

    with Outputs() as seen:
        out.float().sum().backward()
    assert hidden.grad is not None and not seen.fp32, seen.fp32
