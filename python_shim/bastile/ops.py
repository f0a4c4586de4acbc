"""Functional entry points: thin aliases of torch.ops.bastile.* with HF-style defaults."""
import torch

from . import _library  # noqa: F401  (loads the ops)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float = 1e-6, cast_after_weight: bool = False) -> torch.Tensor:
    """HF RMSNorm with n = x * rsqrt(mean(x**2, -1) + eps), statistics in float32:
    Llama/Qwen3's weight * to(x.dtype)(n), of dtype promote(x, weight), or with cast_after_weight
    GPT-OSS's to(x.dtype)(weight * n), the product in float32, of x's dtype."""
    return torch.ops.bastile.rms_norm(x, weight, eps, cast_after_weight)


def swiglu(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """HF's SwiGLU `act_fn(gate) * up` with act_fn = SiLU (Qwen3MLP), in the inputs' dtype: silu(gate) is
    computed in float32 and rounded to that dtype, then multiplied by up in float32 and rounded again.
    gate and up must have the same shape, dtype and device. The backward recomputes silu from the
    saved gate and up, so no activation is kept for it."""
    return torch.ops.bastile.swiglu(gate, up)


def rope(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, unsqueeze_dim: int = 1,
         *, position_ids=None) -> tuple[torch.Tensor, torch.Tensor]:
    """HF apply_rotary_pos_emb (transformers 5.17 signature): q * cos + rotate_half(q) * sin, same for k,
    in one kernel; cos and sin are broadcast over heads (and batch if their first dim is 1 or absent).

    q: [batch, q_heads, seq, head_dim], k: [batch, k_heads, seq, head_dim] for unsqueeze_dim=1 ([batch, seq,
    heads, head_dim] for 2), any strides with a unit last stride (HF's transposed views are read in place);
    cos, sin: [seq, head_dim], [1, seq, head_dim] or [batch, seq, head_dim]; head_dim even. Results have
    dtype promote(q, cos), rounded as HF rounds (each product, then the sum), and q's layout where it is
    dense. Differentiable in q and k; cos and sin must not require grad. position_ids is ignored, as in
    older HF versions that still accepted it.
    """
    return torch.ops.bastile.rope(q, k, cos, sin, unsqueeze_dim)


def qk_norm_rope(q: torch.Tensor, k: torch.Tensor, q_weight: torch.Tensor, k_weight: torch.Tensor,
                 cos: torch.Tensor, sin: torch.Tensor, eps: float = 1e-6) -> tuple[torch.Tensor, torch.Tensor]:
    """Qwen3 attention's q_norm/k_norm followed by apply_rotary_pos_emb, fused.

    q: [B, S, Hq, D] and k: [B, S, Hk, D] (the projections' .view, any strides); cos/sin: [S, D], [1, S, D]
    or [B, S, D] (HF's rotary embedding output; no gradient). Returns fresh contiguous (q_out, k_out) in
    [B, S, H, D]; their .transpose(1, 2) is HF's layout. Rounding as HF: per head row
    n = to(promote(x, w))(w * to(x.dtype)(x * rsqrt(mean(x**2) + eps))) with statistics in float32, then
    out = n * cos + rotate_half(n) * sin with each product and the sum rounded to promote(n, cos).
    """
    return torch.ops.bastile.qk_norm_rope(q, k, q_weight, k_weight, cos, sin, eps)


def fused_linear_cross_entropy(hidden: torch.Tensor, weight: torch.Tensor, target: torch.Tensor,
                               bias: torch.Tensor | None = None, ignore_index: int = -100, reduction: str = "mean",
                               softcap: float | None = None, z_loss: float = 0.0, num_items_in_batch=None,
                               fp32_weight_grad: bool = True, chunk_bytes: int = 0) -> torch.Tensor:
    """HF's causal-LM loss, F.cross_entropy((hidden @ weight.T + bias).float(), target, ignore_index=...,
    reduction=...), without materialising the [tokens, vocab] logits.

    hidden [..., H] and target [...] (int64) are flattened over their leading dimensions; weight is
    [vocab, H] (it may be the tied embedding weight). Optional: softcap (logits -> softcap *
    tanh(logits / softcap)), z_loss (adds z_loss * logsumexp^2 per counted token). Targets equal to
    ignore_index are ignored; "mean" divides by the number of counted targets (loss 0 when there are
    none). With num_items_in_batch (a number or a tensor, as HF passes it) the loss is the sum divided by
    it, whatever `reduction` says. fp32_weight_grad sums the weight gradient over chunks in float32 (else
    in the weight's dtype). Rows go in chunks whose logits take at most chunk_bytes (0: 256 MiB, or
    with fp32_weight_grad 512 MiB or the size of the weight gradient's final cast, whichever is larger);
    a smaller budget lowers the peak memory at some speed. On CUDA, a target outside [0, vocab) that is
    not ignore_index is treated as ignored (checking it would need a host sync); on the CPU it raises.
    Returns a 0-dim float32 loss (float64 for float64 hidden).
    """
    if num_items_in_batch is not None:
        reduction = "sum"
    loss = torch.ops.bastile.fused_linear_cross_entropy(hidden, weight, target, bias, ignore_index, reduction,
                                                        float(softcap or 0.0), float(z_loss), fp32_weight_grad,
                                                        chunk_bytes)
    if num_items_in_batch is not None:
        if torch.is_tensor(num_items_in_batch):
            num_items_in_batch = num_items_in_batch.to(loss.device)
        loss = loss / num_items_in_batch
    return loss


def geglu(gate_up: torch.Tensor, alpha: float = 1.702, limit: float = 7.0) -> torch.Tensor:
    """GPT-OSS's expert activation (HF GptOssExperts._apply_gate) in one kernel:
    gate, up = gate_up[..., ::2], gate_up[..., 1::2]; gate = gate.clamp(max=limit);
    up = up.clamp(-limit, limit); returns (up + 1) * gate * sigmoid(gate * alpha).

    gate_up: [..., 2 * I] of float32, float16 or bfloat16 (float64 on CPU), gate at even and up at odd
    positions of the last dim (read in place, no de-interleaving copy; a non-contiguous tensor is made
    contiguous first). Returns [..., I] in gate_up's dtype, computed in float32 (float64 on CPU) and
    rounded once: HF rounds after each op in the input's dtype, so this is closer to the exact value.
    limit is rounded to the dtype, as torch's clamp does. Differentiable: the gradient is autograd's of
    that expression (torch's clamp passes the gradient where gate <= limit and -limit <= up <= limit,
    the bounds included, else 0), recomputed from the saved gate_up, so no activation is kept.
    """
    return torch.ops.bastile.geglu(gate_up, alpha, limit)
