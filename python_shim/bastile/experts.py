"""The MoE families' experts on Bastile's path, in place of transformers' experts functions.

The token-expert pairs are ordered by expert (a stable counting sort, the `expert_group` op: no host sync), each
token's row is sent to its pairs (the `expert_dispatch` op), each expert's rows go through one grouped product for
gate/up, the family's gated activation (the `swiglu` or `geglu` op), one grouped product for down, then the
routing weights and the sum over a token's experts in one pass (the `expert_combine` op; the backward sends the
tokens' gradient back to the pairs through `expert_dispatch`; the weights scale the inputs' gradient rows in the
combine, and the parameters' gradients on the narrower operand of each product). The experts' biases (GPT-OSS)
are added by the ops after their products (gate/up's by the `geglu` op, down's by `expert_combine`), not in passes
of their own.

PEFT LoRA on the 3-D expert parameters (its ParamWrapper, from `target_parameters` or `all-linear`) enters the
grouped products as x W_e + s (x A_e) B_e. PEFT computes a wrapped module's forward with its weight
parametrized as W + s A B (formed, and copied, on every call); around experts on Bastile's path, `peft_wrapper`
passes the adapters' weights to the experts' forward instead, so nothing the size of the experts is formed or
kept for the backward, and the factors in the experts' dtype and layout are made from the adapters' weights
again in the backward rather than kept (Qwen3-30B-A3B all-linear: 39 MiB a layer). Around a router's 2-D weight,
where PEFT forms W + delta itself, the router's own forward gets W + delta without PEFT's parametrization. A chain
of wrappers that is not plain LoRA (several or disabled adapters, merged weights, a low-precision weight) runs
PEFT's way.

On CUDA, bf16 products run as grouped GEMMs: gate/up's with a SwiGLU family's activation as the `expert_swiglu`
op where no bias joins them, the others of a stored weight (the forward's and the inputs' gradients', in either
layout) as the `expert_linear` op (each one kernel of ours on Hopper, with an adapter's second product
(x A_e)(s B_e) in the same kernel: the factors are made in the weight's layout, B times the scale), the weights'
gradients as torch's; elsewhere (the CPU, other dtypes) expert by expert, which reads the per-expert counts on the
host.
"""
import sys
from functools import partial
from typing import Callable, Dict, NamedTuple, Optional, Tuple

import torch
from torch.nn import functional as F

from .lora import active_adapters

class Adapter(NamedTuple):
    """One LoRA adapter of an expert parameter: `factors(*sources)` gives (lhs, rhs), views of the sources (the
    adapter's own weights), its delta being scale lhs @ rhs in the parameter's stored layout. Only the sources are
    kept for the backward, which makes the factors again and writes their gradients through the same views."""
    sources: Tuple[torch.Tensor, ...]
    factors: Callable
    scale: float


class Projection(NamedTuple):
    """An expert parameter as the grouped products read it: w [experts, in, out] (a view of the stored one), its
    bias [experts, out], and one LoRA adapter's A [experts, in, rank] and B [experts, rank, out] times its scale
    (None without)."""
    w: torch.Tensor
    bias: Optional[torch.Tensor]
    a: Optional[torch.Tensor]
    b: Optional[torch.Tensor]


def stored(experts, name: str) -> Tuple[torch.Tensor, Optional[torch.Tensor]]:
    """`name` (gate_up_proj or down_proj) of an experts module as [experts, in, out], and its bias. transformers
    stores [experts, out, in] unless the class says `is_transposed` ([experts, in, out])."""
    w = getattr(experts, name)
    bias = getattr(experts, f"{name}_bias") if experts.has_bias else None
    return (w if experts.is_transposed else w.transpose(-2, -1)), bias


@torch.library.custom_op("bastile_experts::contiguous", mutates_args=())
def _contiguous_op(t: torch.Tensor, dtype: torch.dtype, scale: float) -> torch.Tensor:
    return torch.mul(t, scale, out=t.new_empty(t.shape, dtype=dtype))


@_contiguous_op.register_fake
def _(t, dtype, scale):
    return t.new_empty(t.shape, dtype=dtype)


