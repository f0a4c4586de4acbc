"""torch.ops.bastile.expert_swiglu against fp64 products per expert and the `swiglu` op of its halves.

The reference is what bastile.experts computed before the op: each expert's rows of x times its stored gate/up
weight (transformers' `[experts, 2 * inter, in]`), plus a LoRA's low-rank product where one is given (lora_x
[pairs, rank], the rows times the adapter's first factor, and the second factor [experts, 2 * inter, rank]), then
HF's `act(gate) * up` of the halves. The rows are grouped by expert as the routing leaves them: experts of many
rows, of one row, of none.
"""
import pytest
import torch
from torch.nn import functional as F

from conftest import DEVICES, Contract, needs_cuda, poison_cuda_allocator
from test_expert_linear import low_rank, unaligned

op = torch.ops.bastile.expert_swiglu
ACT = {"silu": F.silu, "gelu_tanh": lambda g: F.gelu(g, approximate="tanh")}
on_hopper = torch.cuda.is_available() and torch.cuda.get_device_capability() == (9, 0)
hopper = pytest.mark.skipif(not on_hopper, reason="the kernel runs on compute capability 9.0")


def per_expert(x, weight, offsets, lora_x=None, lora_weight=None):
    """Each expert's rows times its weight (plus lora_x's rows times lora_weight's), in fp64 on x's device:
    [pairs, 2 * inter]."""
    ends = offsets.cpu().tolist()
    x, weight = x.double(), weight.double()
    rows = [x[a:b] @ weight[e].t() for e, (a, b) in enumerate(zip([0] + ends[:-1], ends))]
    y = torch.cat(rows) if rows else x.new_zeros(0, weight.shape[1])
    return y if lora_x is None else y + per_expert(lora_x, lora_weight, offsets)


def reference(x, weight, offsets, activation="silu", lora_x=None, lora_weight=None):
    """Each expert's rows times its weights in fp64, rounded once; HF's act(gate) * up in the dtype."""
    gate_up = per_expert(x, weight, offsets, lora_x, lora_weight).to(x.dtype)
    gate, up = gate_up.chunk(2, dim=-1)
    return gate_up, ACT[activation](gate) * up


