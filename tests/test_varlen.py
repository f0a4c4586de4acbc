"""Packed rows through varlen attention (bastile/varlen.py and the patched attention).

The kernel against attention with an explicit block-diagonal mask (fp64 on CPU; bf16 against fp32 on CUDA);
the patched families on packed rows against HF's masked path and against each sequence run alone, with
and without use_cache=False; and a packed mini-Qwen3 trained 20 steps against the same sequences padded.
"""
import copy
import math
import sys

import pytest
import torch
from transformers.masking_utils import find_packed_sequence_indices

import bastile
from bastile import sinks, varlen
from conftest import needs_cuda, rel_err
from bastile.families import FAMILIES as TRAITS
from test_families import (COMMON, IMAGE, assert_grad_close, exact_delta_rule, mini, qwen2_vl_multimodal,
                           qwen3_vl_multimodal)

LENGTHS = (7, 12, 1, 5)


def dense_reference(q, k, v, lengths, scale, window):
    """q [T, Hq, D], k/v [T, Hkv, D]: softmax over an explicit [T, T] mask (same sequence, causal, within
    the window), GQA by repeating k and v."""
    seq = torch.repeat_interleave(torch.arange(len(lengths)), torch.tensor(lengths))
    i = torch.arange(len(seq))
    allowed = (seq[:, None] == seq[None, :]) & (i[None, :] <= i[:, None])
    if window is not None:
        allowed &= i[:, None] - i[None, :] < window
    rep = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1)
    scores = torch.einsum("qhd,khd->hqk", q, k) * scale
    scores = scores.masked_fill(~allowed.to(q.device), float("-inf"))
    return torch.einsum("hqk,khd->qhd", scores.softmax(-1), v)


def qkv(lengths, q_heads, kv_heads, dim, dtype, device, seed=0):
    g = torch.Generator().manual_seed(seed)
    t = sum(lengths)
    return [torch.randn(t, h, dim, generator=g, dtype=torch.float64).to(device=device, dtype=dtype).requires_grad_()
            for h in (q_heads, kv_heads, kv_heads)]


def cu_of(lengths, device):
    cu = torch.zeros(len(lengths) + 1, dtype=torch.int32)
    cu[1:] = torch.tensor(lengths).cumsum(0)
    return cu.to(device)


@pytest.mark.parametrize("window", [None, 3])
def test_attention_matches_dense_mask_fp64(window):
    q, k, v = qkv(LENGTHS, 4, 2, 8, torch.float64, "cpu")
    scale = 8 ** -0.5
    out = varlen.attention(q, k, v, cu_of(LENGTHS, "cpu"), max(LENGTHS), scale, window)
    expected = dense_reference(q, k, v, LENGTHS, scale, window)
    torch.testing.assert_close(out, expected, rtol=1e-12, atol=1e-12)
    grad = torch.randn_like(out)
    got = torch.autograd.grad(out, (q, k, v), grad)
    want = torch.autograd.grad(expected, (q, k, v), grad)
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-10)


@needs_cuda
@pytest.mark.parametrize("window", [None, 100])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_attention_cuda_kernel_matches_fp32(dtype, window):
    """The flash varlen kernel (16-bit) against the fp32 dense reference, at Qwen3's head shapes."""
    lengths = (300, 1, 129, 1000, 64, 2)
    q, k, v = qkv(lengths, 16, 8, 128, dtype, "cuda")
    assert varlen.flash(q)
    scale = 128 ** -0.5
    out = varlen.attention(q, k, v, cu_of(lengths, "cuda"), max(lengths), scale, window)
    ref_in = [t.detach().float().requires_grad_() for t in (q, k, v)]
    expected = dense_reference(*ref_in, lengths, scale, window)
    torch.testing.assert_close(out.float(), expected, rtol=2e-2, atol=2e-2)
    grad = torch.randn_like(expected)
    got = torch.autograd.grad(out, (q, k, v), grad.to(dtype))
    want = torch.autograd.grad(expected, ref_in, grad)
    for a, b in zip(got, want):
        err = (a.float() - b).norm() / b.norm()
        assert err < 1e-2, err


