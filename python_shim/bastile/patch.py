"""bastile.apply(): swaps HF forward functions for Bastile's, and puts them back.

Patches are named by role (roles/): what part of a model they replace, the same in every family. Which class
attributes a role replaces in a family, and with what, is its declaration for the family (`<role>.declare`,
made from the family's traits). A patch name `<role>_<family>` stands for all targets of that role in that
family: apply() returns it once and reset() restores them all. LIBRARIES does the same for libraries beside
transformers: TRL's head (trainers.TRAINERS) applies whatever the model; PEFT's wrapper of the experts'
parameters applies with the families' experts, the part of the mlp role it serves.

The keywords of earlier releases name kernels; each switches the part of a role its kernel served (KERNELS):
rms_norm the norms, swiglu the dense MLP, moe (and geglu, GPT-OSS's experts' activation) the MoE experts, rope
the attention, fused_linear_cross_entropy the head. Patch names made of them (`rope_llama`) are accepted by
reset().
"""
import importlib
import importlib.util
import weakref
from dataclasses import dataclass
from typing import Callable, Dict, FrozenSet, List, Optional, Sequence

import torch

from . import families as traits
from . import experts, long_context, lora, versions
from .families import FAMILIES, Family, Unsupported
from .roles import Context, Declaration, Target, attention, decoder, head, hf_attr, mlp, norm
from .trainers import TRAINER_ROLES, TRAINERS

# After roles/: loading transformers' modeling submodules puts another module object in sys.modules["transformers"],
# the one users import (its __version__ is the one read).
import transformers  # noqa: E402

ROLES = ("norm", "mlp", "attention", "decoder", "head")
_DECLARE = {"norm": norm.declare, "mlp": mlp.declare, "attention": attention.declare, "decoder": decoder.declare,
            "head": head.declare}
# Kernel-named keywords: the role and the part of it (None: all of it) each switches. The mlp role's parts are the
# dense MLP and the MoE experts.
KERNELS = {"rms_norm": ("norm", None), "swiglu": ("mlp", "dense"), "moe": ("mlp", "experts"),
           "geglu": ("mlp", "experts"), "rope": ("attention", None), "fused_linear_cross_entropy": ("head", None)}


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
    part: Optional[str] = None  # the part of its role that a kernel keyword switches (KERNELS)
    lora: Optional[Callable] = None  # Target.lora

    @property
    def name(self) -> str:
        return f"{self.role}_{self.family}"


# name -> [(owner, attribute, original value as found in owner.__dict__, part), ...], one per target patched
_active: Dict[str, list] = {}

# apply()'s library-wide settings (long_context.Settings), read by the patched forwards at each call.
_settings = long_context.Settings()


def _current_settings() -> long_context.Settings:
    return _settings


def _runs(family: str) -> Callable[..., bool]:
    """Whether Bastile's forwards run a role of the family (its `part` only, where given)."""
    def runs(role: str, part: Optional[str] = None) -> bool:
        return any(part in (None, p) for *_, p in _active.get(f"{role}_{family}", ()))
    return runs


def _parts(family: Family) -> List[str]:
    """The family's classes (by part name) that its forwards replace or call into, in its modeling module."""
    return [part for d in DECLARATIONS[family.model_type].values()
            for part in (*(t.cls for t in d.targets if not t.owner), *d.reads)]


def check(model) -> Family:
    """families.check, against the classes the family's declarations name."""
    return traits.check(model, _parts)


# Models already checked against their family's traits.
_checked: "weakref.WeakSet" = weakref.WeakSet()


def _check(model) -> None:
    """check on a model's first patched forward: a model built after apply() is checked there. Skipped while
    torch.compile traces (the check is Python bookkeeping, not part of the graph)."""
    if torch.compiler.is_compiling() or model in _checked:
        return
    try:
        check(model)
    except Unsupported as e:
        raise Unsupported(f"{e}: its classes are patched, and bastile.reset() restores HF's forwards") from None
    _checked.add(model)


# model type -> role -> what the role replaces in the family
DECLARATIONS: Dict[str, Dict[str, Declaration]] = {
    f.model_type: {role: declare(Context(f, _runs(f.model_type), _current_settings, _check))
                   for role, declare in _DECLARE.items()}
    for f in FAMILIES.values()
}


