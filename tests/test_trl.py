"""TRL's trainers with bastile.apply(): their fused LM head runs Bastile's fused_linear_log_probs (the
`log_probs` patch), DistillationTrainer's loss Bastile's fused_linear_divergence (the `divergence` patch), and
every logged figure (loss, entropy, token accuracy, rewards, log-probs...) is the trainer's own without Bastile,
on tiny random-init models in fp32 on the CPU: the first step within 1e-6 relative, later ones within 1e-4 (AdamW
turns last-bit gradient differences into learning-rate-sized steps)."""
import math

import pytest
import torch

import bastile
from conftest import patch_names
from test_families import COMMON as MINI, NEW, mini

trl = pytest.importorskip("trl")
datasets = pytest.importorskip("datasets")

WORDS = 300


def tokenizer():
    from tokenizers import Tokenizer
    from tokenizers.models import WordLevel
    from tokenizers.pre_tokenizers import Whitespace
    from transformers import PreTrainedTokenizerFast
    tok = Tokenizer(WordLevel({"<pad>": 0, "<eos>": 1, **{f"w{i}": i + 2 for i in range(WORDS)}}, unk_token="<pad>"))
    tok.pre_tokenizer = Whitespace()
    return PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", eos_token="<eos>")


def text(gen, lo, hi):
    n = int(torch.randint(lo, hi, (1,), generator=gen))
    return " ".join(f"w{int(i)}" for i in torch.randint(0, WORDS, (n,), generator=gen))


def dataset(kind, rows=16):
    gen = torch.Generator().manual_seed(5)
    if kind == "sft":
        cols = {"input_ids": [torch.randint(2, WORDS, (int(n),), generator=gen).tolist()
                              for n in torch.randint(3, 40, (rows * 2,), generator=gen)]}
    elif kind == "preference":
        cols = {"prompt": [text(gen, 2, 8) for _ in range(rows)], "chosen": [text(gen, 2, 8) for _ in range(rows)],
                "rejected": [text(gen, 2, 8) for _ in range(rows)]}
    elif kind == "unpaired":
        cols = {"prompt": [text(gen, 2, 8) for _ in range(rows)], "completion": [text(gen, 2, 8) for _ in range(rows)],
                "label": [bool(i % 2) for i in range(rows)]}
    else:  # prompts
        cols = {"prompt": [text(gen, 2, 8) for _ in range(rows)]}
    return datasets.Dataset.from_dict(cols)


def reward_len(completions, **_):
    return [float(len(c.split())) + 0.1 * c.count("w1") for c in completions]


COMMON = dict(max_steps=3, logging_steps=1, report_to="none", save_strategy="no", use_cpu=True, bf16=False,
              learning_rate=2e-3, seed=0, per_device_train_batch_size=4)


# DistillationTrainer. TRL 1.16 distils on-policy only: the student generates every step's completions to the
# dataset's prompts. Greedy decoding makes them a function of the weights, the same in the runs compared (other
# completions would show in the logged lengths and loss); every sixth token id ends a completion, so they end at
# various lengths and the loss has masked positions.
STUDENT = dict(eos_token_id=list(range(1, MINI["vocab_size"], 6)))
DISTILLATION = dict(max_completion_length=8, generation_kwargs=dict(do_sample=False))
# The teacher: twice as wide as the student (so the heads' widths differ), another draw with larger weights, so its
# next-token distributions are peaked where the student's are near uniform and the divergence is far from 0.
TEACHER = dict(seed=1, hidden_size=2 * MINI["hidden_size"], initializer_range=0.2)


