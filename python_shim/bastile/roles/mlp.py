"""The mlp role: the dense MLP (part "dense") and the MoE experts (part "experts": experts.py, and the router).

The dense MLP is `down(act(gate(x)) * up(x))`, gate and up from one gate_up_proj (gate first) where the family
fuses them. Where the activation is SiLU or GELU-tanh, the activation and product run in one op fused with the
down projection, so the activation is not kept for the backward; PEFT LoRA adapters on the projections run in
fused nodes (lora.py). Any other activation runs HF's own math. A router (Mlp.router: softmax, Gemma 4's softmax
with a scale per expert, ERNIE 4.5's with a correction bias, GraniteMoE's, or GLM-4.5's and LFM2-MoE's sigmoid)
computes its logits as HF does and its choice and weights in one op (`expert_route`, `expert_route_sigmoid`).
"""
import functools
from typing import Callable, Optional

import torch
from torch import nn
from torch.nn import functional as F
from transformers.activations import GELUTanh, SiLUActivation

from .. import lora
from ..experts import Gate, experts_forward, through_autograd
from ..families import Mlp, Router
from ..ops.expert_route import expert_route, expert_route_sigmoid
from ..ops.expert_swiglu import expert_swiglu
from ..ops.geglu import geglu
from ..ops.swiglu import swiglu
from . import Context, Declaration, Target, named

SILU = (nn.SiLU, SiLUActivation)
# The activation of a dense MLP whose forward calls F.silu itself (Mlp.activation None: LFM2's), or of experts
# holding F.silu as a function (Mlp.expert_activation None: LFM2-MoE's)
_SILU = nn.SiLU()


def gated_activation(f) -> Optional[str]:
    """The `swiglu` activation that computes the activation module f as HF does: "silu", "gelu_tanh"
    (GELUTanh through torch's gelu, not its Python formula), or None."""
    if isinstance(f, SILU):
        return "silu"
    if type(f) is GELUTanh and isinstance(f.act, functools.partial):
        return "gelu_tanh"
    return None


def activation_of(name: Optional[str]) -> Callable:
    """The function of a dense MLP or experts module that gives its activation: its module `name`, or SiLU (None:
    Mlp.activation's, Mlp.expert_activation's)."""
    return (lambda module: _SILU) if name is None else (lambda module: getattr(module, name))


def why_not(traits: Mlp) -> Callable:
    """The function of a dense MLP module that says why its projections are not fused: None when they are."""
    activation = activation_of(traits.activation)

    def why_not(mlp):
        f = activation(mlp)
        return None if gated_activation(f) else f"activation {type(f).__name__} is neither SiLU nor GELU-tanh"
    return why_not


# gate and up of the dense MLP: through the fused nodes, or (HF's own path) its modules.

def fused_gate_up(self, x):
    gate, up = lora.project(x, self.gate_up_proj)[0].chunk(2, dim=-1)
    return gate, up


def hf_fused_gate_up(self, x):
    return self.gate_up_proj(x).chunk(2, dim=-1)


def separate(gate: str, up: str):
    """gate and up from the MLP's separate projections of these names, fused, and HF's own."""
    def gate_up(self, x):
        return lora.project(x, getattr(self, gate), getattr(self, up))

    def hf_gate_up(self, x):
        return getattr(self, gate)(x), getattr(self, up)(x)
    return gate_up, hf_gate_up


def mlp_forward(traits: Mlp) -> Callable:
    """The dense MLP's forward. `keep_activation` (a checkpointed layer: decoder.py) keeps the activation for the
    backward instead of recomputing it."""
    act = activation_of(traits.activation)
    gate, up, down = traits.projections
    gate_up, hf_gate_up = (fused_gate_up, hf_fused_gate_up) if traits.fused_gate_up else separate(gate, up)

    def forward(self, x, keep_activation=False):
        f = act(self)
        activation = gated_activation(f)
        if activation is None:  # HF's own
            gate, up = hf_gate_up(self, x)
            return getattr(self, down)(f(gate) * up)
        gate, up = gate_up(self, x)
        if keep_activation:
            (out,) = lora.project(swiglu(gate, up, activation), getattr(self, down))
            return out
        return lora.swiglu_down(gate, up, getattr(self, down), activation)
    return forward


