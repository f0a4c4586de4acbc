"""What long context needs under gradient checkpointing: the checkpoints in host memory, the MLP in chunks.

With every decoder layer checkpointed, what stays on the device between the forward and the backward is
each layer's input (layers x tokens x hidden), and what peaks in a layer's backward is its MLP's
intermediates (several tokens x intermediate tensors). `bastile.apply(offload_checkpoints=True)` turns on
both remedies (Settings):

- offloaded(): the decoder's forward runs inside saved-tensor hooks that move every sizeable tensor saved
  outside the layers' own checkpoints (torch.utils.checkpoint saves a layer's inputs through autograd, where
  such hooks see them) to host memory. On CUDA the copy runs on a side stream into pinned memory as soon as
  the tensor is saved, while the layer computes; the backward brings each one back on that stream one save
  ahead of its use (double buffering), so both copies hide under compute and no host sync is added.
- tiled_mlp(): the dense MLP of a checkpointed layer runs over chunks of tokens, forward and backward, so
  its intermediates exist for one chunk at a time. The forward keeps its input only, saved by a node ahead
  of the MLP's: the checkpoint's recomputation stops there (its early stop), before the MLP, so tiling adds
  no computation to checkpointing's.

Offloading changes no arithmetic (bit for bit the gradients without it); tiling sums the weights' gradients
over chunks, in fp32.
"""
import contextlib
import dataclasses
from typing import Dict, List, Optional

import torch
from torch import nn

# Tensors smaller than this stay where they are: the copy would cost more than the memory.
_MIN_BYTES = 1 << 20
# A tiled MLP's intermediates for one chunk take at most this share of the device's memory.
_CHUNK_SHARE = 32
# The same for a CPU tensor, whose memory torch does not know: a fixed budget.
_CPU_BUDGET = 1 << 30
# tokens x intermediate tensors alive at once in a chunk's backward (gate, up, activation and their gradients).
_INTERMEDIATES = 6


@dataclasses.dataclass(frozen=True)
class Settings:
    offload_checkpoints: bool = False
    mlp_chunk: Optional[int] = None  # tokens per MLP chunk; None: from the device's memory (chunk_tokens)


# ---------------------------------------------------------------------------------------------- offloading


_side_streams: Dict[int, "torch.cuda.Stream"] = {}


def _side_stream(device: torch.device) -> "torch.cuda.Stream":
    if device.index not in _side_streams:
        _side_streams[device.index] = torch.cuda.Stream(device)
    return _side_streams[device.index]


def _pinned(t: torch.Tensor) -> torch.Tensor:
    try:
        return torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
    except RuntimeError as e:
        raise RuntimeError(f"bastile: offload_checkpoints could not pin {t.numel() * t.element_size()} bytes of "
                           f"host memory for a saved activation ({e}); free host memory, or pass "
                           "offload_checkpoints=False to bastile.apply()") from None


class _Saved:
    """One offloaded tensor: its host copy and, from a fetch until its unpack, its device copy."""

    def __init__(self, index: int, t: torch.Tensor):
        self.index, self.device = index, t.device
        self.fetched = None  # CUDA: (device tensor, event after its copy); CPU: the tensor
        self.taken = False
        if t.device.type != "cuda":
            self.host = t.detach().clone()
            return
        self.host = _pinned(t)
        side = _side_stream(t.device)
        side.wait_stream(torch.cuda.current_stream(t.device))
        with torch.cuda.stream(side):
            self.host.copy_(t, non_blocking=True)
        t.record_stream(side)  # its memory is not reused before the copy has read it

    def fetch(self) -> None:
        if self.fetched is not None:
            return
        if self.device.type != "cuda":
            self.fetched = self.host.clone()
            return
        side = _side_stream(self.device)
        with torch.cuda.stream(side):  # allocated in the side stream's order: no wait for the compute stream
            t = torch.empty(self.host.shape, dtype=self.host.dtype, device=self.device)
            t.copy_(self.host, non_blocking=True)
            done = torch.cuda.Event()
            done.record(side)
        t.record_stream(torch.cuda.current_stream(self.device))
        self.fetched = (t, done)

    def take(self) -> torch.Tensor:
        self.fetch()
        t, self.fetched, self.taken = self.fetched, None, True
        if self.device.type == "cuda":
            t, done = t
            torch.cuda.current_stream(self.device).wait_event(done)
        return t


class _Stash:
    """The tensors one forward offloads, in the order it saved them: the backward takes them about in reverse,
    and each take fetches the one saved before it, unless that one was taken already."""

    def __init__(self):
        self.saved: List[_Saved] = []

    def pack(self, t: torch.Tensor):
        if (isinstance(t, nn.Parameter) or t.device.type not in ("cpu", "cuda") or t.is_sparse
                or not t.is_contiguous() or t.numel() * t.element_size() < _MIN_BYTES):
            return t
        s = _Saved(len(self.saved), t)
        self.saved.append(s)
        return s

    def unpack(self, s):
        if not isinstance(s, _Saved):
            return s
        t = s.take()
        if s.index > 0 and not self.saved[s.index - 1].taken:
            self.saved[s.index - 1].fetch()
        return t


