"""The rank panel's data (ddip/kernel/panel.py), taken from real ranks without a browser: each
rank's state in words (idle, running, waiting in a collective, dead with its cause, replaced by
heal), CPU % and memory from /proc, GPU use from nvidia-smi by pid (the fake one), the last line
each rank printed, the straggler named, one row per host from 16 hosts on, and the text table
%dipstatus and g.status() show where widgets don't render. The widget itself: test_browser.py."""

from __future__ import annotations

import threading

import pytest

import ddip
from ddip.kernel.panel import HOSTS_FROM, PanelData, RankRow, Sampler, by_host, rows_html, status_table
from conftest import wait_until
from fake_nvidia_smi import fake_gpus  # noqa: F401  (a fixture)

# Rank 1 sleeps before each all_reduce: rank 0 waits in it for rank 1 every time.
SLOW_RANK_1 = ("import os, time, torch, torch.distributed as dist\n"
               "for step in range(6):\n"
               "    time.sleep(0.6 if os.environ['RANK'] == '1' else 0)\n"
               "    dist.all_reduce(torch.ones(4))\n"
               "    print(f'step {step}', end='\\r')\n"
               "print('\\r\\nall steps done\\n')\n")


@pytest.fixture(scope="module")
def g():
    with ddip.Group(n=2, backend="gloo") as group:
        yield group


def test_idle_ranks_with_cpu_memory_and_last_line(g):
    g.run("import os\nprint('first line')\nprint('last line of rank', os.environ['RANK'], end='\\r\\n\\n')")
    sampler = Sampler(g)
    first = sampler.sample()
    assert [r.rank for r in first.rows] == [0, 1] and [r.doing for r in first.rows] == ["idle", "idle"]
    assert [r.pid for r in first.rows] == g.pids
    assert all(r.rss_mb > 10 for r in first.rows)
    assert all(r.cpu_pct is None for r in first.rows)  # a share of time needs two samples
    assert [r.last_line for r in first.rows] == ["last line of rank 0", "last line of rank 1"]
    g.run("import time\nt = time.process_time()\nwhile time.process_time() - t < 0.3: pass")
    second = sampler.sample()
    assert all(r.cpu_pct is not None and r.cpu_pct > 0 for r in second.rows), second.text()
    assert not second.busy and second.straggler == "" and second.hosts is None
    assert [r["last_line"] for r in g.status()] == ["last line of rank 0", "last line of rank 1"]


def test_running_waiting_in_a_collective_and_the_straggler(g):
    sampler = Sampler(g, cell_number=lambda: 12)
    samples: list[PanelData] = []
    run = threading.Thread(target=g.run, args=(SLOW_RANK_1,))
    run.start()
    try:
        wait_until(lambda: samples.append(sampler.sample()) or any(
            s.straggler and "waiting in collective all_reduce" in s.rows[0].doing for s in samples), 30)
    finally:
        run.join()
    busy = [s for s in samples if s.busy]
    assert busy, [s.text() for s in samples]
    assert any(s.rows[1].doing.startswith("running cell 12 for ") for s in busy), [s.text() for s in busy]
    assert any("waiting in collective all_reduce #" in s.rows[0].doing and "(running cell 12 for" in s.rows[0].doing
               for s in busy), [s.text() for s in busy]
    named = [s for s in busy if s.straggler]
    assert named and named[-1].straggler.startswith("rank 1 is the straggler"), [s.text() for s in busy]
    assert [r.straggler for r in named[-1].rows] == [False, True]
    assert "rank 1 is the straggler" in named[-1].text().splitlines()[0]
    after = sampler.sample()  # idle again: the straggler stays named, the bar's last state shown
    assert not after.busy and after.straggler.startswith("rank 1 is the straggler")
    assert [r.last_line for r in after.rows] == ["all steps done"] * 2


def test_a_dead_rank_with_its_cause_then_replaced_by_heal():
    with ddip.Group(n=2, backend="gloo") as g:
        sampler = Sampler(g)
        g.kill([1])
        assert wait_until(lambda: sampler.sample().rows[1].state == "dead", 30)
        row = sampler.sample().rows[1]
        assert row.doing == "dead: killed by SIGKILL" and row.cpu_pct is None and row.rss_mb is None
        g.heal()
        row = sampler.sample().rows[1]
        assert row.state == "idle" and row.pid == g.pids[1]
        assert row.doing == "idle (replaced by heal; the rank before: killed by SIGKILL)", row.doing
        assert sampler.sample().rows[0].doing == "idle"


