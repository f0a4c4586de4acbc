"""The projections of the patched attention and MLP as fused autograd nodes, PEFT LoRA adapters included.

A PEFT `lora.Linear` computes base(x) + scaling * B(A(dropout(x))) with its adapter in fp32 by default,
so each wrapped projection casts its input to fp32, keeps that copy for the backward and runs fp32
GEMMs, and q/k/v (or gate/up) each read their shared input again. Here the projections that read one
input form one node: a single GEMM x @ [A_q; A_k; A_v]^T gives every adapter's rank-r product, each base
GEMM adds its adapter's B product in place, and the backward forms no gradient for the frozen base
weights. Products run in the activation dtype (fp32 accumulation); adapter gradients are returned in the
adapters' dtype, accumulated in fp32 without an intermediate rounding, so PEFT's optimizer sees what it
expects. A node saves its input and the [tokens, rank] products. A dropout mask is drawn as PEFT draws it
(one per adapter) and regenerated in the backward from the RNG state it came from, as
torch.utils.checkpoint does, so no mask is kept.

A base layer may be a bitsandbytes 4-bit Linear4bit (QLoRA, NF4 or FP4, nested scales or not): its weight
is dequantized by bastile.dequantize_4bit, bit for bit as bitsandbytes does, into a buffer that lives for
one GEMM, in the forward and again in the backward (never kept, never saved); a node's 4-bit weights
dequantize in one launch.

The MLP's down projection is fused with the SwiGLU before it (for plain and LoRA projections alike): the
activation, as large as gate, is recomputed in the backward instead of being saved.

Anything else runs its module as before: `why_not` says which projections and why (`bastile.lora_modules`
reports it for a model).
"""
import sys
from typing import List, NamedTuple, Optional, Sequence

import torch
from torch import nn
from torch.nn import functional as F

from .ops.dequantize_4bit import dequantize_4bit
from .ops.swiglu import swiglu


def _lora_linear():
    """PEFT's lora.Linear class, or None when PEFT is not imported (then no module is one)."""
    return getattr(sys.modules.get("peft.tuners.lora.layer"), "Linear", None)


def _bnb(name: str):
    """A class of bitsandbytes.nn (Linear4bit, Params4bit, Linear8bitLt), or None when bitsandbytes is not
    imported (then no module is one)."""
    return getattr(sys.modules.get("bitsandbytes.nn.modules"), name, None)


def _lora_classes() -> tuple:
    """PEFT's LoRA layers whose base a node can read: lora.Linear and, with bitsandbytes, its Linear4bit."""
    return tuple(c for c in (_lora_linear(), getattr(sys.modules.get("peft.tuners.lora.bnb"), "Linear4bit", None))
                 if c is not None)


def _why_not_4bit(base: nn.Module) -> Optional[str]:
    """None when a bitsandbytes Linear4bit's weight can be dequantized here, else why not."""
    state = getattr(base.weight, "quant_state", None)
    if state is None:
        return "4-bit weight not quantized yet (still on the CPU before .to(device)?)"
    if getattr(state, "packing_format_for_cpu", False):
        return "4-bit weight repacked for bitsandbytes' CPU inference kernels"
    if len(state.shape) != 2:
        return f"4-bit weight of shape {tuple(state.shape)}"
    return None


def hooked(module: nn.Module) -> bool:
    """Whether calling the module does more than its class's forward: forward hooks, or a forward replaced
    on the instance (accelerate's offloading does that), which a fused node reading its weights would skip."""
    return bool(module._forward_hooks or module._forward_pre_hooks or "forward" in vars(module))


def _trainable(linear: nn.Linear) -> bool:
    """Whether an nn.Linear (no submodules: its own parameters are all of them) has a trainable one."""
    return any(p is not None and p.requires_grad for p in linear._parameters.values())


def active_adapters(module: nn.Module) -> List[str]:
    """A PEFT LoRA layer's active adapters that it holds (PEFT's active_adapters name the model's)."""
    return [a for a in module.active_adapters if a in module.lora_A]


