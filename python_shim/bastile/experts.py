"""The MoE families' experts on Bastile's path, in place of transformers' experts functions.

The token-expert pairs are ordered by expert (a stable sort and per-expert counts: no host sync on CUDA), each
expert's rows go through one grouped product for gate/up, the family's gated activation (the `swiglu` or `geglu`
op), one grouped product for down, then the routing weights and the sum over a token's experts.

PEFT LoRA on the 3-D expert parameters (its ParamWrapper, from `target_parameters` or `all-linear`) enters the
grouped products as x W_e + s (x A_e) B_e. PEFT computes a wrapped module's forward with its weight
parametrized as W + s A B (formed, and copied, on every call); around experts on Bastile's path, `peft_wrapper`
passes the adapters' factors to the experts' forward instead, so nothing the size of the experts is formed or
kept for the backward. A chain of wrappers that is not plain LoRA (several or disabled adapters, merged weights,
a low-precision weight) runs PEFT's way.

On CUDA, bf16 products run as torch's grouped GEMM; elsewhere (the CPU, other dtypes) expert by expert, which
reads the per-expert counts on the host.
"""
import sys
from typing import Callable, Dict, NamedTuple, Optional, Tuple

import torch
from torch.nn import functional as F

Factors = Tuple[Tuple[torch.Tensor, torch.Tensor, float], ...]  # PEFT's (lhs, rhs, scale): delta s lhs @ rhs


class Weight(NamedTuple):
    """An expert parameter as [experts, in, out] (a view of the stored one), and the LoRA terms that add to it:
    (A [experts, in, rank], B [experts, rank, out], scale)."""
    w: torch.Tensor
    lora: Factors


def weight(experts, name: str, factors: Factors = ()) -> Weight:
    """`name` (gate_up_proj or down_proj) of an experts module, and its adapters' factors. transformers stores
    [experts, out, in] unless the class says `is_transposed` ([experts, in, out]); PEFT's delta s lhs @ rhs is in
    the stored layout: stored [in, out], x (W + s L R) = x W + s (x L) R; stored [out, in],
    x (W + s L R)^T = x W^T + s (x R^T) L^T."""
    w = getattr(experts, name)
    if experts.is_transposed:
        return Weight(w, factors)
    return Weight(w.transpose(-2, -1), tuple((r.transpose(-2, -1), l.transpose(-2, -1), s) for l, r, s in factors))


class Groups(NamedTuple):
    """The token-expert pairs ordered by expert: `order` (pair indices), `offsets` (each expert's end, int32),
    `expert` (each ordered pair's expert)."""
    order: torch.Tensor
    offsets: torch.Tensor
    expert: torch.Tensor


def group(top_k_index: torch.Tensor, experts: int) -> Groups:
    ids = top_k_index.reshape(-1)
    expert, order = torch.sort(ids, stable=True)
    # bincount would size its output by the largest id: a host sync on CUDA
    counts = torch.zeros(experts, dtype=torch.int32, device=ids.device).scatter_add_(0, ids, torch.ones_like(ids, dtype=torch.int32))
    return Groups(order, counts.cumsum(0, dtype=torch.int32), expert)


def _grouped_kernel(x: torch.Tensor, w: torch.Tensor) -> bool:
    """Whether torch's grouped GEMM takes these: bf16 on CUDA, rows of 16-byte multiples."""
    return x.is_cuda and x.dtype == w.dtype == torch.bfloat16 and x.shape[1] % 8 == 0 and w.shape[2] % 8 == 0


def grouped_mm(x: torch.Tensor, w: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    """x [pairs, in] ordered by expert times each expert's w [experts, in, out]: [pairs, out]."""
    if _grouped_kernel(x, w):
        return F.grouped_mm(x, w, offs=offsets)
    ends = offsets.tolist()
    starts = [0] + ends[:-1]
    return torch.cat([x[a:b] @ we for a, b, we in zip(starts, ends, w.unbind(0))])


def project(x: torch.Tensor, groups: Groups, p: Weight, bias=None) -> torch.Tensor:
    """Each pair's row times its expert's weight, with the LoRA terms and the bias: [pairs, out]."""
    x = x.to(p.w.dtype)
    y = grouped_mm(x, p.w, groups.offsets)
    for a, b, scale in p.lora:  # PEFT's factors are strided views; contiguous they are a few MB
        a, b = (t.to(x.dtype).contiguous() for t in (a, b))
        y = y + scale * grouped_mm(grouped_mm(x, a, groups.offsets), b, groups.offsets)
    if bias is not None:
        y = y + bias[groups.expert]
    return y


def experts_forward(gate: Callable) -> Callable:
    """The experts' forward, `gate(experts, gate_up)` the family's gated activation stage (mlp.py). `lora`:
    {parameter name: PEFT's factors of its adapters} (peft_wrapper)."""

    def experts(self, hidden_states, top_k_index, top_k_weights, lora: Optional[Dict[str, Factors]] = None):
        lora = lora or {}
        tokens, k = top_k_index.shape
        groups = group(top_k_index, self.num_experts)
        x = hidden_states[groups.order // k]
        gate_up_bias, down_bias = (self.gate_up_proj_bias, self.down_proj_bias) if self.has_bias else (None, None)
        gate_up = project(x, groups, weight(self, "gate_up_proj", lora.get("gate_up_proj", ())), gate_up_bias)
        out = project(gate(self, gate_up), groups, weight(self, "down_proj", lora.get("down_proj", ())), down_bias)
        out = out * top_k_weights.reshape(-1)[groups.order, None]  # promoted as HF's: Mixtral's weights are fp32
        by_pair = torch.empty_like(out).index_copy_(0, groups.order, out)
        return by_pair.view(tokens, k, -1).sum(dim=1).to(hidden_states.dtype)
    return experts


def _plain_factors(chain) -> Optional[Dict[str, Factors]]:
    """{parameter name: factors} of a chain of PEFT ParamWrappers (outermost first) when each wraps one
    parameter with one active plain adapter, as PEFT's own factor path takes them; else None."""
    low_precision = getattr(sys.modules.get("peft.tuners.lora.layer"), "UPCAST_DTYPES", ())
    lora = {}
    for w in chain:
        active = [a for a in w.active_adapters if a in w.lora_A]
        if (w.disable_adapters or w.merged or len(active) != 1 or w.num_experts < 2 or w.parameter_name in lora
                or any(getattr(torch, t, None) == w.get_param().dtype for t in low_precision)):
            return None
        lora[w.parameter_name] = (w.get_delta_factors(active[0]),)
    return lora


def peft_wrapper(on_path: Callable[[type], bool]) -> Callable:
    """PEFT's ParamWrapper.forward made from the original: around experts whose class runs Bastile's forward
    (`on_path`), the chain's adapters go to that forward as factors; anything else runs PEFT's way."""

    def factory(original):
        def forward(self, x, *args, **kwargs):
            chain = [self]
            while type(chain[-1].base_layer) is type(self):
                chain.append(chain[-1].base_layer)
            base = chain[-1].base_layer
            lora = _plain_factors(chain) if on_path(type(base)) and not kwargs else None
            if lora is None:
                return original(self, x, *args, **kwargs)
            return base(x, *args, lora=lora)
        return forward
    return factory
