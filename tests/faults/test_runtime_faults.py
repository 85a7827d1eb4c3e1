"""The runtime's failure paths with real worker processes: a notebook process that reaps children
itself, running out of file descriptors, the kernel's death, stopping ranks that won't stop,
unresponsive ranks, stack dumps of busy ranks, and smaller fixes (stdin, C stdio, shared memory)."""

import os
import signal
import subprocess
import sys
import textwrap
import threading
import time

import pytest

import ddip
from ddip import _core
from ddip.messages import Run, dumps_framed, loads
from conftest import PY, alive, wait_until


def run_script(code: str, timeout: float = 120, **kwargs) -> subprocess.CompletedProcess:
    """Runs `code` in a fresh Python process: it plays the notebook's kernel."""
    return subprocess.run([PY, "-c", textwrap.dedent(code)], capture_output=True, text=True,
                          timeout=timeout, **kwargs)


def send_run(coord, seq: int, code: str, slot: int = 0):
    """A `run` request sent straight to the coordinator, so the test reads the events itself."""
    payload, _ = dumps_framed(Run(code), None, None)
    coord.send([slot], _core.REQUEST, seq, payload)


def events_until(coord, predicate, timeout: float = 30.0) -> list:
    """Events read from the coordinator up to and including the first that satisfies predicate."""
    seen = []
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        ev = coord.next_event(100)
        if ev is None:
            continue
        for fd in ev.fds:
            os.close(fd)
        seen.append(ev)
        if predicate(ev):
            return seen
    raise AssertionError(f"no such event within {timeout} s; saw {seen}")


# -- 1. a foreign reaper in the notebook process --------------------------------------------------

@pytest.mark.parametrize("reaper", ["sigchld-ignored", "os.wait-thread"])
def test_a_notebook_that_reaps_children_itself_keeps_a_working_group(reaper):
    # Before: the IO thread's waitid failed with ECHILD, its error handler threw again, and
    # std::terminate killed the whole kernel.
    r = run_script(f"""
        import os, signal, threading, time
        import ddip
        if {reaper!r} == "sigchld-ignored":
            signal.signal(signal.SIGCHLD, signal.SIG_IGN)   # Linux reaps every child itself
        def reap():
            while True:
                try:
                    os.wait()                                  # takes any child's status
                except ChildProcessError:
                    time.sleep(0.01)
        threading.Thread(target=reap, daemon=True).start()
        with ddip.Group(n=2, backend=None) as g:
            print("values", [r.value for r in g.run("40 + 2")], flush=True)
            os.kill(g.pids[1], signal.SIGKILL)
            try:
                g.run("1", ranks=[1])
            except Exception as e:
                print("dead:", e, flush=True)
            print("values", [r.value for r in g.run("7", ranks=[0])], flush=True)
        print("ok", flush=True)
    """)
    assert r.returncode == 0, r.stderr
    lines = r.stdout.splitlines()
    assert lines[0] == "values [42, 42]"
    dead = r.stdout.split("dead:", 1)[1].split("\nvalues", 1)[0]
    assert "rank 1" in dead
    # The status survives on Linux 6.15+ (the pidfd keeps it); before that it is unknown, and
    # the runtime says so (ExitStatus::describe, the words every way in uses).
    assert "killed by SIGKILL" in dead or "exit status unknown (reaped by someone else" in dead, dead
    assert lines[-2:] == ["values [7]", "ok"]


# -- 2. out of file descriptors ------------------------------------------------------------------

def test_a_rank_out_of_fds_fails_the_request_and_lives_on():
    np = pytest.importorskip("numpy")
    with ddip.Group(n=1, backend=None) as g:
        g.run(textwrap.dedent("""
            import os, resource
            _soft, _hard = resource.getrlimit(resource.RLIMIT_NOFILE)
            _filler = os.open("/dev/null", os.O_RDONLY)   # the lowest free fd: all below are taken
            resource.setrlimit(resource.RLIMIT_NOFILE, (_filler + 1, _hard))
        """))
        big = np.arange(1 << 20, dtype=np.float64)  # 8 MiB: travels as a shared-memory fd
        with pytest.raises(ddip.RemoteError) as info:
            g.push(a=big)
        assert "out of file descriptors" in str(info.value)
        assert "ulimit -n" in str(info.value)
        # The rank lives on, released the request's segment, and works again with fds to spare.
        assert wait_until(lambda: g._coord.pool_stats()[0] == 0, 10)
        g.run("resource.setrlimit(resource.RLIMIT_NOFILE, (_soft, _hard)); os.close(_filler)")
        g.push(a=big)
        assert g.run("float(a.sum())")[0].value == float(big.sum())