def grouped(counts, k, inter, seed=0, dtype=torch.float32, device="cpu"):
    """(x, weight, offsets) for experts of `counts` rows each."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(sum(counts), k, generator=g)
    weight = torch.randn(len(counts), 2 * inter, k, generator=g) / k ** 0.5
    offsets = torch.tensor(counts, dtype=torch.int64).cumsum(0).int()
    return x.to(device, dtype), weight.to(device, dtype), offsets.to(device)


def check(got, x, weight, offsets, activation, sums, lora=(), sum_rounds=0):
    """gate_up within one rounding of the exact sums plus `sums` units of their terms per term summed (and
    `sum_rounds` more roundings of the terms' magnitudes: products computed apart, each rounded before their sum);
    h exactly the `swiglu` op of the returned halves."""
    gate_up, h = got
    assert gate_up.dtype == h.dtype == x.dtype and torch.isfinite(gate_up).all() and torch.isfinite(h).all()
    exact = per_expert(x, weight, offsets, *lora)
    terms = per_expert(x.abs(), weight.abs(), offsets, *(t.abs() for t in lora))
    width, eps = x.shape[1] + (lora[0].shape[1] if lora else 0), torch.finfo(x.dtype).eps
    bound = eps * exact.abs() + (width * sums + sum_rounds * eps) * terms + 1e-300
    excess = ((gate_up.double() - exact).abs() / bound).max() if exact.numel() else 0
    assert excess <= 1, f"gate_up: {excess} times its bound"
    inter = weight.shape[1] // 2
    assert torch.equal(h, torch.ops.bastile.swiglu(gate_up[:, :inter], gate_up[:, inter:], activation))


# Experts of several row tiles, one row, none, and ones ending mid-tile: in the second 64 rows of a 128-row tile or
# in the first (a warp group's rows all past the end), the last one at 64.
COUNTS = [300, 1, 0, 129, 100, 0, 65, 64]


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("activation", ["silu", "gelu_tanh"])
def test_cpu_matches_fp64(dtype, activation):
    x, weight, offsets = grouped([5, 1, 0, 9, 0, 3], 24, 12, dtype=dtype)
    sums = torch.finfo(torch.float64).eps
    check(op(x, weight, offsets, activation), x, weight, offsets, activation, sums)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("layout", ["k", "n"])
def test_cpu_low_rank_matches_fp64(dtype, layout):
    """lora_weight K-major or N-major (made contiguous by the op)."""
    x, weight, offsets = grouped([5, 1, 0, 9, 0, 3], 24, 12, dtype=dtype)
    lora = low_rank(18, 6, 24, 4, dtype=dtype, layout=layout)
    check(op(x, weight, offsets, "silu", *lora), x, weight, offsets, "silu", torch.finfo(torch.float64).eps, lora)


def test_low_rank_product_alone_where_x_has_no_columns():
    x, weight, offsets = grouped([2, 0, 3], 0, 6)
    lora = low_rank(5, 3, 12, 2)
    assert all(map(torch.equal, op(x, weight, offsets, "gelu_tanh", *lora), op(*lora, offsets, "gelu_tanh")))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_equals_hf_expression(device, dtype):
    """h is HF's act(gate) * up of the returned halves in the dtype (up to a unit of h's dtype for torch's own
    silu's rounding)."""
    x, weight, offsets = grouped([7, 0, 2, 11], 40, 16, seed=1, dtype=dtype, device=device)
    gate_up, h = op(x, weight, offsets)
    gate, up = gate_up.chunk(2, dim=-1)
    eps = torch.finfo(dtype).eps
    assert torch.allclose(h, F.silu(gate) * up, rtol=2 * eps, atol=eps)


@needs_cuda
@pytest.mark.parametrize("shape", [(COUNTS, 256, 256), ([5, 0, 40], 72, 128), ([33, 2], 64, 136), ([3, 4], 20, 6)],
                         ids=["tiles", "narrow-in", "inter-136", "odd"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("activation", ["silu", "gelu_tanh"])
def test_cuda_matches_fp64(shape, dtype, activation):
    """Every element written (the allocator poisoned): the GEMM kernel on compute capability 9.0 (bf16, inter a
    multiple of 128), torch's grouped GEMM (inter-136), the rows kernel (other dtypes, odd widths); f32 sums of the
    rounded inputs."""
    counts, k, inter = shape
    x, weight, offsets = grouped(counts, k, inter, seed=2, dtype=dtype, device="cuda")
    poison_cuda_allocator(1 << 26)
    check(op(x, weight, offsets, activation), x, weight, offsets, activation, torch.finfo(torch.float32).eps)


@needs_cuda
@pytest.mark.parametrize("shape", [(COUNTS, 256, 256, 16, True), ([5, 0, 40], 128, 128, 64, True),
                                   ([33, 2], 64, 136, 16, False), ([3, 4], 64, 128, 4, False),
                                   ([3, 4], 20, 6, 8, False)],
                         ids=["tiles-r16", "r64", "inter-136", "r4", "odd"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("layout", ["k", "n"])
def test_cuda_low_rank_matches_fp64(shape, dtype, layout):
    """The low-rank product summed into gate_up: on compute capability 9.0 (bf16, inter a multiple of 128, rank a
    multiple of 8) one more stage of the GEMM kernel, lora_weight made K-major where it comes N-major; other bf16
    calls through `expert_linear` (its kernel, or each product apart, rounded, then summed) and `swiglu`; f32 the
    rows kernel, both products in its sums. Every element written (the allocator poisoned)."""
    counts, k, inter, rank, kernel_takes_it = shape
    x, weight, offsets = grouped(counts, k, inter, seed=6, dtype=dtype, device="cuda")
    lora = low_rank(sum(counts), len(counts), 2 * inter, rank, seed=6, dtype=dtype, device="cuda", layout=layout)
    poison_cuda_allocator(1 << 26)
    apart = dtype == torch.bfloat16 and not (kernel_takes_it and on_hopper)
    check(op(x, weight, offsets, "silu", *lora), x, weight, offsets, "silu", torch.finfo(torch.float32).eps, lora,
          2 * apart)


@needs_cuda
def test_cuda_low_rank_operands_need_no_alignment():
    """lora_x and lora_weight whose data starts off 16 bytes (a direct caller's views): the op copies them to
    aligned storage and runs the same kernel (on compute capability 9.0, the low-rank stage's), bit for bit."""
    x, weight, offsets = grouped(COUNTS, 128, 128, seed=7, dtype=torch.bfloat16, device="cuda")
    lora = low_rank(sum(COUNTS), len(COUNTS), 256, 16, seed=7, dtype=torch.bfloat16, device="cuda")
    got, want = op(x, weight, offsets, "silu", *map(unaligned, lora)), op(x, weight, offsets, "silu", *lora)
    assert all(map(torch.equal, got, want))


@hopper
def test_kernel_at_qwen3_moe_shape():
    """Qwen3-30B-A3B's experts (in 2048, inter 768, 128 experts, top-8 of 4096 tokens), routed unevenly: the
    kernel against fp64 and against torch's grouped GEMM and `swiglu` (whose sums may differ in order only)."""
    g = torch.Generator().manual_seed(3)
    counts = torch.multinomial(torch.rand(128, generator=g) ** 4, 32768, replacement=True, generator=g).bincount(
        minlength=128).tolist()
    x, weight, offsets = grouped(counts, 2048, 768, seed=4, dtype=torch.bfloat16, device="cuda")
    gate_up, h = op(x, weight, offsets)
    check((gate_up, h), x, weight, offsets, "silu", torch.finfo(torch.float32).eps)
    torch_gate_up = F.grouped_mm(x, weight.transpose(-2, -1), offs=offsets)
    assert ((gate_up.float() - torch_gate_up.float()).abs() <= 2 * torch.finfo(torch.bfloat16).eps
            * torch_gate_up.float().abs() + 1e-2).all()
    lora = low_rank(len(x), 128, 1536, 16, seed=4, dtype=torch.bfloat16, device="cuda")
    check(op(x, weight, offsets, "silu", *lora), x, weight, offsets, "silu", torch.finfo(torch.float32).eps, lora)


@needs_cuda
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["gemm", "rows"])
def test_cuda_reads_offsets_as_their_running_maximum(dtype):
    """Offsets the experts' path never makes, which CUDA cannot check without a host sync: each end is the running
    maximum of the offsets clamped to the rows, and rows past the last end are zeros (the allocator poisoned)."""
    x, weight, _ = grouped([130, 70], 64, 128, seed=5, dtype=dtype, device="cuda")
    offsets = lambda *o: torch.tensor(o, dtype=torch.int32, device="cuda")
    poison_cuda_allocator(1 << 26)
    want = op(x, weight, offsets(150, 200))
    for bad in (offsets(150, 10_000), offsets(150, 400)):
        assert all(map(torch.equal, op(x, weight, bad), want))
    gate_up, h = op(x, weight, offsets(150, 100))  # the second expert has no rows
    assert not gate_up[150:].any() and not h[150:].any()
    head = op(x[:150], weight, offsets(150, 150))
    assert torch.equal(gate_up[:150], head[0]) and torch.equal(h[:150], head[1])


def samples(device):
    # The first two differ in every size, and no two sizes of a call are equal (torch.compile would tie them).
    return [((*grouped([3, 0, 2], 12, 5, device=device),), {}), ((*grouped([1, 4, 0, 2], 14, 6, seed=1, device=device),), {}),
            ((*grouped([2, 3], 7, 3, seed=2, device=device),), {"activation": "gelu_tanh"}),
            ((*grouped([2, 0, 4], 9, 4, seed=3, device=device), "silu", *low_rank(6, 3, 8, 2, seed=3, device=device)),
             {})]


def empty(device):
    return [((*grouped([0, 0], 8, 4, device=device),), {}), ((*grouped([2, 1], 8, 0, device=device),), {}),
            ((*grouped([2, 1], 0, 4, device=device),), {})]


x_, w_, o_ = grouped([2, 1], 8, 4)
l_ = low_rank(3, 2, 8, 2)
BAD = [
    (lambda: op(x_, w_.double(), o_), "expert_swiglu: x and weight must have the same dtype"),
    (lambda: op(x_, w_, o_.long()), "expert_swiglu: offsets must be int32"),
    (lambda: op(x_[0], w_, o_), r"expert_swiglu: x must be \[pairs, in\]"),
    (lambda: op(x_, w_[:, :, :4], o_), r"expert_swiglu: weight must be \[experts, 2 \* inter, in\] with in = 8"),
    (lambda: op(x_, w_[:, :7], o_), r"expert_swiglu: weight must be \[experts, 2 \* inter, in\]"),
    (lambda: op(x_, w_, o_[:1]), r"expert_swiglu: offsets must be \[experts\] with experts = 2"),
    (lambda: op(x_, w_, o_, "relu"), "expert_swiglu: activation must be \"silu\" or \"gelu_tanh\""),
    (lambda: op(x_, w_, torch.tensor([2, 2], dtype=torch.int32)), "expert_swiglu: the last offset is 2, but x has 3 rows"),
    (lambda: op(x_, w_, torch.tensor([2, 1], dtype=torch.int32)), r"expert_swiglu: offsets\[1\] = 1 must lie in 2..=3"),
    (lambda: op(x_, w_[:0], o_[:0]), "expert_swiglu: x has 3 rows but weight no experts"),
    (lambda: op(x_.int(), w_.int(), o_), "expert_swiglu: x must be float32"),
    (lambda: op(x_, w_, o_, lora_weight=l_[1]), "expert_swiglu: lora_x and lora_weight go together"),
    (lambda: op(x_, w_, o_, "silu", l_[0][:2], l_[1]), r"expert_swiglu: lora_x must be \[pairs, rank\] with pairs = 3"),
    (lambda: op(x_, w_, o_, "silu", l_[0], l_[1][:, :4]),
     r"expert_swiglu: lora_weight must be \[experts, 2 \* inter, rank\] = \[2, 8, 2\]"),
    (lambda: op(x_, w_, o_, "silu", l_[0], l_[1].double()), "expert_swiglu: x and lora_weight must have the same dtype"),
]

CONTRACT = Contract(op=op, samples=samples, empty=empty, reference=reference, bad=BAD, differentiable=False)