def _contiguous(t: torch.Tensor, dtype: torch.dtype, scale: float = 1.0) -> torch.Tensor:
    """scale t in `dtype`, contiguous, in one pass. Under torch.compile (2.11) through an opaque op: Inductor lays a
    copy of a permuted view out in the view's strides, which grouped_mm refuses."""
    if torch.compiler.is_compiling():
        return _contiguous_op(t, dtype, scale)
    return torch.mul(t, scale, out=t.new_empty(t.shape, dtype=dtype))


class _Factors(NamedTuple):
    """An adapter's factors as Projection's a [experts, in, rank] and b [experts, rank, out]. The delta s lhs @ rhs
    is in the stored layout: stored [in, out], x (W + s L R) = x W + s (x L) R; stored [out, in],
    x (W + s L R)^T = x W^T + s (x R^T) L^T."""
    adapter: Adapter
    transposed: bool

    def views(self, *sources):
        lhs, rhs = self.adapter.factors(*sources)
        return (lhs, rhs) if self.transposed else (rhs.transpose(-2, -1), lhs.transpose(-2, -1))

    def made(self, w: torch.Tensor, *sources):
        """In w's dtype, each laid out as w ([experts, in, out] contiguous, or its transpose) so that the grouped
        GEMM reads the low-rank product's factor in its weight's layout; b times the adapter's scale."""
        def laid_out(t, scale=1.0):
            if w.is_contiguous():
                return _contiguous(t, w.dtype, scale)
            return _contiguous(t.transpose(-2, -1), w.dtype, scale).transpose(-2, -1)
        a, b = self.views(*sources)
        return laid_out(a), laid_out(b, self.adapter.scale)

    def source_grads(self, sources, need, da, db):
        """The sources' gradients (None where `need` says no) from the factors': written through the views."""
        grads = [torch.empty_like(t) for t in sources]
        for view, g in zip(self.views(*grads), (da, db)):
            view.copy_(g)
        return tuple(g if n else None for g, n in zip(grads, need))


class Gate(NamedTuple):
    """A family's gated activation of the experts' gate/up rows: `forward(experts, gate_up)`, and
    `backward(experts, gate_up, grad, dot=False)` (the gradient of gate_up for the output's `grad`, each row's
    <grad, output> in at least fp32 where `dot` asks and the stage sums it, else None), the forward made again from
    gate_up: nothing of it is kept. `grouped(experts, x, weight, offsets, *lora)`, where the family has one: gate/up's
    grouped products of the pairs' rows x with the stored [experts, 2 * inter, in] weight (plus lora's, (x A,
    s B [experts, 2 * inter, rank]) where given) and the activation in one op, (gate_up, the gate's output), or
    None where it does not take this activation. `bias`: forward and backward
    take gate/up's bias and each row's expert after their other arguments, and add it to gate_up first, rounded to
    its dtype."""
    forward: Callable
    backward: Callable
    grouped: Optional[Callable] = None
    bias: bool = False


def through_autograd(forward: Callable) -> Gate:
    """The Gate of a `forward` with no backward op of its own: autograd's."""
    def backward(experts, gate_up, grad, dot=False):
        with torch.enable_grad():
            g = gate_up.detach().requires_grad_()
            (dg,) = torch.autograd.grad(forward(experts, g), g, grad)
        return dg, None
    return Gate(forward, backward)


class Groups(NamedTuple):
    """The token-expert pairs ordered by expert: `order` (the pair of each row), `offsets` (each expert's end,
    int32), `expert` (each row's expert), `position` (the row of each pair, [tokens, k]), `chosen` (each pair's
    expert, [tokens, k]: the router's choice)."""
    order: torch.Tensor
    offsets: torch.Tensor
    expert: torch.Tensor
    position: torch.Tensor
    chosen: torch.Tensor


def group(top_k_index: torch.Tensor, experts: int) -> Groups:
    return Groups(*torch.ops.bastile.expert_group(top_k_index, experts), top_k_index)


def grouped_operands(*operands: torch.Tensor) -> bool:
    """Whether torch's grouped GEMM takes these operands (rows [pairs, n] or experts' [experts, n, m]): bf16, each
    dimension but the first a multiple of 8 (rows of 16-byte multiples)."""
    return all(t.dtype == torch.bfloat16 and all(d % 8 == 0 for d in t.shape[1:]) for t in operands)


