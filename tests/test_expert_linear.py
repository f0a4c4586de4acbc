"""torch.ops.bastile.expert_linear against fp64 products per expert and torch's grouped GEMM.

The reference is what bastile.experts computed before the op: each expert's rows of x times its stored weight
(transformers' `[experts, out, in]`), as F.linear takes it, plus a LoRA's low-rank product where one is given
(lora_x [pairs, rank], the rows times the adapter's first factor, and the second factor [experts, out, rank]). The
rows are grouped by expert as the routing leaves them: experts of many rows, of one row, of none. The weights come
contiguous (K-major: the forward's) or with their transpose contiguous (N-major: the stored weight read for the
inputs' gradient).
"""
import pytest
import torch
from torch.nn import functional as F

from conftest import Contract, needs_cuda, poison_cuda_allocator

op = torch.ops.bastile.expert_linear
on_hopper = torch.cuda.is_available() and torch.cuda.get_device_capability() == (9, 0)
hopper = pytest.mark.skipif(not on_hopper, reason="the kernel runs on compute capability 9.0")


def per_expert(x, weight, offsets, lora_x=None, lora_weight=None):
    """Each expert's rows times its weight (plus lora_x's rows times lora_weight's), in fp64 on x's device:
    [pairs, out]."""
    ends = offsets.cpu().tolist()
    x, weight = x.double(), weight.double()
    rows = [F.linear(x[a:b], weight[e]) for e, (a, b) in enumerate(zip([0] + ends[:-1], ends))]
    y = torch.cat(rows) if rows else x.new_zeros(0, weight.shape[1])
    return y if lora_x is None else y + per_expert(lora_x, lora_weight, offsets)


def reference(x, weight, offsets, lora_x=None, lora_weight=None):
    """Each expert's rows times its weights in fp64, rounded once."""
    return per_expert(x, weight, offsets, lora_x, lora_weight).to(x.dtype)


def grouped(counts, k, out, seed=0, dtype=torch.float32, device="cpu", layout="k"):
    """(x, weight, offsets) for experts of `counts` rows each; the weight K-major or N-major (`layout` "n")."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(sum(counts), k, generator=g)
    weight = torch.randn(len(counts), out, k, generator=g) / k ** 0.5
    offsets = torch.tensor(counts, dtype=torch.int64).cumsum(0).int()
    weight = weight.to(device, dtype)
    if layout == "n":
        weight = weight.transpose(-2, -1).contiguous().transpose(-2, -1)
    return x.to(device, dtype), weight, offsets.to(device)


def low_rank(pairs, experts, out, rank, seed=0, dtype=torch.float32, device="cpu", layout="k"):
    """(lora_x, lora_weight) of a LoRA of `rank` (the factors' sizes: lora_x rows of O(1), lora_weight of
    O(1 / rank)); lora_weight K-major or N-major."""
    g = torch.Generator().manual_seed(100 + seed)
    lora_x = torch.randn(pairs, rank, generator=g)
    lora_weight = torch.randn(experts, out, rank, generator=g) / max(rank, 1) ** 0.5
    lora_weight = lora_weight.to(device, dtype)
    if layout == "n":
        lora_weight = lora_weight.transpose(-2, -1).contiguous().transpose(-2, -1)
    return lora_x.to(device, dtype), lora_weight

LAYOUTS = pytest.mark.parametrize("layout", ["k", "n"])


def check(y, x, weight, offsets, sums, lora=(), sum_rounds=0):
    """y within one rounding of the exact sums plus `sums` units of their terms per term summed (and `sum_rounds`
    more roundings of the terms' magnitudes: torch's grouped GEMM rounds each product before their sum)."""
    assert y.dtype == x.dtype and y.shape == (x.shape[0], weight.shape[1]) and torch.isfinite(y).all()
    exact = per_expert(x, weight, offsets, *lora)
    terms = per_expert(x.abs(), weight.abs(), offsets, *(t.abs() for t in lora))
    width = x.shape[1] + (lora[0].shape[1] if lora else 0)
    eps = torch.finfo(x.dtype).eps
    bound = eps * exact.abs() + (width * sums + sum_rounds * eps) * terms + 1e-300
    excess = ((y.double() - exact).abs() / bound).max() if exact.numel() else 0
    assert excess <= 1, f"y: {excess} times its bound"


# Experts of several row tiles, one row, none, and ones ending mid-tile: in the second 64 rows of a 128-row tile or
# in the first (a warp group's rows all past the end), the last one at 64.
COUNTS = [300, 1, 0, 129, 100, 0, 65, 64]


@LAYOUTS
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.float16, torch.bfloat16])
def test_cpu_matches_fp64(dtype, layout):
    x, weight, offsets = grouped([5, 1, 0, 9, 0, 3], 24, 12, dtype=dtype, layout=layout)
    check(op(x, weight, offsets), x, weight, offsets, torch.finfo(torch.float64).eps)


@LAYOUTS
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.float16, torch.bfloat16])
def test_cpu_low_rank_matches_fp64(dtype, layout):
    x, weight, offsets = grouped([5, 1, 0, 9, 0, 3], 24, 12, dtype=dtype, layout=layout)
    lora = low_rank(18, 6, 12, 4, dtype=dtype, layout=layout)
    check(op(x, weight, offsets, *lora), x, weight, offsets, torch.finfo(torch.float64).eps, lora)


def test_low_rank_product_alone_where_x_has_no_columns():
    x, weight, offsets = grouped([2, 0, 3], 0, 6)
    lora = low_rank(5, 3, 6, 2)
    assert torch.equal(op(x, weight, offsets, *lora), op(*lora, offsets))


@needs_cuda
@pytest.mark.parametrize("shape", [(COUNTS, 256, 512, 16, True), ([5, 0, 40], 128, 256, 64, True),
                                   ([70, 0, 140, 9], 128, 2112, 8, True), ([33, 2], 64, 136, 16, False),
                                   ([3, 4], 64, 256, 4, False)],
                         ids=["tiles-r16", "r64", "tail-r8", "out-136", "r4"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("layouts", ["kk", "kn", "nn", "nk"])
def test_cuda_low_rank_matches_fp64(shape, dtype, layouts):
    """The low-rank product summed in: on compute capability 9.0 (bf16, rank a multiple of 8) one more stage of the
    GEMM kernels, lora_weight copied into the weight's layout where it comes in the other; other bf16 calls (out-136,
    r4) each product apart, rounded, then summed; f32 the rows kernel, both products in its sums."""
    counts, k, out, rank, kernel_takes_it = shape
    x, weight, offsets = grouped(counts, k, out, seed=6, dtype=dtype, device="cuda", layout=layouts[0])
    lora = low_rank(sum(counts), len(counts), out, rank, seed=6, dtype=dtype, device="cuda", layout=layouts[1])
    poison_cuda_allocator(1 << 26)
    apart = dtype == torch.bfloat16 and not (kernel_takes_it and on_hopper)
    check(op(x, weight, offsets, *lora), x, weight, offsets, torch.finfo(torch.float32).eps, lora, 2 * apart)


def unaligned(t):
    """t's values in storage that starts one element (2 bytes in bf16) past a 16-byte boundary."""
    return torch.empty(t.numel() + 1, dtype=t.dtype, device=t.device)[1:].view(t.shape).copy_(t)


