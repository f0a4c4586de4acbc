"""RMSNorm forward kernels of Bastile and torch.compile, a few launches each, for Nsight Compute:

    ncu --profile-from-start off -k regex:'rms_norm|triton' --metrics gpu__time_duration.sum,dram__throughput.avg.pct_of_peak_sustained_elapsed,\
launch__grid_size,launch__block_size,launch__registers_per_thread python3 benches/ncu_rms_norm.py
"""
import types

import torch
from transformers.models.qwen3.modeling_qwen3 import Qwen3RMSNorm

import bastile  # noqa: F401

HF = Qwen3RMSNorm.forward


def hf(x, w):
    return HF(types.SimpleNamespace(weight=w, variance_epsilon=1e-6), x)


compiled = torch.compile(hf, dynamic=False)
inputs = []
for shape in ("65536x128", "8192x1024", "16384x4096"):
    rows, cols = map(int, shape.split("x"))
    x = torch.randn(rows, cols, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(cols, device="cuda", dtype=torch.bfloat16)
    for _ in range(3):  # compile and autotune outside the profiled range
        torch.ops.bastile.rms_norm(x, w, 1e-6)
        compiled(x, w)
    inputs.append((x, w))
torch.cuda.synchronize()
torch.cuda.profiler.start()
for x, w in inputs:
    torch.ops.bastile.rms_norm(x, w, 1e-6)
    compiled(x, w)
torch.cuda.synchronize()
torch.cuda.profiler.stop()
