"""Run by tests/test_install.py inside a bare Debian root, with the Python of a venv where ddip was
installed from a wheel: uses ddip the three ways a user would and prints what it saw as one JSON
object on the last line (the test asserts on it). Needs nothing but that venv."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
import textwrap

import nbformat
import numpy as np
from nbclient import NotebookClient

import ddip

seen: dict = {"ddip": ddip.__file__, "python": sys.version.split()[0]}

# 1. A group from plain Python: a cell on two ranks, and a numpy array pushed to both.
with ddip.Group(n=2, backend=None) as g:
    ran = g.run("import os\nr = int(os.environ['RANK'])\nr * 10")
    seen["group_run"] = [res.value for res in ran]
    g.push(a=np.arange(6, dtype=np.float64).reshape(2, 3))
    g.run("total = float(a.sum()) + r")
    seen["group_push"] = [g.pull("total", rank=r) for r in (0, 1)]

# 2. The `ddip` launcher, found on PATH (the venv's bin) as a native program.
launcher = shutil.which("ddip")
with open(launcher, "rb") as f:
    seen["launcher_elf"] = f.read(4) == b"\x7fELF"
seen["launcher"] = launcher
with tempfile.TemporaryDirectory() as tmp:
    script = os.path.join(tmp, "train.py")
    with open(script, "w") as f:
        f.write("import os\nprint('rank', os.environ['RANK'], 'of', os.environ['WORLD_SIZE'])\n")
    out = subprocess.run([launcher, "run", "-n", "2", sys.executable, script],
                         capture_output=True, text=True, timeout=120)
    seen["run_rc"] = out.returncode
    seen["run_lines"] = sorted(line for line in out.stdout.splitlines() if "rank" in line)
    # The same program inside the package (ddip/bin), as `python -m ddip` and %%diprun reach it.
    out = subprocess.run([sys.executable, "-m", "ddip", "run", "-n", "1", sys.executable, script],
                         capture_output=True, text=True, timeout=120)
    seen["module_run"] = [out.returncode, [line for line in out.stdout.splitlines() if "rank" in line]]

# 3. A notebook through a real kernel (the venv's ipykernel): the extension, %makedip, %%dip.
nb = nbformat.v4.new_notebook()
nb.cells = [nbformat.v4.new_code_cell(c) for c in (
    "%load_ext ddip",
    "%makedip -n 2 --backend none",
    textwrap.dedent("""\
        %%dip --see all
        import os
        print('hello from', os.environ['RANK'])"""),
)]
NotebookClient(nb, timeout=180, kernel_name="python3").execute()
seen["notebook"] = "".join(o.get("text", "") for o in nb.cells[2].outputs if o.output_type == "stream")

print(json.dumps(seen))