def test_sequences_follow_hf_packed_rule():
    """The bounds `sequences` derives are HF's packed sequences (a position not its predecessor's plus one
    starts one, as does each row), and rows that are one sequence each give None."""
    positions = torch.tensor([[0, 1, 2, 0, 1, 5, 6, 0], [3, 4, 0, 1, 2, 3, 0, 0]])
    got = varlen.sequences(positions, 2)
    hf_ids = find_packed_sequence_indices(positions)  # per row: sequence index within the row
    bounds = [0]
    for r in range(2):
        changes = torch.nonzero(hf_ids[r, 1:] != hf_ids[r, :-1]).flatten() + 1 + r * 8
        bounds += changes.tolist() + [(r + 1) * 8]
    assert got["cu_seq_lens_q"].tolist() == bounds and got["cu_seq_lens_q"].dtype == torch.int32
    assert got["max_length_q"] == max(b - a for a, b in zip(bounds, bounds[1:])) == 4
    assert varlen.sequences(torch.arange(6)[None], 3) is None
    # [1, seq] positions broadcast over a batch of 2 restarting rows
    assert varlen.sequences(torch.tensor([[0, 1, 0]]), 2)["cu_seq_lens_q"].tolist() == [0, 2, 3, 5, 6]


def test_padded_spans_show_each_token_what_hfs_mask_shows():
    """`padding` reads each row's pads before its tokens and its tokens where the tokens are one run (pads at its
    start, its end, both or neither), None where pads lie between them; such rows as `padded` spans: each real
    token sees, causally within its span, exactly the keys HF's padding rule shows it (keys at or before it that
    are not pads), and every span holds only tokens or only pads."""
    seq = 9
    mask = torch.tensor([[1] * 6 + [0] * 3, [0] * 4 + [1] * 5, [1] * seq, [0] * seq, [1] * 8 + [0],
                         [0] * 2 + [1] * 4 + [0] * 3])
    rows = varlen.padding(mask)
    assert rows == [(0, 6), (4, 5), (0, 9), (0, 0), (0, 8), (2, 4)]
    assert varlen.padding(torch.tensor([[1, 1, 0, 1], [0, 1, 0, 1]])) == [None, None]
    got = varlen.padded(rows, seq, mask.device)
    cu = got["cu_seq_lens_q"]
    assert cu.dtype == torch.int32 and got["cu_seq_lens_k"] is cu
    lengths = cu.diff().tolist()
    assert min(lengths) > 0 and got["max_length_q"] == got["max_length_k"] == max(lengths)
    span = torch.searchsorted(cu[1:].long(), torch.arange(mask.numel()), right=True).view(mask.shape)
    for row in range(mask.shape[0]):
        for i in range(seq):
            assert len({int(mask[row, j]) for j in range(seq) if span[row, j] == span[row, i]}) == 1
            if mask[row, i]:
                hf = [j for j in range(seq) if j <= i and mask[row, j]]
                ours = [j for j in range(seq) if j <= i and span[row, j] == span[row, i]]
                assert ours == hf, (row, i)


