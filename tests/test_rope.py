"""torch.ops.bastile.rope against HF's apply_rotary_pos_emb (forward and its autograd) and an fp64 reference:
Qwen3's, Phi-3's (partial rotary) and GLM-4's (interleaved pairs, partial)."""
import pytest
import torch
from transformers import Qwen3Config
from transformers.models.glm4 import modeling_glm4
from transformers.models.phi3 import modeling_phi3
from transformers.models.qwen3 import modeling_qwen3
from transformers.models.qwen3.modeling_qwen3 import Qwen3RotaryEmbedding

import bastile
from conftest import DEVICES, Contract, needs_cuda, poison_cuda_allocator, rel_err

op = torch.ops.bastile.rope
op_backward = torch.ops.bastile.rope_backward

HF_APPLY = modeling_qwen3.apply_rotary_pos_emb  # taken before any test patches it
PHI3_APPLY = modeling_phi3.apply_rotary_pos_emb  # the first rot = cos.shape[-1] elements rotate, the rest pass
GLM4_APPLY = modeling_glm4.apply_rotary_pos_emb  # pairs (2j, 2j + 1), partial too


def hf_apply(interleaved):
    """HF's apply_rotary_pos_emb of the layout, partial or not."""
    return GLM4_APPLY if interleaved else PHI3_APPLY

# Relative spacing of each dtype (one ulp at 1.0) and unit roundoff.
EPS = {torch.bfloat16: 2 ** -7, torch.float16: 2 ** -10, torch.float32: 2 ** -23, torch.float64: 2 ** -52}


def unit(dtype):
    return EPS[dtype] / 2


def rotary_tables(batch_positions, dim, dtype, device):
    """cos, sin [batch, seq, dim] from HF's Qwen3RotaryEmbedding for the given position ids."""
    cfg = Qwen3Config(hidden_size=4 * dim, num_attention_heads=4, num_key_value_heads=2, head_dim=dim,
                      max_position_embeddings=1 << 20)
    rope_emb = Qwen3RotaryEmbedding(cfg).to(device)
    pos = torch.as_tensor(batch_positions, dtype=torch.long, device=device)
    return rope_emb(torch.empty(1, dtype=dtype, device=device), pos)


