"""What a user sees: a real JupyterLab server on loopback (with a token) and Debian's Chromium,
driven through Selenium as a person would: open a notebook, run cells with Shift+Enter, press
the stop button, read the rendered page, save screenshots (under the test's temporary folder).

One server and one browser for the whole module. Skips (saying why) only where the browser, or
JupyterLab and Selenium, are not installed; `make setup` installs them.

    DDIP_SCREENSHOTS=docs/img pytest tests/test_browser.py   # also writes the docs' screenshot
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

pytest.importorskip("jupyterlab", reason="JupyterLab is not installed (make setup installs the test extras)")
pytest.importorskip("selenium", reason="Selenium is not installed (make setup installs the test extras)")
nbformat = pytest.importorskip("nbformat")

from selenium import webdriver  # noqa: E402
from selenium.common.exceptions import StaleElementReferenceException, WebDriverException  # noqa: E402
from selenium.webdriver.common.by import By  # noqa: E402
from selenium.webdriver.common.keys import Keys  # noqa: E402

from ddip.errors import strip_ansi  # noqa: E402

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
CHROMEDRIVER = shutil.which("chromedriver")
if not (CHROMIUM and CHROMEDRIVER):
    pytest.skip("Chromium and its driver are not installed (make setup installs Debian's chromium and "
                "chromium-driver; they could not be installed here)", allow_module_level=True)

HAVE_FASTAI = all(__import__("importlib").util.find_spec(m) for m in ("fastai", "accelerate"))
REPO = Path(__file__).resolve().parent.parent
GUIDE = REPO / "examples" / "user_guide.ipynb"
TOKEN = "ddip-browser-test-" + os.urandom(8).hex()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# -- the server and the browser ---------------------------------------------------------------------

@pytest.fixture(scope="module")
def lab(tmp_path_factory):
    """A JupyterLab server on 127.0.0.1 with a token, its own config, data and settings folders
    (no news, no update checks, every cell kept in the DOM), serving a fresh folder."""
    base = tmp_path_factory.mktemp("lab")
    root = base / "notebooks"
    root.mkdir()
    settings = base / "settings"
    for name, value in {
        "@jupyterlab/notebook-extension/tracker.jupyterlab-settings":
            {"windowingMode": "none", "autoStartDefaultKernel": True},
        "@jupyterlab/apputils-extension/notification.jupyterlab-settings":
            {"fetchNews": "false", "checkForUpdates": False},
    }.items():
        path = settings / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(value))
    env = dict(os.environ, JUPYTER_CONFIG_DIR=str(base / "config"), JUPYTER_DATA_DIR=str(base / "data"),
               JUPYTER_RUNTIME_DIR=str(base / "runtime"), JUPYTERLAB_SETTINGS_DIR=str(settings),
               JUPYTERLAB_WORKSPACES_DIR=str(base / "workspaces"))
    env.pop("JUPYTER_PATH", None)  # the server's own python3 kernel: this interpreter
    port = _free_port()
    log = open(base / "server.log", "wb")
    server = subprocess.Popen(
        [sys.executable, "-m", "jupyterlab", "--no-browser", "--ip=127.0.0.1", f"--port={port}",
         "--port-retries=0", f"--IdentityProvider.token={TOKEN}", f"--ServerApp.root_dir={root}",
         "--LabApp.check_for_updates_class=jupyterlab.NeverCheckForUpdate",
         "--LabApp.extension_manager=readonly"] + (["--allow-root"] if os.geteuid() == 0 else []),
        cwd=root, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 120
        while True:
            try:
                with urllib.request.urlopen(f"{url}/api/status?token={TOKEN}", timeout=5) as r:
                    if r.status == 200:
                        break
            except OSError:
                pass
            if server.poll() is not None or time.monotonic() > deadline:
                log.flush()
                pytest.fail(f"JupyterLab did not start:\n{(base / 'server.log').read_text()[-3000:]}")
            time.sleep(0.25)
        yield {"url": url, "root": root, "log": base / "server.log"}
    finally:
        if server.poll() is None:
            server.send_signal(signal.SIGTERM)  # it shuts its kernels down (their ranks die with them)
            try:
                server.wait(30)
            except subprocess.TimeoutExpired:
                os.killpg(server.pid, signal.SIGKILL)
                server.wait()
        log.close()


@pytest.fixture(scope="module")
def browser(lab):
    opts = webdriver.ChromeOptions()
    opts.binary_location = CHROMIUM
    for arg in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage", "--disable-gpu",
                "--window-size=1400,1000", "--no-first-run", "--disable-extensions"):
        opts.add_argument(arg)
    try:
        driver = webdriver.Chrome(options=opts, service=webdriver.ChromeService(executable_path=CHROMEDRIVER))
    except WebDriverException as exc:
        pytest.skip(f"Chromium could not be started here: {exc.msg}")
    driver.set_script_timeout(30)
    yield driver
    driver.quit()


class Page:
    """One notebook open in the browser, seen and driven as a user would."""

    def __init__(self, driver, lab, name, shots: Path):
        self.d, self.lab, self.name, self.shots = driver, lab, name, shots
        self.d.get(f"{lab['url']}/lab/tree/{name}?token={TOKEN}")
        self.wait(lambda: len(self.cells()) > 0 and self.kernel_idle(), 120, "the notebook to open with an idle kernel")

    def wait(self, predicate, timeout, what):
        deadline = time.monotonic() + timeout
        while True:
            try:
                if predicate():
                    return
            except StaleElementReferenceException:
                pass
            if time.monotonic() > deadline:
                self.screenshot("timeout")
                raise AssertionError(f"timed out after {timeout} s waiting for {what}")
            time.sleep(0.1)

    def cells(self):
        return self.d.find_elements(By.CSS_SELECTOR, ".jp-NotebookPanel:not(.lm-mod-hidden) .jp-Notebook .jp-Cell")

    def kernel_idle(self) -> bool:
        """The status bar says the current notebook's kernel is connected and idle."""
        return bool(self.d.execute_script(
            "const bar = document.querySelector('#jp-main-statusbar');"
            "return bar && [...bar.querySelectorAll('.jp-StatusBar-TextItem')]"
            "  .some(e => /\\| Idle$/.test(e.textContent.trim()));"))

    def prompt(self, i) -> str:
        return self.cells()[i].find_element(By.CSS_SELECTOR, ".jp-InputPrompt").text.strip()

    def run(self, i, timeout=180, until_started=False):
        """Clicks into cell i and presses Shift+Enter; waits until it ran (or only started)."""
        def click():
            cell = self.cells()[i]
            self.d.execute_script("arguments[0].scrollIntoView({block: 'center'});", cell)
            try:
                cell.find_element(By.CSS_SELECTOR, ".jp-InputArea-editor").click()
            except WebDriverException:  # still laying out: a person would click again too
                return False
            return "jp-mod-active" in self.cells()[i].get_attribute("class")

        before = self.prompt(i)
        for attempt in range(3):
            self.wait(click, 30, f"cell {i} to take a click")
            webdriver.ActionChains(self.d).key_down(Keys.SHIFT).send_keys(Keys.ENTER).key_up(Keys.SHIFT).perform()
            try:  # the prompt turns to [*] (or, for a quick cell, straight to its new count)
                self.wait(lambda: self.prompt(i) not in (before, "[ ]:"), 10, f"cell {i} to start")
                break
            except AssertionError:
                if attempt == 2:  # a person presses again when nothing happens; not forever
                    raise
        if not until_started:
            self.wait_done(i, timeout)

    def wait_done(self, i, timeout=180):
        self.wait(lambda: re.fullmatch(r"\[\d+\]:", self.prompt(i)) and self.kernel_idle(), timeout,
                  f"cell {i} to finish")

    def outputs(self, i):
        return self.cells()[i].find_elements(By.CSS_SELECTOR, ".jp-OutputArea-child")

    def text(self, i) -> str:
        return "\n".join(o.text for o in self.outputs(i))

    def html(self, i) -> str:
        return self.cells()[i].find_element(By.CSS_SELECTOR, ".jp-Cell-outputArea").get_attribute("innerHTML")

    def count(self, i, css) -> int:
        return len(self.cells()[i].find_elements(By.CSS_SELECTOR, f".jp-Cell-outputArea {css}"))

    def screenshot(self, label, cell=None) -> Path:
        path = self.shots / f"{Path(self.name).stem}-{label}.png"
        if cell is not None:
            self.cells()[cell].screenshot(str(path))
        else:
            self.d.save_screenshot(str(path))
        return path

    def stop(self):
        """The notebook toolbar's stop button (Interrupt the kernel)."""
        buttons = self.d.find_elements(
            By.CSS_SELECTOR, ".jp-NotebookPanel:not(.lm-mod-hidden) .jp-Toolbar [data-command='notebook:interrupt-kernel']")
        assert buttons, "no stop button in the notebook's toolbar"
        buttons[0].click()

    def close(self):
        """Shuts the notebook's kernel down (its group with it), as the Running panel would."""
        api = f"{self.lab['url']}/api/sessions"
        with urllib.request.urlopen(f"{api}?token={TOKEN}", timeout=10) as r:
            sessions = json.load(r)
        for s in sessions:
            if s.get("path", "").endswith(self.name):
                req = urllib.request.Request(f"{api}/{s['id']}?token={TOKEN}", method="DELETE")
                urllib.request.urlopen(req, timeout=30).close()


