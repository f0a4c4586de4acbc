"""The patch layer, one module per role: what a role replaces in a family's HF classes, and the forwards it
puts there, each built from named stages chosen once per family from its traits (families.py).

- norm: the RMSNorms
- mlp: the dense MLP (its part "dense") and the MoE experts' activation (its part "experts")
- attention: the token mixers: the attention, and the linear attention (Qwen3.5's and Qwen3-Next's Gated DeltaNet)
- decoder: the decoder (masks, cache, the packed batch's bounds) and its layers (norms and residuals)
- head: the causal LM's head and loss (the fused linear cross-entropy)

A role module's `declare(ctx)` says all of it for one family: the targets (class, attribute, replacement), the
classes its forwards call into without replacing them, and which targets run PEFT LoRA projections in fused
nodes. Structures of one family only are stages that family's module supplies (gemma4.py, ministral3.py,
qwen3_next.py). Each forward keeps its HF signature and falls back to HF's own math where a Bastile op does not
apply.
"""
import sys
import types
from dataclasses import dataclass
from typing import Any, Callable, Optional, Tuple

from .. import long_context
from ..families import Family


@dataclass(frozen=True)
class Context:
    """What a family's forwards are made from: its traits, and apply()'s state as it is when they run."""
    family: Family
    runs: Callable[..., bool]  # runs(role[, part]): whether Bastile's forwards run that role of the family
    settings: Callable[[], long_context.Settings]  # apply()'s library-wide settings, as they are now
    check: Callable[[Any], None]  # checks a model against its family on its first patched forward


def fused(module) -> Optional[str]:
    """The `lora` of a target whose projections always run in fused nodes: no reason why not."""
    return None


@dataclass(frozen=True)
class Target:
    cls: str                 # the family's class, by its part name (Family.name): "Attention" is Qwen3Attention
    attribute: str           # the attribute replaced: "forward"
    replacement: Callable    # the new attribute; where `wraps`, a function of the original that makes it
    wraps: bool = False
    part: Optional[str] = None  # the part of its role that a kernel keyword switches ("dense", "experts")
    # Where the forward runs the module's PEFT LoRA projections in fused nodes: why it does not for a module
    # (`fused`: it always does); None where it runs none.
    lora: Optional[Callable[[Any], Optional[str]]] = None
    # (modeling module, class prefix) of `cls`, where not the family's: a multimodal wrapper's own module
    owner: Optional[Tuple[str, str]] = None


@dataclass(frozen=True)
class Declaration:
    targets: Tuple[Target, ...]
    reads: Tuple[str, ...] = ()  # classes the forwards call into or read without replacing (by part name)


def hf_attr(family: Family, name: str):
    """`name` from the family's HF modeling module (imported already: its classes are what call this)."""
    return getattr(sys.modules[family.module], name)


def named(fn: Callable, role: str, family: Family) -> Callable:
    """fn, as a function of its own called `<role>.<name>[<model type>]` (attention.forward[qwen3]), the name
    tracebacks and profilers show."""
    name = f"{role}.{fn.__name__}[{family.model_type}]"
    code = fn.__code__.replace(co_name=name, co_qualname=name)
    out = types.FunctionType(code, fn.__globals__, name, fn.__defaults__, fn.__closure__)
    out.__kwdefaults__, out.__doc__, out.__qualname__ = fn.__kwdefaults__, fn.__doc__, name
    out.__dict__.update(fn.__dict__)  # functools.wraps' __wrapped__
    return out
