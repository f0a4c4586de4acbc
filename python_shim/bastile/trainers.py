"""TRL's fused LM head on Bastile: the `log_probs` patch of TRL (TRAINERS).

TRL's trainers (SFT, DPO, GRPO, KTO, RLOO...) give the model a fused head (trl.trainer.utils.add_fused_lm_head)
that runs the backbone, gathers FSDP2 heads, keeps the valid positions, and hands hidden states, head weight
and labels to `_ChunkedLogProbFunction` for the per-token log-probabilities and statistics. The patch
replaces that function with Bastile's fused_linear_log_probs, so TRL keeps everything around it.

SFT's negative log-likelihood (`loss_type="nll"`) gives every scored token the upstream gradient -1 /
tokens: SFTTrainer.compute_loss is wrapped to say so (uniform_grad), and the head forms its gradients in the
forward, one GEMM fewer than a head that makes the logits again in the backward.

DistillationTrainer's loss goes through `_chunked_divergence_loss` (student and teacher hidden states and
heads to the summed divergence, entropy and token count): the `divergence` patch runs it on Bastile's
fused_linear_divergence, which skips the masked positions in place of TRL's compaction of the valid ones
(a host sync).
"""
import contextvars
import functools
import inspect

import torch

from .ops.fused_linear_divergence import fused_linear_divergence
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


# What `_chunked_divergence_loss` takes in TRL 1.16, as _ARGUMENTS for the log-prob head.
_DIVERGENCE_ARGUMENTS = ["student_hidden_states", "teacher_hidden_states", "student_lm_head_weight",
                         "teacher_lm_head_weight", "completion_mask", "beta", "num_items_in_batch",
                         "student_lm_head_bias", "teacher_lm_head_bias", "student_logit_scale", "teacher_logit_scale",
                         "student_final_logit_softcapping", "teacher_final_logit_softcapping", "temperature"]


def _whole(t):
    """A head's weight or bias as one tensor: FSDP2's DTensor gathered once, as TRL's function does."""
    return t.full_tensor() if isinstance(t, torch.distributed.tensor.DTensor) else t


def chunked_divergence_loss(student_hidden_states, teacher_hidden_states, student_lm_head_weight,
                            teacher_lm_head_weight, completion_mask, beta, num_items_in_batch=None,
                            student_lm_head_bias=None, teacher_lm_head_bias=None, student_logit_scale=1.0,
                            teacher_logit_scale=1.0, student_final_logit_softcapping=None,
                            teacher_final_logit_softcapping=None, temperature=1.0):
    """TRL's `_chunked_divergence_loss` on Bastile: (loss, the student's entropy summed, valid positions), the
    loss the divergence summed over the valid positions divided by num_items_in_batch, or without it by their
    count (at least 1)."""
    valid = completion_mask != 0
    n_valid = valid.sum()
    divergence, entropy = fused_linear_divergence(
        student_hidden_states, _whole(student_lm_head_weight), teacher_hidden_states, _whole(teacher_lm_head_weight),
        valid, None if student_lm_head_bias is None else _whole(student_lm_head_bias),
        None if teacher_lm_head_bias is None else _whole(teacher_lm_head_bias), beta=beta, temperature=temperature,
        student_scale=student_logit_scale, student_softcap=student_final_logit_softcapping,
        teacher_scale=teacher_logit_scale, teacher_softcap=teacher_final_logit_softcapping)
    if num_items_in_batch is None:
        return divergence / n_valid.clamp(min=1), entropy, n_valid
    if isinstance(num_items_in_batch, torch.Tensor):
        num_items_in_batch = num_items_in_batch.to(divergence.device)
    return divergence / num_items_in_batch, entropy, n_valid


def divergence_function(original):
    """The replacement of `_chunked_divergence_loss`, once TRL's is the one it stands in for."""
    found = list(inspect.signature(original).parameters)
    if found != _DIVERGENCE_ARGUMENTS:
        raise RuntimeError(f"bastile.apply: this TRL's _chunked_divergence_loss takes {found}, not "
                           f"{_DIVERGENCE_ARGUMENTS}; Bastile's divergence supports trl==1.16. Pass divergence=False "
                           f"to keep TRL's")
    return chunked_divergence_loss


# library -> (module, role -> targets), as a family's declarations (Target.cls: the path to the owner in the
# module). A library that is installed but lacks a target is an error at apply(): its internals moved, and Bastile
# must not guess. TRL's fused LM head: its per-token function, its choice of positions, and SFT's loss.
TRAINERS = {
    "trl": ("trl.trainer", {
        "log_probs": [Target("utils", "_ChunkedLogProbFunction", log_prob_function, wraps=True),
                      Target("utils", "_use_triton", compact),
                      Target("SFTTrainer", "compute_loss", sft_compute_loss, wraps=True)],
        "divergence": [Target("distillation_trainer", "_chunked_divergence_loss", divergence_function, wraps=True)],
    }),
}

# The apply() keywords of these roles.
TRAINER_ROLES = tuple(dict.fromkeys(role for _, per_role in TRAINERS.values() for role in per_role))