def packed_positions(batch, seq):
    """Packed sequences: each row holds several documents whose positions restart, differently per row."""
    rows = []
    for b in range(batch):
        cut = min(seq, max(1, (seq * (b + 1)) // (batch + 2)))
        rows.append(list(range(cut)) + list(range(seq - cut)))
    return rows


def qwen3_inputs(batch, seq, q_heads, k_heads, dim, dtype, device, unsqueeze_dim=1, packed=True, seed=0, rot=None):
    """q, k as Qwen3's attention builds them, from leaf [batch, seq, heads, dim] storage (whose .grad is the
    gradient HF's autograd would give the projections): transposed views for unsqueeze_dim=1; cos, sin of
    width rot (default dim), as Phi-3's and GLM-4's rotary embeddings make them for a partial rotary factor."""
    g = torch.Generator().manual_seed(seed)
    qs = torch.randn(batch, seq, q_heads, dim, generator=g).to(device, dtype).requires_grad_()
    ks = torch.randn(batch, seq, k_heads, dim, generator=g).to(device, dtype).requires_grad_()
    positions = packed_positions(batch, seq) if packed else [list(range(seq))] * batch
    positions = torch.tensor(positions, dtype=torch.long).reshape(batch, seq)
    cos, sin = rotary_tables(positions, rot or dim, dtype, device)
    view = (lambda t: t.transpose(1, 2)) if unsqueeze_dim == 1 else (lambda t: t)
    return qs, ks, view(qs), view(ks), cos, sin


def f64_reference(q, k, cos, sin, unsqueeze_dim=1, interleaved=False):
    return hf_apply(interleaved)(q.double(), k.double(), cos.double(), sin.double(), unsqueeze_dim)


def assert_matches_hf(out, ref, dtype):
    """At most one ulp apart anywhere, and bitwise equal almost everywhere: we round as HF does."""
    assert out.dtype == ref.dtype and out.shape == ref.shape
    torch.testing.assert_close(out, ref, rtol=EPS[dtype], atol=EPS[dtype])
    assert out.numel() == 0 or (out == ref).float().mean().item() > 0.99


# ---------------------------------------------------------------- the generic tests' contract (test_contract.py)


def hf(q, k, cos, sin, unsqueeze_dim=1, interleaved=False):
    """HF's apply_rotary_pos_emb (GLM-4's if interleaved, else Phi-3's, Qwen3's where cos is as wide as a
    head), the op's [seq, rot] tables taken as [1, seq, rot]."""
    if cos.dim() == 2:
        cos, sin = cos[None], sin[None]
    return hf_apply(interleaved)(q, k, cos, sin, unsqueeze_dim)


def samples(device):
    def call(batch, seq, q_heads, k_heads, dim, unsqueeze_dim=1, table="BSD", rot=None, interleaved=False):
        _, _, q, k, cos, sin = qwen3_inputs(batch, seq, q_heads, k_heads, dim, torch.float32, device, unsqueeze_dim,
                                            rot=rot)
        if table != "BSD":
            cos, sin = cos[1:2], sin[1:2]
        if table == "SD":
            cos, sin = cos[0], sin[0]
        return (q, k, cos, sin, unsqueeze_dim), ({"interleaved": True} if interleaved else {})

    # Both layouts with each table: [B, S, D] (packed sequences' positions), [1, S, D] and [S, D], with
    # rotate_half's pairs or interleaved ones, rotating whole heads or their first rot elements. Eight
    # calls at most: torch.compile's recompile limit.
    layouts = [(1, "1SD"), (1, "SD"), (2, "BSD"), (2, "1SD"), (2, "SD")]
    modes = [(None, False), (4, True), (None, True), (4, False), (2, True)]
    return [call(2, 5, 4, 2, 16), call(3, 8, 6, 3, 24)] + [
        call(2, 4, 3, 1, 8, unsqueeze_dim, table, rot, interleaved)
        for (unsqueeze_dim, table), (rot, interleaved) in zip(layouts, modes)] + [call(2, 4, 3, 1, 16, rot=12)]


def empty(device):
    return [((*qwen3_inputs(*shape, 16, torch.float32, device)[2:], 1), {})
            for shape in [(0, 5, 4, 2), (2, 0, 4, 2), (2, 5, 4, 0)]] + [
        ((*qwen3_inputs(2, 0, 4, 2, 16, torch.float32, device, rot=8)[2:], 1), {"interleaved": True})]


def _t(*shape, dtype=torch.float32, device="cpu"):
    return torch.randn(*shape, dtype=dtype, device=device)


BAD = [
    (lambda: op(_t(1, 2, 3, 7), _t(1, 1, 3, 7), _t(3, 7), _t(3, 7)), "head_dim must be even"),
    (lambda: op(_t(1, 2, 3, 8), _t(2, 1, 3, 8), _t(3, 8), _t(3, 8)), "must agree in batch, seq and head_dim"),
    (lambda: op(_t(1, 2, 3, 8), _t(1, 1, 4, 8), _t(3, 8), _t(3, 8)), "must agree in batch, seq and head_dim"),
    (lambda: op(_t(1, 2, 3, 8), _t(1, 1, 3, 4), _t(3, 8), _t(3, 8)), "must agree in batch, seq and head_dim"),
    (lambda: op(_t(2, 3, 8), _t(2, 3, 8), _t(3, 8), _t(3, 8)), "must be 4-D"),
    (lambda: op(_t(1, 2, 3, 8), _t(1, 1, 3, 8), _t(4, 8), _t(4, 8)), "cos and sin must have shape"),
    (lambda: op(_t(2, 2, 3, 8), _t(2, 1, 3, 8), _t(3, 3, 8), _t(3, 3, 8)), "cos and sin must have shape"),
    (lambda: op(_t(1, 2, 3, 8), _t(1, 1, 3, 8), _t(3, 5), _t(3, 5)),
     "rope: the rotary width rot .* must be even with 0 < rot <= head_dim, got rot = 5 for head_dim = 8"),
    (lambda: op(_t(1, 2, 3, 8), _t(1, 1, 3, 8), _t(3, 10), _t(3, 10), 1, True), "got rot = 10 for head_dim = 8"),
    (lambda: op(_t(1, 2, 3, 8), _t(1, 1, 3, 8), _t(3, 0), _t(3, 0)), "got rot = 0 for head_dim = 8"),
    (lambda: op(_t(1, 2, 3, 8), _t(1, 1, 3, 8), _t(3, 8), _t(1, 3, 8)), "cos and sin must have the same shape"),
    (lambda: op(_t(1, 2, 3, 8), _t(1, 1, 3, 8), _t(3, 8), _t(3, 8), 3), "unsqueeze_dim must be 1"),
    (lambda: op(_t(1, 2, 3, 8), _t(1, 1, 3, 8, dtype=torch.float16), _t(3, 8), _t(3, 8)), "must have the same dtype"),
    (lambda: op(_t(1, 2, 3, 8), _t(1, 1, 3, 8), _t(3, 8), _t(3, 8, dtype=torch.float16)),
     "cos and sin must have the same dtype"),
    (lambda: op(torch.ones(1, 2, 3, 8, dtype=torch.int32), _t(1, 1, 3, 8), _t(3, 8), _t(3, 8)), "q must be float32"),
    (lambda: op(_t(1, 2, 3, 8), _t(1, 1, 3, 8), _t(3, 8, device="meta"), _t(3, 8)), "q is on cpu but cos is on meta"),
    (lambda: op(_t(1, 2, 3, 8).requires_grad_(), _t(1, 1, 3, 8), _t(3, 8).requires_grad_(), _t(3, 8)),
     "cos requires grad, but rope does not differentiate it; pass cos.detach"),
    (lambda: op(_t(1, 2, 3, 8), _t(1, 1, 3, 8), _t(3, 8), _t(3, 8).requires_grad_()), "sin requires grad"),
    (lambda: op_backward(_t(1, 2, 3, 7), _t(1, 1, 3, 7), _t(3, 7), _t(3, 7), 1), "rope_backward: head_dim"),
    (lambda: op_backward(_t(1, 2, 3, 8), _t(1, 1, 3, 8), _t(2, 8), _t(2, 8), 1), "rope_backward: cos and sin"),
    (lambda: op_backward(_t(1, 2, 3, 4), _t(1, 1, 3, 4), _t(3, 6), _t(3, 6), 1, True),
     "rope_backward: the rotary width rot .* got rot = 6 for head_dim = 4"),
]

CONTRACT = Contract(op=op, samples=samples, empty=empty, reference=hf, bad=BAD)


# ---------------------------------------------------------------- CPU and any device


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("unsqueeze_dim", [1, 2])
def test_matches_hf_forward_and_backward(device, dtype, unsqueeze_dim):
    qs, ks, q, k, cos, sin = qwen3_inputs(2, 33, 4, 2, 64, dtype, device, unsqueeze_dim)
    q_embed, k_embed = op(q, k, cos, sin, unsqueeze_dim)
    qs2, ks2 = qs.detach().clone().requires_grad_(), ks.detach().clone().requires_grad_()
    view = (lambda t: t.transpose(1, 2)) if unsqueeze_dim == 1 else (lambda t: t)
    rq, rk = HF_APPLY(view(qs2), view(ks2), cos, sin, unsqueeze_dim)
    assert_matches_hf(q_embed, rq, dtype)
    assert_matches_hf(k_embed, rk, dtype)
    gq, gk = torch.randn_like(q_embed), torch.randn_like(k_embed)
    (q_embed * gq).sum().add((k_embed * gk).sum()).backward()
    (rq * gq).sum().add((rk * gk).sum()).backward()
    assert_matches_hf(qs.grad, qs2.grad, dtype)
    assert_matches_hf(ks.grad, ks2.grad, dtype)
    # And the exact values: forward and gradient (the transposed rotation) in float64.
    q64, k64 = q.detach().double().requires_grad_(), k.detach().double().requires_grad_()
    eq, ek = f64_reference(q64, k64, cos, sin, unsqueeze_dim)
    rgq, rgk = torch.autograd.grad((eq, ek), (q64, k64), (gq.double(), gk.double()))
    tol = 4 * unit(dtype)
    assert rel_err(q_embed, eq) < tol and rel_err(k_embed, ek) < tol
    assert rel_err(view(qs.grad), rgq) < tol and rel_err(view(ks.grad), rgk) < tol


# (head_dim, rot, interleaved): Phi-4-mini's 96 of 128, GLM-4's 64 of 128 interleaved, an interleaved full
# head, and narrow ones (one pair; pairs that are not whole vectors, a tail that is).
MODES = [(128, 96, False), (128, 64, True), (64, 64, True), (16, 2, False), (20, 6, True)]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("unsqueeze_dim", [1, 2])
@pytest.mark.parametrize("mode", MODES, ids=lambda m: f"{m[1]}of{m[0]}{'-interleaved' if m[2] else ''}")
def test_partial_and_interleaved_match_hf(device, dtype, unsqueeze_dim, mode):
    dim, rot, interleaved = mode
    qs, ks, q, k, cos, sin = qwen3_inputs(2, 33, 4, 2, dim, dtype, device, unsqueeze_dim, rot=rot)
    q_embed, k_embed = op(q, k, cos, sin, unsqueeze_dim, interleaved)
    qs2, ks2 = qs.detach().clone().requires_grad_(), ks.detach().clone().requires_grad_()
    view = (lambda t: t.transpose(1, 2)) if unsqueeze_dim == 1 else (lambda t: t)
    rq, rk = hf_apply(interleaved)(view(qs2), view(ks2), cos, sin, unsqueeze_dim)
    assert_matches_hf(q_embed, rq, dtype)
    assert_matches_hf(k_embed, rk, dtype)
    # The elements past rot pass through as they are.
    assert torch.equal(q_embed[..., rot:], q[..., rot:]) and torch.equal(k_embed[..., rot:], k[..., rot:])
    gq, gk = torch.randn_like(q_embed), torch.randn_like(k_embed)
    torch.autograd.backward((q_embed, k_embed), (gq, gk))
    torch.autograd.backward((rq, rk), (gq, gk))
    assert_matches_hf(qs.grad, qs2.grad, dtype)
    assert_matches_hf(ks.grad, ks2.grad, dtype)
    assert torch.equal(view(qs.grad)[..., rot:], gq[..., rot:])
    q64, k64 = q.detach().double().requires_grad_(), k.detach().double().requires_grad_()
    eq, ek = f64_reference(q64, k64, cos, sin, unsqueeze_dim, interleaved)
    rgq, rgk = torch.autograd.grad((eq, ek), (q64, k64), (gq.double(), gk.double()))
    tol = 4 * unit(dtype)
    assert rel_err(q_embed, eq) < tol and rel_err(k_embed, ek) < tol
    assert rel_err(view(qs.grad), rgq) < tol and rel_err(view(ks.grad), rgk) < tol


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("interleaved", [False, True])
def test_partial_pass_through_is_promoted(device, interleaved):
    # bf16 q with fp32 tables: HF's torch.cat promotes the passed elements to fp32, and their gradient comes
    # back in bf16.
    qs, ks, q, k, cos, sin = qwen3_inputs(2, 9, 4, 2, 64, torch.bfloat16, device, rot=32)
    cos, sin = cos.float(), sin.float()
    out = op(q, k, cos, sin, 1, interleaved)
    qs2, ks2 = qs.detach().clone().requires_grad_(), ks.detach().clone().requires_grad_()
    ref = hf_apply(interleaved)(qs2.transpose(1, 2), ks2.transpose(1, 2), cos, sin)
    for a, b in zip(out, ref):
        assert_matches_hf(a, b, torch.float32)
    assert torch.equal(out[0][..., 32:], q[..., 32:].float())
    g = [torch.randn_like(o) for o in out]
    torch.autograd.backward(out, g)
    torch.autograd.backward(ref, g)
    assert qs.grad.dtype == torch.bfloat16
    assert torch.equal(qs.grad[..., 32:], qs2.grad[..., 32:])
    tol = 2 * unit(torch.bfloat16)
    assert rel_err(qs.grad, qs2.grad) < tol and rel_err(ks.grad, ks2.grad) < tol


def test_interleaved_pairs_use_the_tables_first_half():
    # GLM-4 reads cos[:rot // 2] and sin[:rot // 2] only: the second half of the tables changes nothing.
    _, _, q, k, cos, sin = qwen3_inputs(2, 5, 4, 2, 16, torch.float32, "cpu", rot=8)
    out = op(q, k, cos, sin, 1, True)
    other = [torch.cat([t[..., :4], torch.randn_like(t[..., 4:])], -1) for t in (cos, sin)]
    for a, b in zip(out, op(q, k, *other, 1, True)):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    # And the pairing differs from rotate_half's.
    assert not torch.allclose(out[0], op(q, k, cos, sin, 1, False)[0])


def test_partial_tables_are_rope_only():
    # qk_norm_rope keeps requiring tables as wide as a head.
    q, k = torch.randn(2, 3, 4, 8), torch.randn(2, 3, 2, 8)
    with pytest.raises(RuntimeError, match="qk_norm_rope: cos and sin must have shape \\[seq, head_dim\\]"):
        torch.ops.bastile.qk_norm_rope(q, k, torch.ones(8), torch.ones(8), torch.randn(3, 4), torch.randn(3, 4), 1e-6)


@pytest.mark.parametrize("device", DEVICES)
def test_outputs_keep_the_dense_layout_of_inputs(device):
    _, _, q, k, cos, sin = qwen3_inputs(2, 7, 4, 2, 32, torch.float32, device)
    q_embed, k_embed = op(q, k, cos, sin)
    assert not q.is_contiguous()
    assert q_embed.stride() == torch.empty_like(q).stride() and k_embed.stride() == torch.empty_like(k).stride()
    rq, rk = HF_APPLY(q, k, cos, sin)
    torch.testing.assert_close(q_embed, rq, rtol=0, atol=0)
    torch.testing.assert_close(k_embed, rk, rtol=0, atol=0)
    # Slices of a fused qkv projection are not dense: results come out contiguous, values unchanged.
    qkv = torch.randn(2, 7, (4 + 2 + 2) * 32, device=device)
    q = qkv[..., : 4 * 32].view(2, 7, 4, 32).transpose(1, 2)
    k = qkv[..., 4 * 32: 6 * 32].view(2, 7, 2, 32).transpose(1, 2)
    q_embed, k_embed = op(q, k, cos, sin)
    assert q_embed.is_contiguous() and k_embed.is_contiguous()
    rq, rk = HF_APPLY(q, k, cos, sin)
    torch.testing.assert_close(q_embed, rq, rtol=0, atol=0)
    torch.testing.assert_close(k_embed, rk, rtol=0, atol=0)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("table_shape", ["1SD", "SD", "BSD"])
@pytest.mark.parametrize("unsqueeze_dim", [1, 2])
def test_table_broadcasts(device, table_shape, unsqueeze_dim):
    _, _, q, k, cos, sin = qwen3_inputs(3, 9, 2, 2, 16, torch.float32, device, unsqueeze_dim)
    if table_shape == "1SD":
        cos, sin = cos[1:2], sin[1:2]
    full_cos, full_sin = cos.expand(3, -1, -1), sin.expand(3, -1, -1)
    if table_shape == "SD":
        cos, sin = cos[1], sin[1]
        full_cos, full_sin = cos.expand(3, -1, -1), sin.expand(3, -1, -1)
    out = op(q, k, cos, sin, unsqueeze_dim)
    ref = HF_APPLY(q, k, full_cos, full_sin, unsqueeze_dim)
    for a, b in zip(out, ref):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


@pytest.mark.parametrize("device", DEVICES)
def test_packed_sequences_use_each_rows_positions(device):
    # Positions restart inside a row and differ between rows: each batch row needs its own cos/sin.
    qs, ks, q, k, cos, sin = qwen3_inputs(3, 40, 4, 2, 64, torch.float32, device, packed=True)
    assert not torch.equal(cos[0], cos[1])
    out = op(q, k, cos, sin)
    for a, b in zip(out, HF_APPLY(q, k, cos, sin)):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    # Using row 0's table for every row would be wrong: the test can tell.
    wrong = op(q, k, cos[:1], sin[:1])
    assert not torch.allclose(wrong[0], out[0])


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dim", [2, 64, 72, 128, 256])
@pytest.mark.parametrize("heads", [(16, 8), (32, 8), (1, 1), (3, 0)])
def test_head_dims_and_gqa(device, dim, heads):
    q_heads, k_heads = heads
    qs, ks, q, k, cos, sin = qwen3_inputs(2, 6, q_heads, k_heads, dim, torch.bfloat16, device)
    out = op(q, k, cos, sin)
    for a, b in zip(out, HF_APPLY(q, k, cos, sin)):
        assert_matches_hf(a, b, torch.bfloat16)
    gq, gk = torch.randn_like(out[0]), torch.randn_like(out[1])
    torch.autograd.backward(out, (gq, gk))
    qs2, ks2 = qs.detach().clone().requires_grad_(), ks.detach().clone().requires_grad_()
    torch.autograd.backward(HF_APPLY(qs2.transpose(1, 2), ks2.transpose(1, 2), cos, sin), (gq, gk))
    assert_matches_hf(qs.grad, qs2.grad, torch.bfloat16)
    assert_matches_hf(ks.grad, ks2.grad, torch.bfloat16)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("q_dtype,cs_dtype", [(torch.bfloat16, torch.float32), (torch.float32, torch.bfloat16),
                                              (torch.float16, torch.bfloat16)])
def test_mixed_dtypes_follow_promotion(device, q_dtype, cs_dtype):
    qs, ks, q, k, cos, sin = qwen3_inputs(2, 11, 4, 2, 32, q_dtype, device)
    cos, sin = cos.to(cs_dtype), sin.to(cs_dtype)
    out = op(q, k, cos, sin)
    qs2, ks2 = qs.detach().clone().requires_grad_(), ks.detach().clone().requires_grad_()
    ref = HF_APPLY(qs2.transpose(1, 2), ks2.transpose(1, 2), cos, sin)
    r_dtype = torch.promote_types(q_dtype, cs_dtype)
    for a, b in zip(out, ref):
        assert_matches_hf(a, b, r_dtype)
    g = [torch.randn_like(o) for o in out]
    torch.autograd.backward(out, g)
    torch.autograd.backward(ref, g)
    assert qs.grad.dtype == q_dtype
    # HF rounds each term of the gradient to q's dtype before summing, we round the sum once.
    assert rel_err(qs.grad, qs2.grad) < 2 * unit(q_dtype) and rel_err(ks.grad, ks2.grad) < 2 * unit(q_dtype)


@pytest.mark.parametrize("device", DEVICES)
def test_autocast_leaves_dtypes_as_hf(device):
    _, _, q, k, cos, sin = qwen3_inputs(2, 5, 2, 1, 16, torch.bfloat16, device)
    with torch.autocast(device, dtype=torch.bfloat16):
        out = op(q, k, cos.float(), sin.float())
        ref = HF_APPLY(q, k, cos.float(), sin.float())
    assert out[0].dtype == ref[0].dtype == torch.float32
    for a, b in zip(out, ref):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


@pytest.mark.parametrize("device", DEVICES)
def test_gradients_of_unused_outputs_and_reductions(device):
    qs, ks, q, k, cos, sin = qwen3_inputs(2, 5, 4, 2, 16, torch.float32, device)
    q_embed, k_embed = op(q, k, cos, sin)
    # sum() hands backward expanded (stride-0) gradients; k_embed's gradient is never given.
    q_embed.sum().backward()
    qs2, ks2 = qs.detach().clone().requires_grad_(), ks.detach().clone().requires_grad_()
    HF_APPLY(qs2.transpose(1, 2), ks2.transpose(1, 2), cos, sin)[0].sum().backward()
    torch.testing.assert_close(qs.grad, qs2.grad, rtol=0, atol=0)
    assert ks.grad is None or not ks.grad.any()
    # An output requires grad only where its input does, as HF's.
    qe, ke = op(q.detach().requires_grad_(), k.detach(), cos, sin)
    assert qe.requires_grad and not ke.requires_grad


def test_cos_requiring_grad_is_accepted_under_no_grad():
    # In grad mode it is refused (CONTRACT.bad); under no_grad nothing is differentiated.
    _, _, q, k, cos, sin = qwen3_inputs(2, 5, 4, 2, 16, torch.float32, "cpu")
    with torch.no_grad():
        out = op(q, k, cos.clone().requires_grad_(), sin)
    for a, b in zip(out, op(q.detach(), k.detach(), cos, sin)):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


def test_functional_mirrors_hf_signature():
    _, _, q, k, cos, sin = qwen3_inputs(2, 5, 4, 2, 16, torch.float32, "cpu")
    for a, b in zip(bastile.rope(q, k, cos, sin), HF_APPLY(q, k, cos, sin)):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    qt, kt = q.transpose(1, 2), k.transpose(1, 2)
    out = bastile.rope(qt, kt, cos, sin, 2, position_ids=torch.arange(5)[None])
    for a, b in zip(out, HF_APPLY(qt, kt, cos, sin, unsqueeze_dim=2)):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


# ---------------------------------------------------------------- CUDA against the CPU reference

# (batch, seq, q_heads, k_heads, head_dim, rot, interleaved): Qwen3-0.6B/1.7B (16/8), 4B/8B (32/8), 14B+
# (40/8) and a wide head; Phi-4-mini (24/8, 96 of 128 rotated), GLM-4-9B (32/2, 64 of 128, interleaved), an
# interleaved full head and a partial interleaved 64. The CPU kernel rounds exactly as the GPU does, so
# results must be bitwise equal.
REAL = [(2, 1024, 16, 8, 128, 128, False), (1, 2048, 32, 8, 128, 128, False), (1, 512, 40, 8, 128, 128, False),
        (2, 256, 16, 8, 256, 256, False), (3, 300, 14, 2, 64, 64, False), (2, 512, 24, 8, 128, 96, False),
        (1, 1024, 32, 2, 128, 64, True), (2, 256, 16, 8, 128, 128, True), (3, 100, 14, 2, 64, 32, True)]


@needs_cuda
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("shape", REAL)
def test_cuda_matches_cpu_at_real_shapes(dtype, shape):
    b, s, hq, hk, d, rot, interleaved = shape
    qs, ks, q, k, cos, sin = qwen3_inputs(b, s, hq, hk, d, dtype, "cpu", rot=rot)
    q, k = q.detach(), k.detach()
    gq, gk = torch.randn(q.shape).to(dtype), torch.randn(k.shape).to(dtype)
    ref = op(q, k, cos, sin, 1, interleaved)
    ref_grad = op_backward(gq, gk, cos, sin, 1, interleaved)
    dev = [t.cuda() for t in (qs.detach(), ks.detach(), cos, sin, gq, gk)]
    qc, kc = dev[0].transpose(1, 2), dev[1].transpose(1, 2)
    poison_cuda_allocator(8 * (q.numel() + k.numel()) * 4)
    out = op(qc, kc, dev[2], dev[3], 1, interleaved)
    poison_cuda_allocator(8 * (q.numel() + k.numel()) * 4)
    grad = op_backward(dev[4], dev[5], dev[2], dev[3], 1, interleaved)
    for got, want in zip((*out, *grad), (*ref, *ref_grad)):
        assert not got.isnan().any()
        assert got.stride() == want.stride()
        assert torch.equal(got.cpu(), want), f"max diff {(got.cpu().double() - want.double()).abs().max()}"
    # And against HF on the GPU, forward and autograd.
    qs2, ks2 = dev[0].clone().requires_grad_(), dev[1].clone().requires_grad_()
    hq_, hk_ = hf_apply(interleaved)(qs2.transpose(1, 2), ks2.transpose(1, 2), dev[2], dev[3])
    assert_matches_hf(out[0], hq_, dtype)
    assert_matches_hf(out[1], hk_, dtype)
    torch.autograd.backward((hq_, hk_), (dev[4], dev[5]))
    assert_matches_hf(grad[0], qs2.grad.transpose(1, 2), dtype)
    assert_matches_hf(grad[1], ks2.grad.transpose(1, 2), dtype)


@needs_cuda
@pytest.mark.parametrize("unsqueeze_dim", [1, 2])
@pytest.mark.parametrize("table", ["BSD", "1SD", "SD"])
@pytest.mark.parametrize("rot,interleaved", [(128, False), (64, True)])
def test_cuda_layouts_match_cpu(unsqueeze_dim, table, rot, interleaved):
    qs, ks, q, k, cos, sin = qwen3_inputs(3, 77, 8, 2, 128, torch.bfloat16, "cpu", unsqueeze_dim, rot=rot)
    q, k = q.detach(), k.detach()
    if table != "BSD":
        cos, sin = cos[2:], sin[2:]
    if table == "SD":
        cos, sin = cos[0], sin[0]
    ref = op(q, k, cos, sin, unsqueeze_dim, interleaved)
    out = op(q.cuda(), k.cuda(), cos.cuda(), sin.cuda(), unsqueeze_dim, interleaved)
    for got, want in zip(out, ref):
        assert torch.equal(got.cpu(), want)


def misaligned_views(dim, offset, device, rot=None):
    """q at a storage offset, k and cos at odd token strides (slices of wider rows), cos and sin rot wide
    (default dim). Built from storage on `device` itself: .to(device) would realign them."""
    rot = rot or dim
    g = torch.Generator().manual_seed(dim + offset)
    raw = [torch.randn(n, generator=g, dtype=torch.float32).to(device, torch.bfloat16)
           for n in (2 * 9 * 5 * dim + offset, 2 * 9 * (3 * dim + 2 * offset), 2 * 9 * (dim + offset), 2 * 9 * dim)]
    q = raw[0][offset:].view(2, 9, 5, dim).transpose(1, 2)
    k = raw[1].view(2, 9, 3 * dim + 2 * offset)[..., 2 * offset:].view(2, 9, 3, dim).transpose(1, 2)
    cos = raw[2].view(2, 9, dim + offset)[..., offset:offset + rot]
    sin = raw[3].view(2, 9, dim)[..., :rot]
    return q, k, cos, sin


@needs_cuda
@pytest.mark.parametrize("dim,offset,rot,interleaved", [
    (128, 1, 128, False), (128, 2, 128, False), (72, 0, 72, False), (72, 2, 72, False), (2, 0, 2, False),
    (256, 4, 256, False), (128, 0, 120, True), (128, 0, 124, False), (128, 2, 96, True), (72, 0, 36, True)])
def test_cuda_misaligned_views_fall_back_correctly(dim, offset, rot, interleaved):
    # Vector widths 1, 2 and 4 (the aligned tests use 8), from offsets, strides, half a head of 36, and
    # partial tables whose pairs (60, 18) are not whole vectors of 8 or passed elements (4, 36) whole
    # items of two.
    q, k, cos, sin = misaligned_views(dim, offset, "cpu", rot)
    qc, kc, cc, sc = misaligned_views(dim, offset, "cuda", rot)
    assert torch.equal(qc.cpu(), q) and qc.data_ptr() % 16 == (2 * offset) % 16
    ref = op(q, k, cos, sin, 1, interleaved)
    ref_grad = op_backward(ref[0], ref[1], cos, sin, 1, interleaved)
    out = op(qc, kc, cc, sc, 1, interleaved)
    grad = op_backward(out[0], out[1], cc, sc, 1, interleaved)
    for got, want in zip((*out, *grad), (*ref, *ref_grad)):
        assert torch.equal(got.cpu(), want)


@needs_cuda
@pytest.mark.parametrize("rot,interleaved", [(128, False), (64, True)])
def test_cuda_fwd_bwd_matches_hf_autograd_with_compile(rot, interleaved):
    qs, ks, q, k, cos, sin = qwen3_inputs(2, 256, 16, 8, 128, torch.bfloat16, "cuda", rot=rot)
    f = torch.compile(lambda q, k: op(q, k, cos, sin, 1, interleaved), fullgraph=True, dynamic=True)
    out = f(q, k)
    g = [torch.randn_like(o) for o in out]
    torch.autograd.backward(out, g)
    qs2, ks2 = qs.detach().clone().requires_grad_(), ks.detach().clone().requires_grad_()
    ref = hf_apply(interleaved)(qs2.transpose(1, 2), ks2.transpose(1, 2), cos, sin)
    torch.autograd.backward(ref, g)
    for a, b in zip((*out, qs.grad, ks.grad), (*ref, qs2.grad, ks2.grad)):
        assert_matches_hf(a, b, torch.bfloat16)


@needs_cuda
def test_cuda_offsets_beyond_int32():
    # q's storage [1, seq, 8, 128] holds 2^31 + 2^20 bf16 elements: the last tokens' offsets pass 2^31.
    seq, hq, hk, d = 2 ** 21 + 1024, 8, 1, 128
    # q, k, outputs, gradients and tables, plus HF's f32 intermediates while it builds the tables.
    need = (3 * seq * (hq + hk) * d + 2 * seq * d) * 2 + 6 * seq * d * 4 + (1 << 30)
    if torch.cuda.mem_get_info()[0] < need:
        pytest.skip(f"needs {need / 2 ** 30:.1f} GiB of free GPU memory")
    qs = torch.randn(1, seq, hq, d, device="cuda", dtype=torch.bfloat16)
    assert qs.numel() > 2 ** 31
    ks = torch.randn(1, seq, hk, d, device="cuda", dtype=torch.bfloat16)
    pos = torch.arange(seq, device="cuda")[None]
    cos, sin = rotary_tables(pos, d, torch.bfloat16, "cuda")
    q_embed, k_embed = op(qs.transpose(1, 2), ks.transpose(1, 2), cos, sin)
    gq, gk = op_backward(q_embed, k_embed, cos, sin, 1)
    tail = slice(seq - 8, seq)
    cpu = [t[:, tail].cpu() for t in (qs, ks, cos, sin)]
    ref = op(cpu[0].transpose(1, 2), cpu[1].transpose(1, 2), cpu[2], cpu[3])
    ref_grad = op_backward(ref[0], ref[1], cpu[2], cpu[3], 1)
    for got, want in zip((q_embed, k_embed, gq, gk), (*ref, *ref_grad)):
        assert torch.equal(got[:, :, tail].cpu(), want)
    # The rotation is orthogonal when cos^2 + sin^2 = 1: the backward undoes the forward everywhere.
    assert rel_err(gq[:, :, ::4096], qs.transpose(1, 2)[:, :, ::4096]) < 2 ** -6