def write_notebook(path: Path, cells: list[str]):
    nb = nbformat.v4.new_notebook()
    nb.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3", "language": "python"}
    nb.cells = [nbformat.v4.new_code_cell(c) for c in cells]
    nbformat.write(nb, path)


# -- the notebook the tests drive ---------------------------------------------------------------------

FIT = """%%dip
import time, torch
from torch.utils.data import DataLoader, TensorDataset
torch.manual_seed(0)
x = torch.randn(256, 1); y = 3 * x - 1 + 0.05 * torch.randn(256, 1)
dls = DataLoaders(DataLoader(TensorDataset(x[:192], y[:192]), batch_size=16, shuffle=True),
                  DataLoader(TensorDataset(x[192:], y[192:]), batch_size=32))
class Pace(Callback):  # a tiny model trains too fast to watch: pace it like a real one
    def after_batch(self): time.sleep(0.05)
learn = Learner(dls, torch.nn.Linear(1, 1), loss_func=MSELossFlat(), lr=0.3, cbs=Pace())
with learn.distrib_ctx():
    learn.fit(5)"""

CELLS = [
    "%load_ext ddip\n%makedip -n 2" + (" -a fastai" if HAVE_FASTAI else ""),
    "%%dip --see all\nimport os\nrank = int(os.environ['RANK'])\nprint('hello from rank', rank)\nrank * 10",
    "%%dip\nfrom IPython.display import HTML\n"
    "HTML('<table class=\"ddip-t\"><tr><th>rank</th><th>loss</th></tr><tr><td>0</td><td>0.25</td></tr></table>')",
    "%%dip\n%matplotlib inline\nimport matplotlib.pyplot as plt\nplt.plot([1, 3, 2]);",
    FIT,
    "%%dip\nimport time\nfrom tqdm.auto import tqdm\nfor i in tqdm(range(60), desc='batches'):\n    time.sleep(0.02)",
    "%%dip --see all\ndef f():\n    raise ValueError('boom')\nf()",
    "%%dip\nimport time\nprint('sleeping', flush=True)\ntime.sleep(120)",
    "%%dip --see all\n'after the stop'",
    "%%dip --see all\nimport os\nx = int(os.environ['RANK']) * 10 + 3\nbreakpoint()\nprint('after the breakpoint', x)",
    # The rank panel (10) watches the cells after it: rank 1 sleeps before each all_reduce (11),
    # stops at a prompt (12), dies (13) and is replaced by heal (14); --tabs, a tab per rank (15).
    "%dipstatus",
    "%%dip\nimport os, time, torch, torch.distributed as dist\nfor step in range(24):\n"
    "    time.sleep(0.5 if os.environ['RANK'] == '1' else 0)\n    dist.all_reduce(torch.ones(4))\n"
    "    print(f'step {step} done')",
    "%%dip -r 1\nbreakpoint()\nprint('rank 1 went on')",
    "get_ipython().magics_manager.registry['DipMagics'].group.kill([1])",
    "%makedip --heal",
    "%%dip --tabs\nimport os, time\nfrom tqdm.auto import tqdm\nr = int(os.environ['RANK'])\n"
    "print(f'only rank {r} prints this')\nfor i in tqdm(range(20 + r)):\n    time.sleep(0.01)\n"
    "if r == 1:\n    raise ValueError('rank 1 fails alone')",
]