# (family, config overrides): sliding windows shorter than the sequences, so that a wrong window shows
VARIANTS = {
    "qwen3": ("qwen3", {}),
    "llama": ("llama", {}),
    "mistral_window": ("mistral", dict(sliding_window=4)),
    "qwen2_window": ("qwen2", dict(use_sliding_window=True, sliding_window=4, max_window_layers=1)),
    # no router loss: over a packed row it is not the count-weighted sum of the sequences' own
    "qwen3_moe": ("qwen3_moe", dict(output_router_logits=False)),
    # attention sinks: Bastile's sink attention over the packed stream (sinks.py); HF's masks attend across it
    "gpt_oss": ("gpt_oss", dict(output_router_logits=False)),
    "mixtral_window": ("mixtral", dict(output_router_logits=False, sliding_window=4)),
    # the window on layer 0, the one layer_types calls sliding (HF's attention windows it by its mask only)
    "qwen2_moe_window": ("qwen2_moe", dict(output_router_logits=False, sliding_window=4)),
    "olmoe": ("olmoe", dict(output_router_logits=False)),
    "phi3_window": ("phi3", dict(resid_pdrop=0.0, sliding_window=4)),  # dropout: other masks in each run
    "smollm3_window": ("smollm3", dict(sliding_window=4)),
    "ministral3_window": ("ministral3", dict(sliding_window=4)),
    "olmo3_window": ("olmo3", dict(sliding_window=4)),
    **{family: (family, {}) for family in ("granite", "granitemoe", "olmo2", "glm4", "glm4_moe", "gemma", "ernie4_5")},
    "gemma3_window": ("gemma3_text", dict(sliding_window=4)),
    # attention softcap: HF's attention with masks made by Bastile (not varlen), HF's own correct
    "gemma2_softcap": ("gemma2", dict(sliding_window=4)),
    # K/V shared by the last layers, per-layer embeddings
    "gemma4_window": ("gemma4_text", dict(sliding_window=4)),
    # the full layers' heads (16) wider than the varlen kernel takes, its limit lowered to 8 (Gemma 4's 512 to
    # the kernel's 256): HF's attention with masks made by Bastile there, the varlen kernel in sliding layers
    "gemma4_wide": ("gemma4_text", dict(sliding_window=4)),
    # Gated DeltaNet layers: the conv and the recurrence restart at each sequence (HF's carry them across)
    "qwen3_5": ("qwen3_5_text", {}),
    "qwen3_5_moe": ("qwen3_5_moe_text", dict(output_router_logits=False)),
    # short convolutions: each restarts at each sequence (HF's carries it across)
    "lfm2": ("lfm2", {}),
    # the same beside routed experts
    "lfm2_moe": ("lfm2_moe", {}),
    # the same with Qwen3-Next's grouped projections, under plain RoPE
    "qwen3_next": ("qwen3_next", dict(output_router_logits=False)),
}
# Variants whose attention has no varlen kernel (a softcap), and those where some layers have none.
MASKED = {"gemma2_softcap"}
VARLEN_LAYERS = {"gemma4_wide": 2, "qwen3_5": 1, "qwen3_5_moe": 1, "lfm2": 2, "lfm2_moe": 2, "qwen3_next": 1}
MAX_HEAD_DIM = {"gemma4_wide": 8}


def _collated(seqs):
    """bastile.data.collate's batch of the sequences, each a row of its own."""
    return bastile.data.collate([{"input_ids": s, "labels": s, "seq_lens": torch.tensor([len(s)])} for s in seqs])


def _packed_inputs(lengths, seed=5):
    gen = torch.Generator().manual_seed(seed)
    seqs = [torch.randint(0, COMMON["vocab_size"], (n,), generator=gen) for n in lengths]
    return seqs, _collated(seqs)


def _alone(ref, seqs):
    """The loss of the sequences run one by one (unpatched): each one's mean weighted by its targets."""
    counts = [len(s) - 1 for s in seqs]
    return sum(ref(input_ids=s[None], labels=s[None]).loss * n for s, n in zip(seqs, counts)) / sum(counts)


def _exact(family, monkeypatch):
    """HF's Gated DeltaNet, where the family has one, on the exact recurrence from here on: HF's chunked rule in
    fp32 gets the gradients of its decay 1e-3 off (test_families.DECAY), Bastile's within fp32 rounding."""
    if TRAITS[family].linear_attention:
        monkeypatch.setattr(sys.modules[TRAITS[family].module], "torch_chunk_gated_delta_rule", exact_delta_rule)


def _counting(monkeypatch, name, module=varlen):
    calls = []
    original = getattr(module, name)

    def spy(*args, **kwargs):
        calls.append(name)
        return original(*args, **kwargs)
    monkeypatch.setattr(module, name, spy)
    return calls


