"""Displays that redraw in place, from ranks, through a real ipykernel (jupyter_client): display
ids mapped per rank, clear_output(wait=True), coalesced updates, fastai's and tqdm's notebook
progress bars, ranch children's displays. Plus DisplayFrames' ordering rules in-process.

One kernel with one 2-rank fastai group (gloo) serves the module.
"""

from __future__ import annotations

import os
import re
import sys
import threading

import pytest

import ddip
from ddip.rank.displays import DisplayFrames

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from test_magics import Kernel, running_kernel  # noqa: E402


class Outputs(list):
    """The iopub messages one execute_request produced (msg_type, content), and its reply."""

    reply: dict

    def of(self, *kinds) -> list[dict]:
        return [c for k, c in self if k in kinds]

    def stream(self, name="stdout") -> str:
        return "".join(c["text"] for k, c in self if k == "stream" and c["name"] == name)

    def ids(self, kind) -> list[str]:
        return [c["transient"]["display_id"] for c in self.of(kind) if "display_id" in c.get("transient", {})]

    @property
    def ok(self) -> bool:
        return self.reply["status"] == "ok"


class RawKernel(Kernel):
    """The cell's raw iopub messages, as (msg_type, content) pairs."""

    def run(self, code: str, timeout: float = 120) -> Outputs:
        out = Outputs()

        def collect(kind, content):
            if kind in ("stream", "display_data", "update_display_data", "execute_result", "error",
                        "clear_output"):
                out.append((kind, content))

        out.reply = self.execute(code, timeout, collect, out)
        return out


@pytest.fixture(scope="module")
def kernel(tmp_path_factory):
    with running_kernel(tmp_path_factory.mktemp("jupyter"), wrap=RawKernel) as k:
        yield k
        k.run("%makedip -k")


HAVE_FASTAI = all(__import__("importlib").util.find_spec(m) for m in ("fastai", "accelerate"))
GROUP = "%makedip -n 2" + (" -a fastai" if HAVE_FASTAI else "")


@pytest.fixture
def k(kernel):
    cell = kernel.run(GROUP, timeout=180)
    assert cell.ok, cell
    return kernel


def html_of(content) -> str:
    return content["data"].get("text/html", "")


# -- display ids, updates, clear_output -------------------------------------------------------------

def test_display_ids_are_mapped_per_rank_and_updates_reach_their_own_display(k):
    cell = k.run("%%dip --see all\nimport os\nfrom IPython.display import HTML, display, update_display\n"
                 "r = os.environ['RANK']\n"
                 "h = display(HTML(f'<b>rank {r} first</b>'), display_id='status')\n"
                 "h.update(HTML(f'<b>rank {r} second</b>'))\n"
                 "update_display(HTML(f'<b>rank {r} third</b>'), display_id='status')")
    assert cell.ok, cell
    assert sorted(cell.ids("display_data")) == ["status@rank0", "status@rank1"]
    updates = cell.of("update_display_data")
    for r in (0, 1):
        mine = [html_of(u) for u in updates if u["transient"]["display_id"] == f"status@rank{r}"]
        assert mine and mine[-1] == f"<b>rank {r} third</b>", updates
        assert all(f"rank {r}" in h for h in mine)  # never the other rank's content
    # Labels mark where a rank's new output starts; an update adds no output, so no label.
    assert cell.stream().count("[rank ") == 2, cell.stream()
    # As in a plain notebook, a later cell can update a display shown by an earlier one.
    later = k.run("%%dip\nupdate_display(HTML('<b>from a later cell</b>'), display_id='status')")
    [u] = later.of("update_display_data")
    assert u["transient"]["display_id"] == "status@rank0" and html_of(u) == "<b>from a later cell</b>"
    assert later.of("display_data") == []


def test_clear_output_wait_reaches_the_cell(k):
    cell = k.run("%%dip --see all\nimport os, time\nfrom IPython.display import clear_output\n"
                 "time.sleep(0.3 * int(os.environ['RANK']))\n"
                 "print('frame 1', flush=True)\nclear_output(wait=True)\nprint('frame 2')")
    assert cell.ok, cell
    kinds = [k_ for k_, _ in cell]
    clears = cell.of("clear_output")
    assert len(clears) == 2 and all(c["wait"] for c in clears), cell
    # After the last clear (rank 1's, mostly), that rank's text is labelled again.
    last_clear = len(kinds) - 1 - kinds[::-1].index("clear_output")
    after = "".join(c["text"] for k_, c in cell[last_clear:] if k_ == "stream")
    assert re.fullmatch(r"\[rank [01]\]\nframe 2\n", after), cell


