"""bastile.apply(): swaps HF forward functions for Bastile ones, and puts them back.

Patches are declared in FAMILIES: for each HF model_type, its modeling module and, per op, the
attribute to replace there and its replacement (or a Wrap, whose factory makes the replacement from the
original), or a list of such pairs where the op has several targets in the family (PATCHES lists them one
row per target). A patch name `<op>_<family>` stands for all targets of that op in that family: apply()
returns it once and reset() restores them all. Adding a family is one entry. TRAINERS does the same for
trainer libraries (TRL), whose patches apply whatever the model.
"""
import importlib
import importlib.util
from dataclasses import dataclass
from typing import Callable, Dict, List, Optional, Sequence

from . import heads, hf, lora

@dataclass(frozen=True)
class Wrap:
    """A replacement made from the attribute it replaces: factory(original)."""
    factory: Callable


@dataclass(frozen=True)
class Patch:
    op: str           # keyword of apply() that selects it
    family: str       # HF model_type
    module: str       # module holding the target
    target: str       # "Class.attribute" or "function"
    replacement: Callable | Wrap

    @property
    def name(self) -> str:
        return f"{self.op}_{self.family}"


def _dense(prefix: str) -> Dict[str, tuple]:
    """What a Llama-like decoder's classes map to: op -> (target, replacement)."""
    return {
        "decoder": (f"{prefix}Model.forward", DECODER),
        "rms_norm": (f"{prefix}RMSNorm.forward", hf.rms_norm_forward),
        "swiglu": (f"{prefix}MLP.forward", hf.swiglu_mlp_forward),
        # the attention forward runs the projections through lora.project and rotates with the
        # module's apply_rotary_pos_emb, which this patch also replaces
        "rope": [("apply_rotary_pos_emb", hf.apply_rotary_pos_emb),
                 (f"{prefix}Attention.forward", hf.attention_forward)],
        "fused_linear_cross_entropy": (f"{prefix}ForCausalLM.forward", hf.causal_lm_forward),
    }


# The decoders' forward: masks that SDPA needs none of, and packed batches (hf.decoder_forward).
DECODER = Wrap(hf.decoder_forward)

# model_type -> (HF modeling module, op -> (target, replacement) or [(target, replacement), ...]).
FAMILIES: Dict[str, tuple] = {
    "qwen3": ("transformers.models.qwen3.modeling_qwen3",
              {**_dense("Qwen3"), "rope": ("Qwen3Attention.forward", hf.attention_forward)}),
    "llama": ("transformers.models.llama.modeling_llama", _dense("Llama")),
    "qwen2": ("transformers.models.qwen2.modeling_qwen2", _dense("Qwen2")),
    "mistral": ("transformers.models.mistral.modeling_mistral", _dense("Mistral")),
    # Experts go through transformers' grouped/batched implementations (grouped_mm is the default),
    # which call `_apply_gate`. The "eager" one (config experts_implementation="eager") stays HF's: it is
    # the original Qwen3MoeExperts.forward, held in a closure by transformers' dispatching wrapper (no
    # attribute to replace), and it computes `self.act_fn(gate) * up` inline, where act_fn is a per-instance
    # module whose product with up happens outside it. Layers in mlp_only_layers (or off the
    # decoder_sparse_step) are dense Qwen3MoeMLP, a SwiGLU MLP.
    "qwen3_moe": ("transformers.models.qwen3_moe.modeling_qwen3_moe", {
        "decoder": ("Qwen3MoeModel.forward", DECODER),
        "rms_norm": ("Qwen3MoeRMSNorm.forward", hf.rms_norm_forward),
        "swiglu": [("Qwen3MoeExperts._apply_gate", hf.swiglu_apply_gate),
                   ("Qwen3MoeMLP.forward", hf.swiglu_mlp_forward)],
        "rope": ("Qwen3MoeAttention.forward", hf.attention_forward),
        "fused_linear_cross_entropy": ("Qwen3MoeForCausalLM.forward", hf.moe_causal_lm_forward),
    }),
    "gpt_oss": ("transformers.models.gpt_oss.modeling_gpt_oss", {
        "decoder": ("GptOssModel.forward", DECODER),
        "rms_norm": ("GptOssRMSNorm.forward", hf.rms_norm_cast_after_weight_forward),
        "rope": ("apply_rotary_pos_emb", hf.half_split_apply_rotary_pos_emb),
        "fused_linear_cross_entropy": ("GptOssForCausalLM.forward", hf.moe_causal_lm_forward),
        "geglu": ("GptOssExperts._apply_gate", hf.gpt_oss_apply_gate),
    }),
}

# library -> (module, op -> targets), as in FAMILIES. A library that is installed but lacks a target is an
# error at apply(): its internals moved, and Bastile must not guess.
TRAINERS: Dict[str, tuple] = {
    # TRL's fused LM head (heads.py): its per-token function, its choice of positions, and SFT's loss.
    "trl": ("trl.trainer", {
        "log_probs": [("utils._ChunkedLogProbFunction", Wrap(heads.log_prob_function)),
                      ("utils._use_triton", heads.compact),
                      ("SFTTrainer.compute_loss", Wrap(heads.sft_compute_loss))],
    }),
}

PATCHES: List[Patch] = [
    Patch(op, family, module, target, replacement)
    for family, (module, per_op) in {**FAMILIES, **TRAINERS}.items()
    for op, targets in per_op.items()
    for target, replacement in (targets if isinstance(targets, list) else [targets])
]

# name -> [(owner, attribute, original value as found in owner.__dict__), ...], one per target
_active: Dict[str, list] = {}