@pytest.mark.parametrize("training", [True, False], ids=["train", "eval"])
@pytest.mark.parametrize("given", [False, True], ids=["positions", "cu_seq_lens"])
@pytest.mark.parametrize("use_cache", [None, False])
@pytest.mark.parametrize("variant", list(VARIANTS))
def test_packed_row_matches_masked_path_and_sequences_alone(variant, use_cache, given, training, monkeypatch):
    """A packed row with labels (HF's flattened layout), in training or evaluation, gives the loss and
    gradients of HF's masked path and of its sequences run one by one, whether its bounds come from the
    collator (no host read) or from the restarting positions, and whether or not the caller passed
    use_cache=False (HF makes a cache by default, and with one attends across the row). The varlen kernel
    (GPT-OSS: the sink attention) runs in every patched attention layer, where the family's attention is
    Bastile's."""
    family, overrides = VARIANTS[variant]
    ref = mini(family, "cpu", torch.float32, **overrides).train(training)
    model = copy.deepcopy(ref)
    bastile.apply(model=model)
    monkeypatch.setattr(varlen, "MAX_HEAD_DIM", MAX_HEAD_DIM.get(variant, varlen.MAX_HEAD_DIM))
    seqs, batch = _packed_inputs((7, 12, 5, 9))
    if not given:
        batch = {k: batch[k] for k in ("input_ids", "labels", "position_ids")}
    attention_calls = _counting(monkeypatch, "attention", sinks if TRAITS[family].attention.sinks else varlen)
    reads = _counting(monkeypatch, "sequences")
    loss = model(**batch, use_cache=use_cache).loss
    grads = torch.autograd.grad(loss, list(model.parameters()))
    # HF's GPT-OSS makes its masks without the position ids, HF's Gated DeltaNet and short convolution ignore the
    # bounds: across
    across = TRAITS[family].attention.sinks or TRAITS[family].linear_attention or TRAITS[family].short_conv
    assert len(attention_calls) == (0 if variant in MASKED else
                                    VARLEN_LAYERS.get(variant, model.config.num_hidden_layers))
    assert len(reads) == (0 if given or variant in MASKED else 1)
    bastile.reset()
    _exact(family, monkeypatch)

    masked = ref(**{k: batch[k] for k in ("input_ids", "labels", "position_ids")}, use_cache=False).loss
    masked_grads = torch.autograd.grad(masked, list(ref.parameters()))
    alone = _alone(ref, seqs)
    alone_grads = torch.autograd.grad(alone, list(ref.parameters()))
    references = [(alone, alone_grads)]
    if across:  # 10x the tolerances below apart: the losses, or (LFM2's 3-tap convolutions carry a few tokens across,
        # 1e-5 of the loss) the gradients
        assert (not math.isclose(masked.item(), alone.item(), rel_tol=1e-4)
                or max(rel_err(m, a) for m, a in zip(masked_grads, alone_grads)) > 1e-3)
    else:
        references.append((masked, masked_grads))
    for expected, expected_grads in references:
        torch.testing.assert_close(loss, expected, rtol=1e-5, atol=0)
        for (name, _), g, e in zip(model.named_parameters(), grads, expected_grads):
            assert_grad_close(g, e, name)


@pytest.mark.parametrize("given", [False, True], ids=["positions", "cu_seq_lens"])
@pytest.mark.parametrize("variant", ["qwen3", "qwen2_window"])
def test_a_layer_that_cannot_run_varlen_keeps_its_mask(variant, given, monkeypatch):
    """One rule decides varlen or masked, for the decoder and for each attention: where one layer's attention
    cannot run varlen (dropout in training, set on that module alone), the decoder keeps HF's masks for that
    layer's type, which that layer attends through, within each sequence. The other layers run the varlen
    kernel where the collator gave the bounds; from positions alone the decoder reads them only for a layer type
    whose every layer runs varlen (Qwen2's sliding layer here), and the other layers take the masks."""
    family, overrides = VARIANTS[variant]
    ref = mini(family, "cpu", torch.float32, **overrides).train()
    ref.model.layers[0].self_attn.attention_dropout = 1e-12  # dropout whose draws change nothing
    model = copy.deepcopy(ref)
    bastile.apply(model=model)
    seqs, batch = _packed_inputs((7, 12, 5, 9))
    if not given:
        batch = {k: batch[k] for k in ("input_ids", "labels", "position_ids")}
    attention_calls = _counting(monkeypatch, "attention")
    loss = model(**batch).loss
    types = model.config.layer_types
    assert len(attention_calls) == (len(types) - 1 if given else sum(t != types[0] for t in types))
    bastile.reset()
    torch.testing.assert_close(loss, _alone(ref, seqs), rtol=1e-5, atol=0)