def test_a_flood_of_updates_is_coalesced_and_ends_in_the_final_state(k):
    cell = k.run("%%dip\nfrom IPython.display import display\n"
                 "h = display({'text/plain': 'step 0'}, raw=True, display_id=True)\n"
                 "for i in range(1, 5001):\n    h.update({'text/plain': f'step {i}'}, raw=True)")
    assert cell.ok, cell
    updates = cell.of("update_display_data")
    assert 1 <= len(updates) <= 40, len(updates)
    assert updates[-1]["data"]["text/plain"] == "step 5000"
    assert len(cell.of("display_data")) == 1


def test_the_last_update_is_shown_while_the_cell_still_runs(k):
    # A bar that stops moving (a long validation after the last batch) still shows its last state,
    # not only once the cell ends.
    cell = k.run("%%dip\nimport time\nfrom IPython.display import display\n"
                 "h = display({'text/plain': 'step 0'}, raw=True, display_id=True)\n"
                 "for i in range(1, 201):\n    h.update({'text/plain': f'step {i}'}, raw=True)\n"
                 "time.sleep(1.5)\nprint('after the pause')")
    assert cell.ok, cell
    kinds = [(k_, c.get("data", {}).get("text/plain") or c.get("text")) for k_, c in cell]
    final = kinds.index(("update_display_data", "step 200"))
    assert final < kinds.index(("stream", "after the pause\n")), kinds


def test_quiet_ranks_send_nothing_to_the_notebook(k):
    cell = k.run("%%dip\nimport os\nfrom IPython.display import display\n"
                 "display({'text/plain': 'shown by ' + os.environ['RANK']}, raw=True, display_id='x');")
    assert [c["data"]["text/plain"] for c in cell.of("display_data")] == ["shown by 0"]


# -- progress bars ----------------------------------------------------------------------------------

def _bar_final(cell):
    """The last drawn HTML of each display, by display id."""
    last = {}
    for k_, c in cell:
        if k_ in ("display_data", "update_display_data") and "display_id" in c.get("transient", {}):
            last[c["transient"]["display_id"]] = html_of(c)
    return last


def test_tqdm_auto_and_notebook_draw_one_html_bar_each_reaching_100_percent(k):
    cell = k.run("%%dip --see all\nimport time\nfrom tqdm.auto import tqdm\nfrom tqdm.notebook import trange\n"
                 "for i in tqdm(range(3000), desc='auto'):\n    pass\n"
                 "for i in trange(30, desc='notebook'):\n    time.sleep(0.01)")
    assert cell.ok, cell
    assert cell.stream("stderr") == ""  # no text bar
    final = _bar_final(cell)
    bars = {i: h for i, h in final.items() if "<progress" in h}
    # One bar per loop, from each rank (--see all), each its own display.
    assert len(bars) == 4, final
    for display_id, markup in bars.items():
        value, maximum = re.search(r"<progress value='(\d+)' max='(\d+)'", markup).groups()
        assert value == maximum and maximum in ("3000", "30"), markup
        assert "100%" in markup and "success" in markup
    assert len(cell.of("update_display_data")) < 100


def test_tqdm_stays_text_outside_a_notebook():
    # A group made from plain Python (a script, a terminal) keeps tqdm's own choice: text.
    with ddip.Group(n=1, backend=None) as g:
        [r] = g.run("import tqdm.auto\nfor i in tqdm.auto.tqdm(range(10)):\n    pass")
        assert "10/10" in r.stderr and r.displays == []
    with ddip.Group(n=1, backend=None, env={"DDIP_NOTEBOOK": "1"}) as g:
        [r] = g.run("import tqdm.auto\nfor i in tqdm.auto.tqdm(range(10)):\n    pass")
        assert r.stderr == "" and any("<progress" in d["data"].get("text/html", "") for d in r.displays)


