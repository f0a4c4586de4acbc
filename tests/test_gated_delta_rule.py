"""torch.ops.bastile.gated_delta_rule against the recurrence in plain torch (float64) and HF's own
torch_chunk_gated_delta_rule / torch_recurrent_gated_delta_rule.

The CPU kernels run the recurrence in float64 and round each result once, so they match the float64
recurrence to float64's roundoff; the CUDA kernels (chunks, float32) are checked against the CPU kernels'
float64 results on the same inputs.
"""
import pytest
import torch
import torch.nn.functional as F
from transformers.models.qwen3_5.modeling_qwen3_5 import torch_chunk_gated_delta_rule, torch_recurrent_gated_delta_rule

import bastile  # noqa: F401  (loads the ops)
from conftest import Contract, needs_cuda, poison_cuda_allocator, rel_err

op = torch.ops.bastile.gated_delta_rule
forward_op = torch.ops.bastile.gated_delta_rule_forward
backward_op = torch.ops.bastile.gated_delta_rule_backward
L2_EPS = 1e-6


def state_dtype(dtype):
    return torch.float64 if dtype == torch.float64 else torch.float32


def recurrence(q, k, v, g, beta, scale, initial_state=None, cu_seqlens=None, l2norm_qk=False):
    """The gated delta rule token by token, in float64: o in v's dtype, the final state in f32 (f64 for f64)."""
    batch, tokens, k_heads, _ = q.shape
    v_heads, v_dim = v.shape[2:]
    rep = v_heads // k_heads if k_heads else 1
    qf, kf = (x.double().repeat_interleave(rep, 2) for x in (q, k))
    if l2norm_qk:
        qf, kf = (x * torch.rsqrt((x * x).sum(-1, keepdim=True) + L2_EPS) for x in (qf, kf))
    qf = qf * scale
    if cu_seqlens is None:
        spans = [(b, 0, tokens) for b in range(batch)]
    else:
        cu = cu_seqlens.tolist()
        spans = [(0, cu[n], cu[n + 1]) for n in range(len(cu) - 1)]
    o = torch.zeros(batch, tokens, v_heads, v_dim, dtype=torch.float64, device=q.device)
    finals = []
    for n, (b, start, end) in enumerate(spans):
        s = (initial_state[n].double() if initial_state is not None
             else torch.zeros(v_heads, q.shape[3], v_dim, dtype=torch.float64, device=q.device))
        for t in range(start, end):
            s = s * g[b, t].double().exp()[:, None, None]
            p = torch.einsum("hk,hkv->hv", kf[b, t], s)
            delta = beta[b, t].double()[:, None] * (v[b, t].double() - p)
            s = s + kf[b, t][:, :, None] * delta[:, None, :]
            o[b, t] = torch.einsum("hk,hkv->hv", qf[b, t], s)
        finals.append(s)
    if finals:
        final = torch.stack(finals)
    else:  # no sequence
        final = (initial_state.double() if initial_state is not None
                 else torch.zeros(0, v_heads, q.shape[3], v_dim, dtype=torch.float64, device=q.device))
    if o.numel() == 0:  # no token: o is still a function of every input (their gradients are empty)
        o = o + 0 * sum(x.double().sum() for x in (q, k, v, g, beta))
    return o.to(v.dtype), final.to(state_dtype(q.dtype))