@pytest.mark.parametrize("family", ["qwen3", "qwen3_5_text", "lfm2"])
def test_packed_training_matches_unpacked_20_steps(family, monkeypatch):
    """A mini Qwen3 (Qwen3.5: its Gated DeltaNet layers too; LFM2: its short convolutions) trained 20 AdamW steps on packed rows (Bastile,
    varlen) and on the same sequences as padded rows (HF, attention mask): the same per-step losses, each the
    mean over the step's predicted tokens. Qwen3.5's reference is HF's in float64 on the exact recurrence: in
    float32 HF's drifts 1e-5 from it by step 8 (Bastile's stays within 2e-7)."""
    gen = torch.Generator().manual_seed(11)
    steps = [[torch.randint(0, 512, (int(n),), generator=gen) for n in torch.randint(2, 40, (5,), generator=gen)]
             for _ in range(20)]
    ref = mini(family, "cpu", torch.float32)
    model = copy.deepcopy(ref)

    def padded(seqs):
        width = max(len(s) for s in seqs)
        ids = torch.zeros(len(seqs), width, dtype=torch.long)
        mask = torch.zeros_like(ids)
        for r, s in enumerate(seqs):
            ids[r, :len(s)], mask[r, :len(s)] = s, 1
        return dict(input_ids=ids, attention_mask=mask, labels=ids.masked_fill(mask == 0, -100))


    def run(net, make):
        opt = torch.optim.AdamW(net.parameters(), lr=2e-3)
        losses = []
        for seqs in steps:
            loss = net(**make(seqs)).loss
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            losses.append(loss.item())
        return losses

    if TRAITS[family].linear_attention:
        _exact(family, monkeypatch)
        ref.double()
    expected = run(ref, padded)
    bastile.apply(model=model)
    got = run(model, _collated)
    for step, (a, b) in enumerate(zip(got, expected)):
        assert math.isclose(a, b, rel_tol=1e-5), f"step {step}: {a} vs {b}"
    assert expected[-1] < expected[0] - 0.5  # it learned: the comparison is not of constants


def test_trl_packed_sft_matches_trl_alone(monkeypatch, tmp_path):
    """TRL's SFTTrainer with packing=True (its best-fit packer, padding-free batches with cu_seq_lens, its
    own fused LM head calling the decoder): under bastile.apply() the attention runs varlen, and the
    per-step losses are TRL's own (masked path)."""
    from datasets import Dataset
    from tokenizers import Tokenizer
    from tokenizers.models import WordLevel
    from transformers import PreTrainedTokenizerFast
    from trl import SFTConfig, SFTTrainer

    gen = torch.Generator().manual_seed(3)
    ds = Dataset.from_dict({"input_ids": [torch.randint(2, 512, (int(n),), generator=gen).tolist()
                                          for n in torch.randint(3, 60, (40,), generator=gen)]})
    tok = PreTrainedTokenizerFast(tokenizer_object=Tokenizer(WordLevel({"<pad>": 0, "<eos>": 1}, unk_token="<pad>")),
                                  pad_token="<pad>", eos_token="<eos>")

    def losses(model):
        cfg = SFTConfig(output_dir=str(tmp_path), max_steps=4, per_device_train_batch_size=2, max_length=128,
                        packing=True, logging_steps=1, report_to="none", save_strategy="no", use_cpu=True,
                        bf16=False, learning_rate=2e-3, seed=0)
        trainer = SFTTrainer(model, args=cfg, train_dataset=ds, processing_class=tok)
        trainer.train()
        return [e["loss"] for e in trainer.state.log_history if "loss" in e]

    expected = losses(mini("qwen3", "cpu", torch.float32))
    calls = _counting(monkeypatch, "attention")
    model = mini("qwen3", "cpu", torch.float32)
    bastile.apply(model=model)
    got = losses(model)
    assert len(calls) >= 4 * model.config.num_hidden_layers
    assert len(got) == len(expected) == 4
    for step, (a, b) in enumerate(zip(got, expected)):
        assert math.isclose(a, b, rel_tol=1e-4), f"step {step}: {a} vs {b}"


