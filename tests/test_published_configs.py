"""The checkpoints users load, as their published config.json files have them (tests/configs/, legacy and
remote-code keys included; tests/configs/SOURCES.md says where each came from).

Each is accepted: its full-size model, built on the meta device from AutoConfig.from_pretrained(folder), passes
bastile.apply(model=...). Each, shrunk to a few small layers that keep what its traits depend on (every layer
type, shared K/V, per-layer inputs, routed experts with top-k > 1, head sizes and rotations as published), trains
two SGD steps on the CPU after a plain bastile.apply() with HF's losses and Bastile's ops dispatched. A key that
the modeling code reads and the traits do not declare is refused; one that no code reads is not.
"""
import copy
import json
from pathlib import Path

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM, AutoModelForImageTextToText
from transformers.models.auto.configuration_auto import CONFIG_MAPPING

import bastile
from bastile import families
from bastile.families import Unsupported
from conftest import NO_TRAINERS, patch_names
from test_families import Dispatched, drawn, expected_ops

CONFIGS = Path(__file__).parent / "configs"
FOLDERS = sorted(p.name for p in CONFIGS.iterdir() if (p / "config.json").is_file())
VOCAB = 512
# Published activations Bastile's fused ops do not compute: HF's own MLP runs (Gemma 1's hidden_act "gelu", the
# erf GELU, where its later checkpoints say gelu_pytorch_tanh).
UNFUSED = {"google--gemma-2b": {"swiglu"}, "google--gemma-7b": {"swiglu"}}
LAYER_TYPE_KEYS = ("layer_types", "no_rope_layers")  # lists with one entry per layer


def published(folder):
    return json.loads((CONFIGS / folder / "config.json").read_text())


def test_the_corpus_covers_every_family():
    """At least two published checkpoints per supported family (a multimodal one counts for its language model)."""
    counts = {}
    for folder in FOLDERS:
        model_type = language_model(folder)["model_type"]
        counts[model_type] = counts.get(model_type, 0) + 1
    assert {f: counts.get(f, 0) for f in families.FAMILIES if counts.get(f, 0) < 2} == {}


@pytest.mark.parametrize("folder", FOLDERS)
def test_published_config_is_accepted(folder):
    config = AutoConfig.from_pretrained(CONFIGS / folder)
    model = build(config, "meta")  # full size, no memory
    names = bastile.apply(model=model, **NO_TRAINERS)
    family = families.family_of(model).model_type
    assert sorted(names) == patch_names(family)


def build(config, device, **kw):
    """The causal LM of a config, or its image-text model where it has no causal LM (Mistral 3's)."""
    auto = AutoModelForCausalLM if type(config) in AutoModelForCausalLM._model_mapping else AutoModelForImageTextToText
    with torch.device(device):
        return drawn(auto.from_config(config, **kw))


