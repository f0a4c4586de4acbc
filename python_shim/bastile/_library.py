"""Finds libbastile.so and loads it into torch, refusing a build made for another torch."""
import ctypes
import os
from pathlib import Path

import torch

_HERE = Path(__file__).resolve().parent


def candidates():
    """Where the library is looked for, in order."""
    env = os.environ.get("BASTILE_LIBRARY")
    if env:
        return [Path(env)]
    return [_HERE / "libbastile.so", _HERE.parent.parent / "target" / "release" / "libbastile.so"]


def load():
    path = next((p for p in candidates() if p.is_file()), None)
    if path is None:
        looked = ", ".join(str(p) for p in candidates())
        raise ImportError(f"bastile: libbastile.so not found (looked in {looked}); build it with `make build` "
                          "or point BASTILE_LIBRARY at it")
    try:
        lib = ctypes.CDLL(str(path))
    except OSError as e:
        raise ImportError(f"bastile: {path} does not load against torch {torch.__version__} "
                          f"(built for another torch? rebuild with `make build`): {e}") from e
    lib.bastile_torch_version.restype = ctypes.c_char_p
    built = lib.bastile_torch_version().decode()
    if built != torch.__version__:
        raise ImportError(f"bastile: {path} was built against torch {built} but torch {torch.__version__} "
                          "is running; rebuild with `make build`")
    torch.ops.load_library(str(path))
    return path


PATH = load()
