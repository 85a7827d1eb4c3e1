"""Progress bars and text output from ranks as the notebook shows them, through a real ipykernel:
Rich (Progress, Console.print, Lightning's default RichProgressBar), Lightning's TQDMProgressBar
and Hugging Face's notebook progress callback draw HTML displays updated in place in a notebook's
ranks; text bars redrawn with '\\r' from ranch children and %%diprun ranks redraw in place, and no
rank's line lands inside another's.

One kernel with one 2-rank group (gloo) serves the module; tiny models, synthetic data.
"""

from __future__ import annotations

import os
import re
import sys

import pytest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from test_displays import RawKernel  # noqa: E402
from conftest import render
from test_magics import running_kernel  # noqa: E402

pytest.importorskip("torch")
pytest.importorskip("rich")


@pytest.fixture(scope="module")
def k(tmp_path_factory):
    with running_kernel(tmp_path_factory.mktemp("bars"), wrap=RawKernel) as kernel:
        cell = kernel.run("%makedip -n 2", timeout=180)
        assert cell.ok, cell
        yield kernel
        kernel.run("%makedip -k")


def strings(obj):
    if isinstance(obj, str):
        yield obj
    elif isinstance(obj, dict):
        for v in obj.values():
            yield from strings(v)
    elif isinstance(obj, list):
        for v in obj:
            yield from strings(v)


def assert_no_ansi(cell):
    bad = [s for s in strings([c for _, c in cell]) if "\x1b[" in s]
    assert not bad, bad[:3]


def in_place(cell) -> dict[str, list[dict]]:
    """Each display id's bundles in order; each was shown once (display_data), then only updated."""
    shown: dict[str, list[dict]] = {}
    for kind, c in cell:
        did = c.get("transient", {}).get("display_id")
        if kind == "display_data" and did:
            assert did not in shown, f"{did} shown twice"
            shown[did] = [c["data"]]
        elif kind == "update_display_data":
            assert did in shown, f"update of {did} before it was shown"
            shown[did].append(c["data"])
    return shown


# -- rich in %%dip ----------------------------------------------------------------------------------

def test_rich_progress_and_console_print_are_html_updated_in_place(k):
    cell = k.run("%%dip\nimport time\nfrom rich.console import Console\nfrom rich.progress import Progress\n"
                 "from rich.table import Table\n"
                 "with Progress() as p:\n    task = p.add_task('rich work', total=40)\n"
                 "    for i in range(40):\n        p.update(task, advance=1)\n        time.sleep(0.01)\n"
                 "t = Table('name', 'value')\nt.add_row('[bold red]answer[/]', '42')\nConsole().print(t)")
    assert cell.ok, cell
    assert cell.stream() == "" and cell.stream("stderr") == ""  # nothing drawn as text
    assert_no_ansi(cell)
    shown = in_place(cell)
    [bar] = [b for b in shown.values() if any("rich work" in d.get("text/html", "") for d in b)]
    assert len(bar) >= 2  # shown, then updated in place
    final = bar[-1]
    assert "100%" in final["text/plain"] and "rich work" in final["text/html"], final
    assert final["text/html"].startswith("<pre")
    # Console.print of a renderable: one HTML display, styled as in a notebook (colour as CSS).
    [table] = [d for kind, d in cell if kind == "display_data" and "answer" in d["data"].get("text/html", "")]
    html = table["data"]["text/html"]
    assert "<span style=" in html and "color:" in html.replace(": ", ":") and "42" in html
    assert "answer" in table["data"]["text/plain"]


# -- Lightning --------------------------------------------------------------------------------------

LIGHTNING = """
import hashlib, torch, lightning as L
torch.manual_seed(0)
X = torch.randn(128, 4); Y = X @ torch.tensor([[1.0], [-2.0], [0.5], [3.0]])
class Reg(L.LightningModule):
    def __init__(self):
        super().__init__(); self.net = torch.nn.Linear(4, 1)
    def training_step(self, batch, i):
        loss = torch.nn.functional.mse_loss(self.net(batch[0]), batch[1])
        self.log("train_loss", loss, prog_bar=True)
        return loss
    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)
model = Reg()
trainer = L.Trainer(accelerator="cpu", devices=2, strategy="ddp", max_epochs=2, logger=False,
                    enable_checkpointing=False, CALLBACKS)
trainer.fit(model, torch.utils.data.DataLoader(torch.utils.data.TensorDataset(X, Y), batch_size=16))
print(type(trainer.progress_bar_callback).__name__, trainer.world_size,
      hashlib.sha1(str([p.tolist() for p in model.parameters()]).encode()).hexdigest()[:12])
"""