def shrunk(raw: dict) -> dict:
    """A published language-model config at test size: 64 wide, a vocabulary of VOCAB, each layer type twice (so
    that a window, a NoPE layer, a linear-attention layer or a shared K/V layer has a layer of another type
    before and after it), top-2 of 8 experts; head sizes, rotations, multipliers and flags as published."""
    full = CONFIG_MAPPING[raw["model_type"]].from_dict(raw)
    d = copy.deepcopy(raw)
    heads = full.num_attention_heads

    def given(key):
        """A key's value as published, or where the config leaves it out, its class's default (Gemma 3's text_config
        gives no vocab_size: 262,208)."""
        return d[key] if key in d else getattr(full, key, None)

    # where the head width follows from hidden_size (and rotation tables from it, Phi-3's longrope factors), so does
    # the test's
    d["hidden_size"] = 64 if "head_dim" in raw else 4 * (full.hidden_size // heads)
    # block_ff_dim: LFM2's first spelling of intermediate_size, which its config class takes over it
    for key, size in dict(intermediate_size=128, block_ff_dim=128, moe_intermediate_size=32,
                          shared_expert_intermediate_size=32, num_attention_heads=4, vocab_size=VOCAB,
                          vocab_size_per_layer_input=VOCAB, hidden_size_per_layer_input=8, linear_num_key_heads=2,
                          linear_num_value_heads=4, linear_key_head_dim=16, linear_value_head_dim=16).items():
        if given(key):
            d[key] = size
    for key in ("num_key_value_heads", "num_global_key_value_heads"):
        if given(key):  # multi-head, grouped or single kv heads as published
            d[key] = 4 if given(key) == heads else min(given(key), 2)
    for key in ("num_experts", "num_local_experts"):
        if given(key):
            d[key] = min(given(key), 8)
    for key in ("num_experts_per_tok", "experts_per_token", "top_k_experts"):
        if given(key):
            d[key] = min(given(key), 2)
    for key in ("sliding_window", "sliding_window_size"):
        if isinstance(given(key), int):
            d[key] = min(given(key), 16)  # shorter than the test sequences
    for key in ("pad_token_id", "bos_token_id", "eos_token_id"):
        ids = given(key)
        if isinstance(ids, list):
            d[key] = [i % VOCAB for i in ids]
        elif isinstance(ids, int):
            d[key] = ids % VOCAB
    full_types = getattr(full, "layer_types", None) or []
    types = list(dict.fromkeys(full_types))
    layers = 2 * len(types) if len(types) > 1 else 4
    if full_types:  # the first layer of each type, then the next of each type
        picked = list(range(layers)) if len(types) == 1 else []
        for t in types * (len(types) > 1) * 2:
            picked.append(next(i for i, u in enumerate(full_types) if u == t and i not in picked))
        d["layer_types"] = [full_types[i] for i in picked]
    if isinstance(given("no_rope_layers"), list):  # SmolLM3: 0 marks a NoPE layer, one in four
        d["no_rope_layers"] = [1, 1, 1, 0]
    if isinstance(given("mlp_only_layers"), list):
        d["mlp_only_layers"] = [i for i in given("mlp_only_layers") if i < layers]
    if given("num_kv_shared_layers"):
        d["num_kv_shared_layers"] = len(types)  # the last of each type reuses the first's K/V
    d["num_hidden_layers"] = layers
    return d


def language_model(folder) -> dict:
    """The language model's config as published; Qwen2-VL's and Qwen2.5-VL's files keep its keys beside the vision
    config's (from before multimodal configs had a text_config): as their config class reads them."""
    raw = published(folder)
    if "text_config" in raw:
        return raw["text_config"]
    if raw["model_type"] in families.MULTIMODAL:
        return AutoConfig.from_pretrained(CONFIGS / folder).get_text_config().to_dict()
    return raw


# Gemma 4 scales its attention by 1, and its q/k norms' weights start at 1: at random init its logits spread as
# sqrt(head_dim) (16 to 22 at the published 256 and 512), the softmax saturates, and fp32 gradients are rounding
# noise (HF's own 1e-4 to 8e-4 from float64's). Its tests start those weights at head_dim^-1/4, as trained weights
# keep the logits in range. (Its float64 gradients are Bastile's to 1e-12: test_families.py.)
SATURATED = {"gemma4_text"}


def temper(model):
    with torch.no_grad():
        for layer in model.model.layers:
            a = layer.self_attn
            for norm in (a.q_norm, getattr(a, "k_norm", None)):  # a layer that reuses K/V has no k_norm
                if norm is not None:
                    norm.weight.mul_(a.head_dim ** -0.25)


def train(model, ids, steps=2):
    # SGD, not AdamW: AdamW's first update is lr times the sign of each gradient element, rounding noise's
    # included, which moved a shrunk Mixtral's second-step router logits by 7e-4 and flipped a top-2 choice whose
    # gap was 1.6e-4 (one thread; HF's and Bastile's first-step logits agree within 1e-6). SGD's moves with the
    # gradient (the loss falls 6.33 -> 5.13 there), so the second step still checks it.
    torch.manual_seed(7)
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    losses = []
    for _ in range(steps):
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.item())
    return losses


