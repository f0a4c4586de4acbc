"""Every supported family as a mini random-init model, patched and unpatched from the same seed, at configs
that set each trait its family declares (more layers than its sliding-window or NoPE period, multipliers and
scales other than 1, partial and interleaved rotation, sandwich and post norms), so that a trait the patch
ignored would change the numbers.

CPU (fp32, in CI): per-step losses over 6 AdamW steps within 1e-5 relative of HF's, every gradient of the
first step within 1e-4, the step dispatches Bastile's norm, attention, MLP and head ops, greedy generation
gives HF's tokens, and reset() restores HF's forwards. CUDA (bf16): losses within 1e-2 relative.
Refusals: a model carrying what its family's traits do not declare is refused before anything is patched.
"""
import copy
import functools
import gc
import inspect
import sys
import warnings
import weakref
from unittest import mock

import pytest
import torch
import transformers
from torch.utils._python_dispatch import TorchDispatchMode

import bastile
from bastile.families import FAMILIES as TRAITS, Unsupported
from bastile.versions import installed_before
from bastile.roles import attention as attention_role
from conftest import DEVICES, NO_TRAINERS, as_near_exact, needs_cuda, patch_names, rel_err
from test_qwen3_training import assert_params_close, batches

COMMON = dict(vocab_size=2048, hidden_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
              max_position_embeddings=256, tie_word_embeddings=False, attn_implementation="sdpa")
IDS = dict(pad_token_id=0, bos_token_id=1, eos_token_id=2)  # inside the mini vocabulary
WINDOW = 16  # shorter than the test sequences, so that a wrong window shows
ALTERNATING = ["sliding_attention", "full_attention"] * 2
PARTIAL_ROPE = {"rope_type": "default", "rope_theta": 1e4, "partial_rotary_factor": 0.5}  # half of each head
# Qwen3.5: three Gated DeltaNet layers (2 key heads, each read by 2 value heads) and a full-attention layer;
# half of each head rotated by multimodal RoPE (sections of 4, 2 and 2 frequencies)
DELTA_NET = dict(num_hidden_layers=4, layer_types=["linear_attention"] * 3 + ["full_attention"], head_dim=32,
                 linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16, linear_value_head_dim=16,
                 linear_conv_kernel_dim=4,
                 rope_parameters={**PARTIAL_ROPE, "mrope_section": [4, 2, 2], "mrope_interleaved": True})
CONFIGS = {
    "llama": ("LlamaConfig", "LlamaForCausalLM", dict(intermediate_size=256)),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM", dict(intermediate_size=256)),
    "mistral": ("MistralConfig", "MistralForCausalLM", dict(intermediate_size=256, head_dim=32)),
    # router aux loss on, so that the patched forward must add it as HF does; layer 1 is a dense MLP
    "qwen3_moe": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM",
                  dict(head_dim=32, moe_intermediate_size=64, num_experts=8, num_experts_per_tok=2,
                       output_router_logits=True, router_aux_loss_coef=0.01, norm_topk_prob=True,
                       intermediate_size=256, mlp_only_layers=[1])),
    # Qwen2's q/k/v biases and window (layer 0 sliding), 2 of 8 experts (their weights not renormalised) beside a
    # sigmoid-gated shared expert; layer 1 a dense MLP; router aux loss on
    "qwen2_moe": ("Qwen2MoeConfig", "Qwen2MoeForCausalLM",
                  dict(intermediate_size=256, moe_intermediate_size=64, shared_expert_intermediate_size=64,
                       num_experts=8, num_experts_per_tok=2, output_router_logits=True, router_aux_loss_coef=0.01,
                       mlp_only_layers=[1], use_sliding_window=True, sliding_window=WINDOW, max_window_layers=1)),
    "gpt_oss": ("GptOssConfig", "GptOssForCausalLM",
                dict(head_dim=32, intermediate_size=64, num_local_experts=4, num_experts_per_tok=2,
                     output_router_logits=True, sliding_window=WINDOW, layer_types=ALTERNATING[:2],
                     attn_implementation="eager")),  # sdpa lacks GPT-OSS's attention sinks
    "mixtral": ("MixtralConfig", "MixtralForCausalLM",
                dict(head_dim=32, intermediate_size=64, num_local_experts=4, num_experts_per_tok=2,
                     output_router_logits=True, router_aux_loss_coef=0.01, sliding_window=WINDOW)),
    # fused qkv_proj and gate_up_proj, half the head rotated, dropout on the residual branches
    "phi3": ("Phi3Config", "Phi3ForCausalLM",
             dict(intermediate_size=256, num_hidden_layers=3, sliding_window=WINDOW, resid_pdrop=0.1,
                  rope_parameters={"rope_type": "default", "rope_theta": 1e4, "partial_rotary_factor": 0.5}, **IDS)),
    # layer 2 of 4 is NoPE; sliding and full layers alternate; a tied head
    "smollm3": ("SmolLM3Config", "SmolLM3ForCausalLM",
                dict(intermediate_size=256, num_hidden_layers=4, no_rope_layer_interval=3, use_sliding_window=True,
                     sliding_window=WINDOW, layer_types=ALTERNATING, tie_word_embeddings=True, **IDS)),
    "granite": ("GraniteConfig", "GraniteForCausalLM",
                dict(intermediate_size=256, num_hidden_layers=3, embedding_multiplier=3.0, residual_multiplier=0.5,
                     attention_multiplier=0.1, logits_scaling=4.0)),
    # Granite's multipliers and scaling around 2 of 4 experts a token (no aux loss: families.py)
    "granitemoe": ("GraniteMoeConfig", "GraniteMoeForCausalLM",
                   dict(intermediate_size=64, num_hidden_layers=3, num_local_experts=4, num_experts_per_tok=2,
                        embedding_multiplier=3.0,
                        residual_multiplier=0.5, attention_multiplier=0.1, logits_scaling=4.0)),
    # queries past position 8 are scaled up
    "ministral3": ("Ministral3Config", "Ministral3ForCausalLM",
                   dict(intermediate_size=256, num_hidden_layers=3, head_dim=32, sliding_window=WINDOW,
                        rope_parameters={"rope_type": "yarn", "rope_theta": 1e6, "factor": 4.0,
                                         "original_max_position_embeddings": 8, "llama_4_scaling_beta": 0.1})),
    "olmo2": ("Olmo2Config", "Olmo2ForCausalLM", dict(intermediate_size=256, num_hidden_layers=3, **IDS)),
    # OLMo 2's full-width q/k norms under Llama's norms, layers and rotation; 2 of 8 experts a token
    "olmoe": ("OlmoeConfig", "OlmoeForCausalLM",
              dict(intermediate_size=64, num_experts=8, num_experts_per_tok=2, output_router_logits=True,
                   router_aux_loss_coef=0.01, **IDS)),
    "olmo3": ("Olmo3Config", "Olmo3ForCausalLM",
              dict(intermediate_size=256, num_hidden_layers=4, sliding_window=WINDOW, layer_types=ALTERNATING, **IDS)),
    # interleaved rotation of half the head, q/k/v biases, sandwich norms
    "glm4": ("Glm4Config", "Glm4ForCausalLM",
             dict(intermediate_size=256, num_hidden_layers=3, head_dim=32, attention_bias=True,
                  rope_parameters={"rope_type": "default", "rope_theta": 1e4, "partial_rotary_factor": 0.5}, **IDS)),
    # GLM-4.5's MoE: layer 0 dense, then a sigmoid router over 2 groups of 4 experts (top group 1, a correction
    # bias), 2 routed experts scaled by 2.5 and a shared expert; q/k norms per head, half of each head rotated
    "glm4_moe": ("Glm4MoeConfig", "Glm4MoeForCausalLM",
                 dict(intermediate_size=256, num_hidden_layers=3, head_dim=32, attention_bias=True, use_qk_norm=True,
                      moe_intermediate_size=64, n_routed_experts=8, num_experts_per_tok=2, n_group=2, topk_group=1,
                      routed_scaling_factor=2.5, n_shared_experts=1, first_k_dense_replace=1, **IDS)),
    # whole heads rotated interleaved on f32 tables, biases everywhere
    "ernie4_5": ("Ernie4_5Config", "Ernie4_5ForCausalLM", dict(intermediate_size=256, use_bias=True, **IDS)),
    # layer 0 dense, then 2 of 8 experts beside a shared expert (2 experts wide), router aux loss on
    "ernie4_5_moe": ("Ernie4_5_MoeConfig", "Ernie4_5_MoeForCausalLM",
                     dict(intermediate_size=256, num_hidden_layers=3, moe_intermediate_size=64, moe_num_experts=8,
                          moe_k=2, moe_num_shared_experts=2, moe_layer_start_index=1, moe_layer_interval=1,
                          output_router_logits=True, router_aux_loss_coef=0.01, **IDS)),
    # (1 + w) norms, GELU-tanh MLPs, embeddings scaled by sqrt(hidden)
    "gemma": ("GemmaConfig", "GemmaForCausalLM", dict(intermediate_size=256, head_dim=32, **IDS)),
    # sandwich norms, sliding and full layers, attention and final-logit softcaps (HF applies the attention's
    # in its eager attention only), a query scale other than head_dim's
    "gemma2": ("Gemma2Config", "Gemma2ForCausalLM",
               dict(intermediate_size=256, num_hidden_layers=4, head_dim=32, sliding_window=WINDOW,
                    layer_types=ALTERNATING, query_pre_attn_scalar=24, attn_logit_softcapping=5.0,
                    final_logit_softcapping=3.0, attn_implementation="eager", **IDS)),
    # (1 + w) q/k norms, RoPE bases per layer type (the full layers' linearly scaled)
    "gemma3_text": ("Gemma3TextConfig", "Gemma3ForCausalLM",
                    dict(intermediate_size=256, num_hidden_layers=4, head_dim=32, sliding_window=WINDOW,
                         layer_types=ALTERNATING, query_pre_attn_scalar=24, final_logit_softcapping=3.0,
                         rope_parameters={"sliding_attention": {"rope_type": "default", "rope_theta": 1e4},
                                          "full_attention": {"rope_type": "linear", "rope_theta": 1e6, "factor": 8.0}},
                         **IDS)),
    # per-layer embeddings; full layers with head_dim 16, one kv head, v = k's projection and a quarter of the
    # head rotated (proportional RoPE); layers 2 and 3 reuse the k/v of layers 0 and 1 and have double-wide
    # MLPs; v normed without a weight; attention scaled by 1 (head_dim 8: wider heads make 6 fp32 steps chaotic,
    # HF's eager and SDPA attention 1e-4 apart)
    "gemma4_text": ("Gemma4TextConfig", "Gemma4ForCausalLM",
                    dict(intermediate_size=256, num_hidden_layers=4, head_dim=8, global_head_dim=16,
                         num_global_key_value_heads=1, attention_k_eq_v=True, sliding_window=WINDOW,
                         layer_types=ALTERNATING, num_kv_shared_layers=2, use_double_wide_mlp=True,
                         hidden_size_per_layer_input=16, vocab_size_per_layer_input=COMMON["vocab_size"],
                         final_logit_softcapping=3.0, **IDS)),
    # Gated DeltaNet layers, a gated full attention with (1 + w) q/k norms, partial multimodal RoPE
    "qwen3_5_text": ("Qwen3_5TextConfig", "Qwen3_5ForCausalLM", dict(intermediate_size=256, **DELTA_NET, **IDS)),
    # the same layers with a gated shared expert beside the routed ones, router aux loss on
    "qwen3_5_moe_text": ("Qwen3_5MoeTextConfig", "Qwen3_5MoeForCausalLM",
                         dict(moe_intermediate_size=64, shared_expert_intermediate_size=64, num_experts=8,
                              num_experts_per_tok=2, output_router_logits=True, router_aux_loss_coef=0.01,
                              **DELTA_NET, **IDS)),
    # gated short convolutions (3 taps, biased) on layers 0 and 2, attention with per-head q/k norms on 1 and 3;
    # the MLP's width adjusted from intermediate_size by the block_* keys (2/3 of 384, a multiple of 32)
    "lfm2": ("Lfm2Config", "Lfm2ForCausalLM",
             dict(intermediate_size=384, block_multiple_of=32, num_hidden_layers=4, conv_bias=True,
                  layer_types=["conv", "full_attention"] * 2, **IDS)),
    # LFM2's layers (biased short convolutions on layers 0 and 2), layer 0 a dense MLP, the others 2 of 8 routed
    # experts (their act_fn F.silu, a function) behind a sigmoid router with an expert bias, scaled by 2.5
    "lfm2_moe": ("Lfm2MoeConfig", "Lfm2MoeForCausalLM",
                 dict(intermediate_size=256, moe_intermediate_size=64, num_experts=8, num_experts_per_tok=2,
                      num_dense_layers=1, routed_scaling_factor=2.5, num_hidden_layers=4, conv_bias=True,
                      layer_types=["conv", "full_attention"] * 2, **IDS)),
    # Qwen3.5-MoE's layers with the Gated DeltaNet's projections grouped by key head, half of each head rotated by
    # plain RoPE; layer 1 (a Gated DeltaNet's) a dense MLP, router aux loss on
    "qwen3_next": ("Qwen3NextConfig", "Qwen3NextForCausalLM",
                   dict(intermediate_size=256, moe_intermediate_size=64, shared_expert_intermediate_size=64,
                        num_experts=8, num_experts_per_tok=2, output_router_logits=True, router_aux_loss_coef=0.01,
                        mlp_only_layers=[1], **{**DELTA_NET, "rope_parameters": PARTIAL_ROPE}, **IDS)),
}
FAMILIES = list(CONFIGS)
NEW = ["mixtral", "phi3", "smollm3", "granite", "ministral3", "olmo2", "olmo3", "olmoe", "glm4", "glm4_moe", "gemma", "gemma2",
       "gemma3_text",
       "gemma4_text", "qwen3_5_text", "qwen3_5_moe_text", "lfm2", "lfm2_moe", "qwen3_next", "qwen2_moe", "granitemoe",
       "ernie4_5", "ernie4_5_moe"]
