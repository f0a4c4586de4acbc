"""Finds libbastile.so and loads it into torch, refusing a build whose C++ ABI is not the running torch's."""
import ctypes
import os
import re
from pathlib import Path

import torch

_HERE = Path(__file__).resolve().parent


def candidates():
    """Where the library is looked for, in order."""
    env = os.environ.get("BASTILE_LIBRARY")
    if env:
        return [Path(env)]
    return [_HERE / "libbastile.so", _HERE.parent.parent / "target" / "release" / "libbastile.so"]


# What to do when the library cannot run with this torch.
REBUILD = "rebuild Bastile against this torch (`pip install --no-build-isolation .` in its source, or `make build`)"


def major_minor(version: str) -> str:
    return re.match(r"\d+\.\d+", version).group()


def incompatibility(built: str, built_abi: bool) -> str | None:
    """Why a library built against torch `built` with that C++11 ABI cannot run in this torch, or None.
    Builds of one torch release (CUDA variants, local tags) and its patch releases share its C++ ABI;
    another minor release changes the C++ API, and the two _GLIBCXX_USE_CXX11_ABI values lay out
    std::string differently."""
    running, running_abi = torch.__version__, bool(torch._C._GLIBCXX_USE_CXX11_ABI)
    if major_minor(built) != major_minor(running):
        return (f"it was built against torch {built} but torch {running} is running, and the C++ ABI changes "
                f"between minor releases; install torch {major_minor(built)}.x or {REBUILD}")
    if built_abi != running_abi:
        return (f"it was built against a torch {built} with _GLIBCXX_USE_CXX11_ABI={int(built_abi)} but torch "
                f"{running} has _GLIBCXX_USE_CXX11_ABI={int(running_abi)}; install a torch "
                f"{major_minor(built)} build with _GLIBCXX_USE_CXX11_ABI={int(built_abi)} or {REBUILD}")
    return None


def load():
    path = next((p for p in candidates() if p.is_file()), None)
    if path is None:
        looked = ", ".join(str(p) for p in candidates())
        raise ImportError(f"bastile: libbastile.so not found (looked in {looked}); install Bastile "
                          "(`pip install --no-build-isolation .` in its source), build it (`make build`) or point "
                          "BASTILE_LIBRARY at it")
    if torch.version.cuda is None:
        raise ImportError(f"bastile: torch {torch.__version__} is not a CUDA build (torch.version.cuda is None), "
                          f"and {path} links torch's CUDA library (libc10_cuda.so); install a CUDA build of "
                          "torch (its CPU ops run without a GPU too)")
    try:
        lib = ctypes.CDLL(str(path))
    except OSError as e:
        raise ImportError(f"bastile: {path} does not load against torch {torch.__version__} "
                          f"(built for another torch? {REBUILD}): {e}") from e
    lib.bastile_torch_version.restype = ctypes.c_char_p
    why = incompatibility(lib.bastile_torch_version().decode(), bool(lib.bastile_torch_cxx11_abi()))
    if why:
        raise ImportError(f"bastile: {path} cannot run here: {why}")
    torch.ops.load_library(str(path))
    lib.bastile_version.restype = ctypes.c_char_p
    return path, lib.bastile_version().decode(), lib


# LIB: the library through ctypes, for its plain C entry points (bastile_pack).
PATH, VERSION, LIB = load()