def why_not(module: nn.Module) -> Optional[str]:
    """None when `module` can run inside a fused node: a frozen nn.Linear, or a PEFT lora.Linear with one
    active plain LoRA adapter over a frozen nn.Linear. Else the reason it runs its own forward."""
    if type(module) is nn.Linear:
        if _trainable(module):
            return "trainable nn.Linear (a full fine-tune has no adapter to fuse)"
        return "forward hooked or replaced" if hooked(module) else None
    if type(getattr(module, "base_layer", module)) is _bnb("Linear8bitLt"):
        return "LLM.int8 base layer (bitsandbytes Linear8bitLt): not fused"
    if type(module) not in _lora_classes():
        return f"{type(module).__name__} is not a PEFT lora.Linear"
    if module.disable_adapters:
        return "adapters disabled"
    if module.merged:
        return "adapter merged into the base weight"
    names = active_adapters(module)
    if len(names) != 1:
        return f"{len(names)} active adapters"
    name = names[0]
    base = module.base_layer
    if name in module.lora_variant:
        return f"{type(module.lora_variant[name]).__name__} (e.g. DoRA) variant"
    if module.lora_bias[name]:
        return "LoRA bias"
    if type(base) is _bnb("Linear4bit"):
        if (why := _why_not_4bit(base)) is not None:
            return why
    elif type(base) is not nn.Linear:
        return f"base layer is {type(base).__name__}, not nn.Linear or bitsandbytes Linear4bit"
    if _trainable(base):
        return "trainable base layer"
    if not isinstance(module.lora_dropout[name], (nn.Identity, nn.Dropout)):
        return f"dropout is {type(module.lora_dropout[name]).__name__}"
    if hooked(module) or hooked(base):
        return "forward hooked or replaced"
    return None


class _Parts(NamedTuple):
    """What a node reads of an eligible module. weight: a dense tensor, or a 4-bit Params4bit; A, B None for
    a plain linear; dtype: the dtype its base computes in outside autocast (None: the input's)."""
    weight: torch.Tensor
    bias: Optional[torch.Tensor]
    A: Optional[torch.Tensor]
    B: Optional[torch.Tensor]
    scaling: float
    p: float
    dtype: Optional[torch.dtype]


def _parts(module: nn.Module) -> _Parts:
    if type(module) is nn.Linear:
        return _Parts(module.weight, module.bias, None, None, 0.0, 0.0, module.weight.dtype)
    (name,) = active_adapters(module)
    drop = module.lora_dropout[name]
    p = drop.p if isinstance(drop, nn.Dropout) and drop.training else 0.0
    base = module.base_layer
    # bitsandbytes casts the input to its compute dtype, which it takes from the first input when unset.
    dtype = base.weight.dtype if type(base) is nn.Linear else base.compute_dtype
    return _Parts(base.weight, base.bias, module.lora_A[name].weight, module.lora_B[name].weight,
                  float(module.scaling[name]), p, dtype)


def _node_dtype(x: torch.Tensor, dtypes: Sequence[Optional[torch.dtype]]) -> Optional[torch.dtype]:
    """The dtype a node computes in: autocast's, else x's. None where a base computes in another dtype
    than x's outside autocast: HF's linear raises there, and bitsandbytes' rounds the input and the output
    through its compute dtype, so the modules are called."""
    kind = x.device.type
    if torch.is_autocast_enabled(kind):
        return torch.get_autocast_dtype(kind)
    return x.dtype if all(d in (None, x.dtype) for d in dtypes) else None


def _is_4bit(weight: torch.Tensor) -> bool:
    params4bit = _bnb("Params4bit")
    return params4bit is not None and type(weight) is params4bit


def _saving(ctx, weights: Sequence[torch.Tensor]) -> list:
    """The base weights to save_for_backward: the dense ones as they are (a copy cast for autocast, or
    dequantized, would be kept as large as the weights); the 4-bit ones stay on ctx by reference instead,
    since a saved-tensor hook's copy of one would lose its quant_state (they are frozen parameters)."""
    ctx.quantized = {i: w for i, w in enumerate(weights) if _is_4bit(w)}
    return [None if i in ctx.quantized else w for i, w in enumerate(weights)]


def _saved(ctx, weights: Sequence[Optional[torch.Tensor]]) -> list:
    """The base weights `_saving` split, back together."""
    return [ctx.quantized.get(i, w) for i, w in enumerate(weights)]


def _dense(weights: Sequence[torch.Tensor], dtype: torch.dtype) -> List[torch.Tensor]:
    """The base weights in `dtype`: dense ones cast (those already in it as they are), 4-bit ones dequantized
    together in one launch, as bitsandbytes does (into their quant_state's dtype, then cast; straight into
    `dtype` where that rounds the same: from float32 or into it)."""
    groups = {}
    for i, w in enumerate(weights):
        if _is_4bit(w):
            groups.setdefault(w.quant_state.dtype, []).append(i)
    out = list(weights)
    for kept, group in groups.items():
        rows = [weights[i].quant_state.shape[0] for i in group]
        into = dtype if kept in (dtype, torch.float32) else kept
        for i, w in zip(group, dequantize_4bit(*(weights[i] for i in group), dtype=into).split(rows)):
            out[i] = w
    return [_cast(w, dtype) for w in out]