# Qwen3's own training tests use a larger model (test_qwen3_training.py); this one is for the other tests.
MINI = {**CONFIGS, "qwen3": ("Qwen3Config", "Qwen3ForCausalLM", dict(intermediate_size=256, head_dim=32))}
LR = 2e-3
STEPS = 6
# Families with no causal LM of their own: their multimodal model (fp32, training mode)
WRAPPED = {"qwen3_vl_text": lambda: qwen3_vl_multimodal(), "qwen3_vl_moe_text": lambda: qwen3_vl_multimodal(moe=True),
           "qwen2_5_vl_text": lambda: qwen2_vl_multimodal("qwen2_5_vl"), "qwen2_vl_text": lambda: qwen2_vl_multimodal("qwen2_vl")}


# Weights transformers 5.17 leaves at zeros where 5.23 draws them, as checkpoints have them: ERNIE 4.5's routers
# (at zeros every expert ties, and HF's CPU top-k orders ties its own way, CUDA's and Bastile's by index)
DRAWN = {"Ernie4_5_MoeTopKRouter"}


def drawn(model):
    """The model with the weights of DRAWN drawn as transformers 5.23 initialises them."""
    with torch.no_grad():
        for m in model.modules():
            if type(m).__name__ in DRAWN:
                m.weight.normal_(0.0, model.config.initializer_range)
    return model


def mini(family, device, dtype, seed=0, **overrides):
    config_cls, model_cls, extra = MINI[family]
    torch.manual_seed(seed)
    cfg = getattr(transformers, config_cls)(**{**COMMON, **extra, **overrides})
    return drawn(getattr(transformers, model_cls)(cfg)).to(device=device, dtype=dtype).train()


class Dispatched(TorchDispatchMode):
    """The names of the bastile ops a region runs, without the _forward/_backward of the pieces their
    autograd nodes call; `calls` each call's op, `tensors` how many tensors it was passed."""

    def __init__(self):
        super().__init__()
        self.ops = set()
        self.calls = []
        self.tensors = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.namespace == "bastile":
            self.ops.add(func._opname.removesuffix("_forward").removesuffix("_backward"))
            self.calls.append(func._opname)
            self.tensors.append(sum(isinstance(a, torch.Tensor) for a in (*args, *(kwargs or {}).values())))
        return func(*args, **(kwargs or {}))


def route_op(traits):
    """The op running the family's router."""
    return "expert_route_sigmoid" if traits.mlp.router.kind in ("glm4_moe", "lfm2_moe") else "expert_route"


def expected_ops(family, model):
    """The ops a patched training step of the family's model must run: its norms, rotation (with the q/k norms where
    the rotation is whole-head and half-split), MLP (and its experts' grouping, dispatch and combine where it has
    experts, Gemma 4's being optional, and its routing where Bastile runs its router), head, Gated DeltaNet's and
    short convolution's."""
    t = TRAITS[family]
    fused = t.attention.qk_norm.name == "PER_HEAD" and t.rotary.layout.name == "HALF_SPLIT" and not t.rotary.partial
    attention = "qk_norm_rope" if fused else "rope"
    mlp = {"geglu" if t.mlp.experts == "geglu" else "swiglu"}
    if t.mlp.experts and any(type(m).__name__ == t.name("Experts") for m in model.modules()):
        mlp |= {"expert_group", "expert_dispatch", "expert_combine"}
    if t.mlp.router and any(type(m).__name__ == t.name("TopKRouter") for m in model.modules()):
        mlp |= {route_op(t)}
    delta_net = {"causal_conv1d", "gated_delta_rule", "rms_norm_gated"} if t.linear_attention else set()
    conv = {"causal_conv1d"} if t.short_conv else set()
    return {"rms_norm", attention, "fused_linear_cross_entropy"} | mlp | delta_net | conv


def assert_grad_close(a, b, name, exact=None):
    """fp32 gradients of two implementations: within 1e-5 in norm, and each element within 1e-4 of itself or
    1e-5 of the tensor's largest (elements near zero are sums that cancel, their rounding that of the large
    terms). A Gated DeltaNet's decay parameters (DECAY), whose gradients are sums that cancel to 1e-3 of
    their terms, within 1e-4 in norm. `exact`: a function giving the reference's gradients in fp64; where a and b
    are farther apart than that, a is held to those instead (as_near_exact)."""
    if name.endswith(DECAY):
        assert rel_err(a, b) < 1e-4, f"{name}: {rel_err(a, b):.2e} of its norm apart"
        return
    try:
        assert (a - b).norm() <= 1e-5 * b.norm(), f"{name}: {(a - b).norm() / b.norm():.2e} of its norm apart"
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5 * float(b.abs().max()), msg=name)
    except AssertionError:
        if exact is None:
            raise
        e = exact()[name]
        assert as_near_exact(a, b, e), f"{name}: {rel_err(a, e):.2e} from fp64, the reference {rel_err(b, e):.2e}"


def in_fp64(model):
    """model (or a PEFT model of it, which passes the call on) in float64, its experts on transformers' eager
    loop: its grouped_mm takes no float64."""
    model = model.double()
    model.set_experts_implementation("eager")
    return model


def train(model, data, seed=7):
    """AdamW steps (each of one micro-batch) from a fixed RNG state (Phi-3's residual dropout); the losses,
    and the gradients of the first step."""
    return adam_steps(model, [dict(input_ids=ids, labels=labels) for (ids, labels), in data], seed)


def adam_steps(model, inputs, seed=7):
    """An AdamW step on each of `inputs` (the model's keyword arguments) from a fixed RNG state; the losses, and the
    gradients of the first step."""
    torch.manual_seed(seed)
    opt = torch.optim.AdamW(model.parameters(), lr=LR)
    losses, first = [], None
    for kwargs in inputs:
        loss = model(**kwargs).loss
        loss.backward()
        if first is None:
            first = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.item())
    return losses, first