@pytest.mark.skipif(not HAVE_FASTAI, reason="fastai/accelerate not installed (make setup installs them)")
def test_fastai_fit_shows_the_notebook_progress_bar_and_results_table_from_rank_0(k):
    cell = k.run("%%dip --see all\nimport torch\nfrom torch.utils.data import DataLoader, TensorDataset\n"
                 "torch.manual_seed(0)\nx = torch.randn(256, 1)\ny = 3 * x - 1\n"
                 "dls = DataLoaders(DataLoader(TensorDataset(x[:192], y[:192]), batch_size=16, shuffle=True),\n"
                 "                  DataLoader(TensorDataset(x[192:], y[192:]), batch_size=32))\n"
                 "learn = Learner(dls, torch.nn.Linear(1, 1), loss_func=MSELossFlat(), lr=0.3)\n"
                 "with learn.distrib_ctx():\n    learn.fit(3)", timeout=240)
    assert cell.ok, cell
    # No console bar, no text table: fastprogress ran in its notebook mode.
    assert "Epoch" not in cell.stream() and "\r" not in cell.stream() and "train_loss" not in cell.stream()
    assert "OMP_NUM_THREADS" not in cell.stream("stderr")
    shown = cell.of("display_data")
    assert any("<progress" in html_of(d) for d in shown), shown
    ids = set(cell.ids("display_data")) | set(cell.ids("update_display_data"))
    assert ids and all(i.endswith("@rank0") for i in ids), ids  # rank 1 is quiet (fastai's choice)
    assert len(ids) == 1  # the master bar's one display, updated in place
    updates = cell.of("update_display_data")
    assert any("<progress" in html_of(u) and "<table" in html_of(u) for u in updates)  # bar over table
    table = html_of(updates[-1])
    assert "<table" in table and "train_loss" in table and "valid_loss" in table
    assert [int(e) for e in re.findall(r"<tr>\s*<td>(\d+)</td>", table)] == [0, 1, 2]


# -- ranch ------------------------------------------------------------------------------------------

def test_ranch_children_displays_reach_the_notebook(k):
    cell = k.run("import ddip\n"
                 "def f():\n"
                 "    import os\n"
                 "    from IPython.display import display, HTML\n"
                 "    from tqdm.auto import tqdm\n"
                 "    r = os.environ['RANK']\n"
                 "    h = display(HTML(f'rank {r} start'), display_id='job')\n"
                 "    for i in tqdm(range(500)):\n"
                 "        h.update(HTML(f'rank {r} step {i}'))\n"
                 "    return r\n"
                 "ddip.ranch(2, f, caller_rank=None)", timeout=120)
    assert cell.ok, cell
    final = _bar_final(cell)
    for r in (0, 1):
        assert final[f"job@rank{r}"] == f"rank {r} step 499", final
    bars = [h for h in final.values() if "<progress" in h]
    assert len(bars) == 2 and all("value='500' max='500'" in b for b in bars), final


# -- DisplayFrames, in-process ---------------------------------------------------------------------

def _update(i, did="bar"):
    return {"data": {"text/plain": str(i)}, "transient": {"display_id": did}, "update": True}


def test_display_frames_keep_order_and_drop_only_superseded_updates():
    sent = []
    frames = DisplayFrames(sent.append, interval=3600)  # nothing is due by time in this test
    frames.publish({"data": {"text/plain": "a"}, "transient": {"display_id": "bar"}, "update": False})
    frames.publish(_update(1))  # the first update of an id goes at once
    for i in range(2, 100):
        frames.publish(_update(i))
    frames.publish(_update(7, "other"))
    assert [m["data"]["text/plain"] for m in sent] == ["a", "1", "7"]
    frames.publish({"clear": True, "wait": True})  # anything else sends what waits, first
    assert [m.get("data", {}).get("text/plain", "clear") for m in sent] == ["a", "1", "7", "99", "clear"]
    frames.publish(_update(100))
    frames.publish(_update(101))
    frames.flush(forget=True)
    assert [m["data"]["text/plain"] for m in sent[-1:]] == ["101"]
    frames.publish(_update(102))  # after forget: at once again
    assert sent[-1]["data"]["text/plain"] == "102"


def test_display_frames_send_a_waiting_update_when_its_time_comes():
    sent = []
    done = threading.Event()

    def send(msg):
        sent.append(msg)
        if msg["data"]["text/plain"] == "50":
            done.set()

    frames = DisplayFrames(send, interval=0.05)
    for i in range(51):
        frames.publish(_update(i))
    assert done.wait(10), sent  # without a flush: the thread sent it
    assert sent[-1]["data"]["text/plain"] == "50"
