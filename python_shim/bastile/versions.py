"""The transformers releases Bastile's patches are tested against (CI runs the suite at both ends). The
patched forwards follow the modeling code of these releases: below the range apply() refuses, above it
apply() warns once. The wheel requires the range up to the next major release (python_shim/backend.py);
the Makefile pins both ends (`python3 python_shim/bastile/versions.py` prints them). No imports at the top:
the build and the Makefile read this file without torch."""
TRANSFORMERS_OLDEST = "5.17.0"
TRANSFORMERS_NEWEST = "5.23.0"


def _release(version: str) -> tuple:
    """(major, minor) of a version string: its patch releases and builds share one modeling code."""
    import re
    return tuple(map(int, re.match(r"(\d+)\.(\d+)", version).groups()))


def tested() -> str:
    (a, b), (c, d) = _release(TRANSFORMERS_OLDEST), _release(TRANSFORMERS_NEWEST)
    return f"{a}.{b} to {c}.{d}"


def installed_before(version: str) -> bool:
    """Whether the installed transformers is a release older than `version`."""
    import transformers
    return _release(transformers.__version__) < _release(version)


def check_transformers(version: str) -> None:
    """Raises for a transformers release older than the tested range; warns, once per version, for a newer one."""
    if _release(version) < _release(TRANSFORMERS_OLDEST):
        raise RuntimeError(f"bastile.apply: transformers {version} is older than the releases Bastile is tested "
                           f"against ({tested()}), whose modeling code its patches follow; nothing was patched: "
                           f"install transformers>={TRANSFORMERS_OLDEST}")
    if _release(version) > _release(TRANSFORMERS_NEWEST) and version not in _warned:
        import warnings
        _warned.add(version)
        warnings.warn(f"bastile: transformers {version} is newer than the releases Bastile is tested against "
                      f"({tested()}). apply() refuses a patch target that is gone or a config key its families do "
                      "not know, but a changed forward it cannot see: compare a few steps with bastile.reset()",
                      stacklevel=3)


_warned: set = set()

if __name__ == "__main__":
    print(TRANSFORMERS_OLDEST, TRANSFORMERS_NEWEST)