@pytest.fixture(scope="module")
def page(browser, lab, tmp_path_factory):
    shots = tmp_path_factory.mktemp("screenshots")
    write_notebook(lab["root"] / "ranks.ipynb", CELLS)
    p = Page(browser, lab, "ranks.ipynb", shots)
    p.run(0, timeout=240)
    assert "2 CPU rank(s) ready" in p.text(0), p.text(0)
    yield p
    p.close()


def test_rank_labels_and_out_prompts_render(page):
    page.run(1)
    text = page.text(1)
    assert "[rank 0]\nhello from rank 0" in text and "[rank 1]\nhello from rank 1" in text, text
    n = re.search(r"\[(\d+)\]:", page.prompt(1)).group(1)
    assert re.search(rf"Out\[0:\d+\]: 0", text) and re.search(rf"Out\[1:\d+\]: 10", text), (n, text)
    page.screenshot("labels", cell=1)


def test_an_html_table_and_a_matplotlib_figure_from_a_rank_render(page):
    page.run(2)
    assert page.count(2, "table.ddip-t td") == 2
    assert re.search(r"Out\[0:\d+\]:", page.text(2))
    page.run(3)
    imgs = page.cells()[3].find_elements(By.CSS_SELECTOR, ".jp-Cell-outputArea img")
    assert len(imgs) == 1 and imgs[0].get_attribute("src").startswith("data:image/png")
    assert imgs[0].size["width"] > 100 and imgs[0].size["height"] > 100
    page.screenshot("figure", cell=3)