def lightning_cell(k, callbacks: str):
    # --raw: each rank's own report line (alike, they would be shown once, for both ranks)
    cell = k.run("%%dip --see all --raw\n" + LIGHTNING.replace("CALLBACKS", callbacks), timeout=240)
    assert cell.ok, cell
    assert_no_ansi(cell)
    assert "\r" not in cell.stream() + cell.stream("stderr")
    # Both ranks trained together: world size 2, the same weights after DDP.
    reports = re.findall(r"(\w+ProgressBar) 2 ([0-9a-f]{12})", cell.stream())
    assert len(reports) == 2 and reports[0] == reports[1], cell.stream()
    bars = {i: b for i, b in in_place(cell).items() if "Epoch" in b[-1].get("text/plain", "")}
    assert len(bars) == 1, in_place(cell)  # one bar, from rank 0 only (Lightning's choice)
    [(did, bar)] = bars.items()
    assert did.endswith("@rank0") and len(bar) >= 2
    return reports[0][0], bar


def test_lightning_default_rich_progress_bar_is_html_updated_in_place(k):
    name, bar = lightning_cell(k, "enable_model_summary=False")
    assert name == "RichProgressBar"  # rich is installed: Lightning's default
    final = bar[-1]
    assert "Epoch 1/1" in final["text/plain"] and "4/4" in final["text/plain"], final
    assert "train_loss" in final["text/html"] and final["text/html"].startswith("<pre")


def test_lightning_tqdm_progress_bar_is_html_updated_in_place(k):
    name, bar = lightning_cell(k, "callbacks=[L.pytorch.callbacks.TQDMProgressBar()], enable_model_summary=False")
    assert name == "TQDMProgressBar"
    html = bar[-1]["text/html"]
    assert "<progress value='4' max='4'" in html and "Epoch\u20071" in html and "train_loss" in html, html


# -- Hugging Face -----------------------------------------------------------------------------------

def test_hf_trainer_shows_the_notebook_progress_table_from_rank_0_only(k, tmp_path):
    pytest.importorskip("transformers")
    cell = k.run(
        "%%dip --see all --raw\nimport torch\n"
        "from transformers import BertConfig, BertForSequenceClassification, Trainer, TrainingArguments\n"
        "cfg = BertConfig(vocab_size=50, hidden_size=16, num_hidden_layers=2, num_attention_heads=2,\n"
        "                 intermediate_size=32, max_position_embeddings=16, num_labels=2)\n"
        "torch.manual_seed(0)\nmodel = BertForSequenceClassification(cfg)\n"
        "class DS(torch.utils.data.Dataset):\n    def __len__(self): return 32\n"
        "    def __getitem__(self, i):\n"
        "        ids = torch.randint(0, 50, (8,), generator=torch.Generator().manual_seed(i))\n"
        "        return {'input_ids': ids, 'labels': int(ids[0] % 2)}\n"
        f"args = TrainingArguments(output_dir={str(tmp_path)!r}, per_device_train_batch_size=4, num_train_epochs=2,\n"
        "                         logging_steps=2, report_to=[], save_strategy='no', use_cpu=True,\n"
        "                         eval_strategy='epoch')\n"
        "trainer = Trainer(model=model, args=args, train_dataset=DS(), eval_dataset=DS())\n"
        "trainer.train()\nprint('world', trainer.args.world_size)", timeout=240)
    assert cell.ok, cell
    assert_no_ansi(cell)
    assert cell.stream().count("world 2") == 2
    assert "it/s]" not in cell.stream("stderr")  # no text bar
    shown = in_place(cell)
    assert shown and all(i.endswith("@rank0") for i in shown), list(shown)  # the main process draws
    [bar] = [b for b in shown.values() if "<progress" in b[-1]["text/html"]]
    final = bar[-1]["text/html"]
    # 32 samples / 2 ranks / 4 per batch * 2 epochs = 8 steps, all done; the metrics table below.
    assert re.search(r"<progress\s+value='8'\s+max='8'", final), final
    assert "Validation Loss" in final and "<table" in final


# -- text: ranch and %%diprun -----------------------------------------------------------------------

def test_ranch_lines_never_mix_and_bars_redraw_in_place(k):
    cell = k.run(
        "import ddip\n"
        "def f():\n"
        "    import os, sys, time\n"
        "    from rich.progress import Progress\n"
        "    r = int(os.environ['RANK'])\n"
        "    for i in range(1, 21):\n"
        "        sys.stderr.write(f'\\rbar of {r}: {i}/20' + ' .' * (i % 3))\n"
        "        sys.stderr.flush()\n"
        "        time.sleep(0.01)\n"
        "    sys.stderr.write('\\n')\n"
        "    print(f'start of {r}', end='', flush=True)\n"
        "    time.sleep(0.3)\n"
        "    print(f' end of {r}')\n"
        "    if r == 1:\n"
        "        with Progress() as p:\n"
        "            t = p.add_task('child work', total=10)\n"
        "            for i in range(10):\n"
        "                p.update(t, advance=1)\n"
        "    return r\n"
        "ddip.ranch(2, f)", timeout=120)
    assert cell.ok, cell
    assert_no_ansi(cell)
    # Each line shown is one rank's: a line the other rank interrupts goes on below it, labelled again.
    out = render(cell.stream())
    mine = {0: [line for line in out if not line.startswith("[rank 1] ")],
            1: [line.removeprefix("[rank 1] ") for line in out if line.startswith("[rank 1] ")]}
    for r in (0, 1):
        assert "".join(mine[r]) == f"start of {r} end of {r}", out
    assert len(out) <= 4, out
    # Each rank's bar is redrawn in place: one line each, at its last state, never one per redraw.
    err = [line.rstrip() for line in render(cell.stream("stderr"))]
    assert sorted(err) == ["[rank 1] bar of 1: 20/20 . .", "bar of 0: 20/20 . ."], err
    # The child's rich bar: an HTML display in the notebook, updated in place to its end.
    [bar] = [b for i, b in in_place(cell).items() if i.endswith("@rank1") and "child work" in b[-1]["text/plain"]]
    assert "100%" in bar[-1]["text/plain"]


