"""JupyterLab's visual debugger across ranks, through a real kernel: the test speaks the Debug
Adapter Protocol over the control channel (debug_request / debug_reply) and reads debug_event
messages on IOPub, in the order and with the arguments JupyterLab uses."""

from __future__ import annotations

import queue
import signal
import time

import pytest

from ddip.errors import RemoteError, strip_ansi
from test_magics import running_kernel

GROUP = "%makedip -n 2 --backend none"
# Gutter lines: 1 is %%dip; the breakpoint goes on line 5, where x is set and y not yet.
CELL = """%%dip --see all
import os
rank = int(os.environ["RANK"])
x = rank * 10
y = x + 1
print(f"rank {rank}: y = {y}")"""  # as JupyterLab sends a cell: no newline at its end
BREAK_AT = 5
OWN_CELL = "a = 5\nb = a + 1\nprint('own cell', b)"


class Debugging:
    """A kernel driven as JupyterLab drives it: DAP requests on the control channel, and a cell's
    outputs and debug events read from IOPub while it runs."""

    def __init__(self, k):
        self.k, self.kc = k, k.kc
        self.seq = 0
        self.events: list[dict] = []
        self.outputs: list[dict] = []
        self.running = None

    def request(self, command: str, **arguments) -> dict:
        self.seq += 1
        msg = self.kc.session.msg("debug_request", {"type": "request", "seq": self.seq, "command": command,
                                                     "arguments": arguments})
        self.kc.control_channel.send(msg)
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            reply = self.kc.control_channel.get_msg(timeout=60)
            if reply["parent_header"].get("msg_id") == msg["header"]["msg_id"]:
                return reply["content"]
        raise AssertionError(f"no debug_reply to {command}")

    def start(self):
        """JupyterLab's start: initialize, attach, then debugInfo (restoreState)."""
        init = self.request("initialize", clientID="jupyterlab", clientName="JupyterLab", adapterID="python",
                            pathFormat="path", linesStartAt1=True, columnsStartAt1=True,
                            supportsVariableType=True, supportsVariablePaging=True,
                            supportsRunInTerminalRequest=True, locale="en")
        assert init["success"], init
        assert self.request("attach")["success"]
        info = self.request("debugInfo")
        assert info["body"]["isStarted"], info
        return info

    def break_in(self, code: str, line: int) -> str:
        """A breakpoint on `line` of the cell `code`, set as JupyterLab sets a gutter's: the cell
        dumped, setBreakpoints on its path, configurationDone."""
        path = self.request("dumpCell", code=code)["body"]["sourcePath"]
        bps = self.request("setBreakpoints", source={"path": path}, breakpoints=[{"line": line}],
                           sourceModified=False)
        assert bps["success"] and bps["body"]["breakpoints"][0]["verified"], bps
        assert self.request("configurationDone")["success"]
        return path

    def execute(self, code: str):
        self.outputs, self.events = [], []
        self.running = self.kc.execute(code, stop_on_error=False)

    def wait_event(self, pred, what: str, timeout: float = 60) -> dict:
        """The next debug event (from now on) of the running cell for which pred(event) holds."""
        deadline = time.monotonic() + timeout
        seen = len(self.events)
        while True:
            for ev in self.events[seen:]:
                if pred(ev):
                    self.events.remove(ev)
                    return ev
            seen = len(self.events)
            if time.monotonic() > deadline:
                raise AssertionError(f"no {what} within {timeout} s; events {self.events}, outputs {self.outputs}")
            if self._pump() == "idle":
                raise AssertionError(f"the cell ended without {what}; events {self.events}, outputs {self.outputs}")

    def finish(self, timeout: float = 60) -> dict:
        """Waits for the running cell to end: its execute_reply's content."""
        deadline = time.monotonic() + timeout
        while self._pump() != "idle":
            assert time.monotonic() < deadline, f"cell still running; outputs {self.outputs}"
        while True:
            reply = self.kc.get_shell_msg(timeout=30)
            if reply["parent_header"].get("msg_id") == self.running:
                return reply["content"]

    def text(self) -> str:
        return strip_ansi("".join(o.get("text", "") for o in self.outputs)
                          + "".join("\n".join(o.get("traceback", [])) for o in self.outputs))

    def _pump(self):
        try:
            msg = self.kc.get_iopub_msg(timeout=0.1)
        except queue.Empty:
            return None
        kind, content = msg["msg_type"], msg["content"]
        if kind == "debug_event":
            self.events.append(content)
        elif msg["parent_header"].get("msg_id") != self.running:
            return None
        elif kind == "status" and content["execution_state"] == "idle":
            return "idle"
        elif kind in ("stream", "error"):
            self.outputs.append(content)
        return None