def exact_delta_rule(query, key, value, g, beta, initial_state=None, output_final_state=False,
                     use_qk_l2norm_in_kernel=False, **_):
    """HF's torch_chunk_gated_delta_rule as the recurrence it stands for, in float64 (HF's runs in float32
    whatever its inputs' dtype), q and k repeated for the value heads where they are not yet (5.23)."""
    dtype = value.dtype
    q, k, v, g, beta = (t.double() for t in (query, key, value, g, beta))
    q, k = (t.repeat_interleave(v.shape[2] // t.shape[2], 2) for t in (q, k))
    if use_qk_l2norm_in_kernel:
        q, k = (t * torch.rsqrt((t * t).sum(-1, keepdim=True) + 1e-6) for t in (q, k))
    q = q * q.shape[-1] ** -0.5
    state = (q.new_zeros(q.shape[0], q.shape[2], q.shape[3], v.shape[3]) if initial_state is None
             else initial_state.double())
    out = []
    for t in range(q.shape[1]):
        state = state * g[:, t].exp()[..., None, None]
        delta = (v[:, t] - torch.einsum("bhkv,bhk->bhv", state, k[:, t])) * beta[:, t, :, None]
        state = state + k[:, t, :, :, None] * delta[:, :, None, :]
        out.append(torch.einsum("bhkv,bhk->bhv", state, q[:, t]))
    return torch.stack(out, 1).to(dtype), state.float() if output_final_state else None


# The parameters that reach the Gated DeltaNet's recurrence through its decay g (Qwen3-Next's in_proj_ba: a's rows
# beside b's). HF's chunked rule in float32 gets their gradients 1e-3 off the exact ones in layers whose state decays
# fast (g near -20; Bastile's are within 3e-8): they are compared with HF's model on the exact recurrence
# (exact_grads).
DECAY = ("linear_attn.A_log", "linear_attn.dt_bias", "linear_attn.in_proj_a.weight",
         "linear_attn.in_proj_ba.weight")


def exact_grads(family, model, forward):
    """The gradients of `forward(model)`'s loss, HF's model (unpatched) on exact_delta_rule, of the DECAY
    parameters; none for a family without linear attention."""
    if not TRAITS[family].linear_attention:
        return {}
    with pytest.MonkeyPatch.context() as m:
        m.setattr(sys.modules[TRAITS[family].module], "torch_chunk_gated_delta_rule", exact_delta_rule)
        forward(model).backward()
    return {n: p.grad for n, p in model.named_parameters() if n.endswith(DECAY)}


@pytest.fixture(autouse=True)
def _restore():
    yield
    bastile.reset()


@pytest.mark.parametrize("family", FAMILIES)
def test_training_matches_hf_cpu_fp32(family):
    data = batches(1, 1, 2, 48, "cpu", ignore_fraction=0.1) * STEPS  # one batch: the loss falls within the steps
    ids, labels = data[0][0]
    exact = exact_grads(family, mini(family, "cpu", torch.float32), lambda m: m(input_ids=ids, labels=labels).loss)
    ref = mini(family, "cpu", torch.float32)
    ref_losses, ref_grads = train(ref, data)
    model = mini(family, "cpu", torch.float32)
    names = bastile.apply(model=model, **NO_TRAINERS)
    assert sorted(names) == patch_names(family)
    with Dispatched() as seen:
        out = model(input_ids=ids, labels=labels)
        out.loss.backward()
    assert expected_ops(family, model) <= seen.ops, seen.ops
    assert out.logits is None  # training with labels goes through the fused cross-entropy: no logits
    model.zero_grad(set_to_none=True)
    losses, grads = train(model, data)
    for step, (a, b) in enumerate(zip(losses, ref_losses)):
        assert abs(a - b) <= 1e-5 * abs(b), f"{family} step {step}: {a} vs {b}"
    assert ref_losses[-1] < ref_losses[0]  # it learned something: the comparison is not of constants
    assert grads.keys() == ref_grads.keys()
    for name, g in ref_grads.items():
        assert_grad_close(grads[name], exact.get(name, g), name)
    # Adam turns last-bit gradient differences of near-zero elements into whole steps: in norm, not per element.
    # Where part of each head is not rotated (partial rotation), k's bias there adds one constant to all of a
    # query's scores: its gradient is rounding noise, which Adam's steps follow; so are HF's gradients of the
    # Gated DeltaNet's decay parameters (DECAY), 1e-3 of their size.
    noise = ((("k_proj.bias",) if TRAITS[family].rotary.partial else ())
             + (DECAY if TRAITS[family].linear_attention else ()))
    # Gemma's norms multiply by 1 + w from w = 0: compared as the 1 + w they multiply by (w alone is a few
    # Adam steps, and its relative error that of the steps' noise). One element one step (lr) apart in the
    # smallest tensors (k_proj, 2 x 32 x 128) is 1e-3 of their norm.
    offset = 1.0 if TRAITS[family].norm.name == "OFFSET_THEN_CAST" else 0.0
    effective = lambda m: {n: p + offset if n.endswith("norm.weight") else p for n, p in m.named_parameters()
                           if not n.endswith(noise)}

    @functools.cache
    def steps_in_fp64():  # HF's own steps, for a tensor farther from HF's fp32 than 1.5e-3
        hf = in_fp64(mini(family, "cpu", torch.float32))
        train(hf, data)
        return effective(hf)
    assert_params_close(effective(model), effective(ref), 1.5e-3, steps_in_fp64)


def test_gpt_oss_gate_follows_its_module():
    """GPT-OSS's experts' GEGLU alpha and limit: config keys in newer transformers (swiglu_alpha,
    swiglu_limit), which its modules take; Bastile's gate reads the modules, so it computes what HF's does
    with either release."""
    data = batches(1, 1, 2, 48, "cpu", ignore_fraction=0.1) * STEPS
    ref = mini("gpt_oss", "cpu", torch.float32, swiglu_alpha=1.25, swiglu_limit=0.5)
    model = copy.deepcopy(ref)
    bastile.apply(model=model)
    losses, grads = train(model, data)
    bastile.reset()
    ref_losses, ref_grads = train(ref, data)
    assert losses == pytest.approx(ref_losses, rel=1e-5)
    for name, g in ref_grads.items():
        torch.testing.assert_close(grads[name], g, rtol=1e-4, atol=1e-6, msg=name)


def norm_recomputation(model, family, ids, labels, autocast=False):
    """One training step of a patched model: whether each sublayer's input norm output outlived the forward
    (something kept it), how often each norm ran in the backward, and the gradients; with an outer
    saved-tensor hook (inside which Bastile keeps the outputs), the same step's gradients."""
    res = TRAITS[family].residual
    layers = model.get_decoder().layers
    norms = [getattr(layer, name) for layer in layers for name in (res.attention_in, res.mlp_in) if name]
    outputs, calls = [], {id(n): 0 for n in norms}

    def seen(module, args, out):
        outputs.append(weakref.ref(out))
        calls[id(module)] += 1

    def step():
        torch.manual_seed(7)  # Phi-3's residual dropout: the same masks in both steps
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            loss = model(input_ids=ids, labels=labels).loss
        return loss

    handles = [n.register_forward_hook(seen) for n in norms]
    try:
        loss = step()
        gc.collect()
        kept = sum(r() is not None for r in outputs)
        forward_calls = dict(calls)
        loss.backward()
        backward_calls = [calls[id(n)] - forward_calls[id(n)] for n in norms]
    finally:
        for h in handles:
            h.remove()
    grads = {n: p.grad for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad(set_to_none=True)
    with torch.autograd.graph.saved_tensors_hooks(lambda t: t, lambda t: t):
        step().backward()
    plain = {n: p.grad for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad(set_to_none=True)
    return kept, backward_calls, grads, plain


@pytest.mark.parametrize("family", [f for f in FAMILIES + list(WRAPPED) if TRAITS[f].residual.attention_in])
def test_norm_outputs_are_recomputed_not_kept(family):
    """The outputs of the norms before attention and MLP are not kept for the backward, which computes each
    again once (q, k and v share it) and gets the same gradients, bit for bit, as the step that keeps them."""
    model = WRAPPED[family]() if family in WRAPPED else mini(family, "cpu", torch.float32)
    bastile.apply(model=model, **NO_TRAINERS)
    (ids, labels), = batches(1, 1, 2, 48, "cpu", ignore_fraction=0.1)[0]
    kept, backward_calls, grads, plain = norm_recomputation(model, family, ids, labels)
    assert kept == 0
    assert set(backward_calls) == {1}, backward_calls
    assert grads.keys() == plain.keys()
    for name, g in plain.items():
        assert torch.equal(grads[name], g), name


def test_norm_recomputation_under_autocast_and_checkpointing():
    """A bf16 model under autocast (the projections keep the norm's output itself): the norm is computed
    again as autocast ran it. A checkpointed layer recomputes it in its own recomputation: once per sublayer
    again, nothing of it kept."""
    model = mini("qwen3", "cpu", torch.bfloat16)
    bastile.apply(model=model, **NO_TRAINERS)
    (ids, labels), = batches(1, 1, 2, 48, "cpu", ignore_fraction=0.1)[0]
    kept, calls, grads, plain = norm_recomputation(model, "qwen3", ids, labels, autocast=True)
    assert kept == 0 and set(calls) == {1}
    for name, g in plain.items():
        assert torch.equal(grads[name], g), name
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    kept, calls, grads, _ = norm_recomputation(model, "qwen3", ids, labels, autocast=True)
    assert kept == 0 and set(calls) == {1}
    for name, g in plain.items():  # the checkpointed MLP keeps its activation: bf16 roundings apart
        torch.testing.assert_close(grads[name], g, rtol=2e-2, atol=1e-3 * float(g.abs().max()), msg=name)


@pytest.mark.parametrize("family, shared", [("qwen3_moe", 0), ("gemma3_text", 0), ("gemma4_text", 1), ("lfm2", 0)])
def test_qk_norm_rope_outputs_are_recomputed_not_kept(family, shared, monkeypatch):
    """The attention's kernel would keep qk_norm_rope's outputs (the normed, rotated q and k) beside the inputs
    qk_norm_rope keeps: they are not kept past the forward (but Gemma 4's k that later layers share, which
    those keep), the backward computes each call's again once, and the gradients equal, bit for bit, those of
    the step that keeps them (inside an outer saved-tensor hook)."""
    model = mini(family, "cpu", torch.float32)
    bastile.apply(model=model, **NO_TRAINERS)
    (ids, labels), = batches(1, 1, 2, 48, "cpu", ignore_fraction=0.1)[0]
    made = []
    real = attention_role.qk_norm_rope

    def watched(*args):
        out = real(*args)
        made.append([weakref.ref(t) for t in out])
        return out
    monkeypatch.setattr(attention_role, "qk_norm_rope", watched)
    loss = model(input_ids=ids, labels=labels).loss
    gc.collect()
    calls = len(made)
    kept = sum(r() is not None for refs in made for r in refs)
    loss.backward()
    assert calls > 0 and kept == shared
    assert len(made) == 2 * calls
    grads = {n: p.grad for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad(set_to_none=True)
    with torch.autograd.graph.saved_tensors_hooks(lambda t: t, lambda t: t):
        model(input_ids=ids, labels=labels).loss.backward()
    assert len(made) == 3 * calls  # kept: not computed again
    plain = {n: p.grad for n, p in model.named_parameters() if p.grad is not None}
    assert grads.keys() == plain.keys()
    for name, g in plain.items():
        assert torch.equal(grads[name], g), name


@pytest.mark.parametrize("family", FAMILIES)
def test_generation_matches_hf_and_reset_restores(family):
    ref = mini(family, "cpu", torch.float32).eval()
    if TRAITS[family].head.router_aux_loss:  # HF's own generate fails with it (the mask covers the whole cache)
        ref.config.output_router_logits = False
    prompt = torch.randint(3, COMMON["vocab_size"], (2, 12), generator=torch.Generator().manual_seed(3))
    kw = dict(max_new_tokens=6, do_sample=False, pad_token_id=0)
    expected = ref.generate(prompt, **kw)
    model = copy.deepcopy(ref)
    originals = {(p.module, p.target): getattr(*bastile.patch._resolve(p))
                 for p in bastile.patch.PATCHES if p.family == family}
    bastile.apply(model=model, **NO_TRAINERS)
    assert type(model).forward is not originals[(TRAITS[family].module, f"{TRAITS[family].prefix}ForCausalLM.forward")]
    torch.testing.assert_close(model.generate(prompt, **kw), expected, rtol=0, atol=0)
    bastile.reset()
    for (module, target), original in originals.items():
        p = next(p for p in bastile.patch.PATCHES if (p.module, p.target) == (module, target))
        assert getattr(*bastile.patch._resolve(p)) is original, target


@pytest.mark.parametrize("family", FAMILIES + list(WRAPPED))
def test_layer_rounds_as_hf_bf16_cpu(family):
    """bf16 on the CPU, the first attention layer's attention, MLP, norms and the whole layer on the same
    inputs, with norm weights away from 1: HF's bits almost everywhere (the CPU kernels round as HF's ops do).
    The families' rounding traits (where a norm rounds, OLMo's tables cast back) are invisible in fp32; a trait
    read wrongly here leaves a third of the elements or more off by an ulp. GPT-OSS's experts and its sink
    attention round once where HF rounds after each op (geglu; the scores, the softmax), so its attention, MLP
    and layer are compared by the training tests only; so are LFM2-MoE's MLP and layer (its router's weights, which
    HF sums, divides and scales in bf16, rounded once). Qwen3.5's
    Gated DeltaNet ops also round once (f32 math), where HF's rounds op by op in bf16: its layers are left to
    the training tests, and its first attention layer is the one compared; so are LFM2's (its short convolution's
    layers)."""
    model = (WRAPPED[family]() if family in WRAPPED else mini(family, "cpu", torch.float32)).to(torch.bfloat16).eval()
    decoder = model.get_decoder()
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 1:
                p.normal_(1.0, 0.3, generator=torch.Generator().manual_seed(2))
    g = torch.Generator().manual_seed(0)
    h = torch.randn(2, 40, COMMON["hidden_size"], generator=g).bfloat16()
    types = getattr(decoder.config, "layer_types", None) or ["full_attention"]
    index = next(i for i, t in enumerate(types) if t not in TRAITS[family].mixer_types)
    layer = decoder.layers[index]
    positions = torch.arange(40)[None].expand(2, -1)
    rotary = decoder.pos_emb if family == "lfm2_moe" else decoder.rotary_emb  # LFM2-MoE's name for it
    per_type = "layer_type" in inspect.signature(rotary.forward).parameters
    sections = positions[None].expand(3, -1, -1) if TRAITS[family].rotary.sections else positions
    tables = rotary(h, positions, types[index]) if per_type else rotary(h, sections)
    kw = dict(attention_mask=None, position_ids=positions, position_embeddings=tables)
    if TRAITS[family].attention.shared_kv:
        kw["shared_kv_states"] = {}
    per_layer = ([torch.randn(2, 40, decoder.config.hidden_size_per_layer_input, generator=g).bfloat16()]
                 if TRAITS[family].residual.per_layer_input else [])
    norms = [m for m in layer.modules() if type(m).__name__.endswith("RMSNorm") and getattr(m, "weight", None) is not None]
    inputs = [torch.randn(2, 40, m.weight.shape[0], generator=g).bfloat16() for m in norms]
    t = TRAITS[family]
    sinks = t.attention.sinks
    once = t.mlp.experts == "geglu" or (t.mlp.router is not None and t.mlp.router.kind == "lfm2_moe")

    def run():
        with torch.no_grad():
            outs = ([] if sinks else [layer.self_attn(h, **kw)[0]]) + [m(x) for m, x in zip(norms, inputs)]
            return outs + ([] if once else [layer(h, *per_layer, **kw), getattr(layer, t.residual.mlp)(h)])
    want = run()
    bastile.apply(model=model)
    got = run()
    assert len(got) >= (2 if once else 3)
    for i, (a, b) in enumerate(zip(got, want)):
        a, b = (t[0] if isinstance(t, tuple) else t for t in (a, b))
        assert a.dtype == b.dtype == torch.bfloat16 and a.shape == b.shape
        assert (a == b).float().mean() >= 0.98, f"output {i}: {(a == b).float().mean():.3f} of the elements equal"


def test_roles_patch_their_targets_and_reset_restores_them():
    """Each role of each family replaces what it names, and nothing else; reset puts the originals back."""
    for family in TRAITS:
        for role in bastile.patch.ROLES:
            others = {r: False for r in bastile.patch.ROLES if r != role}
            assert sorted(bastile.apply(families=[family], **NO_TRAINERS, **others)) == patch_names(family, [role])
            replaced = bastile.patch._active[f"{role}_{family}"]
            targets = [p for p in bastile.patch.PATCHES if p.name == f"{role}_{family}"]
            assert len(replaced) == len(targets) > 0, (family, role)
            for (owner, attr, original, _), patch in zip(replaced, targets):
                if isinstance(patch.replacement, bastile.patch.Wrap):  # made from the original, around it
                    assert getattr(owner, attr).__wrapped__ is original, (family, patch.target)
                else:
                    assert getattr(owner, attr) is patch.replacement, (family, patch.target)
            bastile.reset()
            for owner, attr, original, _ in replaced:
                assert owner.__dict__.get(attr) is original
    assert bastile.get_patched_ops() == []


def test_mini_models_have_the_traits_the_tests_rely_on():
    """The mini configs build what the training tests are meant to exercise."""
    moe = mini("qwen3_moe", "cpu", torch.float32)
    assert [type(layer.mlp).__name__ for layer in moe.model.layers] == ["Qwen3MoeSparseMoeBlock", "Qwen3MoeMLP"]
    smol = mini("smollm3", "cpu", torch.float32)
    assert [layer.self_attn.use_rope for layer in smol.model.layers] == [1, 1, 0, 1]
    assert [layer.self_attn.sliding_window for layer in smol.model.layers] == [WINDOW, None] * 2
    olmo3 = mini("olmo3", "cpu", torch.float32)
    assert [layer.self_attn.sliding_window for layer in olmo3.model.layers] == [WINDOW, None] * 2
    for family, width in [("phi3", 16), ("glm4", 16)]:  # head_dim 32, half of it rotated
        model = mini(family, "cpu", torch.float32)
        cos, _ = model.model.rotary_emb(torch.ones(1), torch.arange(3)[None])
        assert cos.shape[-1] == width
    olmo2 = mini("olmo2", "cpu", torch.float32)
    assert olmo2.model.layers[0].self_attn.q_norm.weight.shape == (COMMON["hidden_size"],)  # the whole width
    for family in ("qwen3_5_text", "qwen3_5_moe_text"):  # 3 Gated DeltaNets (2 key heads, 4 value heads), 1 attention
        model = mini(family, "cpu", torch.float32)
        mixers = [getattr(layer, "linear_attn", None) or layer.self_attn for layer in model.model.layers]
        names = [type(m).__name__.removeprefix(TRAITS[family].prefix) for m in mixers]
        assert names == ["GatedDeltaNet"] * 3 + ["Attention"]
        assert (mixers[0].num_k_heads, mixers[0].num_v_heads) == (2, 4)
        assert mixers[3].q_proj.out_features == 2 * mixers[3].o_proj.in_features  # the query and its gate
        cos, _ = model.model.rotary_emb(torch.ones(1), torch.arange(3)[None, None].expand(3, 1, -1))
        assert cos.shape[-1] == 16  # half the head
    # Qwen3-Next: the same mixers, the Gated DeltaNet's q, k, v, z in one projection and b, a in another; plain
    # RoPE over half the head; layer 1 a dense MLP, the others routed experts beside a gated shared expert
    model = mini("qwen3_next", "cpu", torch.float32)
    mixers = [getattr(layer, "linear_attn", None) or layer.self_attn for layer in model.model.layers]
    assert [type(m).__name__ for m in mixers] == ["Qwen3NextGatedDeltaNet"] * 3 + ["Qwen3NextAttention"]
    assert (mixers[0].num_k_heads, mixers[0].num_v_heads) == (2, 4)
    assert mixers[0].in_proj_qkvz.out_features == 2 * mixers[0].key_dim + 2 * mixers[0].value_dim
    assert mixers[3].q_proj.out_features == 2 * mixers[3].o_proj.in_features
    cos, _ = model.model.rotary_emb(torch.ones(1), torch.arange(3)[None])
    assert cos.shape[-1] == 16
    assert [type(layer.mlp).__name__.removeprefix("Qwen3Next") for layer in model.model.layers] \
        == ["SparseMoeBlock", "MLP", "SparseMoeBlock", "SparseMoeBlock"]
    for model_type in ("qwen2_5_vl", "qwen2_vl"):  # the last of three layers slides; the text MLP is a Qwen2MLP
        decoder = qwen2_vl_multimodal(model_type).model.language_model
        assert decoder.config.layer_types == ["full_attention"] * 2 + ["sliding_attention"]
        assert {type(layer.mlp).__name__ for layer in decoder.layers} == {"Qwen2MLP"}
    # Qwen2.5-VL's vision blocks (one windowed, one full) are normed by the text's RMSNorm class, which Bastile patches
    visual = qwen2_vl_multimodal("qwen2_5_vl").model.visual
    assert {type(b.norm1).__name__ for b in visual.blocks} == {"Qwen2_5_VLRMSNorm"} and visual.fullatt_block_indexes == [1]
    lfm2 = mini("lfm2", "cpu", torch.float32)  # biased short convolutions on layers 0 and 2, the MLP 2/3 as wide
    assert [type(getattr(layer, "conv", None) or layer.self_attn).__name__ for layer in lfm2.model.layers] \
        == ["Lfm2ShortConv", "Lfm2Attention"] * 2
    assert lfm2.model.layers[0].conv.conv.bias is not None and lfm2.model.layers[0].feed_forward.w1.out_features == 256
    lfm2_moe = mini("lfm2_moe", "cpu", torch.float32)  # layer 0 dense, then routed experts whose act_fn is F.silu
    assert [type(layer.feed_forward).__name__ for layer in lfm2_moe.model.layers] \
        == ["Lfm2MoeMLP"] + ["Lfm2MoeSparseMoeBlock"] * 3
    assert lfm2_moe.model.layers[1].feed_forward.experts.act_fn is torch.nn.functional.silu
    assert lfm2_moe.model.layers[1].feed_forward.use_expert_bias
    vl = qwen3_vl_multimodal()  # DeepStack's features go to the first two of three layers
    assert len(vl.model.visual.deepstack_merger_list) == 2 < len(vl.model.language_model.layers)
    vl_moe = qwen3_vl_multimodal(moe=True)
    assert [type(layer.mlp).__name__.removeprefix("Qwen3VLMoeText") for layer in vl_moe.model.language_model.layers] \
        == ["SparseMoeBlock", "MLP", "SparseMoeBlock"]


def gemma3_multimodal(seed=0):
    """Gemma3ForConditionalGeneration with the gemma3_text mini as its language model and a one-layer SigLIP
    tower: a 28x28 image is 16 patches, pooled to 4 image tokens (id IMAGE)."""
    _, _, text = MINI["gemma3_text"]
    torch.manual_seed(seed)
    cfg = transformers.Gemma3Config(
        text_config=transformers.Gemma3TextConfig(**{**COMMON, **text}),
        vision_config=transformers.SiglipVisionConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                                      num_attention_heads=2, image_size=28, patch_size=7),
        mm_tokens_per_image=4, image_token_index=IMAGE, boi_token_index=IMAGE - 1, eoi_token_index=IMAGE + 1)
    cfg.text_config._attn_implementation = cfg._attn_implementation = "sdpa"
    return transformers.Gemma3ForConditionalGeneration(cfg).train()


def gemma4_multimodal(seed=0):
    """Gemma4ForConditionalGeneration with the gemma4_text mini as its language model (its image tokens
    attending both ways: use_bidirectional_attention="vision") and a one-layer vision tower: 16 patches of 4x4
    pixels, pooled 2x2 to 4 image tokens (id IMAGE); no audio tower."""
    _, _, text = MINI["gemma4_text"]
    torch.manual_seed(seed)
    cfg = transformers.Gemma4Config(
        text_config=transformers.Gemma4TextConfig(**{**COMMON, **text, "use_bidirectional_attention": "vision"}),
        vision_config=transformers.Gemma4VisionConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                                      num_attention_heads=2, num_key_value_heads=2, head_dim=16,
                                                      patch_size=4, pooling_kernel_size=2, position_embedding_size=8),
        audio_config=None, image_token_id=IMAGE, boi_token_id=IMAGE - 1, eoi_token_id=IMAGE + 1)
    cfg.text_config._attn_implementation = cfg._attn_implementation = "sdpa"
    return transformers.Gemma4ForConditionalGeneration(cfg).train()


def qwen3_5_multimodal(family, seed=0):
    """Qwen3_5(Moe)ForConditionalGeneration with the family's mini as its language model and a one-block
    vision tower: a 16x16 image is 4x4 patches of 4x4 pixels (two frames), merged 2x2 to 4 image tokens (id
    IMAGE), placed by multimodal RoPE."""
    config, _, text = MINI[family]
    prefix = config.removesuffix("TextConfig")
    torch.manual_seed(seed)
    cfg = getattr(transformers, f"{prefix}Config")(
        text_config=getattr(transformers, config)(**{**COMMON, **text}),
        vision_config=getattr(transformers, f"{prefix}VisionConfig")(
            depth=1, hidden_size=32, intermediate_size=64, num_heads=2, patch_size=4, temporal_patch_size=2,
            spatial_merge_size=2, out_hidden_size=COMMON["hidden_size"], num_position_embeddings=16),
        image_token_id=IMAGE, video_token_id=IMAGE + 2, vision_start_token_id=IMAGE - 1,
        vision_end_token_id=IMAGE + 1)
    cfg.text_config._attn_implementation = cfg._attn_implementation = "sdpa"
    return getattr(transformers, f"{prefix}ForConditionalGeneration")(cfg).train()


# Qwen3-VL's language model (no causal LM of its own): Qwen3's layers under interleaved multimodal RoPE (sections of 8,
# 4 and 4 frequencies); three layers, the first two of which take DeepStack's features
QWEN3_VL_TEXT = dict(intermediate_size=256, num_hidden_layers=3, head_dim=32,
                     rope_parameters={"rope_type": "default", "rope_theta": 1e4, "mrope_section": [8, 4, 4],
                                      "mrope_interleaved": True}, **IDS)


# its MoE model's: 16 experts, top-2, router aux loss on; layer 1 a dense MLP. (With 8, a last-bit difference flips
# a token's experts in the text-only run by step 6 under transformers 5.23, whose HF eager and grouped experts
# drift 1.7e-6 apart there, and the losses 2e-5.)
QWEN3_VL_MOE_TEXT = dict(QWEN3_VL_TEXT, moe_intermediate_size=64, num_experts=16, num_experts_per_tok=2,
                         output_router_logits=True, router_aux_loss_coef=0.01, mlp_only_layers=[1])


def qwen3_vl_multimodal(moe=False, seed=0):
    """Qwen3VL(Moe)ForConditionalGeneration with QWEN3_VL(_MOE)_TEXT as its language model and a two-block vision
    tower whose blocks' features DeepStack adds to the first two layers' outputs: a 16x16 image is 4x4 patches of
    4x4 pixels (two frames), merged 2x2 to 4 image tokens (id IMAGE), placed by multimodal RoPE."""
    prefix, text = ("Qwen3VLMoe", QWEN3_VL_MOE_TEXT) if moe else ("Qwen3VL", QWEN3_VL_TEXT)
    torch.manual_seed(seed)
    cfg = getattr(transformers, f"{prefix}Config")(
        text_config=getattr(transformers, f"{prefix}TextConfig")(**{**COMMON, **text}),
        vision_config=getattr(transformers, f"{prefix}VisionConfig")(
            depth=2, hidden_size=32, intermediate_size=64, num_heads=2, patch_size=4, temporal_patch_size=2,
            spatial_merge_size=2, out_hidden_size=COMMON["hidden_size"], num_position_embeddings=16,
            deepstack_visual_indexes=[0, 1]),
        image_token_id=IMAGE, video_token_id=IMAGE + 2, vision_start_token_id=IMAGE - 1,
        vision_end_token_id=IMAGE + 1, tie_word_embeddings=False)
    cfg.text_config._attn_implementation = cfg._attn_implementation = "sdpa"
    return getattr(transformers, f"{prefix}ForConditionalGeneration")(cfg).train()


# Qwen2-VL's and Qwen2.5-VL's language model (no causal LM of its own): Qwen2's layers (q/k/v biases) under multimodal
# RoPE (sections of 8, 4 and 4 frequencies); three layers, the last on a sliding window
QWEN2_VL_TEXT = dict(intermediate_size=256, num_hidden_layers=3, use_sliding_window=True, sliding_window=WINDOW,
                     max_window_layers=2, rope_parameters={"rope_type": "default", "rope_theta": 1e4,
                                                           "mrope_section": [8, 4, 4]}, **IDS)


def qwen2_vl_multimodal(model_type, seed=0):
    """Qwen2VLForConditionalGeneration or Qwen2_5_VLForConditionalGeneration with QWEN2_VL_TEXT as its language model
    and a two-block vision tower (Qwen2.5-VL's first block attends within windows of one merged patch): a 16x16 image
    is 4x4 patches of 4x4 pixels (two frames), merged 2x2 to 4 image tokens (id IMAGE), placed by multimodal RoPE."""
    prefix = {"qwen2_vl": "Qwen2VL", "qwen2_5_vl": "Qwen2_5_VL"}[model_type]
    tower = dict(depth=2, num_heads=2, patch_size=4, temporal_patch_size=2, spatial_merge_size=2)
    if model_type == "qwen2_5_vl":
        tower.update(hidden_size=32, intermediate_size=64, out_hidden_size=COMMON["hidden_size"], window_size=8,
                     fullatt_block_indexes=[1])
    else:
        tower.update(embed_dim=32, mlp_ratio=2, hidden_size=COMMON["hidden_size"])
    torch.manual_seed(seed)
    cfg = getattr(transformers, f"{prefix}Config")(
        text_config=getattr(transformers, f"{prefix}TextConfig")(**{**COMMON, **QWEN2_VL_TEXT}),
        vision_config=getattr(transformers, f"{prefix}VisionConfig")(**tower),
        image_token_id=IMAGE, video_token_id=IMAGE + 2, vision_start_token_id=IMAGE - 1,
        vision_end_token_id=IMAGE + 1, tie_word_embeddings=False)
    cfg.text_config._attn_implementation = cfg._attn_implementation = "sdpa"
    return getattr(transformers, f"{prefix}ForConditionalGeneration")(cfg).train()


def mistral3_multimodal(family, seed=0):
    """Mistral3ForConditionalGeneration with the family's mini as its language model (Ministral 3's, or Mistral's
    as in Mistral Small 3.x) and a one-layer Pixtral tower: a 16x16 image is 4x4 patches of 4x4 pixels, merged 2x2
    to 4 image tokens (id IMAGE)."""
    config, _, text = MINI[family]
    torch.manual_seed(seed)
    cfg = transformers.Mistral3Config(
        text_config=getattr(transformers, config)(**{**COMMON, **text}),
        vision_config=transformers.PixtralVisionConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                                       num_attention_heads=2, head_dim=16, patch_size=4,
                                                       image_size=16),
        image_token_index=IMAGE, spatial_merge_size=2)
    cfg.text_config._attn_implementation = cfg._attn_implementation = "sdpa"
    return transformers.Mistral3ForConditionalGeneration(cfg).train()


IMAGE = 600  # above the ids batches() draws
# model type -> (its mini, its language model's family, the tolerance of the losses and of the first-step
# gradients, its vision tower). Gemma 4's text mini (attention scaled by 1) amplifies fp32 rounding: into the vision
# tower's gradients (HF's eager and SDPA attention give gradients 8e-6 apart there, Bastile's 1.7e-5 from SDPA's;
# in fp64 (HF's norms run in fp64) Bastile's are within 1e-7 of HF's, the rounding of HF's fp32 loss), and over the
# AdamW steps of an image batch into the losses: on an AMD EPYC, HF's fp32 losses are 2.0e-5 from HF's in fp64 by
# the sixth step, Bastile's 3.0e-6 from them and 1.8e-5 from HF's fp32. Qwen3-VL's text batch likewise: on an Intel
# Xeon (AVX-512) HF's fp32 losses are 1.7e-5 from HF's in fp64 by the sixth step (2e-6 by the fifth), Bastile's
# 3.3e-5, 1.6e-5 to 3.1e-5 from HF's fp32 by the tests run before it (3f7e488 alike); on an AMD EPYC within 1e-5.
MULTIMODAL = {"gemma3": (gemma3_multimodal, "gemma3_text", 1e-5, "model.vision_tower"),
              "gemma4": (gemma4_multimodal, "gemma4_text", 3e-5, "model.vision_tower"),
              "qwen3_5": (lambda: qwen3_5_multimodal("qwen3_5_text"), "qwen3_5_text", 1e-5, "model.visual"),
              "qwen3_5_moe": (lambda: qwen3_5_multimodal("qwen3_5_moe_text"), "qwen3_5_moe_text", 1e-5,
                              "model.visual"),
              "qwen3_vl": (qwen3_vl_multimodal, "qwen3_vl_text", 5e-5, "model.visual"),
              "qwen3_vl_moe": (lambda: qwen3_vl_multimodal(moe=True), "qwen3_vl_moe_text", 1e-5, "model.visual"),
              "qwen2_5_vl": (lambda: qwen2_vl_multimodal("qwen2_5_vl"), "qwen2_5_vl_text", 1e-5, "model.visual"),
              "qwen2_vl": (lambda: qwen2_vl_multimodal("qwen2_vl"), "qwen2_vl_text", 1e-5, "model.visual"),
              "mistral3": (lambda: mistral3_multimodal("ministral3"), "ministral3", 1e-5, "model.vision_tower"),
              "mistral3_mistral": (lambda: mistral3_multimodal("mistral"), "mistral", 1e-5, "model.vision_tower")}


def multimodal_batch(model_type: str, image: bool):
    """(inputs, labels): two rows of 48 tokens, the first with 4 image tokens at 5..8 when `image`."""
    ((ids, labels),) = batches(1, 1, 2, 48, "cpu", ignore_fraction=0.1)[0]
    inputs = dict(input_ids=ids.clone())
    if image:
        inputs["input_ids"][0, 5:9] = IMAGE
        types = (inputs["input_ids"] == IMAGE).long()
        pixels = torch.Generator().manual_seed(4)
        if model_type == "gemma3":
            inputs.update(token_type_ids=types, pixel_values=torch.randn(1, 3, 28, 28, generator=pixels))
        elif model_type.startswith("mistral3"):
            inputs.update(pixel_values=torch.randn(1, 3, 16, 16, generator=pixels), image_sizes=torch.tensor([[16, 16]]))
        elif model_type.startswith(("qwen3_5", "qwen3_vl", "qwen2")):  # the processor's patches: [patches, 3 * 2 * 4 * 4], a 4x4 grid
            inputs.update(mm_token_type_ids=types, pixel_values=torch.randn(16, 96, generator=pixels),
                          image_grid_thw=torch.tensor([[1, 4, 4]]))
        else:  # the processor's patches: [images, patches, 3 * 4 * 4] pixels in [0, 1], their (x, y) on a 4x4 grid
            grid = torch.stack(torch.meshgrid(torch.arange(4), torch.arange(4), indexing="xy"), -1).reshape(1, 16, 2)
            inputs.update(mm_token_type_ids=types, pixel_values=torch.rand(1, 16, 48, generator=pixels),
                          image_position_ids=grid)
        labels = labels.masked_fill(inputs["input_ids"] == IMAGE, -100)
    return inputs, labels


@pytest.mark.parametrize("image", [False, True])
@pytest.mark.parametrize("model_type", list(MULTIMODAL))
def test_multimodal_training_matches_hf_cpu_fp32(model_type, image):
    """The language model of Gemma 3's, Gemma 4's, Qwen3.5's, Qwen3-VL's, Qwen2(.5)-VL's and Mistral 3's multimodal models
    runs Bastile's forwards and head; the vision tower is HF's (but for Qwen2.5-VL's norms). Text-only and image+text
    batches: the losses of 6 AdamW steps and every first-step gradient (the vision tower's and projector's included,
    Qwen3-VL's DeepStack mergers') as HF's, within the family's tolerance."""
    build, family, tolerance, tower = MULTIMODAL[model_type]
    inputs, labels = multimodal_batch(model_type, image)

    run = lambda model: adam_steps(model, [dict(**inputs, labels=labels)] * STEPS)

    exact = exact_grads(family, build(), lambda m: m(**inputs, labels=labels).loss)
    ref_losses, ref_grads = run(build())
    model = build()
    assert sorted(bastile.apply(model=model, **NO_TRAINERS)) == patch_names(family)
    with Dispatched() as seen:
        out = model(**inputs, labels=labels)
    assert expected_ops(family, model) <= seen.ops and out.logits is None
    losses, grads = run(model)
    assert losses == pytest.approx(ref_losses, rel=tolerance) and ref_losses[-1] < ref_losses[0]
    assert grads.keys() == ref_grads.keys() and any(n.startswith(tower) for n in grads) == image
    # In norm: the projector's (zero-initialised) weight gets large gradients of mixed sign, whose small
    # elements carry the summation-order noise of the large ones.
    for name, g in ref_grads.items():
        assert rel_err(grads[name], exact.get(name, g)) < (1e-4 if name in exact else tolerance), name


def test_qwen3_vl_moe_router_loss_matches_hf():
    """Qwen3-VL's MoE head adds the router's load-balancing loss where the call asks for it (output_router_logits;
    transformers 5.23 also takes the text config's): on an image+text batch the loss, the aux loss and the
    gradients are HF's, the sparse layers' experts on Bastile's expert path."""
    inputs, labels = multimodal_batch("qwen3_vl_moe", image=True)

    def step(model):
        out = model(**inputs, labels=labels, output_router_logits=True)
        out.loss.backward()
        return out, {n: p.grad for n, p in model.named_parameters() if p.grad is not None}
    ref, ref_grads = step(qwen3_vl_multimodal(moe=True))
    model = qwen3_vl_multimodal(moe=True)
    bastile.apply(model=model, **NO_TRAINERS)
    calls = []
    real = bastile.roles.mlp.swiglu
    with pytest.MonkeyPatch.context() as m:
        m.setattr(bastile.roles.mlp, "swiglu", lambda *a: calls.append(1) or real(*a))
        out, grads = step(model)
    assert len(calls) >= 2  # the experts' gate of each sparse layer
    assert ref.aux_loss is not None and out.aux_loss is not None
    torch.testing.assert_close(out.aux_loss, ref.aux_loss, rtol=1e-5, atol=0)
    torch.testing.assert_close(out.loss, ref.loss, rtol=1e-5, atol=0)
    assert grads.keys() == ref_grads.keys() and any(".experts." in n for n in grads)
    for name, g in ref_grads.items():
        assert_grad_close(grads[name], g, name)


@pytest.mark.parametrize("family", ["glm4_moe", "lfm2_moe"])
@pytest.mark.parametrize("asked", [True, None])
def test_moe_heads_without_aux_loss_return_hf_outputs(family, asked):
    """MoE heads without a load-balancing loss return HF's output class, and where the call asks for them the router
    logits HF's returns (transformers 5.23: MoeCausalLMOutputWithPast; 5.17: CausalLMOutputWithPast)."""
    ids = torch.randint(0, 128, (2, 12), generator=torch.Generator().manual_seed(3))
    model = mini(family, "cpu", torch.float32)
    want = model(input_ids=ids, labels=ids, output_router_logits=asked)
    bastile.apply(model=model, **NO_TRAINERS)
    got = model(input_ids=ids, labels=ids, output_router_logits=asked)
    assert type(got) is type(want)
    torch.testing.assert_close(got.loss, want.loss, rtol=1e-5, atol=0)
    routed = getattr(want, "router_logits", None)
    assert (routed is not None) == (asked is True and hasattr(want, "router_logits"))
    if routed is not None:
        assert len(got.router_logits) == len(routed)
        for a, b in zip(got.router_logits, routed):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


def test_a_wrapper_of_another_language_model_is_refused():
    """Mistral 3's wrapper holding a decoder of another family than the two Bastile's holds (Llama's): refused,
    naming them, before anything is patched."""
    _, _, text = MINI["llama"]
    cfg = transformers.Mistral3Config(
        text_config=transformers.LlamaConfig(**{**COMMON, **text}),
        vision_config=transformers.PixtralVisionConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                                       num_attention_heads=2, head_dim=16, patch_size=4,
                                                       image_size=16))
    with pytest.raises(Unsupported, match="mistral3 with a 'llama' language model is not supported; Bastile's "
                                          "mistral3 holds ministral3, mistral: nothing was patched"):
        bastile.apply(model=transformers.Mistral3ForConditionalGeneration(cfg))
    assert bastile.get_patched_ops() == []


@pytest.mark.parametrize("model_type", list(MULTIMODAL))
def test_multimodal_generation_matches_hf(model_type):
    build = MULTIMODAL[model_type][0]
    ref = build().eval()
    inputs, _ = multimodal_batch(model_type, image=True)
    inputs = {k: v[:1, :12] if k.endswith("_ids") and k != "image_position_ids" else v for k, v in inputs.items()}
    kw = dict(max_new_tokens=6, do_sample=False, pad_token_id=0)
    expected = ref.generate(**inputs, **kw)
    model = copy.deepcopy(ref)
    family = MULTIMODAL[model_type][1]
    originals = {p: getattr(*bastile.patch._resolve(p)) for p in bastile.patch.PATCHES if p.family == family}
    bastile.apply(model=model, **NO_TRAINERS)
    torch.testing.assert_close(model.generate(**inputs, **kw), expected, rtol=0, atol=0)
    bastile.reset()
    for p, original in originals.items():
        assert getattr(*bastile.patch._resolve(p)) is original, p.target


@pytest.mark.parametrize("reentrant", [False, True])
def test_gemma4_kv_sharing_under_gradient_checkpointing(reentrant):
    """Gemma 4's K/V-sharing layers under HF's gradient checkpointing: non-reentrant (transformers' default),
    the gradients of the run without it, bit for bit. Reentrant runs the layers that make the shared K/V
    without autograd, so their projections miss the sharing layers' gradients (HF's forward too): a warning."""
    (ids, labels), = batches(1, 1, 2, 48, "cpu", 0.1)[0]

    def grads(model):
        model.zero_grad(set_to_none=True)
        model(input_ids=ids, labels=labels).loss.backward()
        return {n: p.grad.clone() for n, p in model.named_parameters()}
    model = mini("gemma4_text", "cpu", torch.float32)
    bastile.apply(model=model)
    plain = grads(model)
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": reentrant})
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        checkpointed = grads(model)
    said = [w for w in caught if "reuses keys and values that carry no gradient" in str(w.message)]
    assert bool(said) == reentrant
    if not reentrant:
        for name, g in plain.items():
            torch.testing.assert_close(checkpointed[name], g, rtol=0, atol=0, msg=name)


@pytest.mark.parametrize("device", DEVICES)
def test_gated_delta_net_compiles_and_checkpoints(device):
    """Qwen3.5 patched: the step traces whole under torch.compile(fullgraph=True) and gives the eager loss;
    under HF's gradient checkpointing its gradients are the eager ones bit for bit. On CUDA the Gated DeltaNet
    has the 9B's head sizes (128) over 1024 tokens in bf16."""
    if device == "cuda":
        model = mini("qwen3_5_text", device, torch.bfloat16, linear_key_head_dim=128, linear_value_head_dim=128,
                     head_dim=128, max_position_embeddings=2048)
        seq, rtol = 1024, 2e-3
    else:
        model = mini("qwen3_5_text", device, torch.float32)
        seq, rtol = 48, 1e-5
    (ids, labels), = batches(1, 1, 2, seq, device, 0.1)[0]
    bastile.apply(model=model)

    def grads():
        model.zero_grad(set_to_none=True)
        loss = model(input_ids=ids, labels=labels).loss
        loss.backward()
        return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}
    with Dispatched() as seen:
        loss, plain = grads()
    assert {"gated_delta_rule", "causal_conv1d"} <= seen.ops
    compiled = torch.compile(lambda: model(input_ids=ids, labels=labels).loss, fullgraph=True, dynamic=False)
    torch.testing.assert_close(compiled().detach(), loss, rtol=rtol, atol=0)
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    with Dispatched() as again:
        checkpointed_loss, checkpointed = grads()
    forward = "gated_delta_rule_forward"  # the autograd node's, which keeps what the backward reads
    assert again.calls.count(forward) == 2 * seen.calls.count(forward) > 0  # recomputed
    assert checkpointed_loss == loss
    for name, g in plain.items():
        torch.testing.assert_close(checkpointed[name], g, rtol=0, atol=0, msg=name)


