"""The quick start notebook, executed headless through a real Jupyter kernel (what `make demo` does)."""

import os
import re
import subprocess
import sys

EXAMPLES = os.path.join(os.path.dirname(__file__), "..", "examples")


def test_make_demo_runs_the_quickstart_and_shows_training(tmp_path):
    out = subprocess.run([sys.executable, os.path.join(EXAMPLES, "run_demo.py")],
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    text = out.stdout
    assert "rank 0 of 2" in text and "rank 1 of 2" in text          # --see all
    assert "512 of 1024 samples on this rank" in text                 # DistributedSampler shards
    losses = [float(x) for x in re.findall(r"epoch \d: loss (\d+\.\d+)", text)]
    assert len(losses) == 5 and losses[-1] < losses[0]               # printed once, by rank 0
    acc = re.search(r"accuracy in the notebook: (\d\.\d+)", text)
    assert acc and float(acc.group(1)) > 0.9
    assert "quickstart.ipynb: done" in text
