"""bastile.apply(): swaps HF forward functions for Bastile ones, and puts them back.

Patches are named by role: what part of a model they replace, the same in every family.
- norm: the RMSNorms
- mlp: the dense MLP and the MoE experts' activation
- attention: the token mixers: the attention (projections, q/k norms, rotation, varlen attention on packed
  batches) and the linear attention (Qwen3.5's Gated DeltaNet)
- decoder: the decoder (masks, cache, the packed batch's bounds) and its layers (norms and residuals)
- head: the causal LM's head and loss (the fused linear cross-entropy)
Which class attribute a role replaces in a family, and with what, follows from the family's traits
(families.py); the forwards are hf.py's, made for the family. A patch name `<role>_<family>` stands for
all targets of that role in that family: apply() returns it once and reset() restores them all. TRAINERS
does the same for trainer libraries (TRL), whose patches apply whatever the model.

The keywords of earlier releases name kernels; they stay as aliases of the role their kernel served:
rms_norm -> norm, swiglu and geglu (and moe, geglu's first name) -> mlp, rope -> attention,
fused_linear_cross_entropy -> head. Patch names made of them (`rope_llama`) are accepted by reset().
"""
import importlib
import importlib.util
import weakref
from dataclasses import dataclass
from typing import Callable, Dict, List, Optional, Sequence

import torch
import transformers

from . import heads, hf, long_context, lora, versions
from .families import FAMILIES, Family, Unsupported, check

ROLES = ("norm", "mlp", "attention", "decoder", "head")
ALIASES = {"rms_norm": "norm", "swiglu": "mlp", "geglu": "mlp", "moe": "mlp", "rope": "attention",
           "fused_linear_cross_entropy": "head"}


@dataclass(frozen=True)
class Wrap:
    """A replacement made from the attribute it replaces: factory(original)."""
    factory: Callable


@dataclass(frozen=True)
class Patch:
    role: str         # keyword of apply() that selects it
    family: str       # HF model_type, or a trainer library
    module: str       # module holding the target
    target: str       # "Class.attribute" or "function"
    replacement: Callable | Wrap

    @property
    def name(self) -> str:
        return f"{self.role}_{self.family}"


# name -> [(owner, attribute, original value as found in owner.__dict__), ...], one per target
_active: Dict[str, list] = {}

# apply()'s library-wide settings (long_context.Settings), read by the patched forwards at each call.
_settings = long_context.Settings()


def _current_settings() -> long_context.Settings:
    return _settings


# Models already checked against their family's traits (families.check).
_checked: "weakref.WeakSet" = weakref.WeakSet()


def _check(model) -> None:
    """families.check on a model's first patched forward: a model built after apply() is checked there.
    Skipped while torch.compile traces (the check is Python bookkeeping, not part of the graph)."""
    if torch.compiler.is_compiling() or model in _checked:
        return
    try:
        check(model)
    except Unsupported as e:
        raise Unsupported(f"{e}: its classes are patched, and bastile.reset() restores HF's forwards") from None
    _checked.add(model)


def _runs(family: str) -> Callable[[str], bool]:
    return lambda role: f"{role}_{family}" in _active


def _targets(f: Family) -> Dict[str, list]:
    """role -> [(target, replacement), ...] of a family, from its traits."""
    n, runs = f.name, _runs(f.model_type)
    mlp = [(f"{n('MLP')}.forward", hf.mlp_forward(f.mlp))] if f.mlp.dense else []
    mlp += [(f"{n('Experts')}._apply_gate", hf.APPLY_GATES[f.mlp.experts])] if f.mlp.experts else []
    return {
        "norm": [(f"{n('RMSNorm')}.forward", hf.NORM_FORWARDS[f.norm])],
        "mlp": mlp,
        "attention": [(f"{n('Attention')}.forward", hf.attention_forward(f))]
                     + ([(f"{n('GatedDeltaNet')}.forward", Wrap(hf.gated_delta_net_forward(f)))]
                        if f.linear_attention else []),
        "decoder": [(f"{n(f.decoder)}.forward", Wrap(hf.decoder_forward(f, runs, _current_settings, _check))),
                    (f"{n('DecoderLayer')}.forward",
                     hf.checkpointed(hf.layer_forward(f, runs, _current_settings)))],
        "head": [(f"{n('ForCausalLM')}.forward", hf.causal_lm_forward(f, _check))]
                + ([(f"{n(f.multimodal.head)}.forward", Wrap(hf.multimodal_lm_forward(f, _check)))] if f.multimodal else []),
    }


# library -> (module, role -> targets), as in a family's. A library that is installed but lacks a target is an
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
    Patch(role, name, module, target, replacement)
    for name, (module, per_role) in {**{f.model_type: (f.module, _targets(f)) for f in FAMILIES.values()},
                                     **TRAINERS}.items()
    for role, targets in per_role.items()
    for target, replacement in targets
]


def _resolve(patch: Patch):
    """(owner object, attribute name) of a patch target, or None where the library lacks it."""
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


def _selected(given: Dict[str, Optional[bool]]) -> Dict[str, bool]:
    """role -> on, from apply()'s role keywords and their aliases: the names of one role must agree."""
    out = {}
    for role in (*ROLES, "log_probs"):
        names = [role] + [a for a, r in ALIASES.items() if r == role]
        values = {n: given[n] for n in names if given.get(n) is not None}
        if len(set(values.values())) > 1:
            raise ValueError(f"bastile.apply: {values} disagree, but they name one role, {role!r} (the others are "
                             "its aliases)")
        out[role] = next(iter(values.values()), True)
    return out