def test_a_bar_that_ends_under_another_writers_bar_takes_its_line_back():
    import io

    from ddip.kernel.group import LabelledOutput

    dest, out = io.StringIO(), LabelledOutput()
    for rank, text in ((0, "\rbar 0: 1/2"), (1, "\rbar 1: 1/2 ..."), (0, "\rbar 0: 2/2"),
                       (1, "\rbar 1: 1/2 ...."), (0, "\n"), (1, "\rbar 1: 2/2"), (1, "\n")):
        out.write(rank, f"[rank {rank}] ", "stderr", text, dest)
    # Each bar's final state, once; no half-way state of either left behind.
    assert [line.rstrip() for line in render(dest.getvalue())] == ["[rank 0] bar 0: 2/2", "[rank 1] bar 1: 2/2"]


def test_diprun_tqdm_bars_of_two_ranks_redraw_in_place(k):
    cell = k.run("%%diprun -n 2\nimport os, time\nfrom tqdm import tqdm\n"
                 "for i in tqdm(range(30), mininterval=0, desc='rank ' + os.environ['RANK']):\n"
                 "    time.sleep(0.01)\nprint('done', os.environ['RANK'])", timeout=120)
    assert cell.ok, cell
    assert_no_ansi(cell)
    assert sorted(render(cell.stream())) == ["[0] done 0", "[1] done 1"]
    err = [line.rstrip() for line in render(cell.stream("stderr"))]
    # Two lines, each one rank's bar at 100 %: redraws overwrote each other, never piled up.
    assert len(err) == 2, err
    for r in (0, 1):
        [line] = [x for x in err if x.startswith(f"[{r}] ")]
        assert re.fullmatch(rf"\[{r}\] rank {r}: 100%\|█+\| 30/30 \[.*\]", line), line


def test_one_splitter_keeps_each_line_end_and_labels_every_rank_alike():
    import io

    from ddip.labels import LabelledOutput, pieces, rank_label

    assert list(pieces("a\nbar 1\rbar 2\r\n\nwin\r\ntail")) == [
        ("a", "\n"), ("bar 1", "\r"), ("bar 2", "\r\n"), ("", "\n"), ("win", "\r\n"), ("tail", "")]
    assert list(pieces("")) == []
    assert rank_label(3) == "[rank 3]"
    # Lines labelled (ranch, output between cells) and headed runs of one rank (%%dip) use the
    # same label; the headed form starts a new line when a rank's line was left open.
    import sys
    saved = sys.stdout
    try:
        sys.stdout = io.StringIO()
        LabelledOutput()(2, "stdout", "x\ny\n")
        lines = sys.stdout.getvalue()
        sys.stdout = io.StringIO()
        headed = LabelledOutput(headers=True)
        for rank, text in ((0, "a"), (1, "b\n"), (1, "c\n"), (0, "d\n")):
            headed(rank, "stdout", text)
        blocks = sys.stdout.getvalue()
    finally:
        sys.stdout = saved
    assert lines == "[rank 2] x\n[rank 2] y\n"
    assert blocks == "[rank 0]\na\n[rank 1]\nb\nc\n[rank 0]\nd\n"


def test_the_notebooks_own_print_is_one_line_whatever_a_rank_writes_between_its_pieces(monkeypatch):
    """ranch: print() writes each argument by itself; a child's line that arrives between two of
    them goes below the notebook's line, which stays whole (issue 33 row 15)."""
    import io
    import sys

    from ddip.labels import LabelledOutput

    dest = io.StringIO()
    monkeypatch.setattr(sys, "stdout", dest)
    out = LabelledOutput()

    class ChildSpeaks:  # print() turns it into text between writing "rank " and the rest
        def __str__(self):
            out(1, "stdout", "rank 1 got 30.0\n")
            return "0"

    with out:
        print("rank", ChildSpeaks(), "got", 30.0)
        print("no end", end="")  # an unfinished last line is written when the launch ends
    assert dest.getvalue().splitlines() == ["[rank 1] rank 1 got 30.0", "rank 0 got 30.0", "no end"], \
        dest.getvalue()