def trainer(kind, family, tmp_path, lora=False, **config):
    model, tok = mini(family, "cpu", torch.float32, **(STUDENT if kind == "distillation" else {})), tokenizer()
    peft = {}
    if lora:  # PEFT adapters on the seven projections, through TRL's peft_config
        from peft import LoraConfig
        peft["peft_config"] = LoraConfig(r=4, lora_alpha=8, task_type="CAUSAL_LM", target_modules=[
            "q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"])
    ref = dict(ref_model=mini(family, "cpu", torch.float32).eval())  # the policy's start
    args = dict(COMMON, output_dir=str(tmp_path), **config)
    if kind == "sft":
        return trl.SFTTrainer(model, args=trl.SFTConfig(max_length=64, **args), train_dataset=dataset("sft"),
                              processing_class=tok, **peft)
    if kind == "dpo":
        return trl.DPOTrainer(model, **ref, args=trl.DPOConfig(max_length=32, **args), train_dataset=dataset("preference"),
                              processing_class=tok)
    if kind == "kto":
        return trl.KTOTrainer(model, **ref, args=trl.KTOConfig(max_length=32, **args), train_dataset=dataset("unpaired"),
                              processing_class=tok)
    if kind == "distillation":
        return trl.DistillationTrainer(model, teacher_model=mini(family, "cpu", torch.float32, **TEACHER).eval(),
                                       args=trl.DistillationConfig(**DISTILLATION, **args),
                                       train_dataset=dataset("prompts"), processing_class=tok)
    generation = dict(num_generations=4, max_completion_length=6, temperature=0.9)
    if kind == "grpo":
        return trl.GRPOTrainer(model, reward_funcs=reward_len, args=trl.GRPOConfig(**generation, **args),
                               train_dataset=dataset("prompts"), processing_class=tok)
    return trl.RLOOTrainer(model, reward_funcs=reward_len, args=trl.RLOOConfig(beta=0.0, **generation, **args),
                           train_dataset=dataset("prompts"), processing_class=tok)


def logged(kind, family, tmp_path, **config):
    t = trainer(kind, family, tmp_path, **config)
    # LoRA adapters are in the trained model exactly when the case asks for them.
    assert config.get("lora", False) == any("lora_" in name for name, _ in t.model.named_parameters())
    t.train()
    return logs_of(t)


def logs_of(trainer):
    """The figures a trained trainer logged at each step, without the timings and epoch counters."""
    skip = ("runtime", "per_second", "time", "epoch", "total_flos", "train_loss")
    return [{k: v for k, v in e.items() if isinstance(v, (int, float)) and not any(s in k for s in skip)}
            for e in trainer.state.log_history if "loss" in e]


def assert_same_logs(got, want):
    assert len(got) == len(want) == COMMON["max_steps"]
    for step, (g, w) in enumerate(zip(got, want)):
        assert g.keys() == w.keys() and "loss" in g
        # Figures near 0 (DPO's rewards: beta times a difference of two log-probs near -50) get an absolute
        # tolerance as well.
        rel, abs_ = (1e-6, 1e-7) if step == 0 else (1e-4, 1e-6)
        for key in w:
            assert math.isclose(g[key], w[key], rel_tol=rel, abs_tol=abs_), f"step {step} {key}: {g[key]} vs {w[key]}"


@pytest.fixture
def head_calls(monkeypatch):
    """The uniform_grad of every call of Bastile's head through TRL."""
    calls = []
    real = bastile.trainers.fused_linear_log_probs

    def counting(*args, **kwargs):
        calls.append(kwargs["uniform_grad"])
        return real(*args, **kwargs)
    monkeypatch.setattr(bastile.trainers, "fused_linear_log_probs", counting)
    return calls


CASES = [("sft", "qwen3", dict(loss_type="nll")), ("sft", "llama", dict(loss_type="nll", packing=True)),
         ("sft", "qwen3", dict(loss_type="nll", lora=True)),
         ("sft", "qwen3", dict(loss_type="dft")), ("sft", "llama", dict(loss_type="dft", packing=True)),
         ("dpo", "qwen3", {}), ("kto", "llama", {}), ("grpo", "qwen3", {}), ("rloo", "llama", {}),
         # two prompts of a batch's eight rows: the shorter padded on the left (Bastile's decoder: varlen spans)
         ("grpo", "llama", dict(per_device_train_batch_size=8)),
         # TRL's head on each newer family (Granite's: TRL scales the logits by 1 / logits_scaling). GraniteMoE's
         # config has no num_experts, which TRL's head reads for the router's loss: TRL alone runs it without
         # that loss only (families.py refuses it too)
         *[("sft", family, dict(loss_type="nll", **({"router_aux_loss_coef": 0.0} if family == "granitemoe" else {})))
           for family in NEW]]


