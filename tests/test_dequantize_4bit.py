"""torch.ops.bastile.dequantize_4bit against bitsandbytes' dequantize_4bit (bit for bit) and a plain-torch
statement of the same arithmetic."""
import pytest
import torch

import bastile
from conftest import CUDA, DEVICES, Contract, needs_cuda

op = torch.ops.bastile.dequantize_4bit


def reference(packed, absmax, code, blocksize, rows, cols, dtype, nested_absmax, nested_code, nested_blocksize,
              offset):
    """Each weight's code[q] * scale in float32, rounded once to dtype, one after another; nested scales are
    nested_code[absmax] * nested_absmax + offset in float32, as separate ops."""
    outs = []
    for i, q in enumerate(packed):
        n = rows[i] * cols
        nibbles = torch.stack([q.reshape(-1) >> 4, q.reshape(-1) & 15], 1).reshape(-1)[:n].long()
        scales = absmax[i]
        if nested_absmax[i] is not None:
            outer = nested_absmax[i].repeat_interleave(nested_blocksize[i])[:scales.numel()]
            scales = nested_code[i][scales.long()] * outer + offset[i]
        outs.append((code[i][nibbles] * scales.repeat_interleave(blocksize[i])[:n]).to(dtype).reshape(rows[i], cols))
    return torch.cat(outs) if outs else torch.empty(0, cols, dtype=dtype)