# -- 3. a rank's children die with the kernel ----------------------------------------------------

def test_a_ranks_own_children_die_when_the_kernel_is_killed():
    # Before: PR_SET_PDEATHSIG killed the rank alone; its subprocess (a DataLoader worker, `!cmd`)
    # lived on, holding its memory.
    kernel = subprocess.Popen([PY, "-c", textwrap.dedent("""
        import sys
        import ddip
        g = ddip.Group(n=1, backend=None)
        r = g.run("import subprocess\\np = subprocess.Popen(['sleep', '300'])\\np.pid")
        print(r[0].value, g.pids[0], flush=True)
        sys.stdin.read()   # until killed
    """)], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    sleeper = rank = None
    try:
        sleeper, rank = map(int, kernel.stdout.readline().split())
        assert alive(sleeper)
        kernel.kill()
        kernel.wait()
        assert wait_until(lambda: not alive(sleeper), 2), "the rank's child outlived the kernel"
        assert wait_until(lambda: not alive(rank), 2)
    finally:
        kernel.kill()
        kernel.wait()
        for pid in (sleeper, rank):
            if pid and alive(pid):
                os.kill(pid, signal.SIGKILL)


# -- 4. bounded, interruptible stop --------------------------------------------------------------

def test_close_keeps_reading_output_so_a_rank_flooding_on_sigterm_exits_by_itself():
    # Before: after the shutdown grace nothing read the pipes, so a SIGTERM handler that printed
    # more than a pipe holds blocked until SIGKILL.
    with ddip.Group(n=1, backend=None) as g:
        g.run(textwrap.dedent("""
            import os, signal
            def _flood(signum, frame):
                for _ in range(2048):
                    os.write(1, b"x" * 1023 + b"\\n")
                os._exit(7)
            signal.signal(signal.SIGTERM, _flood)
        """))
        coord = g._coord
        send_run(coord, 10**6, "import time; time.sleep(60)")  # ignores the shutdown frame
        assert coord.close(300) == []
        events = []
        while (ev := coord.next_event(0)) is not None:
            events.append(ev)
        exits = [e for e in events if e.kind == "exited"]
        assert [(e.code, e.signal) for e in exits] == [(7, 0)]  # its own exit, not SIGKILL
        flooded = b"".join(e.data for e in events if e.kind == "output" and e.stream == "stdout")
        assert flooded.count(b"x" * 1023 + b"\n") == 2048


def test_ctrl_c_interrupts_close_and_the_ranks_are_still_stopped():
    # Before: close() waited in C++ with the GIL released and no slices: Ctrl-C waited for it.
    with ddip.Group(n=1, backend=None) as g:
        g.run("import signal; signal.signal(signal.SIGTERM, signal.SIG_IGN)")
        coord, pid = g._coord, g.pids[0]
        send_run(coord, 10**6, "import time; time.sleep(120)")
        timer = threading.Timer(0.5, os.kill, (os.getpid(), signal.SIGINT))
        started = time.monotonic()
        timer.start()
        with pytest.raises(KeyboardInterrupt):
            coord.close(60_000)  # would take 2 minutes: shutdown and SIGTERM are ignored
        assert time.monotonic() - started < 10
        assert alive(pid)  # still stopping, in the background
        assert coord.close(0) == []  # a shorter grace hastens it: SIGKILL now
        assert not alive(pid)


def test_ctrl_c_during_group_close_kills_the_ranks_now():
    # Before: the interrupted close left the ranks in their grace period, and the coordinator's
    # destructor (GIL held, whenever the traceback let go of it) sat out the rest of it.
    g = ddip.Group(n=1, backend=None)
    g.run("import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN)")
    pid = g.pids[0]
    busy = g.apply_async(lambda: __import__("time").sleep(120))  # deaf to the shutdown request
    timer = threading.Timer(0.5, os.kill, (os.getpid(), signal.SIGINT))
    timer.start()
    with pytest.raises(KeyboardInterrupt) as excinfo:
        g.close(grace=60)
    assert not alive(pid), "Ctrl-C during close() must SIGKILL the ranks before it returns"
    assert g.closed
    del excinfo, busy


# -- 5. heartbeats that detect something ---------------------------------------------------------

def test_a_stopped_rank_is_reported_unresponsive_then_responsive():
    env = dict(os.environ, RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", DDIP_SLOT="0",
               CUDA_VISIBLE_DEVICES="", PYTHONUNBUFFERED="1")
    env.pop("DDIP_BACKEND", None)
    spec = ([PY, "-c", "import ddip.worker; ddip.worker.main()"], [f"{k}={v}" for k, v in env.items()],
            os.getcwd())
    coord = _core.Coordinator([spec], heartbeat_ms=50, heartbeat_timeout_ms=500)
    try:
        events_until(coord, lambda e: e.kind == "hello")
        pid = coord.pids[0]
        os.kill(pid, signal.SIGSTOP)
        ev = events_until(coord, lambda e: e.kind == "unresponsive")[-1]
        assert ev.slot == 0 and ev.age >= 0.5
        os.kill(pid, signal.SIGCONT)
        ev = events_until(coord, lambda e: e.kind == "responsive")[-1]
        assert (ev.kind, ev.slot) == ("responsive", 0)
    finally:
        os.kill(coord.pids[0], signal.SIGCONT)
        coord.close(1000)


# -- 6. stack dumps of busy ranks ----------------------------------------------------------------

def test_a_rank_busy_in_c_code_answers_a_stack_request_naming_its_frame():
    with ddip.Group(n=1, backend=None) as g:
        g.run("import time\ndef sleepy_function():\n    print('sleeping', flush=True)\n    time.sleep(30)")
        coord = g._coord
        send_run(coord, 555, "sleepy_function()")
        events_until(coord, lambda e: e.kind == "output" and b"sleeping" in e.data)
        coord.send([0], _core.STACK_REQUEST, 999, b"")
        reply = events_until(coord, lambda e: e.kind == "stacks")[-1]
        assert reply.seq == 999
        text = reply.data.decode()
        assert "sleepy_function" in text, text
        coord.signal(0, signal.SIGINT)  # end the cell; the group is usable again
        events_until(coord, lambda e: e.kind == "done" and e.seq == 555)
        g._state[0] = "idle"  # the request above bypassed the Group's bookkeeping
        assert g.run("1 + 1")[0].value == 2


# -- 7. smaller runtime fixes --------------------------------------------------------------------

def test_input_in_a_rank_sees_end_of_file_instead_of_hanging():
    # The kernel process's stdin is a pipe that stays open, as a terminal's would: before, a rank
    # inherited it and input() waited forever.
    kernel = subprocess.Popen([PY, "-c", textwrap.dedent("""
        import ddip
        with ddip.Group(n=1, backend=None) as g:
            res = g.run("try:\\n    input()\\nexcept EOFError:\\n    print('EOF')", timeout=30)
            print(res[0].stdout.strip(), flush=True)
    """)], stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        assert kernel.stdout.readline().strip() == "EOF", kernel.stderr.read()
        assert kernel.wait(60) == 0
    finally:
        kernel.kill()
        kernel.wait()


def test_c_level_printf_is_in_the_output_of_its_cell():
    # Ranks run unbuffered, C stdio included, but a C library may buffer its stream again (as
    # here); what it printed must still come with its cell, before "done".
    with ddip.Group(n=1, backend=None) as g:
        res = g.run(textwrap.dedent("""
            import ctypes
            libc = ctypes.CDLL(None)
            _cbuf = ctypes.create_string_buffer(1 << 16)  # lives as long as the rank's namespace
            libc.setvbuf(ctypes.c_void_p.in_dll(libc, "stdout"), _cbuf, 0, len(_cbuf))  # _IOFBF
            libc.printf(b"from C\\n")
            None
        """))
        assert "from C" in res[0].stdout


def test_idle_shared_memory_can_be_trimmed_while_the_group_lives():
    np = pytest.importorskip("numpy")
    with ddip.Group(n=1, backend=None) as g:
        g.push(a=np.zeros(4 << 20, dtype=np.uint8))
        g.run("del a")
        assert wait_until(lambda: g._coord.pool_stats()[1] >= 4 << 20, 10)  # kept for reuse
        assert g._coord.trim_pool() >= 4 << 20
        in_use, free_bytes, created = g._coord.pool_stats()
        assert (in_use, free_bytes) == (0, 0) and created == 1