@pytest.mark.skipif(not HAVE_FASTAI, reason="fastai/accelerate not installed (make setup installs them)")
def test_fastai_fit_shows_one_progress_bar_updating_in_place_then_the_results_table(page):
    page.run(4, until_started=True)
    seen_bar = False
    most_outputs_with_bars = 0
    shot = None
    deadline = time.monotonic() + 240
    while page.prompt(4) == "[*]:" and time.monotonic() < deadline:
        try:
            with_bars = sum(1 for o in page.outputs(4) if o.find_elements(By.CSS_SELECTOR, "progress"))
            rows = page.count(4, "table.dataframe tbody tr")
        except StaleElementReferenceException:
            continue
        most_outputs_with_bars = max(most_outputs_with_bars, with_bars)
        if with_bars:
            seen_bar = True
            if rows >= 2 and shot is None:  # mid-training: the bar above the first epochs' rows
                shot = page.screenshot("fastai-training", cell=4)
                if os.environ.get("DDIP_SCREENSHOTS"):
                    shutil.copy(shot, Path(os.environ["DDIP_SCREENSHOTS"]) / "dip-fastai-progress.png")
        time.sleep(0.05)
    page.wait_done(4, 60)
    assert seen_bar, "no progress bar was ever drawn"
    assert most_outputs_with_bars == 1, "more than one output held a progress bar at once"
    # Finished, as in a single-process notebook: the master bar's display now holds the table.
    assert page.count(4, "progress") == 0
    rows = page.cells()[4].find_elements(By.CSS_SELECTOR, ".jp-Cell-outputArea table.dataframe tbody tr")
    assert [r.find_elements(By.TAG_NAME, "td")[0].text for r in rows] == ["0", "1", "2", "3", "4"]
    header = page.cells()[4].find_element(By.CSS_SELECTOR, ".jp-Cell-outputArea table.dataframe thead").text
    assert "train_loss" in header and "valid_loss" in header
    assert "Epoch" not in page.text(4) and "█" not in page.text(4)  # no console bar
    page.screenshot("fastai-done", cell=4)
    assert shot is not None, "never caught the bar above the table mid-training"


