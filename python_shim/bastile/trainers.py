"""TRL's fused LM head on Bastile: the `log_probs` patch of TRL (TRAINERS).

TRL's trainers (SFT, DPO, GRPO, KTO, RLOO...) give the model a fused head (trl.trainer.utils.add_fused_lm_head)
that runs the backbone, gathers FSDP2 heads, keeps the valid positions, and hands hidden states, head weight
and labels to `_ChunkedLogProbFunction` for the per-token log-probabilities and statistics. The patch
replaces that function with Bastile's fused_linear_log_probs, so TRL keeps everything around it.

SFT's negative log-likelihood (`loss_type="nll"`) gives every scored token the upstream gradient -1 /
tokens: SFTTrainer.compute_loss is wrapped to say so (uniform_grad), and the head forms its gradients in the
forward, one GEMM fewer than a head that makes the logits again in the backward.
"""
import contextvars
import functools
import inspect

from .ops.fused_linear_log_probs import LogProbs, fused_linear_log_probs
from .roles import Target

# What `_ChunkedLogProbFunction.forward` takes and returns in the TRL versions this patch was written
# against (1.16): a TRL whose function differs is refused at apply(), never run with a wrong meaning.
_ARGUMENTS = ["ctx", "hidden", "weight", "bias", "targets", "temperature", "chunk_size", "final_logit_softcapping",
              "logit_scale", "outputs"]

# Set while SFTTrainer.compute_loss computes the negative log-likelihood.
_uniform = contextvars.ContextVar("bastile_uniform_grad", default=False)


class ChunkedLogProbs:
    """Stands in for TRL's `_ChunkedLogProbFunction`: `apply` with its arguments and its outputs (the fields
    not asked for in `outputs` are None). chunk_size, TRL's vocabulary tile, has no meaning here."""

    @staticmethod
    def apply(hidden, weight, bias, targets, temperature, chunk_size, final_logit_softcapping=None,
              logit_scale=1.0, outputs=("log_probs",)):
        out = fused_linear_log_probs(hidden, weight, targets, bias, temperature=temperature, logit_scale=logit_scale,
                                     softcap=final_logit_softcapping, uniform_grad=_uniform.get())
        return tuple(value if name == "log_probs" or name in outputs else None
                     for name, value in zip(LogProbs._fields, out))


def log_prob_function(original):
    """The replacement of `_ChunkedLogProbFunction`, once TRL's is the one it stands in for."""
    found = list(inspect.signature(original.forward).parameters)
    if found != _ARGUMENTS:
        raise RuntimeError(f"bastile.apply: this TRL's _ChunkedLogProbFunction.forward takes {found}, not "
                           f"{_ARGUMENTS}; Bastile's head supports trl==1.16. Pass log_probs=False to keep TRL's head")
    return ChunkedLogProbs


def compact(device) -> bool:
    """TRL's `_use_triton`, as its fused head asks it: whether to score only the valid positions. Always, for
    Bastile's head: elsewhere TRL scores every position (with a clamped label, masked after), which costs
    compute and would break uniform_grad's promise on the CPU (the masked positions' upstream gradient is 0)."""
    return True


def sft_compute_loss(compute_loss):
    """SFTTrainer.compute_loss, with uniform_grad for the negative log-likelihood."""
    @functools.wraps(compute_loss)
    def wrapper(self, *args, **kwargs):
        token = _uniform.set(getattr(self.args, "loss_type", None) == "nll")
        try:
            return compute_loss(self, *args, **kwargs)
        finally:
            _uniform.reset(token)
    return wrapper


# library -> (module, role -> targets), as a family's declarations (Target.cls: the path to the owner in the
# module). A library that is installed but lacks a target is an error at apply(): its internals moved, and Bastile
# must not guess. TRL's fused LM head: its per-token function, its choice of positions, and SFT's loss.
TRAINERS = {
    "trl": ("trl.trainer", {
        "log_probs": [Target("utils", "_ChunkedLogProbFunction", log_prob_function, wraps=True),
                      Target("utils", "_use_triton", compact),
                      Target("SFTTrainer", "compute_loss", sft_compute_loss, wraps=True)],
    }),
}
