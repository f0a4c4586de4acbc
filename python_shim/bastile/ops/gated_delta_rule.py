"""Qwen3.5's gated delta rule (HF chunk_gated_delta_rule, the token mixer of its Gated DeltaNet layers):
`gated_delta_rule`."""
from typing import Optional, Tuple

import torch

from .. import _library  # noqa: F401  (loads the ops)


def gated_delta_rule(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                     scale: Optional[float] = None, initial_state: Optional[torch.Tensor] = None,
                     cu_seqlens: Optional[torch.Tensor] = None,
                     l2norm_qk: bool = False) -> Tuple[torch.Tensor, torch.Tensor]:
    """(o, final_state) of the gated delta rule over q, k [batch, T, k_heads, K], v [batch, T, v_heads, V]
    (v_heads a multiple of k_heads, each value head reading key head h // (v_heads // k_heads), as HF's
    repeat_interleave), g (the decay's log, <= 0) and beta [batch, T, v_heads]: per sequence and value head,
    S_t = exp(g_t) S_{t-1} + beta_t k_t (v_t - exp(g_t) S_{t-1}^T k_t)^T and o_t = S_t^T (scale q_t), with q and k
    first l2-normalized where l2norm_qk (HF's use_qk_l2norm_in_kernel). scale defaults to K ** -0.5. Sequences
    are the batch rows, or with cu_seqlens (int32/int64 [N + 1], batch 1) the packed spans, each from its own
    initial state ([N, v_heads, K, V], zeros if None). o has v's dtype, the final state float32. Differentiable
    in q, k, v, g, beta and the initial state."""
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    return torch.ops.bastile.gated_delta_rule(q, k, v, g, beta, scale, initial_state, cu_seqlens, l2norm_qk)
