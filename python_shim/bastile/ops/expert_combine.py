"""A mixture of experts' token-expert pairs joined back into their tokens: `expert_combine`."""
from typing import Optional

import torch

from .. import _library  # noqa: F401  (loads the ops)


def expert_combine(rows: torch.Tensor, position: torch.Tensor, weights: Optional[torch.Tensor] = None,
                   bias: Optional[torch.Tensor] = None, expert: Optional[torch.Tensor] = None) -> torch.Tensor:
    """The experts' outputs for each token's k pairs, weighted and summed per token: rows [tokens * k, dim] in any
    order (grouped by expert), position [tokens, k] (int64) the row of token t's j-th pair, weights [tokens, k] its
    routing weight (None: ones), of rows' dtype, float32, or a dtype that promotes with rows' to one of those.
    Returns out[t] = sum_j weights[t, j] * rows[position[t, j]] [tokens, dim] in the promoted dtype: each product
    rounded as torch rounds `rows * weights`, the sum in float32 (float64 on CPU), rounded once, the same on every
    run. With bias [experts, dim] (rows' dtype) and expert [tokens * k] (int64, each row's expert), each row is
    rows[r] + bias[expert[r]] first, rounded to rows' dtype as HF's `out + bias` (the experts' down bias, with no
    pass of its own).
    Differentiable in rows, weights and bias (the backward needs position to be a permutation of the rows).

    `torch.ops.bastile.expert_dispatch(x, order, weights=None, rows=None, dtype=None)` is the other direction and
    its backward as a piece: with order the inverse of position (the pair t * k + j of each row), row r gets
    weights[p] * x[p // k] in `dtype` (p = order[r]; without weights the experts' dispatch of each token to its
    pairs) and given rows the weights' gradient. bastile.experts runs both in the experts' own node, after
    `torch.ops.bastile.expert_group(chosen, experts)` has ordered the pairs by expert (order, offsets, each row's
    expert, position: a stable counting sort with no host sync)."""
    return torch.ops.bastile.expert_combine(rows, position, weights, bias, expert)