def test_packed_row_with_lora_adapters(monkeypatch):
    """PEFT LoRA on the seven projections (Bastile's fused nodes) over a packed row: the loss and adapter
    gradients of PEFT unpatched on the sequences alone."""
    from peft import LoraConfig, get_peft_model
    base = mini("qwen3", "cpu", torch.float32)

    def lora():
        torch.manual_seed(1)
        return get_peft_model(copy.deepcopy(base), LoraConfig(
            r=4, lora_alpha=8, init_lora_weights=False, target_modules=["q_proj", "k_proj", "v_proj", "o_proj",
                                                                      "gate_proj", "up_proj", "down_proj"]))
    ref = lora()
    bastile.apply(families="qwen3")
    model = lora()
    assert set(bastile.lora_modules(model).values()) == {"fused"}
    seqs, batch = _packed_inputs((7, 12, 5))
    calls = _counting(monkeypatch, "attention")
    loss = model(**batch).loss
    assert len(calls) == base.config.num_hidden_layers
    trained = [p for p in model.parameters() if p.requires_grad]
    grads = torch.autograd.grad(loss, trained)
    bastile.reset()
    alone = _alone(ref, seqs)
    expected = torch.autograd.grad(alone, [p for p in ref.parameters() if p.requires_grad])
    torch.testing.assert_close(loss, alone, rtol=1e-5, atol=0)
    for g, e in zip(grads, expected):
        torch.testing.assert_close(g, e, rtol=1e-4, atol=1e-6)


@pytest.mark.parametrize("family", ["qwen3", "qwen3_5_text", "lfm2"])
def test_two_packed_rows_use_per_row_tables(family):
    """A batch of two packed rows [2, seq] (positions restarting in each): the q/k-norm + RoPE op reads
    per-row cos/sin tables (Qwen3.5's Gated DeltaNet and LFM2's short convolution run the rows as one stream of
    four sequences), and the
    loss and gradients are those of the sequences alone."""
    ref = mini(family, "cpu", torch.float32)
    model = copy.deepcopy(ref)
    bastile.apply(model=model)
    seqs, _ = _packed_inputs((7, 9, 12, 4))
    ids = torch.stack([torch.cat(seqs[:2]), torch.cat(seqs[2:])])
    positions = torch.stack([torch.cat([torch.arange(len(s)) for s in pair]) for pair in (seqs[:2], seqs[2:])])
    labels = ids.clone()
    labels[positions == 0] = -100
    loss = model(input_ids=ids, labels=labels, position_ids=positions).loss
    grads = torch.autograd.grad(loss, list(model.parameters()))
    alone = _alone(ref, seqs)
    torch.testing.assert_close(loss, alone, rtol=1e-5, atol=0)
    for g, e in zip(grads, torch.autograd.grad(alone, list(ref.parameters()))):
        torch.testing.assert_close(g, e, rtol=1e-4, atol=1e-6)


# multimodal model type -> (its mini, the parameters an image's gradients reach beyond the vision blocks: Qwen3-VL's
# DeepStack mergers, the others' patch merger)
QWEN_VL = {"qwen3_vl": (qwen3_vl_multimodal, "model.visual.deepstack"),
           "qwen2_5_vl": (lambda: qwen2_vl_multimodal("qwen2_5_vl"), "model.visual.merger"),
           "qwen2_vl": (lambda: qwen2_vl_multimodal("qwen2_vl"), "model.visual.merger")}