def _grouped_kernel(*operands: torch.Tensor) -> bool:
    """Whether the products run as torch's grouped GEMM: on CUDA, where it takes the operands."""
    return operands[0].is_cuda and grouped_operands(*operands)


def _bounds(offsets: torch.Tensor):
    ends = offsets.tolist()
    return zip([0] + ends[:-1], ends)


def grouped_mm(x: torch.Tensor, w: torch.Tensor, offsets: torch.Tensor, lora=()) -> torch.Tensor:
    """x [pairs, in] ordered by expert times each expert's w [experts, in, out], plus lora_x [pairs, rank] times
    each expert's lora_w [experts, rank, out] where `lora` gives them: [pairs, out]. A w stored whole (contiguous,
    or its transpose: a view of transformers' stored weight either way) through the `expert_linear` op, our grouped
    GEMM on Hopper in either layout with the low-rank product in the same kernel."""
    if _grouped_kernel(x, w):
        if w.is_contiguous() or w.transpose(-2, -1).is_contiguous():
            low_rank = (lora[0], lora[1].transpose(-2, -1)) if lora else ()
            return torch.ops.bastile.expert_linear(x, w.transpose(-2, -1), offsets, *low_rank)
        y = F.grouped_mm(x, w, offs=offsets)
        return y + grouped_mm(*lora, offsets) if lora else y
    y = torch.cat([x[a:b] @ we for (a, b), we in zip(_bounds(offsets), w.unbind(0))])
    return y + grouped_mm(*lora, offsets) if lora else y