def test_tqdm_loop_shows_one_bar_that_reaches_100_percent(page):
    page.run(5)
    bars = page.cells()[5].find_elements(By.CSS_SELECTOR, ".jp-Cell-outputArea progress")
    assert len(bars) == 1, page.html(5)
    assert bars[0].get_attribute("value") == bars[0].get_attribute("max") == "60"
    assert "100%" in page.text(5) and "60/60" in page.text(5).replace("\u2007", " ")
    assert len(page.outputs(5)) == 1, page.text(5)  # no text bar beside it
    page.screenshot("tqdm", cell=5)


def test_a_traceback_from_two_ranks_renders_once_naming_both(page):
    page.run(6)
    text = strip_ansi(page.text(6))
    assert text.count("ranks 0,1 (the same traceback on each)") == 1, text
    assert text.count("ValueError: boom") == 1 and "raise ValueError" in text
    assert "ddip/magics" not in text
    page.screenshot("traceback", cell=6)


def test_the_stop_button_interrupts_every_rank_and_the_next_cell_runs(page):
    page.run(7, until_started=True)
    page.wait(lambda: "sleeping" in page.text(7), 60, "the cell to print 'sleeping'")
    page.stop()
    page.wait_done(7, 60)
    text = strip_ansi(page.text(7))
    assert "KeyboardInterrupt" in text and re.search(r"\b0, 1\b", text), text
    page.screenshot("stopped", cell=7)
    page.run(8, timeout=60)
    text = page.text(8)
    assert re.search(r"Out\[0:\d+\]: 'after the stop'", text) and re.search(r"Out\[1:\d+\]: 'after the stop'", text), text


def test_a_ranks_breakpoint_is_an_input_box_under_the_cell_answered_by_typing(page):
    # JupyterLab keeps an answered prompt's box in the page, hidden (jp-OutputArea-stdin-hiding):
    # the prompt waiting for an answer is the one box not being hidden.
    waiting = ".jp-OutputArea-stdin-item:not(.jp-OutputArea-stdin-hiding) .jp-Stdin-input"

    def box():
        boxes = page.cells()[9].find_elements(By.CSS_SELECTOR, waiting)
        return boxes[-1] if boxes else None

    def taken(el) -> bool:
        try:
            return el not in page.cells()[9].find_elements(By.CSS_SELECTOR, waiting)
        except StaleElementReferenceException:
            return True

    page.run(9, until_started=True)
    typed = []
    for rank in (0, 1):  # each rank's prompt in turn, labelled; the user types into the box
        for line in ("p x", "c"):
            page.wait(lambda: box() is not None, 60, f"an input box for rank {rank}'s prompt")
            typed.append(page.cells()[9].find_elements(
                By.CSS_SELECTOR, ".jp-OutputArea-stdin-item:not(.jp-OutputArea-stdin-hiding) .jp-Stdin-prompt")[-1]
                .text.strip())
            el = box()
            el.send_keys(line + Keys.ENTER)
            page.wait(lambda: taken(el), 30, f"the answer {line!r} to be taken")
    page.wait_done(9, 60)
    assert sorted(typed) == ["[rank 0] ipdb>"] * 2 + ["[rank 1] ipdb>"] * 2, typed
    # The answered boxes turn into text as the outputs settle: read it once it has.
    seen = {}

    def settled() -> bool:
        seen["text"] = strip_ansi(page.text(9))  # a stale read is retried by wait()
        return "after the breakpoint 3" in seen["text"] and "after the breakpoint 13" in seen["text"]

    page.wait(settled, 30, "the cell's last output")
    text = seen["text"]
    assert "[rank 0] 3" in text and "[rank 1] 13" in text, text
    assert "after the breakpoint 3" in text and "after the breakpoint 13" in text, text
    page.screenshot("breakpoint", cell=9)


PANEL = 10


def panel_rows(page) -> list[list[str]]:
    """The rank panel's rows as the page shows them: each a list of its cells' text."""
    # Read in one script, as one snapshot: the panel redraws about once a second, and rows looked up
    # one call before their cells are read can be gone by then (a stale element).
    return page.d.execute_script(
        "return [...arguments[0].querySelectorAll('.ddip-rank-panel table.ddip-panel tbody tr')]"
        "  .map(r => [...r.querySelectorAll('td')].map(td => td.innerText.trim()));", page.cells()[PANEL])