# ---------------------------------------------------------------- refusals


def test_bidirectional_gemma_is_refused_before_patching():
    model = mini("gemma3_text", "cpu", torch.float32)
    model.config.use_bidirectional_attention = True
    with pytest.raises(Unsupported, match=r"gemma3_text with use_bidirectional_attention=True: Bastile's forwards "
                                          "are causal.*nothing was patched"):
        bastile.apply(model=model)
    assert bastile.get_patched_ops() == []


def test_olmoe_clipping_q_k_v_is_refused_before_patching():
    model = mini("olmoe", "cpu", torch.float32)
    model.config.clip_qkv = 8.0
    with pytest.raises(Unsupported, match=r"olmoe with clip_qkv=8.0: Bastile's attention does not clamp q, k and v"
                                          ".*nothing was patched"):
        bastile.apply(model=model)
    assert bastile.get_patched_ops() == []


def test_granitemoe_router_loss_where_transformers_records_its_logits():
    """GraniteMoE asking for the router's load-balancing loss: from transformers 5.23, whose decoder records the
    router logits, the loss, the aux loss and the gradients are HF's (Bastile's router and block); before it,
    refused before anything is patched (5.17 records none)."""
    ids = torch.randint(0, 128, (2, 12), generator=torch.Generator().manual_seed(4))

    def step(model):
        out = model(input_ids=ids, labels=ids)
        out.loss.backward()
        return out, {n: p.grad for n, p in model.named_parameters() if p.grad is not None}
    build = lambda: mini("granitemoe", "cpu", torch.float32, output_router_logits=True, router_aux_loss_coef=0.01)
    model = build()
    if installed_before("5.23"):
        with pytest.raises(Unsupported, match=r"granitemoe with output_router_logits=True: transformers before 5.23 "
                                              "records no router logits.*nothing was patched"):
            bastile.apply(model=model)
        assert bastile.get_patched_ops() == []
        return
    ref, ref_grads = step(model)
    model = build()
    bastile.apply(model=model, **NO_TRAINERS)
    out, grads = step(model)
    assert ref.aux_loss is not None and len(out.router_logits) == len(ref.router_logits) == 3
    torch.testing.assert_close(out.aux_loss, ref.aux_loss, rtol=1e-5, atol=0)
    torch.testing.assert_close(out.loss, ref.loss, rtol=1e-5, atol=0)
    assert grads.keys() == ref_grads.keys() and any(".router." in n for n in grads)
    for name, g in ref_grads.items():
        assert_grad_close(grads[name], g, name)