def _mm(a: torch.Tensor, b: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """a @ b in `dtype`: from bf16/fp16 operands to fp32 straight from the fp32 accumulator on CUDA."""
    if a.dtype == dtype:
        return a.mm(b)
    if a.is_cuda and dtype == torch.float32:
        return torch.mm(a, b, out_dtype=dtype)
    return a.to(dtype).mm(b.to(dtype)) if dtype == torch.float32 else a.mm(b).to(dtype)


@torch.library.custom_op("bastile_lora::addmm_", mutates_args=("out",))
def _addmm_op(out: torch.Tensor, m1: torch.Tensor, m2: torch.Tensor) -> None:
    out.addmm_(m1, m2)


def _addmm_(out: torch.Tensor, m1: torch.Tensor, m2: torch.Tensor) -> torch.Tensor:
    """out += m1 @ m2 in place. Under torch.compile (2.11) through an opaque op, which Inductor keeps in
    place: a plain addmm_ it makes out of place, which ATen runs as a copy of out and a GEMM (a [tokens, out]
    device copy per call), and a Function whose forward mutates a tensor it returns that way loses its
    gradients. Eager calls addmm_ itself: the op would add its dispatch time to every call."""
    if torch.compiler.is_compiling():
        _addmm_op(out, m1, m2)
    else:
        out.addmm_(m1, m2)
    return out


def _rng_state(device: torch.device) -> torch.Tensor:
    return torch.cuda.get_rng_state(device) if device.type == "cuda" else torch.get_rng_state()


def _dropout_scale(x: torch.Tensor, p: float, state: Optional[torch.Tensor] = None) -> torch.Tensor:
    """mask / (1 - p) of a dropout of x's shape; drawn from `state` (then the RNG is left as it was) to
    regenerate the mask drawn when the RNG was in that state."""
    if state is None:
        return F.dropout(torch.ones_like(x), p)
    cuda = x.device.type == "cuda"
    with torch.random.fork_rng([x.device] if cuda else [], device_type=x.device.type):
        (torch.cuda.set_rng_state(state, x.device) if cuda else torch.set_rng_state(state))
        return F.dropout(torch.ones_like(x), p)


def _cast(t: torch.Tensor, dtype: torch.dtype, scale: float = 1.0) -> torch.Tensor:
    """scale * t in `dtype`, rounded once, in one kernel (none for t already in dtype and unscaled)."""
    if scale == 1.0 and t.dtype == dtype:
        return t
    return torch.mul(t, scale, out=t.new_empty(t.shape, dtype=dtype))


def _stack(ts: Sequence[torch.Tensor], dtype: torch.dtype) -> torch.Tensor:
    """torch.cat(ts) in `dtype` in one kernel (none for one tensor already in dtype)."""
    if len(ts) == 1:
        return _cast(ts[0], dtype)
    return torch.cat(ts, out=ts[0].new_empty((sum(len(t) for t in ts), ts[0].shape[1]), dtype=dtype))


class _Adapters:
    """The rank-r side of a node's adapters that read one input x [tokens, in]. Their weights are cast
    once per call, in the forward: `weights` gives A = [A_1; A_2; ...] and each s_i * B_i in the compute
    dtype (rank-sized, saved for the backward, which casts nothing). The forward's products x_i @ A_i^T
    come from one GEMM when none drops out; the backward gives their gradients."""

    def __init__(self, As, Bs, ps, scales):
        self.ps, self.scales = ps, scales
        self.ranks = [a.shape[0] for a in As]
        self.dtypes = [(a.dtype, b.dtype) for a, b in zip(As, Bs)]
        self.states = [None] * len(As)

    def weights(self, As, Bs, dtype):
        return _stack(As, dtype), [_cast(b, dtype, s) for b, s in zip(Bs, self.scales)]

    def forward(self, x, a):
        if not any(self.ps):
            return x.mm(a.t())
        parts = []
        for i, (a_i, p) in enumerate(zip(a.split(self.ranks), self.ps)):
            if p:  # the state each mask is drawn from, in PEFT's order (q, k, v)
                self.states[i] = _rng_state(x.device)
            parts.append((x * _dropout_scale(x, p) if p else x).mm(a_i.t()))
        return torch.cat(parts, 1)

    def backward(self, x, xa, a, bs, grads, grad_x):
        """Adapter gradients (dA, dB per adapter) for the output gradients `grads`; adds the adapters'
        share of the input gradient to grad_x (when it is not None)."""
        ts = [g.mm(b) for g, b in zip(grads, bs)]  # s_i * g_i @ B_i: b is scaled
        dBs = [_mm(g.t(), part, db) for g, part, (_, db) in zip(grads, xa.split(self.ranks, 1), self.dtypes)]
        torch._foreach_mul_(dBs, self.scales)
        if not any(self.ps):
            t = torch.cat(ts, 1) if len(ts) > 1 else ts[0]
            if grad_x is not None:
                _addmm_(grad_x, t, a)
            dAs = _mm(t.t(), x, self.dtypes[0][0]).split(self.ranks)
            return [(dA.to(da), dB) for dA, (da, _), dB in zip(dAs, self.dtypes, dBs)]
        out = []
        for t, a_i, p, state, (da, _), dB in zip(ts, a.split(self.ranks), self.ps, self.states, self.dtypes, dBs):
            scale = _dropout_scale(x, p, state) if p else None
            if grad_x is not None:
                share = t.mm(a_i)
                grad_x.add_(share.mul_(scale) if p else share)
            out.append((_mm(t.t(), x * scale if p else x, da), dB))
        return out


class _Projections(torch.autograd.Function):
    """[x @ W_i^T + b_i + s_i * drop_i(x) @ A_i^T @ B_i^T] for the projections reading x [tokens, in];
    the base weights and biases are frozen. `parts`: per projection (W, b, A, B), A and B None without an
    adapter."""

    @staticmethod
    def forward(ctx, x, scales, ps, *parts):
        c = x.dtype
        projections = [parts[i:i + 4] for i in range(0, len(parts), 4)]
        adapted = [i for i, (_, _, a, _) in enumerate(projections) if a is not None]
        As, Bs = [projections[i][2] for i in adapted], [projections[i][3] for i in adapted]
        adapters = _Adapters(As, Bs, [ps[i] for i in adapted], [scales[i] for i in adapted])
        with torch.autocast(x.device.type, enabled=False):
            weights = _dense([w for w, _, _, _ in projections], c)
            outs = [F.linear(x, w, None if b is None else _cast(b, c)) for w, (_, b, _, _) in zip(weights, projections)]
            a, bs = adapters.weights(As, Bs, c)
            xa = adapters.forward(x, a)
            for i, part, b in zip(adapted, xa.split(adapters.ranks, 1), bs):
                _addmm_(outs[i], part, b.t())
        ctx.adapters, ctx.adapted = adapters, adapted
        ctx.save_for_backward(x, xa, a, *bs, *_saving(ctx, [w for w, _, _, _ in projections]))
        return tuple(outs)

    @staticmethod
    def backward(ctx, *grads):
        adapters, adapted = ctx.adapters, ctx.adapted
        x, xa, a, *rest = ctx.saved_tensors
        bs, weights = rest[:len(adapted)], _saved(ctx, rest[len(adapted):])
        grad_x = None
        if ctx.needs_input_grad[0]:
            for g, w in zip(grads, _dense(weights, x.dtype)):
                grad_x = g.mm(w) if grad_x is None else _addmm_(grad_x, g, w)
        adapter_grads = adapters.backward(x, xa, a, bs, [grads[i] for i in adapted], grad_x)
        out = [None] * (4 * len(grads))
        for i, (dA, dB) in zip(adapted, adapter_grads):
            out[4 * i + 2], out[4 * i + 3] = dA, dB
        return (grad_x, None, None, *out)


def project(x: torch.Tensor, *modules: nn.Module) -> List[torch.Tensor]:
    """[m(x) for m in modules], with the eligible ones (`why_not`) in one fused node when at least one of
    them carries a LoRA adapter; the others are called as modules."""
    parts = [_parts(m) if why_not(m) is None else None for m in modules]
    group = [p for p in parts if p is not None]
    c = _node_dtype(x, [p.dtype for p in group])
    if c is None or all(p.A is None for p in group):  # a dtype mismatch, or no adapter to fuse
        return [m(x) for m in modules]
    flat = x.to(c).reshape(-1, x.shape[-1])
    outs = iter(_Projections.apply(flat, [p.scaling for p in group], [p.p for p in group],
                                   *(t for p in group for t in p[:4])))
    return [next(outs).view(*x.shape[:-1], -1) if p is not None else m(x) for m, p in zip(modules, parts)]


class _SwiGLUDown(torch.autograd.Function):
    """down(swiglu(gate, up, activation)) keeping gate and up only: the activation is recomputed in the
    backward. Without an adapter the gradients are those of the two ops in sequence, bit for bit."""

    @staticmethod
    def forward(ctx, gate, up, weight, bias, A, B, scale, p, activation):
        c = gate.dtype
        ctx.activation = activation
        with torch.autocast(gate.device.type, enabled=False):
            act = swiglu(gate, up, activation)
            out = F.linear(act, _dense([weight], c)[0], None if bias is None else _cast(bias, c))
            ha = adapters = a = b = None
            if A is not None:
                flat = act.reshape(-1, act.shape[-1])
                adapters = _Adapters([A], [B], [p], [scale])
                a, (b,) = adapters.weights([A], [B], c)
                ha = adapters.forward(flat, a)
                _addmm_(out.view(-1, out.shape[-1]), ha, b.t())
        ctx.adapters = adapters
        ctx.save_for_backward(gate, up, *_saving(ctx, [weight]), bias, a, b, ha)
        return out

    @staticmethod
    def backward(ctx, grad):
        gate, up, weight, bias, a, b, ha = ctx.saved_tensors
        (weight,) = _saved(ctx, [weight])
        act = swiglu(gate, up, ctx.activation)
        flat_grad, flat_act = grad.reshape(-1, grad.shape[-1]), act.reshape(-1, act.shape[-1])
        grad_weight = grad_bias = dA = dB = None
        if ctx.needs_input_grad[2]:
            grad_weight = _mm(flat_grad.t(), flat_act, weight.dtype)
        if bias is not None and ctx.needs_input_grad[3]:
            grad_bias = flat_grad.sum(0, dtype=bias.dtype)
        grad_gate = grad_up = None
        grad_act = grad.matmul(_dense([weight], gate.dtype)[0]) if ctx.needs_input_grad[0] or ctx.needs_input_grad[1] else None
        if ctx.adapters is not None:
            flat_grad_act = None if grad_act is None else grad_act.view(-1, grad_act.shape[-1])
            ((dA, dB),) = ctx.adapters.backward(flat_act, ha, a, [b], [flat_grad], flat_grad_act)
        if grad_act is not None:
            grad_gate, grad_up, _ = torch.ops.bastile.swiglu_backward(grad_act, gate, up, ctx.activation)
        return grad_gate, grad_up, grad_weight, grad_bias, dA, dB, None, None, None


def swiglu_down(gate: torch.Tensor, up: torch.Tensor, down: nn.Module, activation: str = "silu") -> torch.Tensor:
    """down(swiglu(gate, up, activation)) for a plain nn.Linear or an eligible LoRA-wrapped one, the
    activation recomputed in the backward; any other module is called on the activation."""
    plain = type(down) is nn.Linear and not hooked(down)
    if not plain and why_not(down) is not None:
        return down(swiglu(gate, up, activation))
    weight, bias, A, B, scale, p, dtype = _parts(down)
    c = _node_dtype(gate, [dtype])
    if c is None:
        return down(swiglu(gate, up, activation))
    return _SwiGLUDown.apply(gate.to(c), up.to(c), weight, bias, A, B, scale, p, activation)


def report(model: nn.Module, fused_parents: dict) -> dict:
    """{qualified name: "fused" or why not} for every PEFT LoRA layer of `model`; `fused_parents` maps the
    module classes whose (patched) forwards run their projections through this module's nodes to a
    function of the module that says why they do not for that module (None: they always do)."""
    layer = getattr(sys.modules.get("peft.tuners.lora.layer"), "LoraLayer", None)
    out = {}
    for name, module in model.named_modules():
        if layer is None or not isinstance(module, layer):
            continue
        parent = model.get_submodule(name.rpartition(".")[0])
        if type(parent) not in fused_parents:
            out[name] = f"inside {type(parent).__name__}, whose forward bastile.apply() has not patched"
            continue
        parent_why_not = fused_parents[type(parent)]
        out[name] = (parent_why_not and parent_why_not(parent)) or why_not(module) or "fused"
    return out
