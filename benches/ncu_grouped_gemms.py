"""The experts' grouped products at Qwen3-30B-A3B's shape (4096 tokens x 8 pairs over 128 experts, even routing;
2048 -> 2 x 768 and 768 -> 2048), one launch each, for Nsight Compute: Bastile's `expert_swiglu` and torch's grouped
GEMM for gate/up, down, both inputs' gradients and gate/up's weight gradient, in that order:

    ncu --clock-control none -k regex:'expert_swiglu|device_kernel' --metrics gpu__time_duration.sum,\
lts__t_bytes.sum,lts__throughput.avg.pct_of_peak_sustained_elapsed,dram__bytes_read.sum python3 benches/ncu_grouped_gemms.py
"""
import torch
from torch.nn import functional as F

import bastile  # noqa: F401

tokens, k, experts, hidden, inter = 4096, 8, 128, 2048, 768
g = torch.Generator().manual_seed(0)
counts = torch.multinomial(torch.ones(experts), tokens * k, replacement=True, generator=g).bincount(minlength=experts)
offsets = counts.cumsum(0).int().cuda()
pairs = tokens * k


def rows(width):
    return torch.randn(pairs, width, device="cuda", dtype=torch.bfloat16)


x, h, dy, dgate_up = rows(hidden), rows(inter), rows(hidden), rows(2 * inter)
gate_up_w = torch.randn(experts, 2 * inter, hidden, device="cuda", dtype=torch.bfloat16) / hidden ** 0.5
down_w = torch.randn(experts, hidden, inter, device="cuda", dtype=torch.bfloat16) / inter ** 0.5
torch.ops.bastile.expert_swiglu(x, gate_up_w, offsets)
F.grouped_mm(x, gate_up_w.transpose(-2, -1), offs=offsets)
F.grouped_mm(h, down_w.transpose(-2, -1), offs=offsets)
F.grouped_mm(dgate_up, gate_up_w, offs=offsets)
F.grouped_mm(dy, down_w, offs=offsets)
F.grouped_mm(dgate_up.t(), x, offs=offsets)
torch.cuda.synchronize()