def test_gemma4_gradients_are_the_exact_derivative():
    """Gemma 4 at Gemma4TextConfig's defaults made small (3 sliding layers and a full one of twice the head width,
    per-layer inputs): in float64 Bastile's step-1 gradients are those of HF's math (its norms, which round
    through float32, and its loss, taken in float64) to 1e-10; in float32 they are no further from them than HF's
    own, which attention scaled by 1 over wide normed heads puts 1e-4 to 1e-3 away."""
    from transformers.models.gemma4 import modeling_gemma4

    torch.manual_seed(0)
    config = transformers.Gemma4TextConfig(
        vocab_size=2048, hidden_size=128, intermediate_size=256, num_hidden_layers=4, num_attention_heads=4,
        num_key_value_heads=2, vocab_size_per_layer_input=2048, hidden_size_per_layer_input=16,
        attn_implementation="sdpa", tie_word_embeddings=False, **IDS)
    assert config.layer_types == ["sliding_attention"] * 3 + ["full_attention"] and config.hidden_size_per_layer_input
    base = transformers.Gemma4ForCausalLM(config).train()
    ids = torch.randint(3, 512, (2, 48), generator=torch.Generator().manual_seed(1))

    def grads(dtype, loss):
        model = copy.deepcopy(base).to(dtype)
        loss(model).backward()
        return {n: p.grad.double() for n, p in model.named_parameters() if p.grad is not None}

    def exact_loss(model):  # HF's causal LM loss without its float32 upcast of the logits
        logits = model(input_ids=ids).logits
        return torch.nn.functional.cross_entropy(logits[:, :-1].flatten(0, 1), ids[:, 1:].flatten())

    with pytest.MonkeyPatch.context() as m:
        m.setattr(modeling_gemma4.Gemma4RMSNorm, "forward",
                  lambda self, x: self._norm(x) * self.weight if self.with_scale else self._norm(x))
        exact = grads(torch.float64, exact_loss)
    hf32 = grads(torch.float32, lambda model: model(input_ids=ids, labels=ids).loss)
    bastile.apply(model=base, **NO_TRAINERS)
    ours = {dtype: grads(dtype, lambda model: model(input_ids=ids, labels=ids).loss)
            for dtype in (torch.float64, torch.float32)}
    worst = lambda g: max(float((g[n] - e).abs().max() / e.abs().max()) for n, e in exact.items())
    assert ours.keys() and all(g.keys() == exact.keys() for g in (*ours.values(), hf32))
    assert worst(ours[torch.float64]) < 1e-10
    assert worst(ours[torch.float32]) <= 2 * worst(hf32), (worst(ours[torch.float32]), worst(hf32))


