"""The causal-LM loss without the logits: `fused_linear_cross_entropy`."""
import torch

from .. import _library  # noqa: F401  (loads the ops)


def fused_linear_cross_entropy(hidden: torch.Tensor, weight: torch.Tensor, target: torch.Tensor,
                               bias: torch.Tensor | None = None, ignore_index: int = -100, reduction: str = "mean",
                               softcap: float | None = None, z_loss: float = 0.0, num_items_in_batch=None,
                               fp32_weight_grad: bool = True, chunk_bytes: int = 0,
                               label_smoothing: float = 0.0, logit_scale: float = 1.0) -> torch.Tensor:
    """HF's causal-LM loss, F.cross_entropy((hidden @ weight.T + bias).float(), target, ignore_index=...,
    reduction=...), without materialising the [tokens, vocab] logits.

    hidden [..., H] and target [...] (int64) are flattened over their leading dimensions; weight is
    [vocab, H] (it may be the tied embedding weight). Optional: logit_scale (the logits are multiplied by
    it first: Granite's 1 / logits_scaling), softcap (logits -> softcap * tanh(logits / softcap)), z_loss (adds z_loss * logsumexp^2 per counted token), label_smoothing
    (F.cross_entropy's: the target distribution (1 - eps) onehot + eps / vocab). Targets equal to
    ignore_index are ignored; "mean" divides by the number of counted targets (loss 0 when there are
    none); "none" gives each target's loss (0 where ignored), and its backward makes the logits again (one
    more GEMM: the gradients cannot be formed in the forward when each row has its own upstream
    gradient). With num_items_in_batch (a number or a tensor, as HF passes it) the loss is the sum divided by
    it, whatever `reduction` says. fp32_weight_grad sums the weight gradient over chunks in float32 (else
    in the weight's dtype). Rows go in chunks whose logits take at most chunk_bytes (0: 256 MiB, or
    with fp32_weight_grad 512 MiB or the size of the weight gradient's final cast, whichever is larger);
    a smaller budget lowers the peak memory at some speed. On CUDA, a target outside [0, vocab) that is
    not ignore_index is treated as ignored (checking it would need a host sync); on the CPU it raises.
    Returns a 0-dim float32 loss (float64 for float64 hidden), or for "none" target's shape.
    """
    if num_items_in_batch is not None:
        reduction = "sum"
    loss = torch.ops.bastile.fused_linear_cross_entropy(hidden, weight, target, bias, ignore_index, reduction,
                                                        float(softcap or 0.0), float(z_loss), fp32_weight_grad,
                                                        chunk_bytes, float(label_smoothing), float(logit_scale))
    if num_items_in_batch is not None:
        if torch.is_tensor(num_items_in_batch):
            num_items_in_batch = num_items_in_batch.to(loss.device)
        loss = loss / num_items_in_batch
    return loss
