import importlib.util
import os
import socket
from dataclasses import dataclass
from typing import Callable

import pytest
import torch

import bastile

CUDA = torch.cuda.is_available()
needs_cuda = pytest.mark.skipif(not CUDA, reason="needs a CUDA GPU")
DEVICES = ["cpu"] + (["cuda"] if CUDA else [])

Sample = tuple[tuple, dict]  # one call's (args, kwargs)


@dataclass
class Contract:
    """What test_contract.py's generic tests need of an op; each op's test file defines one as CONTRACT."""
    op: torch._ops.OpOverloadPacket
    # A few small float32 calls on a device, their differentiable tensors requiring grad; the first two
    # differ in sizes only (torch.compile's dynamic shapes).
    samples: Callable[[str], list[Sample]]
    # Calls with zero-size dimensions.
    empty: Callable[[str], list[Sample]]
    # An independent implementation (HF's, or plain torch) with the op's signature.
    reference: Callable
    # (call, pattern): each call raises a RuntimeError matching the pattern.
    bad: list[tuple[Callable[[], object], str]]
    # float64 CPU calls for gradcheck, where the samples in float64 would not do.
    gradcheck_samples: Callable[[], list[Sample]] | None = None
    # False for an op of frozen inputs (no autograd node): the autograd tests leave it out, and a tensor
    # argument that requires grad makes its backward raise.
    differentiable: bool = True


# What apply() patches in trainer libraries whatever the model (patch.TRAINERS), where they are installed.
TRAINER_PATCHES = [f"{role}_trl" for role in bastile.trainers.TRAINER_ROLES] if importlib.util.find_spec("trl") else []
# apply()'s keywords that leave every trainer library's patches out.
NO_TRAINERS = {role: False for role in bastile.trainers.TRAINER_ROLES}
# What apply() patches in PEFT with the families' MoE experts (patch.LIBRARIES), where it is installed.
EXPERTS_PATCHES = ["mlp_peft"] if importlib.util.find_spec("peft") else []


def free_port() -> int:
    """A free TCP port on the loopback, for spawned ranks' process group."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def patch_names(family: str, roles=bastile.patch.ROLES) -> list:
    """What apply() returns for one family's roles, sorted: `<role>_<family>`, and PEFT's wrapper with the mlp of
    a family with experts."""
    experts = "mlp" in roles and bastile.families.FAMILIES[family].mlp.experts
    return sorted([f"{role}_{family}" for role in roles] + (EXPERTS_PATCHES if experts else []))


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


def as_near_exact(ours, theirs, exact) -> bool:
    """Whether our fp32 result is no farther from the fp64 one than the reference's fp32 result is, twice over:
    both are roundings of the same sums, which a CPU's kernels can put farther apart than a fixed tolerance
    (tensors, or floats such as losses)."""
    if isinstance(exact, torch.Tensor):
        return rel_err(ours, exact) <= 2 * rel_err(theirs, exact)
    return abs(ours - exact) <= 2 * abs(theirs - exact)


def ulps(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """|a - b| elementwise, in units of a's dtype spacing in the binade of the larger of the two;
    computed on a's device."""
    fi = torch.finfo(a.dtype)
    a, b = a.detach().double(), b.detach().to(a.device).double()
    _, e = torch.frexp(torch.maximum(a.abs(), b.abs()).clamp_min(fi.tiny))
    return (a - b).abs() / torch.ldexp(torch.full_like(a, fi.eps), e - 1)


def assert_row_dots(dots: torch.Tensor, grad_y: torch.Tensor, y: torch.Tensor):
    """A gated activation's backward's dots (dot=True) against each row's products of grad_y and y (the forward's
    output) summed in fp64: float32 (float64 for float64) of y's rows, within a summation's rounding in that
    dtype (a row's length times its unit roundoff) of the row's sum of magnitudes."""
    wide = y.dtype == torch.float64
    assert dots.dtype == (torch.float64 if wide else torch.float32) and dots.device == y.device
    assert dots.shape == y.shape[:-1]
    terms = grad_y.double().cpu() * y.double().cpu()
    bound = terms.abs().sum(-1) * (y.shape[-1] + 1) * (2.0 ** -53 if wide else 2.0 ** -24)
    err = (dots.double().cpu() - terms.sum(-1)).abs()
    assert (err <= bound).all(), f"{(err - bound).max().item()} beyond the bound"


def poison_cuda_allocator(nbytes: int):
    """Leaves NaN in the caching allocator's free blocks, so an output element a kernel forgets to
    write shows up as NaN instead of a plausible stale value."""
    if CUDA:
        t = torch.full((nbytes // 4 + 1024,), float("nan"), device="cuda")
        del t