def test_gpu_use_matched_by_pid(fake_gpus, tmp_path):  # noqa: F811
    smi = fake_gpus(4)
    with ddip.Group(gpus="3,1", backend=None) as g:
        pids = g.pids
        (tmp_path / "fake-nvidia-smi" / "apps.csv").write_text(
            f"{pids[0]}, GPU-3aaa3, 1500\n{pids[1]}, GPU-1aaa1, 700\n4242, GPU-0aaa0, 99\n")
        rows = Sampler(g).sample().rows
        assert smi
    assert [(r.gpu_util, r.gpu_mib) for r in rows] == [(67, 1500), (47, 700)]
    assert "67%, 1500 MiB" in rows[0].cells()


def test_one_row_per_host_from_16_hosts_on():
    def rows(hosts):
        dead = (3, 1)  # a dead rank has no CPU or memory to show
        return [RankRow(rank=h * 2 + i, pid=100 + h * 2 + i, host=f"node{h}", device="cpu",
                        state="dead" if (h, i) == dead else "busy", doing="",
                        cpu_pct=None if (h, i) == dead else 50.0, rss_mb=None if (h, i) == dead else 100.0,
                        straggler=(h, i) == (5, 0)) for h in range(hosts) for i in range(2)]

    assert by_host(rows(HOSTS_FROM - 1)) is None
    hosts = by_host(rows(HOSTS_FROM))
    assert [h.host for h in hosts] == [f"node{h}" for h in range(HOSTS_FROM)]
    assert [r.rank for r in hosts[3].ranks] == [6, 7]
    assert hosts[3].summary == "node3: ranks 6-7: 1 dead, 1 busy; CPU 50%, 100 MiB"
    assert hosts[5].summary == "node5: ranks 10-11: 2 busy; CPU 100%, 200 MiB; the straggler is here"


def test_the_tables():
    row = RankRow(rank=0, pid=7, host="h", device="cpu", state="busy", doing="running cell 3 for 2 s",
                  cpu_pct=99.6, rss_mb=300.2, last_line="<loss> 0.5", straggler=True)
    markup = rows_html([row])
    assert 'class="ddip-busy ddip-straggler"' in markup and "&lt;loss&gt; 0.5" in markup
    assert PanelData([row], "rank 0 is the straggler").text().splitlines() == [
        "rank 0 is the straggler",
        "rank  pid  device  state                   CPU   memory   GPU  last line",
        "0     7    cpu     running cell 3 for 2 s  100%  300 MiB  -    <loss> 0.5"]
    text, html = status_table([{"rank": 0, "pid": 7, "device": "cpu", "state": "idle", "busy_s": None,
                                "rss_mb": 300.0, "heartbeat_ms": 200}], gpus=False)
    assert text.splitlines() == ["rank  pid  device  state  busy for  memory   heartbeat",
                                 "0     7    cpu     idle   -         300 MiB  0.2 s ago"]
    assert html.startswith("<table><thead><tr><th>rank</th>")


def test_the_widget_draws_a_table_then_a_row_per_host_opening_to_its_ranks():
    pytest.importorskip("ipywidgets", reason="ipywidgets is not installed (make setup installs the test extras)")
    from ddip.kernel.panel_view import PanelView

    view = PanelView()
    rows = [RankRow(rank=r, pid=10 + r, host=f"node{r // 2}", device="cpu", state="busy", doing="running cell 4",
                    cpu_pct=90.0, rss_mb=100.0, last_line=f"loss {r}", straggler=r == 5) for r in range(2 * HOSTS_FROM)]
    view.draw(PanelData(rows[:4], "rank 1 is the straggler"))
    assert view.body.children == (view.table,) and view.table.value.count("<tr class=") == 4
    assert "rank 1 is the straggler" in view.straggler.value and "4 busy" in view.title.value
    view.draw(PanelData(rows, "", by_host(rows)))
    assert view.body.children == (view.hosts,) and len(view.hosts.children) == HOSTS_FROM
    assert view.hosts.titles[2] == "node2: ranks 4-5: 2 busy; CPU 180%, 200 MiB; the straggler is here"
    assert "loss 5" in view.hosts.children[2].value and "loss 6" not in view.hosts.children[2].value
    view.stopped("the group is closed")
    assert "the group is closed" in view.title.value and view.stop_button.layout.display == "none"


def test_tabs_where_widgets_do_not_render_are_the_labelled_output_with_a_note(capsys):
    from ddip.magics.render import RankOutput
    from ddip.magics.tabs import NO_WIDGETS, tabbed

    out = tabbed([0, 1])  # no Jupyter kernel here: a terminal's case
    assert type(out) is RankOutput and out.shown == {0, 1}
    assert capsys.readouterr().err == NO_WIDGETS
