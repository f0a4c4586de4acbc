"""Tensors that autograd keeps as how to compute them again rather than as themselves.

Inside `recomputing(outputs, compute)`, a saved output (or a view of one) is kept as its geometry, and the outputs
are computed again, by `compute()` under the forward's autocast, at the first unpack in the backward; each one's
last unpack drops it. A norm's output, which every projection after it would keep, costs a norm forward per
sublayer in the backward instead; the attention's normed and rotated q and k, which its kernel keeps beside the
un-normed ones that qk_norm_rope keeps, cost one qk_norm_rope.

Off where the outputs' memory is not the layer's to save: without autograd, under torch.compile, inside other
saved-tensor hooks (a checkpointed layer, whose checkpoint recomputes everything anyway; activation offloading,
which would take its tensors from them), or where such hooks are disabled. Nested contexts share the outer one's
hooks.
"""
import contextlib
import weakref
from typing import Callable, Sequence

import torch


class _Group:
    """Tensors made by one computation: weak references to them (strong ones would keep them for the graph's
    lifetime), how to compute them all again, and how many saves of each are still to be unpacked."""

    def __init__(self, outputs, compute: Callable):
        device = outputs[0].device.type
        self.amp = dict(device_type=device, enabled=torch.is_autocast_enabled(device),
                        dtype=torch.get_autocast_dtype(device), cache_enabled=torch.is_autocast_cache_enabled())
        self.refs, self.compute = [weakref.ref(t) for t in outputs], compute
        self.meta = [(t.shape, t.dtype) for t in outputs]
        self.packed, self.unpacked = [0] * len(outputs), [0] * len(outputs)
        self.values = [None] * len(outputs)

    def match(self, t) -> int:
        for i, ref in enumerate(self.refs):
            base = ref()
            if base is not None and (t is base or t._base is base):
                return i
        return -1

    def again(self, i: int):
        if self.values[i] is None:
            with torch.autocast(**self.amp):
                values = self.compute()
            for j, (value, (shape, dtype)) in enumerate(zip(values, self.meta)):
                if (value.shape, value.dtype) != (shape, dtype) or not value.is_contiguous():
                    raise RuntimeError(f"bastile: a tensor computed again for the backward gave {value.dtype} "
                                       f"{tuple(value.shape)}, its forward {dtype} {tuple(shape)}")
                if self.unpacked[j] < self.packed[j]:
                    self.values[j] = value
        value = self.values[i]
        self.unpacked[i] += 1
        if self.unpacked[i] >= self.packed[i]:
            self.values[i] = None
        return value


class _Saved:
    """What autograd keeps of a recomputed tensor or its view: its group, which of the group's, and the view's
    geometry."""

    def __init__(self, group: _Group, i: int, t):
        self.group, self.i, self.size, self.stride, self.offset = group, i, t.shape, t.stride(), t.storage_offset()


class _Hooks:
    """The saved-tensor hooks of one outermost context, and the tensors its contexts recompute."""

    def __init__(self):
        self.groups = []

    def pack(self, t):
        for group in self.groups:
            i = group.match(t)
            if i >= 0:
                group.packed[i] += 1
                return _Saved(group, i, t)
        return t

    def unpack(self, saved):
        if not isinstance(saved, _Saved):
            return saved
        return saved.group.again(saved.i).as_strided(saved.size, saved.stride, saved.offset)


def recomputing(outputs: Sequence[torch.Tensor], compute: Callable[[], Sequence[torch.Tensor]]):
    """A context inside which autograd keeps each of `outputs` (contiguous) saved as how to compute it again:
    compute() gives them all. Where recompute is off, a nullcontext: Dynamo cannot resume a graph broken inside a
    generator's context (HF's output capturing breaks one), so a compiled layer would run eager."""
    if not torch.is_grad_enabled() or torch.compiler.is_compiling() or not all(t.is_contiguous() for t in outputs):
        return contextlib.nullcontext()
    hooks = torch._C._autograd
    top = hooks._top_saved_tensors_default_hooks(False)
    outer = getattr(top[0], "__self__", None) if top is not None else None
    if (top is not None and not isinstance(outer, _Hooks)
            or hooks._saved_tensors_hooks_get_disabled_error_message() is not None):
        return contextlib.nullcontext()
    return _saving(_Group(outputs, compute), outer)


@contextlib.contextmanager
def _saving(group: _Group, outer):
    """`group` recomputed inside: in the outer context's hooks, or in hooks of its own."""
    if outer is not None:
        outer.groups.append(group)
        try:
            yield
        finally:
            outer.groups.remove(group)
        return
    own = _Hooks()
    own.groups.append(group)
    with torch.autograd.graph.saved_tensors_hooks(own.pack, own.unpack):
        yield
