"""The `ddip` command: a native program (cpp/tools) shipped inside the package.

The wheel puts that program on PATH as `ddip` itself, so `ddip run` starts without a Python
interpreter. This module is how Python reaches it where PATH may not lead there:
`python -m ddip run ...` and the %%diprun magic.
"""

from __future__ import annotations

import importlib.util
import os
import sys
from pathlib import Path


def binary() -> str:
    """Path of the `ddip` program installed next to the extension module."""
    spec = importlib.util.find_spec("ddip._core")
    if spec is None or spec.origin is None:
        raise FileNotFoundError("ddip's compiled parts are not installed; run `pip install ddip` (or `make setup`)")
    path = Path(spec.origin).parent / "bin" / "ddip"
    if not path.is_file():
        raise FileNotFoundError(f"{path} is missing; reinstall ddip (`make setup` in a checkout)")
    return str(path)


def main(argv: list[str] | None = None) -> None:
    """Replaces this process with `ddip ARGS...`: signals and the exit code are the program's."""
    args = sys.argv[1:] if argv is None else argv
    # torchrun's "python" for a script is this interpreter, as `python -m torch.distributed.run`'s.
    if args[:1] == ["run"]:
        args = ["run", "--interpreter", sys.executable, *args[1:]]
    os.execv(binary(), ["ddip", *args])