# Bastile's experts forwards (the families' Experts targets), which take PEFT's adapters of the experts' parameters
_EXPERTS_FORWARDS = frozenset(t.replacement for roles in DECLARATIONS.values() for d in roles.values()
                              for t in d.targets if t.cls == "Experts")


def _patch(role: str, family: str, module: str, path: str, t: Target) -> Patch:
    return Patch(role, family, module, f"{path}.{t.attribute}", Wrap(t.replacement) if t.wraps else t.replacement,
                 t.part, t.lora)


# The experts classes whose forward is Bastile's now, as _active says after each apply() and reset(): PEFT's
# wrapper asks at every call, where a scan of _active would cost each expert parameter's forward.
_experts_forward: FrozenSet[type] = frozenset()


def _note_experts_forward():
    global _experts_forward
    _experts_forward = frozenset(owner for targets in _active.values() for owner, attr, *_ in targets
                                 if owner.__dict__.get(attr) in _EXPERTS_FORWARDS)


def _on_experts_path(cls) -> bool:
    """Whether the experts class runs Bastile's experts forward now."""
    return cls in _experts_forward


# library -> (module, role -> targets), as trainers.TRAINERS. A library target of a part (Target.part) is applied
# with the families' targets of that part of its role.
LIBRARIES = {
    **TRAINERS,
    "peft": ("peft.tuners.lora.layer", {
        "mlp": [Target("ParamWrapper", "forward", experts.peft_wrapper(_on_experts_path), wraps=True, part="experts")],
    }),
}