def panel_text(page) -> str:
    return page.d.execute_script(  # one snapshot, as panel_rows
        "const p = arguments[0].querySelector('.ddip-rank-panel'); return p ? p.innerText : '';", page.cells()[PANEL])


def state_of(page, rank: int) -> str:
    rows = panel_rows(page)
    return rows[rank][3] if len(rows) > rank else ""


def test_the_rank_panel_renders(page):
    page.run(PANEL)
    page.wait(lambda: page.count(PANEL, ".ddip-rank-panel table.ddip-panel") == 1, 30, "the rank panel")
    rows = panel_rows(page)
    assert [r[0] for r in rows] == ["0", "1"] and [r[3] for r in rows] == ["idle", "idle"], rows
    assert all(r[5].endswith("MiB") for r in rows), rows
    # The widget is drawn, not its text fallback (the table %dipstatus prints in a terminal).
    assert "heartbeat" not in page.text(PANEL) and "stop updating" in page.text(PANEL)


def test_the_panel_updates_while_a_cell_runs_and_names_the_straggler(page):
    page.run(PANEL + 1, until_started=True)
    seen = {"titles": set(), "rank 0": set(), "rank 1": set(), "straggler": ""}
    shot, best_shot = None, False
    deadline = time.monotonic() + 120
    while page.prompt(PANEL + 1) == "[*]:" and time.monotonic() < deadline:
        try:
            text, rows = panel_text(page), panel_rows(page)
        except StaleElementReferenceException:
            continue
        seen["titles"].add(text.splitlines()[0])
        seen["rank 0"].add(rows[0][3])
        seen["rank 1"].add(rows[1][3])
        if "is the straggler" in text:
            seen["straggler"] = next(line for line in text.splitlines() if "is the straggler" in line)
            # The docs' picture: the straggler named while rank 0 waits for it (else as named).
            if not best_shot and ("waiting in collective" in rows[0][3] or shot is None):
                shot, best_shot = page.screenshot("rank-panel", cell=PANEL), "waiting in collective" in rows[0][3]
        time.sleep(0.2)
    page.wait_done(PANEL + 1, 60)
    n = re.search(r"\[(\d+)\]:", page.prompt(PANEL + 1)).group(1)
    busy = [t for t in seen["titles"] if "2 busy" in t]
    assert len(busy) >= 3, seen["titles"]  # redrawn again and again while the cell ran
    assert any(s.startswith(f"running cell {n} for") for s in seen["rank 1"]), seen
    assert any(re.match(r"waiting in collective all_reduce #\d+ \(float32\[4\]\) for \d+ s", s)
               for s in seen["rank 0"]), seen
    assert seen["straggler"].startswith("rank 1 is the straggler: the others waited for it"), seen
    # The cell is over: idle again, the last lines they printed, the straggler still named.
    page.wait(lambda: [r[3] for r in panel_rows(page)] == ["idle", "idle"], 30, "the ranks to show idle")
    assert [r[7] for r in panel_rows(page)] == ["step 23 done"] * 2
    assert "rank 1 is the straggler" in panel_text(page)
    if os.environ.get("DDIP_SCREENSHOTS"):
        shutil.copy(shot, Path(os.environ["DDIP_SCREENSHOTS"]) / "rank_panel.png")


def test_the_panel_shows_a_rank_at_its_debugger_prompt_then_dead_then_replaced(page):
    page.run(PANEL + 2, until_started=True)
    box = ".jp-OutputArea-stdin-item:not(.jp-OutputArea-stdin-hiding) .jp-Stdin-input"
    page.wait(lambda: page.cells()[PANEL + 2].find_elements(By.CSS_SELECTOR, box), 60, "rank 1's prompt")
    page.wait(lambda: state_of(page, 1).startswith("at a debugger prompt"), 30, "the panel to show the prompt")
    assert state_of(page, 0) == "idle"
    page.cells()[PANEL + 2].find_element(By.CSS_SELECTOR, box).send_keys("c" + Keys.ENTER)
    page.wait_done(PANEL + 2, 60)
    page.run(PANEL + 3)
    page.wait(lambda: state_of(page, 1) == "dead: killed by SIGKILL", 30, "the panel to show rank 1 dead")
    page.screenshot("rank-panel-dead", cell=PANEL)
    page.run(PANEL + 4, timeout=120)
    page.wait(lambda: state_of(page, 1).startswith("idle (replaced by heal"), 30, "the panel to show the heal")
    assert "killed by SIGKILL" in state_of(page, 1) and state_of(page, 0) == "idle"