def stopped(ev) -> bool:
    return ev["event"] == "stopped"


@pytest.fixture(scope="module")
def dbg(tmp_path_factory):
    with running_kernel(tmp_path_factory.mktemp("jupyter")) as k:
        assert k.run(GROUP).ok
        d = Debugging(k)
        d.start()
        yield d
        d.request("disconnect", restart=False, terminateDebuggee=False)
        k.run("%makedip -k")


def rank_threads(dbg) -> dict[int, int]:
    """rank -> the id the frontend sees for its MainThread, from a threads request."""
    threads = dbg.request("threads")["body"]["threads"]
    found = {int(t["name"].split()[1].rstrip(":")): t["id"] for t in threads
             if t["name"].startswith("rank ") and t["name"].endswith(": MainThread")}
    return found


def locals_of(dbg, thread: int) -> tuple[dict, dict]:
    """The top frame of `thread` and its local variables (name -> value)."""
    frame = dbg.request("stackTrace", threadId=thread, startFrame=0, levels=20)["body"]["stackFrames"][0]
    scopes = dbg.request("scopes", frameId=frame["id"])["body"]["scopes"]
    ref = next(s["variablesReference"] for s in scopes if s["name"] == "Locals")
    variables = dbg.request("variables", variablesReference=ref)["body"]["variables"]
    return frame, {v["name"]: v["value"] for v in variables}


def test_a_breakpoint_in_a_dip_cell_stops_every_rank_with_its_own_frames_and_variables(dbg):
    path = dbg.break_in(CELL, BREAK_AT)
    dbg.execute(CELL)
    first = dbg.wait_event(stopped, "a rank stopped at the breakpoint")
    second = dbg.wait_event(stopped, "the other rank stopped at the breakpoint")
    threads = rank_threads(dbg)
    assert sorted(threads) == [0, 1], threads
    assert {first["body"]["threadId"], second["body"]["threadId"]} == set(threads.values())

    for rank in (0, 1):
        frame, local = locals_of(dbg, threads[rank])
        assert frame["line"] == BREAK_AT and frame["source"]["path"] == path, frame
        assert local["x"] == str(rank * 10) and "y" not in local, local
        # The debug console and the variable viewer ask in the rank's frame too.
        value = dbg.request("evaluate", expression="x + 3", frameId=frame["id"], context="repl")
        assert value["success"] and value["body"]["result"] == str(rank * 10 + 3), value
        rich = dbg.request("richInspectVariables", variableName="x", frameId=frame["id"])
        assert rich["body"]["data"]["text/plain"] == str(rank * 10), rich
        copied = dbg.request("copyToGlobals", srcVariableName="x", dstVariableName="x_copy", srcFrameId=frame["id"])
        assert copied["success"], copied

    # A step goes to the rank it names: rank 1 moves to the next line, rank 0 stays.
    assert dbg.request("next", threadId=threads[1])["success"]
    ev = dbg.wait_event(lambda e: stopped(e) and e["body"]["threadId"] == threads[1], "rank 1 stopped after a step")
    assert ev["body"]["reason"] == "step"
    frame, local = locals_of(dbg, threads[1])
    assert frame["line"] == BREAK_AT + 1 and local["y"] == "11", (frame, local)
    frame, local = locals_of(dbg, threads[0])
    assert frame["line"] == BREAK_AT and "y" not in local

    # continue for rank 1's thread continues rank 1 alone; rank 0, still stopped, is announced again.
    reply = dbg.request("continue", threadId=threads[1])
    assert reply["success"] and reply["body"]["allThreadsContinued"] is False, reply
    dbg.wait_event(lambda e: e["event"] == "continued" and e["body"]["threadId"] == threads[1], "rank 1 continued")
    dbg.wait_event(lambda e: stopped(e) and e["body"]["threadId"] == threads[0], "rank 0 announced again")
    # JupyterLab's Continue names thread 1 (the notebook's, not stopped): every stopped rank goes on.
    reply = dbg.request("continue", threadId=1)
    assert reply["success"] and reply["body"]["allThreadsContinued"], reply
    done = dbg.finish()
    assert done["status"] == "ok", dbg.outputs
    assert "rank 0: y = 1\n" in dbg.text() and "rank 1: y = 11\n" in dbg.text(), dbg.outputs
    copies = dbg.k.run("%%dip --see all\nprint('copied', x_copy)")  # "Copy to globals" went to each rank's own
    assert "copied 0" in copies.stream() and "copied 10" in copies.stream(), copies.outputs