def test_gemma4_moe_training_matches_hf_cpu_fp32():
    """Gemma 4's MoE layers (enable_moe_block: a router and GELU-tanh experts beside the dense MLP, each with
    its norms): the losses of 2 AdamW steps and the first step's gradients as HF's, the experts' gate through
    `swiglu`. Two: top-2 routing turns last-bit differences into other experts after that, from the third step
    on some CPUs (8e-5 apart there; HF's eager and SDPA attention drift 1.2e-4 apart by step 5)."""
    moe = dict(enable_moe_block=True, num_experts=4, top_k_experts=2, moe_intermediate_size=32)
    steps = 2
    data = batches(1, 1, 2, 48, "cpu", ignore_fraction=0.1) * steps
    ref_losses, ref_grads = train(mini("gemma4_text", "cpu", torch.float32, **moe), data)
    model = mini("gemma4_text", "cpu", torch.float32, **moe)
    bastile.apply(model=model, **NO_TRAINERS)
    assert all(type(layer.experts).__name__ == "Gemma4TextExperts" for layer in model.model.layers)
    calls = []
    real = bastile.roles.mlp.swiglu
    with pytest.MonkeyPatch.context() as m, Dispatched() as seen:
        m.setattr(bastile.roles.mlp, "swiglu", lambda *a: calls.append(1) or real(*a))
        losses, grads = train(model, data)
    assert len(calls) >= steps * len(model.model.layers)  # each layer's experts, each step
    assert expected_ops("gemma4_text", model) <= seen.ops, seen.ops
    assert losses == pytest.approx(ref_losses, rel=1e-5) and ref_losses[-1] < ref_losses[0]
    assert grads.keys() == ref_grads.keys() and any(".experts." in n for n in grads)
    for name, g in ref_grads.items():
        assert_grad_close(grads[name], g, name)


