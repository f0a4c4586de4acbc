"""GPT-OSS's expert activation on the GPU: Bastile vs HF eager (GptOssExperts._apply_gate) and torch.compile of it.

    python benches/bench_geglu.py            # bf16, GPT-OSS-20B expert shapes; CSV under $OUT or bench-results/

Shapes are routed tokens x 2 * intermediate (2 * 2880 for GPT-OSS-20B): 8192 and 32768 rows (32768 also
being an 8192-token batch routed to 4 experts each), and 131072 (32768 tokens x 4 experts).
Liger Kernel is left out: its geglu is the tanh-GELU GEGLU of separate gate and up tensors, not this
function (clamped gate and up, gate * sigmoid(1.702 * gate) * (up + 1), interleaved in one tensor).

Effective bandwidth counts the bytes an ideal kernel must move: forward reads gate_up (2n elements) and
writes y (n); forward+backward also reads dy (n) and gate_up (2n) and writes grad_gate_up (2n).
"""
from types import SimpleNamespace

import torch
from common import BANDWIDTH_COLUMNS, bandwidth_row, chosen, parser, report, start, time_ms
from transformers.models.gpt_oss.modeling_gpt_oss import GptOssExperts

import bastile  # noqa: F401  (loads torch.ops.bastile)

ALPHA, LIMIT = 1.702, 7.0


def hf(gate_up):
    return GptOssExperts._apply_gate(SimpleNamespace(alpha=ALPHA, limit=LIMIT), gate_up)


def implementations():
    return {"bastile": lambda x: torch.ops.bastile.geglu(x, ALPHA, LIMIT), "eager": hf,
            "compile": torch.compile(hf, dynamic=False)}


def main():
    ap = parser("8192x5760,32768x5760,131072x5760", "bastile,eager,compile", "comma-separated rows x 2*I")
    args = ap.parse_args()
    dtype = getattr(torch, args.dtype)
    size = torch.finfo(dtype).bits // 8
    copy = start()
    rows_out = []
    for shape in args.shapes.split(","):
        rows, cols = map(int, shape.split("x"))
        x = 4 * torch.randn(rows, cols, device="cuda", dtype=dtype)
        dy = torch.randn(rows, cols // 2, device="cuda", dtype=dtype)
        n = dy.numel()
        fwd_bytes = 3 * n * size
        fwdbwd_bytes = fwd_bytes + 5 * n * size
        ref = hf(x)
        for name, f in chosen(implementations(), args).items():
            xg = x.clone().requires_grad_()
            # Same function before timing (HF rounds after each bf16 op, Bastile once).
            torch.testing.assert_close(f(x), ref, rtol=2 ** -6, atol=1e-2)
            fwd = time_ms(lambda: f(x))
            both = time_ms(lambda: torch.autograd.grad(f(xg), xg, dy))
            rows_out.append(bandwidth_row(shape, args.dtype, name, fwd, fwd_bytes, both, fwdbwd_bytes))
            del xg
    report("geglu", rows_out, BANDWIDTH_COLUMNS, copy)


if __name__ == "__main__":
    main()
