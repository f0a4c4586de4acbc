import os
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "python_shim"))
import bastile  # noqa: E402

CUDA = torch.cuda.is_available()
needs_cuda = pytest.mark.skipif(not CUDA, reason="needs a CUDA GPU")
DEVICES = ["cpu"] + (["cuda"] if CUDA else [])


@pytest.fixture(autouse=True)
def _fresh_patches():
    """Every test starts and ends with HF unpatched."""
    bastile.reset()
    yield
    bastile.reset()


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    """||a - b|| / ||b|| in float64."""
    a, b = a.double().cpu(), b.double().cpu()
    return ((a - b).norm() / b.norm().clamp_min(1e-300)).item()


def ulps(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """|a - b| elementwise, in units of a's dtype spacing in the binade of the larger of the two;
    computed on a's device."""
    fi = torch.finfo(a.dtype)
    a, b = a.detach().double(), b.detach().to(a.device).double()
    _, e = torch.frexp(torch.maximum(a.abs(), b.abs()).clamp_min(fi.tiny))
    return (a - b).abs() / torch.ldexp(torch.full_like(a, fi.eps), e - 1)


def poison_cuda_allocator(nbytes: int):
    """Leaves NaN in the caching allocator's free blocks, so an output element a kernel forgets to
    write shows up as NaN instead of a plausible stale value."""
    if CUDA:
        t = torch.full((nbytes // 4 + 1024,), float("nan"), device="cuda")
        del t