@contextlib.contextmanager
def offloaded(on: bool):
    """Inside, with `on`, the tensors autograd saves go to host memory until the backward needs them (see the
    module's docstring). Not under torch.compile, whose graphs save their own tensors."""
    if not on or torch.compiler.is_compiling():
        yield
        return
    stash = _Stash()
    with torch.autograd.graph.saved_tensors_hooks(stash.pack, stash.unpack):
        yield


# ---------------------------------------------------------------------------------------------- tiled MLP


def chunk_tokens(settings: Settings, x: torch.Tensor, intermediate: int) -> Optional[int]:
    """Tokens per chunk of a tiled MLP of `intermediate` width on x, or None where it runs whole: offloading
    off, under torch.compile (as offloaded()), or x no longer than one chunk. A chunk's intermediates take
    1/_CHUNK_SHARE of the device's memory (its total, not what is free now, so that one run chunks, and sums,
    the same way every step)."""
    if not settings.offload_checkpoints or torch.compiler.is_compiling():
        return None
    tokens = x.numel() // x.shape[-1]
    chunk = settings.mlp_chunk
    if chunk is None:
        memory = (torch.cuda.get_device_properties(x.device).total_memory // _CHUNK_SHARE
                  if x.device.type == "cuda" else _CPU_BUDGET)
        chunk = max(1, memory // (_INTERMEDIATES * intermediate * x.element_size()))
    return chunk if tokens > chunk else None


class _Keep(torch.autograd.Function):
    """x itself, saved: the MLP node after it reads x from here, so that a checkpoint's recomputation, which
    ends once the last tensor saved in the layer is back, ends here and never runs the MLP."""

    @staticmethod
    def forward(ctx, x):
        ctx.save_for_backward(x)
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return grad


def _chunked(run, x: torch.Tensor, chunk: int) -> torch.Tensor:
    """run(x) a chunk of x's tokens at a time, into one output."""
    flat = x.reshape(-1, x.shape[-1])
    first = run(flat[:chunk])
    out = first.new_empty(flat.shape[0], first.shape[-1])
    out[:chunk] = first
    for s in range(chunk, flat.shape[0], chunk):
        out[s:s + chunk] = run(flat[s:s + chunk])
    return out.view(*x.shape[:-1], -1)


class _TiledMlp(torch.autograd.Function):
    """run(x) over chunks of x's tokens: the forward without autograd, the backward one chunk at a time
    (run again with autograd, under the forward's autocast and RNG state, chunks in the forward's order).
    x comes through _Keep where it requires grad, else it is saved here."""

    @staticmethod
    def forward(ctx, run, chunk, x, *params):
        ctx.run, ctx.chunk, ctx.params = run, chunk, params
        ctx.keep = x.grad_fn
        if ctx.keep is None:
            ctx.save_for_backward(x)
        device = x.device.type
        ctx.amp = dict(device_type=device, enabled=torch.is_autocast_enabled(device),
                       dtype=torch.get_autocast_dtype(device), cache_enabled=torch.is_autocast_cache_enabled())
        ctx.rng = (torch.get_rng_state(), torch.cuda.get_rng_state(x.device) if device == "cuda" else None)
        return _chunked(run, x, chunk)

    @staticmethod
    def backward(ctx, grad):
        (x,) = ctx.saved_tensors if ctx.keep is None else ctx.keep.saved_tensors
        want_dx = ctx.needs_input_grad[2]
        flat, grad = x.reshape(-1, x.shape[-1]), grad.reshape(-1, grad.shape[-1])
        dx = torch.empty_like(flat) if want_dx else None
        sums = [None] * len(ctx.params)
        cpu, cuda = ctx.rng
        with torch.random.fork_rng(devices=[x.device] if cuda is not None else [], device_type=x.device.type):
            torch.set_rng_state(cpu)
            if cuda is not None:
                torch.cuda.set_rng_state(cuda, x.device)
            for s in range(0, flat.shape[0], ctx.chunk):
                part = flat[s:s + ctx.chunk].detach().requires_grad_(want_dx)
                with torch.enable_grad(), torch.autocast(**ctx.amp):
                    out = ctx.run(part)
                inputs = ((part,) if want_dx else ()) + ctx.params
                grads = list(torch.autograd.grad(out, inputs, grad[s:s + ctx.chunk], allow_unused=True))
                if want_dx:
                    dx[s:s + ctx.chunk] = grads.pop(0)
                for i, d in enumerate(grads):
                    if d is not None:
                        sums[i] = d.float() if sums[i] is None else sums[i].add_(d)
        dparams = [None if d is None else d.to(p.dtype) for d, p in zip(sums, ctx.params)]
        return (None, None, dx.view_as(x) if want_dx else None, *dparams)


def tiled_mlp(mlp: nn.Module, x: torch.Tensor, chunk: int) -> torch.Tensor:
    """mlp(x) over chunks of `chunk` tokens: without autograd a loop, with it one node (_TiledMlp) whose
    inputs are x and the trainable parameters of mlp."""
    params = tuple(p for p in mlp.parameters() if p.requires_grad)
    if not torch.is_grad_enabled() or not (x.requires_grad or params):
        return _chunked(mlp, x, chunk)
    return _TiledMlp.apply(mlp, chunk, _Keep.apply(x) if x.requires_grad else x, *params)
