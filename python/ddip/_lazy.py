"""Attributes of ddip's packages imported on first use (PEP 562's module `__getattr__`).

`import ddip` loads no more than the package's own `__init__`: a rank, a host's agent and the
rank template each import only their own side (tests/test_layout.py checks which ddip modules a real
rank has loaded), and `ddip.Group`, `ddip.kernel.group` or `ddip.hosts.release` still work after a
plain `import ddip`, importing what they name when first read.
"""

from __future__ import annotations

import importlib
import importlib.util
from typing import Callable


def submodule(package: str, name: str):
    """`package.name` imported, when `name` is a submodule of `package`; else AttributeError, as
    for any missing attribute (so hasattr() and getattr(x, name, default) keep working)."""
    if not name.startswith("__"):
        full = f"{package}.{name}"
        try:
            found = importlib.util.find_spec(full) is not None
        except (ImportError, ValueError):
            found = False
        if found:
            return importlib.import_module(full)
    raise AttributeError(f"module {package!r} has no attribute {name!r}")


def submodules(package: str) -> Callable[[str], object]:
    """A package's `__getattr__`: its submodules, imported when first read."""

    def __getattr__(name: str):
        return submodule(package, name)

    return __getattr__


def submodule_names(package: str, path) -> list[str]:
    """The names of a package's submodules (for its `__dir__`)."""
    import pkgutil

    return sorted(m.name for m in pkgutil.iter_modules(path) if not m.name.startswith("_"))