@pytest.mark.parametrize("kind,family,config", CASES, ids=[f"{k}-{f}-{'-'.join(map(str, c.values()))}"
                                                          for k, f, c in CASES])
def test_trainer_logs_match_trl_alone(kind, family, config, tmp_path, head_calls):
    want = logged(kind, family, tmp_path, **config)
    assert not head_calls
    assert "log_probs_trl" in bastile.apply()
    got = logged(kind, family, tmp_path, **config)
    assert head_calls, "Bastile's head never ran"
    # SFT's negative log-likelihood forms its gradients in the forward; every other loss weighs each token.
    assert set(head_calls) == {kind == "sft" and config["loss_type"] == "nll"}
    assert_same_logs(got, want)


def test_reset_restores_trls_head():
    import trl.trainer.utils as utils
    original = utils._ChunkedLogProbFunction, utils._use_triton, trl.SFTTrainer.compute_loss
    bastile.apply()
    assert utils._ChunkedLogProbFunction is bastile.trainers.ChunkedLogProbs
    bastile.reset()
    assert (utils._ChunkedLogProbFunction, utils._use_triton, trl.SFTTrainer.compute_loss) == original


def test_a_trl_whose_head_moved_is_refused(monkeypatch):
    """A TRL whose per-token function takes other arguments: apply() raises and patches nothing."""
    import trl.trainer.utils as utils

    class Other(torch.autograd.Function):
        @staticmethod
        def forward(ctx, hidden, weight, targets):
            return hidden

    monkeypatch.setattr(utils, "_ChunkedLogProbFunction", Other)
    with pytest.raises(RuntimeError, match="supports trl==1.16"):
        bastile.apply()
    assert bastile.get_patched_ops() == [] and utils._ChunkedLogProbFunction is Other
    assert "log_probs_trl" not in bastile.apply(log_probs=False)


# The JSD, the forward KL, the reverse KL; and two micro-batches a step, each loss its divergence sum over the
# step's token count (num_items_in_batch), not its own.
DISTILLATION_CASES = [dict(beta=0.5), dict(beta=0.0), dict(beta=1.0), dict(beta=0.5, gradient_accumulation_steps=2)]


@pytest.mark.parametrize("config", DISTILLATION_CASES, ids=lambda c: "-".join(f"{k}={v}" for k, v in c.items()))
def test_distillation_logs_match_trl_alone(config, tmp_path, monkeypatch):
    """DistillationTrainer, its loss on Bastile's fused_linear_divergence (the `divergence` patch) and the student's
    layers on Bastile's (its family's patches): every logged figure as in test_trainer_logs_match_trl_alone, and the
    loss and the student's entropy within 1e-5 at every step; Bastile's divergence ran at every micro-batch with
    gradients and TRL's ChunkedDivergenceFunction never."""
    from trl.kernels.chunked_divergence import ChunkedDivergenceFunction
    ours, theirs = [], []
    real_ours, real_theirs = bastile.trainers.fused_linear_divergence, ChunkedDivergenceFunction.apply

    def counting_ours(*args, **kwargs):
        ours.append(torch.is_grad_enabled())
        return real_ours(*args, **kwargs)

    def counting_theirs(*args):
        theirs.append(torch.is_grad_enabled())
        return real_theirs(*args)
    monkeypatch.setattr(bastile.trainers, "fused_linear_divergence", counting_ours)
    monkeypatch.setattr(ChunkedDivergenceFunction, "apply", counting_theirs)

    calls = [True] * COMMON["max_steps"] * config.get("gradient_accumulation_steps", 1)
    want = logged("distillation", "qwen3", tmp_path, **config)
    assert (ours, theirs) == ([], calls)
    assert {*patch_names("qwen3"), "divergence_trl"} <= set(bastile.apply())
    theirs.clear()
    got = logged("distillation", "qwen3", tmp_path, **config)
    assert (ours, theirs) == (calls, [])
    assert_same_logs(got, want)
    for step, (g, w) in enumerate(zip(got, want)):
        for key in ("loss", "entropy"):
            assert math.isclose(g[key], w[key], rel_tol=1e-5), f"step {step} {key}: {g[key]} vs {w[key]}"
    assert min(e["completions/clipped_ratio"] for e in want) < 1, "every completion ran to the length limit"