def newer_modeling_reads(monkeypatch, family, *keys):
    """families.reads as if the family's modeling module (a newer release's) also read `keys`."""
    module, reads = TRAITS[family].module, bastile.families.reads
    monkeypatch.setattr(bastile.families, "reads", lambda m: reads(m) | set(keys) if m == module else reads(m))


def test_undeclared_multimodal_config_key_is_refused(monkeypatch):
    model = gemma3_multimodal()
    model.config.audio_config = {}
    bastile.apply(model=model)  # read by no modeling code: no reason to refuse
    bastile.reset()
    newer_modeling_reads(monkeypatch, "gemma3_text", "audio_config")
    with pytest.raises(Unsupported, match=r"config of gemma3 has \['audio_config'\]"):
        bastile.apply(model=model)
    assert bastile.get_patched_ops() == []


def test_undeclared_config_key_is_refused_before_patching(monkeypatch):
    model = mini("llama", "cpu", torch.float32)
    model.config.use_qk_norm = True  # a flag a newer modeling file might read
    newer_modeling_reads(monkeypatch, "llama", "use_qk_norm")
    with pytest.raises(Unsupported, match=r"config of llama has \['use_qk_norm'\].*nothing was patched"):
        bastile.apply(model=model)
    assert bastile.get_patched_ops() == []