PATCHES: List[Patch] = [
    *(_patch(role, f.model_type, t.owner[0], t.owner[1] + t.cls, t) if t.owner else
      _patch(role, f.model_type, f.module, f.name(t.cls), t)
      for f in FAMILIES.values() for role, d in DECLARATIONS[f.model_type].items() for t in d.targets),
    *(_patch(role, library, module, t.cls, t)
      for library, (module, per_role) in LIBRARIES.items() for role, targets in per_role.items() for t in targets),
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


def _agreed(given: Dict[str, Optional[bool]], names: List[str], what: str) -> Optional[bool]:
    values = {n: given[n] for n in names if given.get(n) is not None}
    if len(set(values.values())) > 1:
        raise ValueError(f"bastile.apply: {values} disagree, but they name one {what}")
    return next(iter(values.values()), None)


def _selected(given: Dict[str, Optional[bool]]) -> Callable[[str, Optional[str]], bool]:
    """(role, part) -> on, from apply()'s keywords: a part's kernel keyword where given (swiglu=False, moe=True:
    the experts without the dense MLP), else its role's (`mlp`, or a kernel keyword for the whole role, such as
    rms_norm), else on. Keywords that name the same part, or the same whole role, must agree."""
    roles = {role: _agreed(given, [role] + [k for k, (r, part) in KERNELS.items() if r == role and part is None],
                           f"role, {role!r}")
             for role in (*ROLES, *TRAINER_ROLES)}
    parts = {(role, part): _agreed(given, [k for k, rp in KERNELS.items() if rp == (role, part)],
                                   f"part of the {role!r} role, its {part}")
             for role, part in set(KERNELS.values()) if part is not None}

    def on(role: str, part: Optional[str]) -> bool:
        value = parts.get((role, part))
        return (roles[role] if value is None else value) is not False
    return on


def apply(*, norm: Optional[bool] = None, mlp: Optional[bool] = None, attention: Optional[bool] = None,
          decoder: Optional[bool] = None, head: Optional[bool] = None, log_probs: Optional[bool] = None,
          divergence: Optional[bool] = None, model=None,
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
    whose internals differ is an error here), and `divergence` its DistillationTrainer's loss on Bastile's
    fused_linear_divergence, likewise. The kernel-named keywords of earlier releases switch the part of
    a role their kernel served (patch.KERNELS): `swiglu` the dense MLP, `moe` and `geglu` the MoE experts, within
    the mlp role; `rms_norm`, `rope` and `fused_linear_cross_entropy` the norm, attention and head roles.

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
                              log_probs=log_probs, divergence=divergence, rms_norm=rms_norm, swiglu=swiglu, rope=rope,
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
    chosen = [p for p in PATCHES if selected(p.role, p.part) and (families is None or p.family in families)]
    served = {(p.role, p.part) for p in chosen}
    chosen += [p for p in PATCHES if p.family in LIBRARIES and families is not None and selected(p.role, p.part)
               and (p.part is None or (p.role, p.part) in served)]
    # Resolve everything first, so that a missing target leaves nothing half-patched.
    by_name: Dict[str, list] = {}
    for p in chosen:
        by_name.setdefault(p.name, []).append((p, _resolve(p)))
    for name, found in by_name.items():
        moved = [f"{p.module}.{p.target}" for p, t in found
                 if t is None and p.family in LIBRARIES and importlib.util.find_spec(p.family) is not None]
        if moved:
            p = found[0][0]
            raise RuntimeError(f"bastile.apply: the installed {p.family} lacks {moved}, the targets of {name}; "
                               f"pass {p.role}=False to keep its own")
    if model is not None:
        missing = [f"{name} ({p.target})" for name, found in by_name.items() for p, t in found
                   if t is None and p.family not in LIBRARIES]
        if missing:
            raise RuntimeError(f"bastile.apply: this transformers lacks the targets of {missing}")
        _checked.add(model)
    # Replacements are made (and a Wrap's factory may refuse its original) before anything is patched. A target
    # already patched stays as it is (applying twice is harmless); a part left out before is added. A target
    # that another family's patch holds (a multimodal wrapper of two families' decoders) is held by both, and
    # restored when the last of them is reset.
    todo = {}
    for name, found in by_name.items():
        done = {(owner, attr) for owner, attr, *_ in _active.get(name, ())}
        todo[name] = [(owner, attr, p.replacement.factory(getattr(owner, attr))
                       if isinstance(p.replacement, Wrap) else p.replacement, p.part)
                      for p, t in found if t is not None and t not in done for owner, attr in [t]]
    for name, targets in todo.items():
        for owner, attr, replacement, part in targets:
            held = _holder(owner, attr)
            _active.setdefault(name, []).append((owner, attr, held[2] if held else owner.__dict__.get(attr), part))
            if not held:
                setattr(owner, attr, replacement)
    _note_experts_forward()
    chunk = _settings.mlp_chunk if mlp_chunk is None else mlp_chunk
    _settings = long_context.Settings(offload, chunk if offload else None)
    return [name for name, found in by_name.items() if name in _active]


def _canonical(name: str) -> str:
    """A patch name with a kernel keyword's prefix (`rope_llama`) as its role's (`attention_llama`)."""
    for alias, (role, _) in KERNELS.items():
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
        for owner, attr, original, _ in reversed(_active.pop(name)):
            if _holder(owner, attr):
                continue
            if original is None:
                delattr(owner, attr)
            else:
                setattr(owner, attr, original)
    _note_experts_forward()
    return names


def _holder(owner, attr) -> Optional[tuple]:
    """The entry of an active patch that holds owner.attr, or None."""
    return next((t for targets in _active.values() for t in targets if t[0] is owner and t[1] == attr), None)


def lora_modules(model) -> Dict[str, str]:
    """{qualified name: "fused", or why PEFT's own forward runs it} for every PEFT LoRA layer of `model`
    (adapters on other modules than the patched attention's and MLP's projections and experts, DoRA, several
    active adapters, LoRA bias, quantized base layers... keep PEFT's path); a router's ParamWrapper:
    experts.WEIGHT_PLUS_DELTA."""
    fused = {hf_attr(FAMILIES[p.family], p.target.split(".")[0]): p.lora for p in PATCHES
             if p.lora is not None and p.family in FAMILIES and _runs(p.family)(p.role, p.part)}
    # PEFT's wrappers of 3-D parameters: in the expert path where its patch is active
    return {**lora.report(model, fused), **experts.report(model, _on_experts_path if "mlp_peft" in _active else None)}


def get_patched_ops() -> List[str]:
    return sorted(_active)