def gated_projection(x, gate, act, up, projection):
    """projection(act(gate(x)) * up), the activation and product fused with the projection where the activation
    is one `swiglu` computes and up has gate's dtype (as lora.swiglu_down needs), else HF's math."""
    (g,) = lora.project(x, gate)
    activation = gated_activation(act)
    if activation is None or up.dtype != g.dtype:
        return projection(act(g) * up)
    return lora.swiglu_down(g, up, projection, activation)


def swiglu_gate(traits: Mlp) -> Gate:
    """The experts' gated activation: act(gate) * up of the halves of gate_up, fused when the activation
    (Mlp.expert_activation) is SiLU or GELU-tanh."""
    act = activation_of(traits.expert_activation)

    def swiglu_gate(self, gate_up):
        gate, up = gate_up.chunk(2, dim=-1)
        f = act(self)
        activation = gated_activation(f)
        if activation is None:
            return f(gate) * up
        return swiglu(gate, up, activation)

    hf = through_autograd(swiglu_gate)

    def swiglu_gate_backward(self, gate_up, grad, dot=False):
        activation = gated_activation(act(self))
        if activation is None:
            return hf.backward(self, gate_up, grad, dot)
        grad_gate_up, _, dots = torch.ops.bastile.swiglu_backward(grad, gate_up, None, activation, dot)
        return grad_gate_up, dots if dot else None

    def swiglu_grouped(self, x, weight, offsets, *lora):
        activation = gated_activation(act(self))
        return None if activation is None else expert_swiglu(x, weight, offsets, activation, *lora)
    return Gate(swiglu_gate, swiglu_gate_backward, swiglu_grouped)


def geglu_gate(self, gate_up, bias=None, expert=None):
    """GPT-OSS's experts' gated activation (GptOssExperts._apply_gate): clamped, interleaved GEGLU of gate_up (plus
    each row's expert's bias) in one kernel."""
    return geglu(gate_up, self.alpha, self.limit, bias, expert)


def geglu_gate_backward(self, gate_up, grad, bias=None, expert=None, dot=False):
    grad_gate_up, dots = torch.ops.bastile.geglu_backward(grad, gate_up, self.alpha, self.limit, bias, expert, dot)
    return grad_gate_up, dots if dot else None


# The routers' forwards (HF's <prefix>TopKRouter): (logits, weights, chosen) as HF's, the logits as HF computes them
# and what it makes of them one op. Router.renorm names the router's attribute saying whether it renormalises.

def renorms(traits: Router) -> Callable:
    return (lambda router: getattr(router, traits.renorm)) if traits.renorm else (lambda router: True)


def softmax_router(traits: Router) -> Callable:
    """The softmax, top-k, renormalisation and cast as one `expert_route`."""
    weights_dtype = {"logits": None, "float32": torch.float32}[traits.weights]
    renorm = renorms(traits)

    def router(self, hidden_states):
        x = hidden_states.reshape(-1, self.weight.shape[-1])
        logits = F.linear(x, self.weight, self.bias if traits.bias else None)
        weights, chosen = expert_route(logits, self.top_k, renorm(self), weights_dtype or logits.dtype)
        return logits, weights, chosen
    return router


def glm4_moe_router(traits: Router) -> Callable:
    """GLM-4.5's (Glm4MoeTopkRouter): float32 logits, the scores' sigmoid chosen with e_score_correction_bias within
    the topk_group best of n_group groups, the weights renormalised (plus 1e-20) where norm_topk_prob says, times
    routed_scaling_factor, as one `expert_route_sigmoid`."""
    renorm = renorms(traits)

    def router(self, hidden_states):
        logits = F.linear(hidden_states.view(-1, self.hidden_dim).float(), self.weight.float())
        weights, chosen = expert_route_sigmoid(logits, self.top_k, self.e_score_correction_bias, renorm(self), 1e-20,
                                               self.routed_scaling_factor, self.num_group, self.topk_group,
                                               torch.float32)
        return logits, weights, chosen
    return router