def apply(*, norm: Optional[bool] = None, mlp: Optional[bool] = None, attention: Optional[bool] = None,
          decoder: Optional[bool] = None, head: Optional[bool] = None, log_probs: Optional[bool] = None, model=None,
          families: Optional[Sequence[str]] = None, rms_norm: Optional[bool] = None, swiglu: Optional[bool] = None,
          rope: Optional[bool] = None, fused_linear_cross_entropy: Optional[bool] = None,
          geglu: Optional[bool] = None, moe: Optional[bool] = None, offload_checkpoints: Optional[bool] = None,
          mlp_chunk: Optional[int] = None) -> List[str]:
    """Patches the selected roles (all by default) for the given families (all supported ones, one family
    by name, or the family of `model`, an HF model instance, after checking that the model is what its
    family's traits declare). Works before or after the model is built, since it replaces class attributes
    and module functions; a model built afterwards is checked on its first forward. Returns the names
    `<role>_<family>` of the patches active from this call, e.g. ['norm_qwen3', 'mlp_qwen3', ...]. Applying
    twice is harmless. `log_probs` is TRL's fused LM head (its trainers' per-token log-probabilities) on
    Bastile's fused_linear_log_probs, whatever the model, where TRL is installed (trl==1.16; another TRL
    whose internals differ is an error here). The kernel-named keywords of earlier releases are aliases
    (patch.ALIASES).

    `offload_checkpoints=True` (off by default; None keeps the current setting) is for long context under
    gradient checkpointing (HF's gradient_checkpointing_enable(), TRL's gradient_checkpointing=True): the
    layers' saved inputs wait for the backward in pinned host memory, copied on a side stream, and a
    checkpointed layer's dense MLP runs over chunks of `mlp_chunk` tokens (default: as many as fit 1/32 of
    the device's memory) (long_context.py). The decoder patches do both (the MLP's chunks need the mlp patch
    too); it changes nothing without checkpointing."""
    versions.check_transformers(transformers.__version__)
    global _settings
    if mlp_chunk is not None and (isinstance(mlp_chunk, bool) or not isinstance(mlp_chunk, int) or mlp_chunk < 1):
        raise ValueError(f"bastile.apply: mlp_chunk must be a positive number of tokens, not {mlp_chunk!r}")
    offload = _settings.offload_checkpoints if offload_checkpoints is None else bool(offload_checkpoints)
    if mlp_chunk is not None and not offload:
        raise ValueError("bastile.apply: mlp_chunk sizes the MLP's chunks under offload_checkpoints=True, which is off")
    selected = _selected(dict(norm=norm, mlp=mlp, attention=attention, decoder=decoder, head=head,
                              log_probs=log_probs, rms_norm=rms_norm, swiglu=swiglu, rope=rope,
                              fused_linear_cross_entropy=fused_linear_cross_entropy, geglu=geglu, moe=moe))
    if model is not None:
        try:
            families = [check(model).model_type]
        except Unsupported as e:
            raise Unsupported(f"{e}: nothing was patched") from None
    elif families is not None:
        families = [families] if isinstance(families, str) else list(families)
        unknown = sorted(set(families) - set(FAMILIES))
        if unknown:
            raise ValueError(f"bastile.apply: unknown families {unknown}; supported: {', '.join(supported_families())}")
    chosen = [p for p in PATCHES
              if selected[p.role] and (families is None or p.family in families or p.family in TRAINERS)]
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
                               f"pass {p.role}=False to keep its own")
    if model is not None:
        missing = [f"{name} ({p.target})" for name, found in by_name.items() for p, t in found
                   if t is None and p.family not in TRAINERS]
        if missing:
            raise RuntimeError(f"bastile.apply: this transformers lacks the targets of {missing}")
        _checked.add(model)
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
    chunk = _settings.mlp_chunk if mlp_chunk is None else mlp_chunk
    _settings = long_context.Settings(offload, chunk if offload else None)
    return [name for name, found in by_name.items() if name in _active]


def _canonical(name: str) -> str:
    """A patch name with an alias's prefix (`rope_llama`) as its role's (`attention_llama`)."""
    for alias, role in ALIASES.items():
        if name.startswith(alias + "_") and name[len(alias) + 1:] in FAMILIES:
            return f"{role}_{name[len(alias) + 1:]}"
    return name


def reset(names: Optional[Sequence[str]] = None) -> List[str]:
    """Restores the originals of the named patches (all by default, and then apply()'s settings too); returns
    the names restored. As applying twice is, resetting a patch that is not active, or naming one twice, is
    harmless; an unknown name raises before anything is restored."""
    global _settings
    if names is None:
        names = list(_active)
        _settings = long_context.Settings()
    names = list(dict.fromkeys(_canonical(n) for n in ([names] if isinstance(names, str) else names)))
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
    fused = {}
    for f in FAMILIES.values():
        runs = _runs(f.model_type)
        if runs("attention"):
            fused[hf.hf_attr(f, f.name("Attention"))] = None
            if f.linear_attention:
                fused[hf.hf_attr(f, f.name("GatedDeltaNet"))] = hf.delta_net_why_not
        if runs("mlp") and f.mlp.dense:
            fused[hf.hf_attr(f, f.name("MLP"))] = hf.mlp_why_not(f.mlp)
        if runs("decoder") and f.residual.per_layer_input:  # the per-layer input's gate and projection
            fused[hf.hf_attr(f, f.name("DecoderLayer"))] = hf.mlp_why_not(f.mlp)
    return lora.report(model, fused)


def get_patched_ops() -> List[str]:
    return sorted(_active)
