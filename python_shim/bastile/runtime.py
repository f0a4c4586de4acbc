"""Library-wide controls: loading kernels ahead of time and the per-device launch cache."""
from typing import Optional

import torch

from . import _library  # noqa: F401  (loads the ops)


def warmup_all_kernels(device: Optional[torch.device] = None) -> None:
    """Loads every Bastile kernel module on `device` (default: the current CUDA device), so the first
    training step does not pay for it. Without a CUDA device there is nothing to load: it returns, so that
    one script runs on a laptop and on the cluster."""
    if not torch.cuda.is_available():
        return
    index = torch.device(device).index if device is not None else None
    torch.ops.bastile.warmup(torch.cuda.current_device() if index is None else index)


def clear_autotune_cache() -> None:
    """Drops the kernel handles and the occupancy figures cached on every device (the kernel modules stay
    loaded): the next launch of each kernel looks it up and asks the driver for its occupancy again.
    Bastile benchmarks no launch variants (each launch's geometry follows from the shape and that
    occupancy), so this is the only cache there is; the name is kept for the original API."""
    torch.ops.bastile.clear_kernel_cache()