@needs_cuda
@LAYOUTS
def test_cuda_low_rank_operands_need_no_alignment(layout):
    """lora_x and lora_weight whose data starts off 16 bytes (a direct caller's views): the op copies them to
    aligned storage and runs the same kernel (on compute capability 9.0, the low-rank stage's), bit for bit."""
    x, weight, offsets = grouped(COUNTS, 128, 256, seed=7, dtype=torch.bfloat16, device="cuda", layout=layout)
    lora = low_rank(sum(COUNTS), len(COUNTS), 256, 16, seed=7, dtype=torch.bfloat16, device="cuda")
    assert torch.equal(op(x, weight, offsets, *map(unaligned, lora)), op(x, weight, offsets, *lora))


@needs_cuda
@pytest.mark.parametrize("shape", [(COUNTS, 256, 512), ([5, 0, 40], 72, 256), ([70, 0, 140, 9], 128, 2112),
                                   ([33, 2], 64, 136), ([3, 4], 20, 6)],
                         ids=["tiles", "narrow-in", "tail", "out-136", "odd"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@LAYOUTS
def test_cuda_matches_fp64(shape, dtype, layout):
    """Every element written, none past out (the allocator poisoned): the GEMM kernels on compute capability 9.0
    (bf16, out a multiple of 256 or of 8 with a short last tile (tail); N-major: in a multiple of 64, not
    narrow-in), torch's grouped GEMM (out-136, N-major narrow-in), the rows kernel (other dtypes, odd widths); f32
    sums of the rounded inputs."""
    counts, k, out = shape
    x, weight, offsets = grouped(counts, k, out, seed=2, dtype=dtype, device="cuda", layout=layout)
    poison_cuda_allocator(1 << 26)
    check(op(x, weight, offsets), x, weight, offsets, torch.finfo(torch.float32).eps)


@hopper
@pytest.mark.parametrize("shape", [(128, 8, 768, 2048, "k"), (128, 8, 2048, 1536, "k"), (128, 8, 2048, 768, "n"),
                                   (128, 8, 1536, 2048, "n"), (32, 4, 2880, 5760, "n"), (32, 4, 2880, 2880, "n"),
                                   (32, 4, 5760, 2880, "k")],
                         ids=["qwen3-down", "qwen3-gate_up", "qwen3-down-dx", "qwen3-gate_up-dx", "gpt_oss-gate_up",
                              "gpt_oss-down", "gpt_oss-gate_up-dx"])
def test_kernel_at_moe_shapes(shape):
    """Qwen3-30B-A3B's experts (128 experts, top-8 of 4096 tokens; down 768 -> 2048, gate/up 2048 -> 1536 as a
    LoRA'd gate/up runs it, and the inputs' gradients through each, N-major) and GPT-OSS-20B's (32 experts, top-4,
    stored [experts, in, out]: the forward N-major, the last column tile short), routed unevenly: the kernels
    against fp64 and against torch's grouped GEMM (whose sums may differ in order only)."""
    experts, top_k, k, out, layout = shape
    g = torch.Generator().manual_seed(3)
    counts = torch.multinomial(torch.rand(experts, generator=g) ** 4, 4096 * top_k, replacement=True,
                               generator=g).bincount(minlength=experts).tolist()
    x, weight, offsets = grouped(counts, k, out, seed=4, dtype=torch.bfloat16, device="cuda", layout=layout)
    y = op(x, weight, offsets)
    check(y, x, weight, offsets, torch.finfo(torch.float32).eps)
    theirs = F.grouped_mm(x, weight.transpose(-2, -1), offs=offsets).float()
    assert ((y.float() - theirs).abs() <= 2 * torch.finfo(torch.bfloat16).eps * theirs.abs() + 1e-2).all()
    # a LoRA r16's low-rank product in the same call: its factors as the experts' path makes them
    lora = low_rank(len(x), experts, out, 16, seed=4, dtype=torch.bfloat16, device="cuda", layout=layout)
    check(op(x, weight, offsets, *lora), x, weight, offsets, torch.finfo(torch.float32).eps, lora)


@needs_cuda
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["gemm", "rows"])
@LAYOUTS
def test_cuda_reads_offsets_as_their_running_maximum(dtype, layout):
    """Offsets the experts' path never makes, which CUDA cannot check without a host sync: each end is the running
    maximum of the offsets clamped to the rows, and rows past the last end are zeros (the allocator poisoned)."""
    x, weight, _ = grouped([130, 70], 64, 256, seed=5, dtype=dtype, device="cuda", layout=layout)
    offsets = lambda *o: torch.tensor(o, dtype=torch.int32, device="cuda")
    poison_cuda_allocator(1 << 26)
    want = op(x, weight, offsets(150, 200))
    for bad in (offsets(150, 10_000), offsets(150, 400)):
        assert torch.equal(op(x, weight, bad), want)
    y = op(x, weight, offsets(150, 100))  # the second expert has no rows
    assert not y[150:].any()
    assert torch.equal(y[:150], op(x[:150], weight, offsets(150, 150)))


def samples(device):
    # The first two differ in every size, and no two sizes of a call are equal (torch.compile would tie them); the
    # third's weight N-major, the last with a low-rank product.
    return [((*grouped([3, 0, 2], 12, 7, device=device),), {}), ((*grouped([1, 4, 0, 2], 14, 6, seed=1, device=device),), {}),
            ((*grouped([2, 3], 7, 3, seed=2, device=device, layout="n"),), {}),
            ((*grouped([2, 0, 4], 9, 5, seed=3, device=device), *low_rank(6, 3, 5, 2, seed=3, device=device)), {})]


def empty(device):
    return [((*grouped([0, 0], 8, 4, device=device),), {}), ((*grouped([2, 1], 8, 0, device=device),), {}),
            ((*grouped([2, 1], 0, 4, device=device),), {})]


x_, w_, o_ = grouped([2, 1], 8, 4)
l_ = low_rank(3, 2, 4, 2)
BAD = [
    (lambda: op(x_, w_.double(), o_), "expert_linear: x and weight must have the same dtype"),
    (lambda: op(x_, w_, o_.long()), "expert_linear: offsets must be int32"),
    (lambda: op(x_[0], w_, o_), r"expert_linear: x must be \[pairs, in\]"),
    (lambda: op(x_, w_[:, :, :4], o_), r"expert_linear: weight must be \[experts, out, in\] with in = 8"),
    (lambda: op(x_, w_[0], o_), r"expert_linear: weight must be \[experts, out, in\]"),
    (lambda: op(x_, w_, o_[:1]), r"expert_linear: offsets must be \[experts\] with experts = 2"),
    (lambda: op(x_, w_, torch.tensor([2, 2], dtype=torch.int32)), "expert_linear: the last offset is 2, but x has 3 rows"),
    (lambda: op(x_, w_, torch.tensor([2, 1], dtype=torch.int32)), r"expert_linear: offsets\[1\] = 1 must lie in 2..=3"),
    (lambda: op(x_, w_[:0], o_[:0]), "expert_linear: x has 3 rows but weight no experts"),
    (lambda: op(x_.int(), w_.int(), o_), "expert_linear: x must be float32"),
    (lambda: op(x_, w_, o_, lora_x=l_[0]), "expert_linear: lora_x and lora_weight go together"),
    (lambda: op(x_, w_, o_, l_[0][:2], l_[1]), r"expert_linear: lora_x must be \[pairs, rank\] with pairs = 3"),
    (lambda: op(x_, w_, o_, l_[0], l_[1][:, :2]), r"expert_linear: lora_weight must be \[experts, out, rank\] = \[2, 4, 2\]"),
    (lambda: op(x_, w_, o_, l_[0].double(), l_[1]), "expert_linear: x and lora_x must have the same dtype"),
]

CONTRACT = Contract(op=op, samples=samples, empty=empty, reference=reference, bad=BAD, differentiable=False)