def saved(q, k, v, g, beta, initial_state, cu_seqlens, l2norm_qk, chunk, width):
    """What gated_delta_rule_forward keeps for the backward, from the recurrence in float64: each chunk's starting
    state and each token's v' = beta (v - a S^T k), by slot (packed: start / chunk + n, else n * ceil(T / chunk)
    + t / chunk), value head and slice of `width` columns of V, zeros past V; and which slots hold a chunk."""
    batch, tokens, k_heads, k_dim = q.shape
    v_heads, v_dim = v.shape[2:]
    rep = v_heads // k_heads
    kf = k.double().repeat_interleave(rep, 2)
    if l2norm_qk:
        kf = kf * torch.rsqrt((kf * kf).sum(-1, keepdim=True) + L2_EPS)
    if cu_seqlens is None:
        spans = [(b, 0, tokens) for b in range(batch)]
        slots = batch * -(-tokens // chunk)
    else:
        cu = cu_seqlens.tolist()
        spans = [(0, cu[n], cu[n + 1]) for n in range(len(cu) - 1)]
        slots = tokens // chunk + len(spans)
    slices = -(-v_dim // width)
    states = torch.zeros(slots, v_heads, k_dim, slices * width, dtype=torch.float64)
    v_new = torch.zeros(slots, v_heads, chunk, slices * width, dtype=torch.float64)
    used = torch.zeros(slots, dtype=torch.bool)
    for n, (b, start, end) in enumerate(spans):
        s = (initial_state[n].double().cpu() if initial_state is not None
             else torch.zeros(v_heads, k_dim, v_dim, dtype=torch.float64))
        for t in range(start, end):
            i = t - start
            slot = (start + i // chunk * chunk) // chunk + n if cu_seqlens is not None else n * (slots // batch) + i // chunk
            used[slot] = True
            if i % chunk == 0:
                states[slot, :, :, :v_dim] = s
            s = s * g[b, t].double().cpu().exp()[:, None, None]
            delta = beta[b, t].double().cpu()[:, None] * (v[b, t].double().cpu() - torch.einsum("hk,hkv->hv", kf[b, t].cpu(), s))
            v_new[slot, :, i % chunk, :v_dim] = delta
            s = s + kf[b, t].cpu()[:, :, None] * delta[:, None, :]
    by_slice = lambda x: x.unflatten(-1, (slices, width)).movedim(-2, 2)
    return by_slice(states), by_slice(v_new), used


def inputs(batch, tokens, k_heads, rep, k_dim, v_dim, dtype=torch.float32, device="cpu", initial=True, seed=0,
           sequences=None):
    """q, k, v, g (decays in log space, <= 0), beta in (0, 1) and an initial state (or None)."""
    gen = torch.Generator().manual_seed(seed)
    v_heads = k_heads * rep
    r = lambda *s: torch.randn(*s, generator=gen, dtype=torch.float64)
    q, k = r(batch, tokens, k_heads, k_dim), r(batch, tokens, k_heads, k_dim)
    v = r(batch, tokens, v_heads, v_dim)
    g = -F.softplus(r(batch, tokens, v_heads)) * 0.7
    beta = torch.sigmoid(r(batch, tokens, v_heads))
    n = batch if sequences is None else sequences
    h0 = r(n, v_heads, k_dim, v_dim) * 0.5 if initial else None
    cast = lambda x, dt: None if x is None else x.to(device=device, dtype=dt)
    return (cast(q, dtype), cast(k, dtype), cast(v, dtype), cast(g, torch.float32 if dtype != torch.float64 else dtype),
            cast(beta, dtype), cast(h0, state_dtype(dtype)))


def leaves(*ts):
    return [None if t is None else t.detach().clone().requires_grad_() for t in ts]


def sample(device, batch, tokens, k_heads, rep, k_dim, v_dim, initial=True, l2norm=True, cu=None, seed=0):
    n = None if cu is None else len(cu) - 1
    q, k, v, g, beta, h0 = leaves(*inputs(batch, tokens, k_heads, rep, k_dim, v_dim, device=device, initial=initial,
                                          seed=seed, sequences=n))
    cu_t = None if cu is None else torch.tensor(cu, dtype=torch.int32, device=device)
    return (q, k, v, g, beta, k_dim ** -0.5, h0, cu_t, l2norm), {}


def samples(device):
    return [sample(device, 2, 5, 1, 2, 4, 3), sample(device, 2, 7, 1, 2, 4, 3, seed=1),
            sample(device, 2, 6, 2, 1, 5, 4, initial=False, l2norm=False, seed=2),
            sample(device, 1, 9, 1, 2, 4, 3, cu=[0, 3, 3, 9], seed=3)]


def empty(device):
    return [sample(device, 2, 0, 1, 2, 4, 3), sample(device, 0, 3, 1, 2, 4, 3),
            sample(device, 1, 0, 1, 2, 4, 3, cu=[0, 0], initial=False)]


def _bad(**kw):
    q, k, v, g, beta, h0 = inputs(2, 3, 1, 2, 4, 3)
    args = dict(q=q, k=k, v=v, g=g, beta=beta, scale=0.5, initial_state=h0, cu_seqlens=None, l2norm_qk=True)
    args.update(kw)
    return lambda: op(**args)


def _saved():
    """The states and v' gated_delta_rule_forward keeps for _bad's inputs."""
    return forward_op(*inputs(2, 3, 1, 2, 4, 3)[:5], 0.5)[2:]


BAD = [
    (_bad(q=torch.randn(2, 3, 4)), "must be \\[batch, tokens, heads, head_dim\\]"),
    (_bad(k=torch.randn(2, 3, 1, 5)), "q and k must have the same shape"),
    (_bad(q=torch.randn(2, 3, 2, 4), k=torch.randn(2, 3, 2, 4), v=torch.randn(2, 3, 3, 3), g=torch.randn(2, 3, 3),
          beta=torch.rand(2, 3, 3), initial_state=None), "must be a multiple of"),
    (_bad(v=torch.randn(2, 4, 2, 3)), "must agree in batch and tokens"),
    (_bad(g=torch.randn(2, 3, 1)), "g and beta must be \\[batch, tokens, v_heads\\]"),
    (_bad(initial_state=torch.zeros(2, 2, 4, 4)), "initial_state must be \\[sequences, v_heads, K, V\\]"),
    (_bad(cu_seqlens=torch.tensor([0, 3], dtype=torch.int32)), "batch must be 1"),
    (_bad(v=torch.randn(2, 3, 2, 3, dtype=torch.float64)), "q and v must have the same dtype"),
    (_bad(q=torch.randint(0, 3, (2, 3, 1, 4)), k=torch.randint(0, 3, (2, 3, 1, 4))), "q must be float32"),
    (_bad(beta=torch.rand(2, 3, 2, device="meta")), "q is on cpu but beta is on meta"),
    (lambda: op(*inputs(1, 4, 1, 2, 4, 3, initial=False)[:5], 0.5, None, torch.tensor([0.0, 4.0])),
     "cu_seqlens must be a 1-d int32 or int64"),
    (lambda: op(*inputs(1, 4, 1, 2, 4, 3, initial=False)[:5], 0.5, None, torch.tensor([0, 3, 2, 4])),
     "cu_seqlens must rise from 0 to the 4 tokens"),
    (lambda: op(*inputs(1, 4, 1, 2, 4, 3, initial=False)[:5], 0.5, None, torch.tensor([0, 3])),
     "cu_seqlens must rise from 0 to the 4 tokens"),
    (lambda: backward_op(torch.zeros(2, 3, 2, 4), None, *inputs(2, 3, 1, 2, 4, 3)[:5], *_saved(), 0.5),
     "grad_o and v must have the same shape"),
    (lambda: backward_op(torch.zeros(2, 3, 2, 3), torch.zeros(2, 2, 4, 4), *inputs(2, 3, 1, 2, 4, 3)[:5], *_saved(),
                         0.5),
     "grad_final_state must have the final state's shape"),
    (lambda: backward_op(torch.zeros(2, 3, 2, 3), None, *inputs(2, 3, 1, 2, 4, 3)[:5], _saved()[1], _saved()[1], 0.5),
     "states and v_new must be what gated_delta_rule_forward returned"),
    (lambda: backward_op(torch.zeros(2, 3, 2, 3), None, *inputs(2, 3, 1, 2, 4, 3)[:5],
                         *(t.double() for t in _saved()), 0.5),
     "states and v_new must be what gated_delta_rule_forward returned"),
]

CONTRACT = Contract(op=op, samples=samples, empty=empty, reference=recurrence, bad=BAD)


def both(fn, args, grad_o, grad_final):
    """(o, final state) and the gradients of every input that requires grad, through autograd."""
    args = [a.detach().clone().requires_grad_() if isinstance(a, torch.Tensor) and a.is_floating_point() else a
            for a in args]
    o, final = fn(*args)
    wrt = [a for a in args if isinstance(a, torch.Tensor) and a.requires_grad]
    grads = torch.autograd.grad((o.double() * grad_o.double()).sum() + (final.double() * grad_final.double()).sum(), wrt)
    return (o.detach(), final.detach()), grads


def cotangents(v, v_heads, k_dim, sequences, seed=7):
    gen = torch.Generator().manual_seed(seed)
    return (torch.randn(v.shape, generator=gen, dtype=torch.float64).to(v),
            torch.randn(sequences, v_heads, k_dim, v.shape[-1], generator=gen, dtype=torch.float64).to(v.device))


def assert_close_all(got, want, tol):
    (go, gf), gg = got
    (wo, wf), wg = want
    assert rel_err(go, wo) <= tol and rel_err(gf, wf) <= tol
    for a, b in zip(gg, wg):
        assert rel_err(a, b) <= tol, (rel_err(a, b), tol)


# ---------------------------------------------------------------- CPU


@pytest.mark.parametrize("l2norm", [True, False])
@pytest.mark.parametrize("rep", [1, 3])
def test_cpu_float64_equals_the_recurrence(l2norm, rep):
    """Values and every gradient (q, k, v, g, beta, the initial state) to float64 roundoff, over several replay
    stretches (the backward keeps a state every 64 tokens)."""
    q, k, v, g, beta, h0 = inputs(2, 150, 2, rep, 6, 5, dtype=torch.float64, seed=rep)
    full = (q, k, v, g, beta, 0.4, h0, None, l2norm)
    grad_o, grad_final = cotangents(v, 2 * rep, 6, 2)
    assert_close_all(both(op, full, grad_o, grad_final), both(recurrence, full, grad_o, grad_final), 1e-12)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_cpu_rounds_once(dtype):
    """In 16 and 32 bits the CPU computes in float64 and rounds each output once: o within half a unit (plus
    float64 noise) of the exact value on the same inputs."""
    q, k, v, g, beta, h0 = inputs(2, 40, 1, 2, 8, 6, dtype=dtype)
    o, final = op(q, k, v, g, beta, 8 ** -0.5, h0, None, True)
    eo, ef = recurrence(q.double(), k.double(), v.double(), g.double(), beta.double(), 8 ** -0.5, h0.double(), None, True)
    assert o.dtype == dtype and final.dtype == torch.float32
    fi = torch.finfo(dtype)
    spacing = fi.eps * torch.exp2(torch.floor(torch.log2(eo.abs().clamp_min(fi.smallest_normal))))
    assert ((o.double() - eo).abs() <= 0.5001 * spacing).all()
    assert rel_err(final, ef) <= 2 ** -23


def hf(fn, q, k, v, g, beta, scale, initial_state, output_final=True):
    """HF's function on its own layout (q and k repeated to v's heads), with the op's scale (HF scales by
    K^-0.5: o is linear in the scaled q)."""
    rep = v.shape[2] // q.shape[2]
    q, k = q.repeat_interleave(rep, 2), k.repeat_interleave(rep, 2)
    o, final = fn(q, k, v, g=g, beta=beta, initial_state=initial_state, output_final_state=output_final,
                  use_qk_l2norm_in_kernel=True)
    return o * (scale * q.shape[-1] ** 0.5), final


@pytest.mark.parametrize("fn", [torch_chunk_gated_delta_rule, torch_recurrent_gated_delta_rule])
def test_cpu_float32_matches_hf(fn):
    """HF's chunked and recurrent functions (float32 arithmetic): values and gradients within float32 noise."""
    q, k, v, g, beta, h0 = inputs(2, 100, 2, 2, 16, 12)
    grad_o, grad_final = cotangents(v, 4, 16, 2)
    scale = 16 ** -0.5
    ours = both(lambda *a: op(*a, True), (q, k, v, g, beta, scale, h0, None), grad_o, grad_final)
    theirs = both(lambda *a: hf(fn, *a), (q, k, v, g, beta, scale, h0), grad_o, grad_final)
    exact = both(recurrence, (q.double(), k.double(), v.double(), g.double(), beta.double(), scale, h0.double(), None,
                              True), grad_o, grad_final)
    assert_close_all(ours, theirs, 2e-5)
    # At least as close to the exact values as HF is.
    assert rel_err(ours[0][0], exact[0][0]) <= max(rel_err(theirs[0][0], exact[0][0]), 1e-7)


def test_cpu_packed_equals_sequences_alone():
    """With cu_seqlens every sequence (an empty one too) starts from its own state: outputs, final states and
    gradients are those of each sequence run alone."""
    cu = [0, 5, 5, 6, 40, 71]
    q, k, v, g, beta, h0 = inputs(1, 71, 1, 2, 4, 3, sequences=len(cu) - 1, dtype=torch.float64)
    grad_o, grad_final = cotangents(v, 2, 4, len(cu) - 1)
    packed = both(op, (q, k, v, g, beta, 0.5, h0, torch.tensor(cu), True), grad_o, grad_final)
    for n in range(len(cu) - 1):
        s = slice(cu[n], cu[n + 1])
        alone = both(op, (q[:, s], k[:, s], v[:, s], g[:, s], beta[:, s], 0.5, h0[n:n + 1], None, True),
                     grad_o[:, s], grad_final[n:n + 1])
        (o, f), (dq, dk, dv, dg, db, dh) = alone
        (po, pf), (pdq, pdk, pdv, pdg, pdb, pdh) = packed
        for a, b in [(o, po[:, s]), (f, pf[n:n + 1]), (dq, pdq[:, s]), (dk, pdk[:, s]), (dv, pdv[:, s]),
                     (dg, pdg[:, s]), (db, pdb[:, s]), (dh, pdh[n:n + 1])]:
            torch.testing.assert_close(a, b, rtol=0, atol=0)


def test_cpu_shared_key_heads_equal_repeated_ones():
    """Value heads reading one key head: the same values as q and k repeated, and their gradients summed."""
    q, k, v, g, beta, h0 = inputs(2, 20, 2, 3, 4, 5, dtype=torch.float64)
    grad_o, grad_final = cotangents(v, 6, 4, 2)
    (o, f), (dq, dk, *rest) = both(op, (q, k, v, g, beta, 0.5, h0, None, True), grad_o, grad_final)
    rq, rk = leaves(q.repeat_interleave(3, 2), k.repeat_interleave(3, 2))
    ro, rf = op(rq, rk, v, g, beta, 0.5, h0, None, True)
    rdq, rdk = torch.autograd.grad((ro * grad_o).sum() + (rf * grad_final).sum(), [rq, rk])
    torch.testing.assert_close(o, ro.detach(), rtol=0, atol=0)
    torch.testing.assert_close(dq, rdq.unflatten(2, (2, 3)).sum(3), rtol=1e-13, atol=1e-13)
    torch.testing.assert_close(dk, rdk.unflatten(2, (2, 3)).sum(3), rtol=1e-13, atol=1e-13)


@pytest.mark.parametrize("shape, cu", [((2, 70, 1, 2, 6, 40), None), ((1, 75, 2, 1, 5, 3), [0, 10, 10, 43, 75])])
def test_cpu_forward_saves_chunk_states_and_new_values(shape, cu):
    """gated_delta_rule_forward's o and final state are gated_delta_rule's; what it keeps for the backward is each
    chunk's starting state and each token's v' of the recurrence, by slot, value head and slice of V, in q's
    dtype, zeros past V and past each sequence."""
    q, k, v, g, beta, h0 = inputs(*shape, dtype=torch.float64, sequences=None if cu is None else len(cu) - 1)
    cu_t = None if cu is None else torch.tensor(cu)
    o, final, states, v_new = forward_op(q, k, v, g, beta, 0.3, h0, cu_t, True)
    want_o, want_final = op(q, k, v, g, beta, 0.3, h0, cu_t, True)
    assert torch.equal(o, want_o) and torch.equal(final, want_final)
    ref_states, ref_v_new, _ = saved(q, k, v, g, beta, h0, cu_t, True, v_new.shape[-2], states.shape[-1])
    assert states.dtype == v_new.dtype == q.dtype
    torch.testing.assert_close(states, ref_states, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(v_new, ref_v_new, rtol=1e-12, atol=1e-12)


def test_gradcheck_without_final_state_gradient():
    q, k, v, g, beta, h0 = leaves(*inputs(1, 5, 1, 2, 3, 2, dtype=torch.float64))
    assert torch.autograd.gradcheck(lambda *a: op(*a, 0.7, None, None, True)[0], (q, k, v, g, beta))


# ---------------------------------------------------------------- CUDA against the CPU kernels


def cuda_case(batch, tokens, k_heads, rep, k_dim, v_dim, dtype, cu=None, l2norm=True, initial=True, seed=0):
    """The op on CUDA and on the CPU (float64 arithmetic) on the same inputs: outputs and gradients."""
    n = None if cu is None else len(cu) - 1
    q, k, v, g, beta, h0 = inputs(batch, tokens, k_heads, rep, k_dim, v_dim, dtype=dtype, seed=seed, sequences=n,
                                  initial=initial)
    cu_t = None if cu is None else torch.tensor(cu, dtype=torch.int32)
    grad_o, grad_final = cotangents(v, k_heads * rep, k_dim, batch if n is None else n)
    args = (q, k, v, g, beta, k_dim ** -0.5, h0, cu_t, l2norm)
    cpu = both(op, args, grad_o, grad_final)
    poison_cuda_allocator(1 << 26)
    gpu = both(op, [a.cuda() if isinstance(a, torch.Tensor) else a for a in args], grad_o.cuda(), grad_final.cuda())
    return gpu, cpu


CUDA_TOL = {torch.float32: 2e-5, torch.bfloat16: 8e-3, torch.float16: 2e-3}


@needs_cuda
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("shape", [(2, 1, 1, 1, 8, 8), (2, 33, 1, 2, 16, 40), (1, 100, 2, 2, 64, 32),
                                   (1, 130, 1, 2, 128, 128), (3, 65, 2, 1, 100, 70), (1, 70, 2, 3, 64, 48)])
def test_cuda_matches_cpu(dtype, shape):
    gpu, cpu = cuda_case(*shape, dtype)
    assert_close_all(gpu, cpu, CUDA_TOL[dtype])


@needs_cuda
def test_cuda_packed_many_short_sequences():
    lengths = [1, 0, 2, 31, 32, 33, 5, 64, 3, 100]
    cu = [0]
    for n in lengths:
        cu.append(cu[-1] + n)
    gpu, cpu = cuda_case(1, cu[-1], 1, 2, 32, 48, torch.bfloat16, cu=cu)
    assert_close_all(gpu, cpu, CUDA_TOL[torch.bfloat16])


@needs_cuda
def test_cuda_without_l2norm_or_initial_state():
    gpu, cpu = cuda_case(2, 70, 2, 2, 32, 32, torch.float32, l2norm=False, initial=False)
    assert_close_all(gpu, cpu, CUDA_TOL[torch.float32])


@needs_cuda
def test_cuda_long_sequence():
    """16k tokens: the state carried over 512 chunks, against the CPU's float64 recurrence."""
    gpu, cpu = cuda_case(1, 16384, 1, 1, 32, 32, torch.bfloat16)
    assert_close_all(gpu, cpu, CUDA_TOL[torch.bfloat16])


@needs_cuda
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("shape, cu", [((3, 65, 2, 1, 100, 70), None), ((1, 140, 1, 2, 32, 48), [0, 1, 1, 33, 97, 140])])
def test_cuda_forward_saves_what_the_cpu_does(dtype, shape, cu):
    """The CUDA forward's saved states and v' against the recurrence's, in every slot that holds a chunk."""
    q, k, v, g, beta, h0 = inputs(*shape, dtype=dtype, device="cuda", sequences=None if cu is None else len(cu) - 1)
    cu_t = None if cu is None else torch.tensor(cu, device="cuda")
    _, _, states, v_new = forward_op(q, k, v, g, beta, shape[4] ** -0.5, h0, cu_t, True)
    ref_states, ref_v_new, used = saved(q, k, v, g, beta, h0, cu_t, True, v_new.shape[-2], states.shape[-1])
    assert states.dtype == v_new.dtype == dtype
    assert rel_err(states.cpu()[used], ref_states[used]) <= CUDA_TOL[dtype]
    assert rel_err(v_new.cpu()[used], ref_v_new[used]) <= CUDA_TOL[dtype]


@needs_cuda
def test_cuda_rejects_wide_key_heads():
    q, k, v, g, beta, _ = inputs(1, 4, 1, 1, 192, 8, device="cuda")
    with pytest.raises(RuntimeError, match="CUDA kernels take a key head_dim up to 128, got 192"):
        op(q, k, v, g, beta, 0.1)
