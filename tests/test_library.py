"""Loading libbastile.so: where it is found, and the errors a user sees when it cannot be used."""
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import bastile

def run_import(code: str, **env):
    """Imports bastile in a fresh interpreter (after `code`) and returns (exit code, stderr)."""
    full_env = {**os.environ, **env}
    p = subprocess.run([sys.executable, "-c", f"{code}\nimport bastile"], env=full_env, capture_output=True,
                       text=True, timeout=300)
    return p.returncode, p.stderr


def test_loaded_library_matches_running_torch():
    assert bastile.library_path.is_file()
    assert torch.ops.bastile.torch_version() == torch.__version__


def test_missing_library_is_a_clear_import_error():
    code, err = run_import("", BASTILE_LIBRARY="/nonexistent/libbastile.so")
    assert code != 0
    assert "ImportError: bastile: libbastile.so not found" in err and "/nonexistent/libbastile.so" in err


MAJOR, MINOR = map(int, torch.__version__.split(".")[:2])
ABI = bool(torch._C._GLIBCXX_USE_CXX11_ABI)


@pytest.mark.parametrize("version", [f"{MAJOR}.{MINOR}.9+cu128", f"{MAJOR}.{MINOR}.0", f"{MAJOR}.{MINOR}.0a0+git1234567"])
def test_library_loads_in_another_build_of_its_torch_release(version):
    """Patch releases, CUDA variants and source builds of the torch release it was built against share its
    C++ ABI: the library loads and its ops run."""
    code, err = run_import(f"import torch; torch.__version__ = {version!r}\n"
                           "import bastile; x, w = torch.randn(2, 8), torch.randn(8)\n"
                           "torch.testing.assert_close(bastile.rms_norm(x, w), "
                           "w * x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6))",
                           BASTILE_LIBRARY=str(bastile.library_path))
    assert code == 0, err


def test_library_for_another_minor_release_is_refused():
    other = f"{MAJOR}.{MINOR + 1}.0"
    code, err = run_import(f"import torch; torch.__version__ = {other!r}", BASTILE_LIBRARY=str(bastile.library_path))
    assert code != 0
    assert (f"ImportError: bastile: {bastile.library_path} cannot run here: it was built against torch "
            f"{torch.__version__} but torch {other} is running, and the C++ ABI changes between minor releases; "
            f"install torch {MAJOR}.{MINOR}.x or rebuild Bastile against this torch (`pip install "
            "--no-build-isolation .` in its source, or `make build`)") in err


def test_library_for_the_other_cxx11_abi_is_refused():
    code, err = run_import(f"import torch; torch._C._GLIBCXX_USE_CXX11_ABI = {not ABI}",
                           BASTILE_LIBRARY=str(bastile.library_path))
    assert code != 0
    assert (f"with _GLIBCXX_USE_CXX11_ABI={int(ABI)} but torch {torch.__version__} has "
            f"_GLIBCXX_USE_CXX11_ABI={int(not ABI)}; install a torch {MAJOR}.{MINOR} build with "
            f"_GLIBCXX_USE_CXX11_ABI={int(ABI)} or rebuild Bastile") in err


def test_torch_without_cuda_is_refused():
    code, err = run_import("import torch; torch.version.cuda = None", BASTILE_LIBRARY=str(bastile.library_path))
    assert code != 0
    assert (f"ImportError: bastile: torch {torch.__version__} is not a CUDA build (torch.version.cuda is None), and "
            f"{bastile.library_path} links torch's CUDA library (libc10_cuda.so)") in err


ROOT = Path(__file__).resolve().parent.parent


def test_the_installed_package_carries_its_library_and_torch():
    """`import bastile` from outside the source tree finds the installed wheel, with libbastile.so inside it
    (the tests run against the wheel, so a file it lacks fails them), and the wheel's metadata names the
    torch release it was built for."""
    shim = str(ROOT / "python_shim")
    path = os.pathsep.join(p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p and p != shim)
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "BASTILE_LIBRARY")}
    p = subprocess.run([sys.executable, "-c", "import importlib.metadata as m, bastile\n"
                        "print(bastile.__file__, bastile.library_path, bastile.__version__, m.version('bastile'))\n"
                        "print(*m.requires('bastile'), sep=';')"],
                       env={**env, **({"PYTHONPATH": path} if path else {})}, cwd="/", capture_output=True,
                       text=True, timeout=300)
    assert p.returncode == 0, p.stderr
    (init, library, version, dist_version), requires = p.stdout.split("\n")[0].split(), p.stdout.split("\n")[1]
    package = Path(init).parent
    crate = re.search(r'^version = "(.*)"', (ROOT / "Cargo.toml").read_text(), re.M).group(1)
    assert version == crate and dist_version == f"{crate}+torch{MAJOR}.{MINOR}"
    assert package != ROOT / "python_shim" / "bastile" and (package.parent / f"bastile-{dist_version}.dist-info").is_dir()
    assert Path(library) == package / "libbastile.so"
    assert f"torch=={MAJOR}.{MINOR}.*" in requires.split(";")
    # Installs beside every tested transformers, without changing it, up to the next major release.
    from packaging.requirements import Requirement
    from bastile.versions import TRANSFORMERS_NEWEST, TRANSFORMERS_OLDEST
    spec = next(Requirement(r) for r in requires.split(";") if r.startswith("transformers")).specifier
    major, minor = map(int, TRANSFORMERS_OLDEST.split(".")[:2])
    for version, ok in [(TRANSFORMERS_OLDEST, True), (TRANSFORMERS_NEWEST, True), (f"{major}.99.1", True),
                        (f"{major}.{minor - 1}.9", False), (f"{major + 1}.0.0", False)]:
        assert spec.contains(version) is ok, (str(spec), version)