@pytest.mark.parametrize("model_type", list(QWEN_VL))
@pytest.mark.parametrize("image", [False, True], ids=["text", "images"])
@pytest.mark.parametrize("given", [False, True], ids=["positions", "cu_seq_lens"])
def test_qwen_vl_packed_row_matches_sequences_alone(given, image, model_type, monkeypatch):
    """Qwen3-VL's, Qwen2.5-VL's and Qwen2-VL's multimodal models on a packed row: text only, with 2-D restarting
    positions, or with an image in two of its three sequences, with each sequence's multimodal RoPE sections as HF's
    get_rope_index makes them alone after the text positions ([4, 1, tokens], as HF's decoder reads them). The varlen
    kernel runs in every layer, and the loss and gradients (the vision tower's and DeepStack's included) are those
    of the sequences run alone through HF's model."""
    build, reached = QWEN_VL[model_type]
    ref = build()
    model = copy.deepcopy(ref)
    bastile.apply(model=model)
    gen = torch.Generator().manual_seed(5)
    seqs = [torch.randint(3, 512, (n,), generator=gen) for n in (12, 9, 14)]
    starts = {0: 2, 2: 3} if image else {}  # sequence -> its 4 image tokens' first position
    for i, at in starts.items():
        seqs[i][at:at + 4] = IMAGE
    grid = torch.tensor([[1, 4, 4]])
    pixels = {i: torch.randn(16, 96, generator=gen) for i in starts}

    def alone(i, s):
        kw = dict(input_ids=s[None], labels=s.masked_fill(s == IMAGE, -100)[None])
        if i in pixels:
            kw.update(mm_token_type_ids=(s == IMAGE).long()[None], pixel_values=pixels[i], image_grid_thw=grid)
        return kw

    batch = _collated(seqs)
    batch["labels"] = batch["labels"].masked_fill(batch["input_ids"] == IMAGE, -100)
    if image:
        sections = [ref.model.get_rope_index(s[None], (s == IMAGE).long()[None], grid if i in pixels else None)[0]
                    for i, s in enumerate(seqs)]
        batch["position_ids"] = torch.cat([batch["position_ids"][None], torch.cat(sections, -1)])
        batch.update(pixel_values=torch.cat(list(pixels.values())), image_grid_thw=grid.repeat(len(pixels), 1))
    if not given:
        batch = {k: v for k, v in batch.items() if k not in varlen.KEYS}
    attention_calls = _counting(monkeypatch, "attention")
    loss = model(**batch).loss
    grads = torch.autograd.grad(loss, list(model.parameters()), allow_unused=True)
    assert len(attention_calls) == model.config.text_config.num_hidden_layers
    bastile.reset()

    runs = [alone(i, s) for i, s in enumerate(seqs)]
    counts = [(kw["labels"][:, 1:] != -100).sum() for kw in runs]
    expected = sum(ref(**kw).loss * n for kw, n in zip(runs, counts)) / sum(counts)
    expected_grads = torch.autograd.grad(expected, list(ref.parameters()), allow_unused=True)
    torch.testing.assert_close(loss, expected, rtol=1e-5, atol=0)
    assert any(n.startswith(reached) and g is not None
               for (n, _), g in zip(model.named_parameters(), grads)) == image
    for (name, _), g, e in zip(model.named_parameters(), grads, expected_grads):
        assert (g is None) == (e is None), name
        if e is not None:
            assert_grad_close(g, e, name)


@needs_cuda
def test_packed_step_compiles_cuda():
    """torch.compile of a patched model on a packed batch with the collator's bounds: the loss and
    gradients of eager (bf16)."""
    model = mini("qwen3", "cuda", torch.bfloat16)
    bastile.apply(model=model)
    _, batch = _packed_inputs((70, 120, 50, 90))
    batch = {k: v.cuda() if torch.is_tensor(v) else v for k, v in batch.items()}
    eager = model(**batch).loss
    eager_grads = torch.autograd.grad(eager, list(model.parameters()))
    compiled = torch.compile(model)(**batch).loss
    grads = torch.autograd.grad(compiled, list(model.parameters()))
    torch.testing.assert_close(compiled, eager, rtol=1e-2, atol=0)
    for g, e in zip(grads, eager_grads):
        assert (g.float() - e.float()).norm() <= 2e-2 * e.float().norm() + 1e-6