def test_the_notebooks_own_cell_still_stops_at_its_own_breakpoint(dbg):
    dbg.k.run("%%dip\nz = 1")  # the ranks' debugpy are started and connected: they change nothing here
    dbg.break_in(OWN_CELL, 2)
    dbg.execute(OWN_CELL)
    ev = dbg.wait_event(stopped, "the notebook's cell stopped")
    thread = ev["body"]["threadId"]
    assert thread in {t["id"] for t in dbg.request("threads")["body"]["threads"] if not t["name"].startswith("rank ")}
    frame, local = locals_of(dbg, thread)
    assert frame["line"] == 2 and local["a"] == "5" and "b" not in local, (frame, local)
    assert dbg.request("continue", threadId=thread)["success"]
    assert dbg.finish()["status"] == "ok" and "own cell 6" in dbg.text()


def test_time_stopped_at_a_breakpoint_is_not_counted_by_the_cells_timeout(dbg):
    cell = "%%dip --timeout 1.5\nv = 3\nw = v * 2\nprint('w is', w)\n"  # a newline at its end too
    dbg.break_in(cell, 3)
    dbg.execute(cell)
    threads = {dbg.wait_event(stopped, "a rank stopped")["body"]["threadId"],
               dbg.wait_event(stopped, "the other rank stopped")["body"]["threadId"]}
    time.sleep(3)  # the user looks at the variables for longer than the cell's --timeout
    assert dbg.request("continue", threadId=1)["success"]
    done = dbg.finish()
    assert done["status"] == "ok" and "w is 6" in dbg.text(), dbg.outputs
    assert threads <= {e["body"]["threadId"] for e in dbg.events if e["event"] == "continued"}


def test_the_stop_button_at_a_breakpoint_ends_the_cell_and_the_group_goes_on(dbg):
    cell = "%%dip --see all\nimport os\nu = int(os.environ['RANK']) + 100\nprint('u is', u)"
    path = dbg.break_in(cell, 4)
    dbg.execute(cell)
    threads = {dbg.wait_event(stopped, "a rank stopped")["body"]["threadId"],
               dbg.wait_event(stopped, "the other rank stopped")["body"]["threadId"]}
    dbg.k.km.interrupt_kernel()
    done = dbg.finish()
    assert done["status"] == "error" and "KeyboardInterrupt" in dbg.text() and "u is" not in dbg.text(), dbg.outputs
    # The frontend hears that both ranks went on, and nothing is left stopped.
    assert threads <= {e["body"]["threadId"] for e in dbg.events if e["event"] == "continued"}
    assert dbg.request("debugInfo")["body"]["stoppedThreads"] == []
    # The group and its ranks' debuggers go on: the same cell stops at its breakpoint again, and
    # runs to its end on both ranks.
    dbg.execute(cell)
    for _ in range(2):
        frame, local = locals_of(dbg, dbg.wait_event(stopped, "a rank stopped again")["body"]["threadId"])
        assert frame["line"] == 4 and frame["source"]["path"] == path and local["u"] in ("100", "101"), local
    assert dbg.request("continue", threadId=1)["success"]
    assert dbg.finish()["status"] == "ok" and "u is 100" in dbg.text() and "u is 101" in dbg.text(), dbg.outputs