def grouped_wgrad(x: torch.Tensor, dy: torch.Tensor, offsets: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """Each expert's x^T dy over its pairs: [experts, in, out] in the memory layout of `like` (the weight it is the
    gradient of: a transposed view of [experts, out, in] gets dy^T x, transposed), so that autograd stores it in
    the parameter's layout with no copy; bf16 off the grouped GEMM, at least fp32 off the expert-by-expert
    products."""
    if like.stride(-2) == 1 and like.stride(-1) != 1:
        return grouped_wgrad(dy, x, offsets, like.transpose(-2, -1)).transpose(-2, -1)
    if _grouped_kernel(x, dy):
        return F.grouped_mm(x.t(), dy, offs=offsets)
    acc = torch.promote_types(x.dtype, torch.float32)
    return torch.stack([x[a:b].to(acc).t() @ dy[a:b].to(acc) for a, b in _bounds(offsets)])


def _low_rank(x, groups: Groups, p: Projection) -> Optional[torch.Tensor]:
    """x a, an adapter's first product (kept for the backward), or None without an adapter."""
    return grouped_mm(x, p.a, groups.offsets) if p.a is not None else None


def _forward(x, xa, groups: Groups, p: Projection, taken: bool = False):
    """x w + xa b + bias of each pair's expert (xa = x a, b scaled), and whether the op after the product adds the
    bias itself (`taken`, _takes_bias): then y is without it."""
    y = grouped_mm(x, p.w, groups.offsets, (xa, p.b) if xa is not None else ())
    if _takes_bias(taken, p.bias, y):
        return y, True
    if p.bias is not None:
        y = _add_bias(y, p.bias, groups.expert)
    return y, False


def _takes_bias(taken: bool, bias: Optional[torch.Tensor], y: torch.Tensor) -> bool:
    """Whether the op after a product adds the product's bias itself (`taken`: that op takes one; a bias of the
    product's dtype), so that no pass of its own writes their sum."""
    return taken and bias is not None and bias.dtype == y.dtype


def _add_bias(y: torch.Tensor, bias: torch.Tensor, expert: torch.Tensor) -> torch.Tensor:
    """y + bias[expert] (each row's expert's bias). Eager, where the dtypes agree: into y as the product of the rows'
    one-hot experts and the biases, one pass over y and no [rows, out] gather (each row's sum has one term: exact,
    rounded once as the addition is). Under torch.compile the expression itself, which Inductor fuses into one pass
    (2.11 mislowered the in-place product: a later op's input came out as the index's buffer)."""
    if bias.dtype != y.dtype or torch.compiler.is_compiling():
        return y + bias[expert]
    return y.addmm_(_one_hot(expert, bias.shape[0], y.dtype), bias)


def _one_hot(expert: torch.Tensor, experts: int, dtype: torch.dtype) -> torch.Tensor:
    """[rows, experts] of dtype: 1 at each row's expert, else 0."""
    return torch.eye(experts, dtype=dtype, device=expert.device)[expert]


def _backward(dy, x, xa, groups: Groups, p: Projection, scale: float, need, rows=None, wx=None):
    """The gradients of _forward's y for the pairs' dy: (dx, dw, dbias, da, db), `need` saying which of w, bias,
    a, b; db that of the adapter's B, p.b divided by `scale`. `rows` (each row's routing weight): the parameters'
    gradients are those of dy scaled by it, dx that of dy; the scale goes on the narrower operand of each product
    (x, x a, or dy (B^T)), not on dy. `wx`: x's rows already scaled by theirs (then x, which only dw would read, may
    be None)."""
    need_w, need_bias, need_a, need_b = need
    t = grouped_mm(dy, p.b.transpose(-2, -1), groups.offsets) if p.a is not None else None
    dx = grouped_mm(dy, p.w.transpose(-2, -1), groups.offsets, (t, p.a.transpose(-2, -1)) if t is not None else ())
    scaled = (lambda v: _weighted(v, rows, v.dtype)) if rows is not None else (lambda v: v)
    dw = grouped_wgrad(scaled(x) if wx is None else wx, dy, groups.offsets, p.w).to(p.w.dtype) if need_w else None
    dbias = None
    if need_bias:
        # each expert's rows of dy (times their weights) summed as one product with the rows' one-hot experts, in at
        # least fp32: the same sum on every run, where index_add_ on CUDA is not (as the ops' sum_by_expert)
        acc = torch.promote_types(dy.dtype, torch.float32)
        one_hot = _one_hot(groups.expert, p.bias.shape[0], acc)
        if rows is not None:
            one_hot = one_hot * rows[:, None].to(acc)
        dbias = (one_hot.t() @ dy.to(acc)).to(p.bias.dtype)
    da = grouped_wgrad(x, scaled(t), groups.offsets, p.a).to(p.a.dtype) if need_a else None
    db = (scale * grouped_wgrad(scaled(xa), dy, groups.offsets, p.b)).to(p.b.dtype) if need_b else None
    return dx, dw, dbias, da, db


def _weighted(v: torch.Tensor, rows: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Each row of v times its routing weight, as (v * rows[:, None]).to(dtype) rounds it, without that product in
    fp32 (Mixtral's and GLM's weights) as large as v."""
    return torch.mul(v, rows[:, None], out=v.new_empty(v.shape, dtype=dtype))


def _dispatch(x: torch.Tensor, order: torch.Tensor, dtype: torch.dtype, weights=None) -> torch.Tensor:
    """Each row's token's row of x, in dtype; times the row's routing weight where `weights` ([tokens, k]) are
    given, rounded once as _weighted rounds it."""
    return torch.ops.bastile.expert_dispatch(x, order, weights, dtype=dtype)[0]


def _down_backward(gate: Gate, bias1: tuple, grad, w, gate_up, ha, groups: Groups, p: Projection, scale: float, need,
                   dot: bool):
    """The backward of down and the gate (given gate/up's `bias1` where it adds it, _takes_bias) for the tokens'
    gradient `grad`, `w` each row's routing weight: (the gate's input's gradient for rows of weight 1, the routing
    weights' gradient per row where `dot` asks, down's parameters' gradients). A function of its own so that its
    [pairs, hidden] tensors are freed before the gate/up backward allocates its own.
    With dpair each row's token's gradient and u = dpair (W2 + s A2 B2)^T: dh = w u, the weights' gradient <u, h>
    (+ <dpair, bias2>), <u, h> summed by the gate's backward where it can: then h is made again only where down's
    weight or factor A reads it."""
    need_w, _, need_a, _ = need
    h = gate.forward(gate_up, *bias1) if need_w or need_a else None
    dpair = _dispatch(grad, groups.order, p.w.dtype)
    u, *grads = _backward(dpair, h, ha, groups, p, scale, need, w)
    dgate_up, dweight = gate.backward(gate_up, u.to(gate_up.dtype), *bias1, dot=dot)
    if dot and dweight is None:
        h = gate.forward(gate_up, *bias1) if h is None else h
        dweight = (u * h).sum(-1, dtype=torch.promote_types(u.dtype, torch.float32))  # 16-bit: the products rounded
    if dot and p.bias is not None:
        # <dpair, bias2> of each row: its token's gradient against every expert's bias, [tokens, experts], read at
        # the row's token and expert (16-bit values are exact in TF32, were a user to allow it)
        per_token = grad.to(p.w.dtype).to(dweight.dtype).view(-1, grad.shape[-1]) @ p.bias.to(dweight.dtype).t()
        dweight = dweight + per_token[groups.order // groups.position.shape[-1], groups.expert]
    return dgate_up, dweight, grads


def _gate_up_fused(gate: Gate, x, xa, groups: Groups, p: Projection):
    """gate/up's products (an adapter's with xa = x a) and the gate in the family's grouped op, (gate_up, h), where
    it has one and they are plain: no bias, the grouped GEMM's operands, the weight stored [experts, out, in] (and
    so the adapter's s B made in its layout, _Factors.made); else None."""
    if gate.grouped is None or p.bias is not None or not _grouped_kernel(x, p.w):
        return None
    stored_w = p.w.transpose(-2, -1)
    if not stored_w.is_contiguous():
        return None
    return gate.grouped(x, stored_w, groups.offsets, *((xa, p.b.transpose(-2, -1)) if xa is not None else ()))


def _projection(params, factors: Optional[_Factors]) -> Projection:
    """(w, bias, the adapter's two sources) as the products read them; the factors made from the sources."""
    w, bias, *sources = params
    if factors is None:
        return Projection(w, bias, None, None)
    return Projection(w, bias, *factors.made(w, *sources))


class _Experts(torch.autograd.Function):
    """The experts of the pairs of a batch: sum over a token's k experts of weight * down(gate(gate_up(x))).
    Saved for the backward: the gate's input (gate_up), the rank-sized LoRA products and the adapters' sources;
    the pairs' rows of x, the gate's output, the down products (and so the routing weights' gradient) and the
    adapters' factors are made again from them. `lora`: each projection's _Factors, or None."""

    @staticmethod
    def forward(ctx, gate, lora, hidden, weights, order, offsets, expert, position, chosen, *params):
        groups = Groups(order, offsets, expert, position, chosen)
        make1, make2 = lora
        p1, p2 = _projection(params[:4], make1), _projection(params[4:], make2)
        x = _dispatch(hidden, order, p1.w.dtype)
        xa = _low_rank(x, groups, p1)
        both = _gate_up_fused(gate, x, xa, groups, p1)
        if both is not None:
            gate_up, h = both
        else:
            gate_up, folded = _forward(x, xa, groups, p1, gate.bias)
            h = gate.forward(gate_up, *((p1.bias, expert) if folded else ()))
        del x  # [pairs, hidden], freed before down's output of that size is made
        ha = _low_rank(h, groups, p2)
        out, folded = _forward(h, ha, groups, p2, True)
        # The weights' products rounded as HF's `out * weights` (promoted: Mixtral's and GLM's are fp32; an fp32
        # model's bf16 under autocast)
        combined = torch.ops.bastile.expert_combine(out, position, weights, *((p2.bias, chosen) if folded else ()))
        ctx.save_for_backward(hidden, weights, *groups, gate_up, xa, ha, *params)
        ctx.gate, ctx.lora = gate, lora
        # not a `.to` that returns combined itself: under torch.compile (2.11) a Function's output that is
        # its forward's no-op `.to` gets a zero gradient
        return combined if combined.dtype == hidden.dtype else combined.to(hidden.dtype)

    @staticmethod
    def backward(ctx, grad):
        hidden, weights, *saved = ctx.saved_tensors
        groups, (gate_up, xa, ha, *params) = Groups(*saved[:5]), saved[5:]
        order, expert, position, needs = groups.order, groups.expert, groups.position, ctx.needs_input_grad
        make1, make2 = ctx.lora
        s1, s2 = (make.adapter.scale if make else 0.0 for make in ctx.lora)
        # an adapter's factors both, where either source needs a gradient
        need1, need2 = (needs[i:i + 2] + (any(needs[i + 2:i + 4]),) * 2 for i in (9, 13))
        p2 = _projection(params[4:], make2)
        w = weights.reshape(-1)[order]
        # gate_up is without its bias where the gate adds it
        bias1 = (params[1], expert) if _takes_bias(ctx.gate.bias, params[1], gate_up) else ()
        dgate_up, dweight, (dw2, dbias2, da2, db2) = _down_backward(ctx.gate, bias1, grad, w, gate_up, ha, groups,
                                                                    p2, s2, need2, needs[3])
        if da2 is not None:
            da2, db2 = make2.source_grads(params[6:], needs[15:17], da2, db2)
        # gate/up, from the pairs' rows of x made again where a weight or factor A takes a gradient; in the
        # weights' dtype: under autocast the forward's products were narrower, and the backward runs without it
        p1 = _projection(params[:4], make1)
        # where only the weight reads x (no factor A), its rows come weighted from the dispatch: no pass of their own
        weighted = need1[0] and not need1[2]
        x = (_dispatch(hidden, order, p1.w.dtype, weights if weighted else None)
             if need1[0] or need1[2] else None)
        # dgate_up is that of rows of weight 1: gate/up's parameters take the weights on their narrower operands, and
        # the rows of dx take theirs where each token's k rows are summed, side by side in fp32 (no atomics), rounded
        # once to the wider of the two dtypes; the weights' product never runs over the [pairs, inter] rows
        dx, dw1, dbias1, da1, db1 = _backward(dgate_up.to(p1.w.dtype), None if weighted else x, xa, groups, p1, s1,
                                              need1, w, x if weighted else None)
        if da1 is not None:
            da1, db1 = make1.source_grads(params[2:4], needs[11:13], da1, db1)
        total = torch.promote_types(dx.dtype, hidden.dtype)
        dhidden = (torch.ops.bastile.expert_combine(dx.to(total), position, weights).to(hidden.dtype)
                   .view(hidden.shape) if needs[2] else None)
        dweights = dweight[position].to(weights.dtype) if needs[3] else None
        return (None, None, dhidden, dweights, *(None,) * len(groups), dw1, dbias1, da1, db1, dw2, dbias2, da2, db2)


def experts_forward(gate: Gate, concatenated: bool) -> Callable:
    """The experts' forward, `gate` the family's gated activation stage (mlp.py), which reads gate/up
    concatenated ([gate; up]) or interleaved. `lora`: {parameter name: its Adapter} (peft_wrapper)."""

    def experts(self, hidden_states, top_k_index, top_k_weights, lora: Optional[Dict[str, Adapter]] = None):
        if not self.has_gate or self.is_concatenated != concatenated:
            layout = "concatenated" if concatenated else "interleaved"
            raise RuntimeError(f"bastile: {type(self).__name__} declares has_gate={self.has_gate}, is_concatenated="
                               f"{self.is_concatenated}; Bastile's gate reads a {layout} gate/up projection. Pass "
                               "moe=False to keep transformers' experts")
        lora = lora or {}
        groups = group(top_k_index, self.num_experts)
        params, makers = [], []
        for name in ("gate_up_proj", "down_proj"):
            adapter = lora.get(name)
            params += [*stored(self, name), *(adapter.sources if adapter else (None, None))]
            makers.append(_Factors(adapter, self.is_transposed) if adapter else None)
        bound = Gate(partial(gate.forward, self), partial(gate.backward, self),
                     gate.grouped and partial(gate.grouped, self), gate.bias)
        return _Experts.apply(bound, tuple(makers), hidden_states, top_k_weights, *groups, *params)
    return experts


def _chain(wrapper) -> list:
    """A PEFT ParamWrapper and the ones it wraps, outermost first."""
    chain = [wrapper]
    while type(chain[-1].base_layer) is type(wrapper):
        chain.append(chain[-1].base_layer)
    return chain


FUSED, WEIGHT_PLUS_DELTA = "fused", "W + delta, without PEFT's parametrization"


def route(chain, on_path: Callable[[type], bool]) -> str:
    """How a chain of ParamWrappers runs: FUSED in the expert path, around experts whose class runs Bastile's
    forward (`on_path`); WEIGHT_PLUS_DELTA, the wrapped module's own forward with each parameter plus its delta,
    where PEFT forms W + delta itself (2-D parameters: the routers), without registering and removing a
    parametrization on every call; else why PEFT's own forward runs it. Either needs each wrapper's own parameter
    with one active plain adapter."""
    low_precision = getattr(sys.modules.get("peft.tuners.lora.layer"), "UPCAST_DTYPES", ())
    names = [w.parameter_name for w in chain]
    if len(set(names)) != len(names):
        return "two wrappers of one parameter"
    for w in chain:
        names = active_adapters(w)
        dtype = w.get_param().dtype
        if w.disable_adapters:
            return "adapters disabled"
        if w.merged:
            return "adapter merged into the base weight"
        if len(names) != 1:
            return f"{len(names)} active adapters"
        if any(getattr(torch, t, None) == dtype for t in low_precision):
            return f"{dtype} weight (PEFT adds its delta in a wider type)"
    base = chain[-1].base_layer
    if on_path(type(base)):
        return FUSED
    if all(w.num_experts == 1 for w in chain):
        return WEIGHT_PLUS_DELTA
    return f"around {type(base).__name__}, whose forward is not Bastile's expert path"


def report(model, on_path: Optional[Callable[[type], bool]]) -> Dict[str, str]:
    """{qualified name: route()} for every ParamWrapper of `model`; on_path None: PEFT's wrapper is not patched."""
    wrapper = getattr(sys.modules.get("peft.tuners.lora.layer"), "ParamWrapper", None)
    out = {}
    for name, module in model.named_modules():
        if wrapper is not None and type(module) is wrapper and name not in out:
            chain = _chain(module)
            how = route(chain, on_path) if on_path else "PEFT's ParamWrapper.forward is not patched (mlp_peft)"
            out.update({name + ".base_layer" * i: how for i in range(len(chain))})
    return out


def peft_factors(experts: int, swapped: bool, weight_a: torch.Tensor, weight_b: torch.Tensor):
    """PEFT's ParamWrapper.get_delta_factors of its lora_A ([experts * rank, in]) and lora_B ([out, rank *
    experts]) weights, without its cast: views, so that the expert path keeps the adapter's weights, not copies."""
    a = weight_a.view(experts, -1, weight_a.shape[-1])  # (experts, rank, in)
    b = weight_b.view(weight_b.shape[0], -1, experts).permute(2, 0, 1)  # (experts, out, rank)
    return (b, a) if swapped else (a.transpose(-2, -1), b.transpose(-2, -1))


def adapter_of(wrapper) -> Adapter:
    """The active adapter of a ParamWrapper that route() passed."""
    (name,) = active_adapters(wrapper)
    return Adapter((wrapper.lora_A[name].weight, wrapper.lora_B[name].weight),
                   partial(peft_factors, wrapper.num_experts, wrapper._did_swap_in_out_features),
                   wrapper.scaling[name])


def peft_wrapper(on_path: Callable[[type], bool]) -> Callable:
    """PEFT's ParamWrapper.forward made from the original, by route(): the chain's adapters to the experts' forward,
    or the wrapped module's forward called with its parameters plus their deltas; anything else PEFT's way."""

    def factory(original):
        def forward(self, x, *args, **kwargs):
            chain = _chain(self)
            how = route(chain, on_path) if not kwargs else "keyword arguments"
            base = chain[-1].base_layer
            if how == FUSED:
                return base(x, *args, lora={w.parameter_name: adapter_of(w) for w in chain})
            if how == WEIGHT_PLUS_DELTA:
                weights = {w.parameter_name: w.get_param() + w.get_delta_weight(active_adapters(w)[0]) for w in chain}
                return torch.func.functional_call(base, weights, (x, *args))
            return original(self, x, *args, **kwargs)
        return forward
    return factory