def _resolve(patch: Patch):
    """(owner object, attribute name) of a patch target, or None where transformers lacks it."""
    try:
        owner = importlib.import_module(patch.module)
    except ImportError:
        return None
    *path, attr = patch.target.split(".")
    for part in path:
        owner = getattr(owner, part, None)
        if owner is None:
            return None
    return (owner, attr) if hasattr(owner, attr) else None


def supported_families() -> List[str]:
    return sorted(FAMILIES)


def apply(rms_norm: bool = True, swiglu: bool = True, rope: bool = True, fused_linear_cross_entropy: bool = True,
          geglu: Optional[bool] = None, model=None, families: Optional[Sequence[str]] = None,
          moe: Optional[bool] = None, decoder: bool = True, log_probs: bool = True) -> List[str]:
    """Patches the selected ops for the given families (all supported ones by default, one family by
    name, or the family of `model`, an HF model instance). Works before or after the model is built,
    since it replaces class attributes and module functions. Returns the names `<op>_<family>` of the
    patches active from this call, e.g. ['rms_norm_qwen3', 'swiglu_qwen3', ...]. Applying twice is
    harmless. `moe` is the original name of `geglu` (GPT-OSS's experts' activation, on by default).
    `decoder` is the decoders' forward: no mask where SDPA needs none, and packed batches (varlen bounds
    for the patched attention, or masks made with the position ids). `log_probs` is TRL's fused LM head
    (its trainers' per-token log-probabilities) on Bastile's fused_linear_log_probs, whatever the model,
    where TRL is installed (trl==1.16; another TRL whose internals differ is an error here)."""
    if geglu is not None and moe is not None and geglu != moe:
        raise ValueError(f"bastile.apply: geglu={geglu} and moe={moe} disagree, but they name one patch "
                         "(moe is geglu's original name)")
    selected = {"rms_norm": rms_norm, "swiglu": swiglu, "rope": rope,
                "fused_linear_cross_entropy": fused_linear_cross_entropy,
                "geglu": next((v for v in (geglu, moe) if v is not None), True), "decoder": decoder,
                "log_probs": log_probs}
    if model is not None:
        model_type = getattr(getattr(model, "config", None), "model_type", None)
        if model_type not in supported_families():
            raise ValueError(f"bastile.apply: model type {model_type!r} is not supported; "
                             f"supported: {', '.join(supported_families())}")
        families = [model_type]
    elif families is not None:
        families = [families] if isinstance(families, str) else list(families)
        unknown = sorted(set(families) - set(supported_families()))
        if unknown:
            raise ValueError(f"bastile.apply: unknown families {unknown}; supported: {', '.join(supported_families())}")
    chosen = [p for p in PATCHES
              if selected.get(p.op) and (families is None or p.family in families or p.family in TRAINERS)]
    # Resolve everything first, so that a missing target leaves nothing half-patched.
    by_name: Dict[str, list] = {}
    for p in chosen:
        by_name.setdefault(p.name, []).append((p, _resolve(p)))
    for name, found in by_name.items():
        moved = [f"{p.module}.{p.target}" for p, t in found
                 if t is None and p.family in TRAINERS and importlib.util.find_spec(p.family) is not None]
        if moved:
            p = found[0][0]
            raise RuntimeError(f"bastile.apply: the installed {p.family} lacks {moved}, the targets of {name}; "
                               f"pass {p.op}=False to keep its own")
    if model is not None:
        missing = [f"{name} ({p.target})" for name, found in by_name.items() for p, t in found
                   if t is None and p.family not in TRAINERS]
        if missing:
            raise RuntimeError(f"bastile.apply: this transformers lacks the targets of {missing}")
    # Replacements are made (and a Wrap's factory may refuse its original) before anything is patched.
    todo = {}
    for name, found in by_name.items():
        found = [(p, t) for p, t in found if t is not None]
        if found and name not in _active:
            todo[name] = [(owner, attr, p.replacement.factory(getattr(owner, attr))
                           if isinstance(p.replacement, Wrap) else p.replacement) for p, (owner, attr) in found]
    for name, targets in todo.items():
        _active[name] = [(owner, attr, owner.__dict__.get(attr)) for owner, attr, _ in targets]
        for owner, attr, replacement in targets:
            setattr(owner, attr, replacement)
    return [name for name, found in by_name.items() if name in _active]


def reset(names: Optional[Sequence[str]] = None) -> List[str]:
    """Restores the originals of the named patches (all by default); returns the names restored. As
    applying twice is, resetting a patch that is not active, or naming one twice, is harmless; an unknown
    name raises before anything is restored."""
    if names is None:
        names = list(_active)
    names = list(dict.fromkeys([names] if isinstance(names, str) else names))
    known = {p.name for p in PATCHES}
    unknown = [n for n in names if n not in known]
    if unknown:
        raise ValueError(f"bastile.reset: unknown patches {unknown}; the patches are: {', '.join(sorted(known))}")
    names = [n for n in names if n in _active]
    for name in names:
        for owner, attr, original in reversed(_active.pop(name)):
            if original is None:
                delattr(owner, attr)
            else:
                setattr(owner, attr, original)
    return names


def lora_modules(model) -> Dict[str, str]:
    """{qualified name: "fused", or why PEFT's own forward runs it} for every PEFT LoRA layer of `model`
    (adapters on other modules than the patched attention's and MLP's projections, DoRA, several active
    adapters, LoRA bias, quantized base layers... keep PEFT's path)."""
    return lora.report(model, {hf.attention_forward: None, hf.swiglu_mlp_forward: hf.swiglu_mlp_why_not})


def get_patched_ops() -> List[str]:
    return sorted(_active)