def test_autodip_cells_stop_at_their_breakpoints_too(dbg):
    assert dbg.k.run('%autodip on -a "--see all"').ok
    try:
        cell = "import os\nq = int(os.environ['RANK']) + 7\nprint('q is', q)"
        path = dbg.break_in(cell, 3)
        dbg.execute(cell)
        for _ in range(2):
            thread = dbg.wait_event(stopped, "a rank stopped")["body"]["threadId"]
            frame, local = locals_of(dbg, thread)
            assert frame["line"] == 3 and frame["source"]["path"] == path, frame
        assert dbg.request("continue", threadId=1)["success"]
        assert dbg.finish()["status"] == "ok" and "q is 7" in dbg.text() and "q is 8" in dbg.text(), dbg.outputs
    finally:
        dbg.k.run("%autodip off")


def test_switching_the_debugger_off_lets_stopped_ranks_go_on_and_on_again_stops_them_again(dbg):
    cell = "%%dip --see all\nimport os\ns = int(os.environ['RANK']) + 50\nprint('s is', s)"
    dbg.break_in(cell, 4)
    dbg.execute(cell)
    dbg.wait_event(stopped, "a rank stopped")
    dbg.wait_event(stopped, "the other rank stopped")
    assert dbg.request("disconnect", restart=False, terminateDebuggee=False)["success"]
    assert dbg.finish()["status"] == "ok" and "s is 50" in dbg.text() and "s is 51" in dbg.text(), dbg.outputs
    # Off, the ranks' debugpy stop nothing; on again (JupyterLab sets its breakpoints anew), they do.
    dbg.execute(cell)
    assert dbg.finish()["status"] == "ok" and not [e for e in dbg.events if stopped(e)], dbg.events
    dbg.start()
    dbg.break_in(cell, 4)
    dbg.execute(cell)
    for _ in range(2):
        frame, local = locals_of(dbg, dbg.wait_event(stopped, "a rank stopped again")["body"]["threadId"])
        assert frame["line"] == 4 and local["s"] in ("50", "51"), (frame, local)
    assert dbg.request("continue", threadId=1)["success"]
    assert dbg.finish()["status"] == "ok" and "s is 50" in dbg.text() and "s is 51" in dbg.text(), dbg.outputs


def test_a_cells_file_name_and_first_line_are_checked_and_name_its_code_in_the_rank(group2, tmp_path):
    for bad in [("cell.py", 0), ("cell.py",), "cell.py", (3, 1), ("cell.py", 1.5)]:
        with pytest.raises(TypeError, match=r"cell must be \(file name, first line >= 1\)"):
            group2.run("1", cell=bad)
    # The code's lines are the whole cell's: line 2 of the code is line 4 of the file.
    path = str(tmp_path / "cell.py")
    with pytest.raises(RemoteError) as err:
        group2.run("a = 1\nraise ValueError('from line 2')", cell=(path, 3), ranks=[1])
    failure = err.value.failures[0]
    assert failure.rank == 1 and "line 4" in strip_ansi("\n".join(failure.traceback)), failure.traceback
    assert group2.apply(_failed_code_file, ranks=[1]) == [path]


def _failed_code_file():
    """In a rank: the file name of the code whose exception it keeps for %dipdebug."""
    import sys

    tb = sys.last_traceback
    while tb.tb_next is not None:
        tb = tb.tb_next
    return tb.tb_frame.f_code.co_filename


def test_a_kernel_that_dies_while_ranks_are_stopped_takes_them_along(tmp_path_factory):
    from conftest import alive, wait_until

    with running_kernel(tmp_path_factory.mktemp("jupyter")) as k:
        assert k.run(GROUP).ok
        cell = k.run("%%dip --see all\nimport os\nos.getpid()")
        pids = [int(p.rsplit(": ", 1)[1]) for p in cell.plain]
        assert len(pids) == 2 and all(alive(p) for p in pids), cell.plain
        d = Debugging(k)
        d.start()
        code = "%%dip\nq = 1\nq += 1"
        d.break_in(code, 3)
        d.execute(code)
        d.wait_event(stopped, "a rank stopped")
        d.wait_event(stopped, "the other rank stopped")
        k.km.signal_kernel(signal.SIGKILL)  # no clean-up code of the kernel runs
        # Stopped in their debugpy (which runs inside them: no process of its own), they go too.
        assert wait_until(lambda: not any(alive(p) for p in pids), 30), [p for p in pids if alive(p)]
