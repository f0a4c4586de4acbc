"""pyproject.toml's build backend (PEP 517): `cargo build --release`, then a wheel of the `bastile` package
with libbastile.so inside it.

The library links the torch of the interpreter that builds it, so the build runs without isolation
(`pip install --no-build-isolation .`) in the environment the wheel is for. The wheel records that torch:
its version is `<crate version>+torch<major>.<minor>` and it requires `torch==<major>.<minor>.*`, the
builds that share the library's C++ ABI (`bastile/_library.py` checks the same at import). Name,
version, description and license come from Cargo.toml. There is no sdist: the source is the repository.
"""
import base64
import hashlib
import os
import re
import subprocess
import sys
import sysconfig
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "python_shim" / "bastile"
LIBRARY = "libbastile.so"

def _transformers() -> str:
    """The tested transformers releases (bastile/versions.py) up to the next major one: apply() warns above
    the newest tested."""
    tested = {}
    exec((PACKAGE / "versions.py").read_text(), tested)
    oldest = tested["TRANSFORMERS_OLDEST"]
    return f"transformers>={oldest},<{int(oldest.split('.')[0]) + 1}"

# The 4-bit layout and arithmetic bastile.dequantize_4bit reproduces (tests pin 0.50.2).
BITSANDBYTES = "bitsandbytes>=0.50,<0.51"


def _crate() -> dict:
    """The [package] fields of Cargo.toml that the wheel's metadata uses."""
    text = (ROOT / "Cargo.toml").read_text()
    package = text.split("[package]", 1)[1].split("\n[", 1)[0]
    return dict(re.findall(r'^(name|version|description|license) = "([^"]*)"', package, re.M))


def _torch_release() -> str:
    try:
        import torch
    except ImportError as e:
        raise RuntimeError("bastile: the build cannot import torch, and Bastile links the torch it will run with: "
                           "build without isolation (pip hides the environment's packages otherwise) in an "
                           "environment with torch: pip install --no-build-isolation .") from e
    return re.match(r"\d+\.\d+", torch.__version__).group()


def _build_library() -> Path:
    """cargo build --release with this interpreter's torch (and the CUDA compiler beside it, if pip installed
    one there), as `make build` does."""
    env = dict(os.environ, BASTILE_PYTHON=sys.executable)
    env["PATH"] = os.pathsep.join([os.path.dirname(sys.executable), env.get("PATH", "")])
    subprocess.run(["cargo", "build", "--release"], cwd=ROOT, env=env, check=True, stdout=sys.stderr)
    target = Path(os.environ.get("CARGO_TARGET_DIR", ROOT / "target"))
    return (target if target.is_absolute() else ROOT / target) / "release" / LIBRARY


def _metadata(crate: dict, version: str, torch_release: str) -> str:
    return "".join([
        "Metadata-Version: 2.1\n",
        f"Name: {crate['name']}\n",
        f"Version: {version}\n",
        f"Summary: {crate['description']}\n",
        f"License: {crate['license']}\n",
        "Requires-Python: >=3.10\n",
        f"Requires-Dist: torch=={torch_release}.*\n",
        f"Requires-Dist: {_transformers()}\n",
        "Provides-Extra: qlora\n",  # 4-bit base layers in the fused LoRA nodes
        f"Requires-Dist: {BITSANDBYTES}; extra == \"qlora\"\n",
        "Description-Content-Type: text/markdown\n\n",
        (ROOT / "README.md").read_text(),
    ])


def _record_line(name: str, data: bytes) -> str:
    digest = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()
    return f"{name},sha256={digest},{len(data)}\n"


def build_wheel(wheel_directory, config_settings=None, metadata_directory=None):
    torch_release = _torch_release()
    library = _build_library()
    crate = _crate()
    version = f"{crate['version']}+torch{torch_release}"
    tag = "py3-none-" + re.sub(r"[-.]", "_", sysconfig.get_platform())
    dist_info = f"{crate['name']}-{version}.dist-info"
    files = {f"bastile/{p.relative_to(PACKAGE).as_posix()}": p.read_bytes()
             for p in sorted(PACKAGE.rglob("*.py")) if "__pycache__" not in p.parts}
    files[f"bastile/{LIBRARY}"] = library.read_bytes()
    files[f"{dist_info}/METADATA"] = _metadata(crate, version, torch_release).encode()
    files[f"{dist_info}/WHEEL"] = (f"Wheel-Version: 1.0\nGenerator: bastile backend\nRoot-Is-Purelib: false\n"
                                   f"Tag: {tag}\n").encode()
    record = "".join(_record_line(name, data) for name, data in files.items()) + f"{dist_info}/RECORD,,\n"
    files[f"{dist_info}/RECORD"] = record.encode()
    name = f"{crate['name']}-{version}-{tag}.whl"
    with zipfile.ZipFile(Path(wheel_directory) / name, "w", zipfile.ZIP_DEFLATED) as wheel:
        for path, data in files.items():
            info = zipfile.ZipInfo(path, date_time=(1980, 1, 1, 0, 0, 0))  # reproducible: no build time inside
            info.external_attr = (0o755 if path.endswith(".so") else 0o644) << 16
            info.compress_type = zipfile.ZIP_DEFLATED
            wheel.writestr(info, data)
    return name