def test_tabs_show_each_ranks_own_output(page):
    page.run(PANEL + 5)
    cell = page.cells()[PANEL + 5]
    tabs = ".ddip-rank-tabs .lm-TabBar-tab"
    titles = [t.text for t in cell.find_elements(By.CSS_SELECTOR, tabs)]
    assert titles == ["rank 0", "rank 1 (ValueError)"], titles

    def shown() -> str:  # the open tab's output
        panes = [p for p in cell.find_elements(By.CSS_SELECTOR, ".ddip-rank-tabs .widget-tab-contents > *")
                 if p.is_displayed()]
        return strip_ansi("\n".join(p.text for p in panes))

    def bars() -> list[str]:  # the open tab's progress bars, each by its value
        return [b.get_attribute("value") for b in cell.find_elements(By.CSS_SELECTOR, ".ddip-rank-tabs progress")
                if b.is_displayed()]

    page.wait(lambda: "only rank 0 prints this" in shown(), 30, "rank 0's tab in front")
    assert "rank 1" not in shown() and bars() == ["20"]  # its own bar, updated in place to its end
    cell.find_elements(By.CSS_SELECTOR, tabs)[1].click()
    page.wait(lambda: "only rank 1 prints this" in shown(), 30, "rank 1's tab")
    assert "ValueError: rank 1 fails alone" in shown() and "only rank 0" not in shown() and bars() == ["21"]
    # The cell's error, as without --tabs, below the tabs.
    assert "ValueError" in strip_ansi(page.text(PANEL + 5)).split("only rank 1 prints this")[-1]
    shot = page.screenshot("rank-tabs", cell=PANEL + 5)
    if os.environ.get("DDIP_SCREENSHOTS"):
        shutil.copy(shot, Path(os.environ["DDIP_SCREENSHOTS"]) / "rank_tabs.png")


def test_the_executed_user_guide_opens_and_shows_its_outputs(page, browser, lab):
    page.close()
    shutil.copy(GUIDE, lab["root"] / GUIDE.name)
    guide = nbformat.read(GUIDE, as_version=4)
    saved = [c for c in guide.cells if c.cell_type == "code" and c.get("outputs")]
    assert saved, "examples/user_guide.ipynb has no saved outputs"
    g = Page(browser, lab, GUIDE.name, page.shots)
    expected = sum(len(c.outputs) for c in saved)
    shown = lambda: g.d.find_elements(  # noqa: E731
        By.CSS_SELECTOR, ".jp-NotebookPanel:not(.lm-mod-hidden) .jp-OutputArea-child")
    # Every saved output is drawn (consecutive stream outputs may be drawn as one).
    g.wait(lambda: len(shown()) >= expected * 0.8, 60, f"the guide's {expected} outputs to be drawn")
    assert not g.d.find_elements(By.CSS_SELECTOR, ".jp-NotebookPanel:not(.lm-mod-hidden) .jp-RenderedText "
                                                  "[data-mime-type='application/vnd.jupyter.widget-view+json']")
    page_text = g.d.find_element(By.CSS_SELECTOR, ".jp-NotebookPanel:not(.lm-mod-hidden) .jp-Notebook").text
    assert re.search(r"Out\[0:\d+\]", page_text), page_text[:2000]
    assert "[rank 1]" in page_text
    # Its progress bar, as saved: one bar at 100 %.
    [bar] = g.d.find_elements(By.CSS_SELECTOR, ".jp-NotebookPanel:not(.lm-mod-hidden) .jp-OutputArea-output progress")
    assert bar.get_attribute("value") == bar.get_attribute("max") == "40"
    g.screenshot("user-guide")