@pytest.mark.parametrize("family", ["qwen3", "llama", "gpt_oss", "gemma2", "gemma3_text", "gemma4_text",
                                    "qwen3_5_text", "lfm2"])
def test_decoder_called_directly_on_a_packed_row(family, monkeypatch):
    """TRL's fused head calls the decoder (model.model) itself, with the collator's kwargs: each sequence's
    hidden states are those it has alone, and a decoder that takes prepared masks makes none of HF's (Qwen3:
    the varlen path; GPT-OSS: its sink attention). HF's own GPT-OSS decoder attends across the row's sequences
    (its masks ignore positions)."""
    ref = mini(family, "cpu", torch.float32, **({"output_router_logits": False} if family == "gpt_oss" else {}))
    model = copy.deepcopy(ref)
    bastile.apply(model=model)
    seqs, batch = _packed_inputs((7, 12, 5))
    kw = {k: v for k, v in batch.items() if k != "labels"}
    made = []
    modeling = sys.modules[type(model.model).__module__]
    monkeypatch.setattr(modeling, "create_causal_mask", lambda **a: made.append(a))
    packed = model.model(**kw, use_cache=False).last_hidden_state[0]
    # Llama's decoder takes no prepared masks: it still makes HF's (unused)
    assert (made == []) == (family != "llama")
    monkeypatch.undo()
    bastile.reset()
    alone = torch.cat([ref.model(input_ids=s[None]).last_hidden_state[0] for s in seqs])
    torch.testing.assert_close(packed, alone, rtol=1e-4, atol=1e-5)
    if family == "gpt_oss":
        hf = ref.model(**kw, use_cache=False).last_hidden_state[0]
        assert not torch.allclose(hf, alone, rtol=1e-2, atol=1e-2)


@needs_cuda
def test_gemma4_packed_row_cuda_bf16_at_real_head_dims(monkeypatch):
    """Gemma 4's heads (256 on sliding layers, 512 on full ones, past the flash varlen kernel's limit) on a
    packed row in bf16: the sliding layers run the varlen kernel, the full ones HF's attention with Bastile's
    masks, and the loss and gradients are those of the sequences alone. The q/k norm weights are head_dim^-1/4,
    scores of unit spread as in a trained model: at 1 (scores of spread sqrt(512), attention scaled by 1) bf16
    rounding moves the gradients by a quarter, HF's own packed row against its sequences alone included."""
    ref = mini("gemma4_text", "cuda", torch.bfloat16, head_dim=256, global_head_dim=512, sliding_window=48)
    with torch.no_grad():
        for attention in (layer.self_attn for layer in ref.model.layers):
            for norm in (attention.q_norm, getattr(attention, "k_norm", None)):
                if norm is not None:
                    norm.weight.fill_(attention.head_dim ** -0.25)
    model = copy.deepcopy(ref)
    bastile.apply(model=model)
    seqs, batch = _packed_inputs((70, 120, 50, 90))
    batch = {k: v.cuda() if torch.is_tensor(v) else v for k, v in batch.items()}
    calls = _counting(monkeypatch, "attention")
    loss = model(**batch).loss
    grads = torch.autograd.grad(loss, list(model.parameters()))
    assert len(calls) == model.config.layer_types.count("sliding_attention")
    bastile.reset()
    alone = _alone(ref, [s.cuda() for s in seqs])
    torch.testing.assert_close(loss, alone, rtol=1e-2, atol=0)
    for g, e in zip(grads, torch.autograd.grad(alone, list(ref.parameters()))):
        assert (g.float() - e.float()).norm() <= 3e-2 * e.float().norm() + 1e-6