def lfm2_moe_router(traits: Router) -> Callable:
    """LFM2-MoE's: the scores' sigmoid chosen with the MoE block's expert bias where use_expert_bias says, the weights
    in the logits' dtype renormalised (plus 1e-6) where norm_topk_prob says, times routed_scaling_factor, as one
    `expert_route_sigmoid`."""
    renorm = renorms(traits)

    def router(self, hidden_states, expert_bias=None):
        logits = F.linear(hidden_states, self.weight)
        weights, chosen = expert_route_sigmoid(logits, self.top_k, expert_bias if self.use_expert_bias else None,
                                               renorm(self), 1e-6, self.routed_scaling_factor, dtype=logits.dtype)
        return logits, weights, chosen
    return router


def gemma4_router(traits: Router) -> Callable:
    """Gemma 4's (Gemma4TextRouter): HF's norm, scaling and projection to the logits; their softmax's top-k
    renormalised as one float32 `expert_route`, times each chosen expert's per_expert_scale. Its first output is
    the softmax of all logits, as HF's (the layer drops it; output_router_logits records it)."""
    def router(self, hidden_states):
        logits = self.proj(self.norm(hidden_states) * self.scale * self.scalar_root_size)
        weights, chosen = expert_route(logits, self.config.top_k_experts, True, torch.float32)
        return F.softmax(logits, dim=-1, dtype=torch.float32), weights * self.per_expert_scale[chosen], chosen
    return router


def ernie4_5_moe_router(traits: Router) -> Callable:
    """ERNIE 4.5's (Ernie4_5_MoeTopKRouter): float32 logits outside autocast, as HF's; the top-k of their softmax
    plus moe_statics' correction bias, the weights renormalised by their sum clamped at moe_norm_min, in the hidden
    states' dtype, as one `expert_route`."""
    def router(self, hidden_states):
        with torch.autocast(hidden_states.device.type, enabled=False):
            logits = F.linear(hidden_states.float(), self.weight.float())
        weights, chosen = expert_route(logits, self.top_k, True, hidden_states.dtype,
                                       self.moe_statics.e_score_correction_bias.view(-1), self.norm_min)
        return logits, weights, chosen
    return router


def granitemoe_router(traits: Router) -> Callable:
    """GraniteMoE's: float32 logits, the softmax over their top-k in the hidden states' dtype, as one `expert_route`,
    returned in Bastile's order (which its block, Bastile's too, unpacks)."""
    def router(self, hidden_states):
        logits = F.linear(hidden_states, self.weight).float()
        weights, chosen = expert_route(logits, self.top_k, True, hidden_states.dtype)
        return logits, weights, chosen
    return router


# traits -> router stage
ROUTERS = {"softmax": softmax_router, "glm4_moe": glm4_moe_router, "lfm2_moe": lfm2_moe_router,
           "gemma4": gemma4_router, "ernie4_5_moe": ernie4_5_moe_router, "granitemoe": granitemoe_router}


def moe_block(self, layer_input):
    """A MoE block of the router and the experts alone (GraniteMoE's, Router.block): the router's outputs in
    Bastile's order, whatever the release's."""
    hidden_states = layer_input.reshape(-1, layer_input.shape[-1])
    _, weights, chosen = self.router(hidden_states)
    return self.experts(hidden_states, chosen, weights).view(*layer_input.shape[:-1], self.input_size)


# traits -> gate stage
GATES = {"swiglu": swiglu_gate, "geglu": lambda traits: Gate(geglu_gate, geglu_gate_backward, bias=True)}
CONCATENATED = {"swiglu": True, "geglu": False}  # how each gate reads gate/up: [gate; up], or interleaved


def declare(ctx: Context) -> Declaration:
    f, m = ctx.family, ctx.family.mlp
    targets = []
    if m.dense:
        targets.append(Target("MLP", "forward", named(mlp_forward(m), "mlp", f), part="dense", lora=why_not(m)))
    if m.experts:
        gate = Gate(*(named(stage, "mlp", f) if callable(stage) else stage for stage in GATES[m.experts](m)))
        experts = named(experts_forward(gate, CONCATENATED[m.experts]), "mlp", f)
        targets.append(Target("Experts", "forward", experts, part="experts"))
    if m.router:
        router = named(ROUTERS[m.router.kind](m.router), "mlp", f)
        targets.append(Target("TopKRouter", "forward", router, part="experts"))
        if m.router.block:
            targets.append(Target("MoE", "forward", named(moe_block, "mlp", f), part="experts"))
    return Declaration(tuple(targets))
