"""Loading libbastile.so: where it is found, and the errors a user sees when it cannot be used."""
import os
import subprocess
import sys
from pathlib import Path

import torch

import bastile

SHIM = str(Path(__file__).resolve().parent.parent / "python_shim")


def run_import(code: str, **env):
    """Imports bastile in a fresh interpreter (after `code`) and returns (exit code, stderr)."""
    full_env = {**os.environ, "PYTHONPATH": SHIM, **env}
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


def test_library_built_for_another_torch_is_refused():
    code, err = run_import("import torch; torch.__version__ = '0.0.0-other'", BASTILE_LIBRARY=str(bastile.library_path))
    assert code != 0
    assert f"was built against torch {torch.__version__} but torch 0.0.0-other is running" in err