def tower(model_type, width) -> dict:
    """A vision tower of one small block whose output is `width` wide, in the keys of the multimodal model's vision
    config (Qwen2-VL's hidden_size is its output's width, embed_dim its blocks'; Qwen3-VL's DeepStack takes the
    block's features)."""
    if model_type == "qwen2_vl":
        return dict(depth=1, embed_dim=32, num_heads=2, hidden_size=width)
    deepstack = dict(deepstack_visual_indexes=[0]) if model_type.startswith("qwen3_vl") else {}
    return dict(depth=1, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=width, **deepstack)


def trained(folder):
    """The shrunk language model's config; where the language model has no causal LM of its own (Qwen3-VL's,
    Qwen2(.5)-VL's), its multimodal model's around it, with a vision tower of one small block (the text-only steps
    never run it)."""
    text = CONFIG_MAPPING[language_model(folder)["model_type"]].from_dict(shrunk(language_model(folder)))
    if families.FAMILIES[text.model_type].causal_lm:
        return text
    raw = published(folder)
    if "text_config" not in raw:  # a flat file: as its config class reads it (5.23 would keep its text keys beside)
        raw = AutoConfig.from_pretrained(CONFIGS / folder).to_dict()
    vision = {**raw["vision_config"], **tower(raw["model_type"], text.hidden_size)}
    return CONFIG_MAPPING[raw["model_type"]].from_dict({**raw, "text_config": text.to_dict(), "vision_config": vision})


@pytest.mark.parametrize("folder", FOLDERS)
def test_published_config_trains_as_hf(folder):
    config = trained(folder)
    torch.manual_seed(0)
    ref = build(config, "cpu", dtype=torch.float32).train()
    if config.model_type in SATURATED:
        temper(ref)
    model = copy.deepcopy(ref)
    ids = torch.randint(3, VOCAB, (2, 40), generator=torch.Generator().manual_seed(1))
    ref_losses = train(ref, ids)
    bastile.apply()  # as a user does; the model is checked on its first forward
    with Dispatched() as seen:
        losses = train(model, ids)
    assert losses == pytest.approx(ref_losses, rel=1e-5, abs=0)
    expected = expected_ops(families.family_of(model).model_type, model) - UNFUSED.get(folder, set())
    assert expected <= seen.ops, seen.ops


def test_unread_keys_are_accepted():
    """Keys no modeling code reads: the published leftovers, and a flag no release has."""
    config = AutoConfig.from_pretrained(CONFIGS / "microsoft--Phi-4-mini-instruct")
    leftovers = {"full_attn_mod", "interpolate_factor", "lm_head_bias", "mlp_bias", "attention_bias"}
    assert leftovers <= set(config.to_dict()) and not leftovers & families.reads(families.FAMILIES["phi3"].module)
    config.use_qk_norm = True
    bastile.apply(model=build(config, "meta"), **NO_TRAINERS)


def test_a_read_key_the_traits_do_not_declare_is_refused(monkeypatch):
    """A key the modeling code reads (here as a newer release's would) that the traits do not declare is refused,
    before anything is patched; a read key that they declare is not."""
    config = AutoConfig.from_pretrained(CONFIGS / "meta-llama--Llama-3.2-1B")
    config.use_qk_norm = True
    module, reads = families.FAMILIES["llama"].module, families.reads
    newer = reads(module) | {"use_qk_norm"}
    monkeypatch.setattr(families, "reads", lambda m: newer if m == module else reads(m))
    with pytest.raises(Unsupported, match=r"config of llama has \['use_qk_norm'\], which its transformers modeling "
                                          r"code reads.*nothing was patched"):
        bastile.apply(model=build(config, "meta"))
    assert bastile.get_patched_ops() == []
    assert "mlp_bias" in newer and "mlp_bias" in families.FAMILIES["llama"].keys