def test_partial_rotation_is_refused_where_undeclared():
    model = mini("llama", "cpu", torch.float32)
    model.config.rope_parameters = {**model.config.rope_parameters, "partial_rotary_factor": 0.5}
    with pytest.raises(Unsupported, match="partial_rotary_factor=0.5"):
        bastile.apply(model=model)
    assert bastile.get_patched_ops() == []


def test_subclass_of_a_patched_class_is_refused_before_patching():
    from transformers.models.llama import modeling_llama

    class ScaledAttention(modeling_llama.LlamaAttention):
        def __init__(self, config, layer_idx):
            super().__init__(config, layer_idx)
            self.temperature = 2.0

    model = mini("llama", "cpu", torch.float32)
    layer = model.model.layers[1]
    scaled = ScaledAttention(model.config, 1)
    scaled.load_state_dict(layer.self_attn.state_dict())
    layer.self_attn = scaled
    with pytest.raises(Unsupported, match=r"model.layers.1.self_attn is a .*ScaledAttention, a subclass of "
                                          "LlamaAttention"):
        bastile.apply(model=model)
    assert bastile.get_patched_ops() == []


def padded_step_matches_hf(family, inputs, watch):
    """Asserts that one step on `inputs` (a padded batch) gives HF's loss and gradients (the decay parameters' on
    exact_delta_rule), the patched model's run inside the context `watch`; returns the patched model."""
    def grads(model):
        loss = model(**inputs).loss
        loss.backward()
        return loss, {n: p.grad for n, p in model.named_parameters() if p.grad is not None}
    exact = exact_grads(family, mini(family, "cpu", torch.float32), lambda m: m(**inputs).loss)
    ref_loss, ref_grads = grads(mini(family, "cpu", torch.float32))
    model = mini(family, "cpu", torch.float32)
    bastile.apply(model=model, **NO_TRAINERS)
    with watch:
        loss, got = grads(model)
    torch.testing.assert_close(loss, ref_loss, rtol=1e-5, atol=0)
    assert got.keys() == ref_grads.keys()
    exact64 = functools.cache(lambda: grads(in_fp64(mini(family, "cpu", torch.float32)))[1])
    for name, g in ref_grads.items():
        assert_grad_close(got[name], exact.get(name, g), name, exact64)
    return model


@pytest.mark.parametrize("family", FAMILIES)
def test_right_padded_batch_runs_unmasked_as_hf(family):
    """A batch padded on the right, as HF's and TRL's collators pad (labels -100 at the pads): the loss and
    gradients are HF's with its padding mask, and no mask with padding is made (no token sees the pads after it:
    the decoder drops the mask, so SDPA runs is_causal; GPT-OSS's pads are varlen spans)."""
    from transformers import masking_utils
    (ids, labels), = batches(1, 1, 2, 48, "cpu", ignore_fraction=0.1)[0]  # test_training_matches_hf_cpu_fp32's
    right = torch.ones_like(ids)
    right[0, 30:] = 0
    inputs = dict(input_ids=ids, attention_mask=right, labels=labels.masked_fill(right == 0, -100))
    made = mock.Mock(wraps=masking_utils.padding_mask_function)  # HF's masks with padding
    padded_step_matches_hf(family, inputs, mock.patch.object(masking_utils, "padding_mask_function", made))
    assert not made.called


@pytest.mark.parametrize("family", FAMILIES)
def test_rows_padded_at_both_ends_run_as_spans_as_hf(family):
    """A row padded on the left and the right (an RL trainer's prompt and completion) beside one padded on the
    right, labels -100 at the pads: the loss and gradients are HF's with its padding mask, and the decoder makes
    no mask with padding (the rows' tokens run as varlen spans) unless an attention layer keeps HF's (an
    attention softcap: Gemma 2). The first token's label is ignored too, as a prompt's are: the last left pad
    predicts it, and a pad's output is not HF's (nor is HF's the same under eager attention and SDPA)."""
    from transformers import masking_utils
    (ids, labels), = batches(1, 1, 2, 48, "cpu", ignore_fraction=0.1)[0]
    mask = torch.ones_like(ids)
    mask[0, :9], mask[0, 40:], mask[1, 30:] = 0, 0, 0
    labels = labels.masked_fill(mask == 0, -100)
    labels[0, 9] = -100
    inputs = dict(input_ids=ids, attention_mask=mask, labels=labels)
    made = mock.Mock(wraps=masking_utils.padding_mask_function)
    model = padded_step_matches_hf(family, inputs, mock.patch.object(masking_utils, "padding_mask_function", made))
    assert made.called == (getattr(model.config, "attn_logit_softcapping", None) is not None)


@pytest.mark.parametrize("pads", ["left", "inside"])
@pytest.mark.parametrize("family", ["qwen3_5_text", "qwen3_5_moe_text", "qwen3_next"])
def test_gated_delta_net_padded_batch_matches_hf(family, pads):
    """A padded batch with its attention mask, and the loss and gradients are HF's. Left: the row's tokens run as
    a varlen span, their conv and state starting from zeros as HF's do over its zeroed pads (the first token's
    label ignored, as in test_rows_padded_at_both_ends_run_as_spans_as_hf). Inside a row: HF's masks, and the
    Gated DeltaNet zeroes the pads' inputs as HF's does (its conv and state run over them)."""
    (ids, labels), = batches(1, 1, 2, 32, "cpu", ignore_fraction=0.1)[0]
    mask = torch.ones_like(ids)
    mask[1, :5] = 0
    if pads == "inside":
        mask[1, :5], mask[1, 10:14] = 1, 0
    labels = labels.masked_fill(mask == 0, -100)
    if pads == "left":
        labels[1, 5] = -100
    inputs = dict(input_ids=ids, attention_mask=mask, labels=labels)
    seen = Dispatched()
    padded_step_matches_hf(family, inputs, seen)
    assert "gated_delta_rule" in seen.ops


@pytest.mark.parametrize("family", ["qwen3_5_text", "qwen3_5_moe_text", "qwen3_next"])
def test_unmasked_hybrid_step_skips_hfs_packed_sequence_check(monkeypatch, family):
    """With no attention mask, positions or cache, the Gated DeltaNet and SDPA layers need no mask: the patched
    decoder gives None for both layer types, so HF's packed-sequence check on the positions (a host sync on
    CUDA) does not run, and the loss is HF's."""
    from transformers import masking_utils
    checked = []
    find = masking_utils.find_packed_sequence_indices
    monkeypatch.setattr(masking_utils, "find_packed_sequence_indices", lambda p: checked.append(p) or find(p))
    ids = torch.randint(0, COMMON["vocab_size"], (2, 24), generator=torch.Generator().manual_seed(0))
    ref = mini(family, "cpu", torch.float32, use_cache=False)  # HF's with a cache does not look for packed rows
    assert ref.config._attn_implementation == "sdpa"
    ref_loss = ref(input_ids=ids, labels=ids).loss
    assert checked
    model = mini(family, "cpu", torch.float32)
    bastile.apply(model=model, **NO_TRAINERS)
    checked.clear()
    torch.testing.assert_close(model(input_ids=ids, labels=ids).loss, ref_loss, rtol=1e-5, atol=0)
    assert checked == []


@pytest.mark.parametrize("family, layer, attr, part, layer_type", [
    ("qwen3_5_text", 1, "linear_attn", "GatedDeltaNet", "linear_attention"),
    ("qwen3_next", 1, "linear_attn", "GatedDeltaNet", "linear_attention"),
    ("lfm2", 2, "conv", "ShortConv", "conv")])
def test_token_mixer_subclass_and_undeclared_mixer_layers_are_refused(family, layer, attr, part, layer_type):
    """A subclass of a token mixer whose forward Bastile replaces (Qwen3.5's and Qwen3-Next's Gated DeltaNet, LFM2's
    short convolution) is refused, as is its layer type in a family whose traits have no such mixer."""
    model = mini(family, "cpu", torch.float32)
    mixer = getattr(sys.modules[TRAITS[family].module], f"{TRAITS[family].prefix}{part}")
    getattr(model.model.layers[layer], attr).__class__ = type("Wider", (mixer,), {})
    with pytest.raises(Unsupported, match=rf"model.layers.{layer}.{attr} is a .*Wider, a subclass of "
                                          rf"{mixer.__name__}.*nothing was patched"):
        bastile.apply(model=model)
    qwen3 = mini("qwen3", "cpu", torch.float32)
    qwen3.config.layer_types = [layer_type, "full_attention"]
    with pytest.raises(Unsupported, match=rf"qwen3 layer_types \['{layer_type}'\] are not among"):
        bastile.apply(model=qwen3)
    assert bastile.get_patched_ops() == []


def test_model_built_after_apply_is_checked_on_its_first_forward(monkeypatch):
    bastile.apply(families="llama", **NO_TRAINERS)
    model = mini("llama", "cpu", torch.float32)
    model.config.use_qk_norm = True
    newer_modeling_reads(monkeypatch, "llama", "use_qk_norm")
    ids = torch.randint(0, 512, (1, 8))
    with pytest.raises(Unsupported, match=r"use_qk_norm.*its classes are patched, and bastile.reset\(\) restores"):
        model(input_ids=ids, labels=ids)
    del model.config.use_qk_norm
    assert model(input_ids=ids, labels=ids).loss.isfinite()


@needs_cuda
def test_gemma4_moe_training_matches_hf_cuda_bf16():
    moe = dict(enable_moe_block=True, num_experts=4, top_k_experts=2, moe_intermediate_size=32)
    data = batches(1, 1, 2, 48, "cuda", ignore_fraction=0.1) * STEPS
    ref_losses, _ = train(mini("gemma4_text", "cuda", torch.bfloat16, **moe), data)
    model = mini("gemma4_text", "cuda", torch.bfloat16, **moe)
    bastile.apply(model=model)
    losses, _ = train(model, data)
    assert losses == pytest.approx(ref_losses, rel=1e-2)


@needs_cuda
@pytest.mark.parametrize("family", FAMILIES)
def test_training_matches_hf_cuda_bf16(family):
    data = batches(1, 1, 2, 48, "cuda", ignore_fraction=0.1) * STEPS
    ref = mini(family, "cuda", torch.bfloat16)
    ref_losses, _ = train(ref, data)
    model = mini(family, "cuda", torch.bfloat16)
    bastile.apply(model=model)
    losses, _ = train(model, data)
    for step, (a, b) in enumerate(zip(losses, ref_losses)):
        assert abs(a - b) <= 1e-2 * abs(b), f"{family} step {step}: {a} vs {b}"