def weight(rows, cols, blocksize, nested, device, seed):
    """Random packed codes and scales of one weight, as op arguments (packed, absmax, code, blocksize, rows,
    nested_absmax, nested_code, nested_blocksize, offset)."""
    g = torch.Generator().manual_seed(seed)
    n = rows * cols
    blocks = -(-n // blocksize)
    packed = torch.randint(0, 256, ((n + 1) // 2,), generator=g, dtype=torch.uint8)
    code = torch.randn(16, generator=g).sort().values
    if not nested:
        absmax = torch.rand(blocks, generator=g) + 0.5
        return [t.to(device) for t in (packed, absmax, code)] + [blocksize, rows, None, None, 1, None]
    absmax = torch.randint(0, 256, (blocks,), generator=g, dtype=torch.uint8)
    outer, inner = torch.rand(-(-blocks // 4), generator=g) + 0.5, torch.randn(256, generator=g)
    offset = torch.rand((), generator=g)
    return ([t.to(device) for t in (packed, absmax, code)] + [blocksize, rows]
            + [t.to(device) for t in (outer, inner)] + [4, offset.to(device)])


def call(weights, cols, dtype=torch.float32):
    """The op's arguments for weights made by `weight`."""
    field = lambda i: [w[i] for w in weights]
    return ((field(0), field(1), field(2), field(3), field(4), cols, dtype, field(5), field(6), field(7), field(8)),
            {})


def samples(device):
    # No two sizes of a call equal, nor 1, 16 or 256 (the codes'): torch.compile would tie them together.
    return [
        call([weight(10, 64, 64, False, device, 0), weight(20, 64, 64, True, device, 1), weight(6, 64, 32, False, device, 2)], 64),
        call([weight(20, 64, 64, False, device, 3), weight(40, 64, 64, True, device, 4), weight(12, 64, 32, False, device, 5)], 64),
        call([weight(3, 7, 4, True, device, 6)], 7),  # odd size and blocksize: element by element
    ]


def empty(device):
    return [call([weight(0, 64, 64, False, device, 7)], 64), call([weight(2, 0, 64, True, device, 8)], 0)]


def bad_call(edit):
    args, _ = call([weight(4, 64, 64, True, "cpu", 9)], 64)
    args = list(args)
    edit(args)
    return lambda: op(*args)


def _set(args, i, j, value):
    args[i] = list(args[i])
    args[i][j] = value


BAD = [
    (bad_call(lambda a: _set(a, 0, 0, a[0][0].float())), r"dequantize_4bit: packed\[0\] must be Byte"),
    (bad_call(lambda a: _set(a, 0, 0, a[0][0][1:])), r"dequantize_4bit: packed\[0\] must have 128 elements, got 127"),
    (bad_call(lambda a: _set(a, 1, 0, a[1][0].float())), r"dequantize_4bit: absmax\[0\] must be Byte"),
    (bad_call(lambda a: _set(a, 2, 0, a[2][0][:8])), r"dequantize_4bit: code\[0\] must have 16 elements"),
    (bad_call(lambda a: _set(a, 10, 0, None)), r"nested_absmax\[0\], nested_code\[0\] and offset\[0\] are given together"),
    (bad_call(lambda a: _set(a, 3, 0, 0)), r"blocksize\[0\] > 0"),
    (bad_call(lambda a: a.__setitem__(6, torch.float64)), r"dtype must be float32, float16 or bfloat16"),
    (bad_call(lambda a: a.__setitem__(4, [4, 4])), r"rows must have one entry per weight \(1\), got 2"),
    (bad_call(lambda a: [a.__setitem__(i, a[i] * 4) for i in (0, 1, 2, 3, 4, 7, 8, 9, 10)]), r"takes 1 to 3 weights, got 4"),
]

CONTRACT = Contract(op=op, samples=samples, empty=empty, reference=reference, bad=BAD, differentiable=False)


@pytest.fixture
def BF():
    """bitsandbytes.functional, where bitsandbytes is installed (the test venv pins it)."""
    return pytest.importorskip("bitsandbytes.functional")


def quantized(BF, rows, cols, dtype, quant_type, nested, blocksize, device, seed=0):
    """A bitsandbytes-quantized weight: its packed codes, carrying their quant_state as a Params4bit does."""
    torch.manual_seed(seed)
    w = (torch.randn(rows, cols) * 0.05).to(dtype).to(device)
    packed, state = BF.quantize_4bit(w, blocksize=blocksize, quant_type=quant_type, compress_statistics=nested)
    packed.quant_state = state
    return packed


CASES = [(q, nested, bs) for q in ("nf4", "fp4") for nested in (False, True) for bs in (64, 128, 256)]


@pytest.mark.parametrize("device,cols", [("cpu", 512)] + ([("cuda", 512), ("cuda", 320)] if CUDA else []))
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("quant_type,nested,blocksize", CASES)
def test_equals_bitsandbytes_bit_for_bit(quant_type, nested, blocksize, dtype, device, cols, BF):
    """Against bitsandbytes' CUDA kernel, and on the CPU against its portable implementation (the one its
    other backends run, which its CUDA kernel equals). Its native CPU kernel (0.50.2) is compared for bf16
    and float32: for float16 it rounds a few elements one ulp off on some hosts (6 of 49152 on the GPU
    machine's Xeon, none on CI's), and it places blocks by row, which agrees with the flat blocks it
    quantizes only where blocksize divides in_features (real models' widths do), so the other widths are
    compared on CUDA."""
    w = quantized(BF, 96, cols, dtype, quant_type, nested, blocksize, device)
    state = w.quant_state
    got = bastile.dequantize_4bit(w)
    wants = [BF.dequantize_4bit(w, state)] if device == "cuda" or dtype != torch.float16 else []
    if device == "cpu":
        from bitsandbytes.backends.default.ops import _dequantize_4bit_compute
        absmax = BF.dequantize_blockwise(state.absmax, state.state2) + state.offset if nested else state.absmax
        wants.append(_dequantize_4bit_compute(w.reshape(-1), absmax, state.code, blocksize, state.shape, dtype))
    for want in wants:
        assert got.dtype == dtype and got.shape == want.shape
        assert torch.equal(got, want)


@needs_cuda
def test_cpu_kernel_equals_bitsandbytes_cuda(BF):
    """The CPU kernel, bastile's reference, against bitsandbytes' CUDA kernel on the same weights."""
    for quant_type, nested, blocksize in CASES:
        for dtype in (torch.bfloat16, torch.float16, torch.float32):
            w = quantized(BF, 96, 320, dtype, quant_type, nested, blocksize, "cuda")
            want = BF.dequantize_4bit(w, w.quant_state).cpu()
            on_cpu = w.cpu()
            on_cpu.quant_state = w.quant_state
            on_cpu.quant_state.to("cpu")  # in place
            assert torch.equal(bastile.dequantize_4bit(on_cpu), want)


@pytest.mark.parametrize("device", DEVICES)
def test_weights_share_one_launch_and_a_target_dtype(device, BF):
    """q, k and v (one in_features, several quantization settings) in one call: each one's rows are its own
    dequantization; a dtype other than the quant_state's rounds the float32 products once into it."""
    ws = [quantized(BF, 64, 256, torch.bfloat16, "nf4", True, 64, device, 1),
          quantized(BF, 32, 256, torch.bfloat16, "fp4", False, 128, device, 2),
          quantized(BF, 32, 256, torch.bfloat16, "nf4", False, 64, device, 3)]
    got = bastile.dequantize_4bit(*ws)
    assert torch.equal(got, torch.cat([BF.dequantize_4bit(w, w.quant_state) for w in ws]))
    f32 = torch.cat([bastile.dequantize_4bit(w, dtype=torch.float32) for w in ws])
    assert torch.equal(bastile.dequantize_4bit(*ws, dtype=torch.float16), f32.half())


@needs_cuda
@pytest.mark.parametrize("rows,cols,blocksize", [(4096, 4096, 64), (1027, 4096, 64), (33, 129, 64), (64, 96, 32)])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_cuda_equals_cpu_kernel(rows, cols, blocksize, dtype):
    """The vector kernel (whole, aligned 32-element units) and the element kernel (an odd size) on the GPU
    against the CPU kernel, on random codes and nested scales."""
    args, _ = call([weight(rows, cols, blocksize, True, "cpu", 10), weight(rows, cols, blocksize, False, "cpu", 11)],
                   cols, dtype)
    cuda = [[t.cuda() if isinstance(t, torch.Tensor) else t for t in a] if isinstance(a, list) else a for a in args]
    assert torch.equal(op(*cuda).cpu(), op(*args))
