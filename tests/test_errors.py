"""ddip.errors: each way a request is refused is its own exception type, raised for real (a
killed rank, a busy one, a stopped one, a closed group, a start that fails) and carrying the
ranks and the cause as attributes; subclasses of RuntimeError, so `except RuntimeError` still
catches them. The magics' side (how a notebook shows them) is in test_magics.py."""

from __future__ import annotations

import os
import signal

import pytest

import ddip
from conftest import wait_until


def _state(g, rank):
    return next(r["state"] for r in g.status() if r["rank"] == rank)


# In a rank: says it has started (an interrupt that comes before is dropped), then waits.
GATE = ("import pathlib, threading\ngate = threading.Event()\n"
        "def wait_for_gate(started):\n    pathlib.Path(started).touch()\n    return gate.wait(60)\n")


def test_a_dead_rank_is_a_rank_dead_error_naming_the_rank_and_its_exit():
    with ddip.Group(n=3, backend=None) as g:
        os.kill(g.pids[1], signal.SIGKILL)
        assert wait_until(lambda: _state(g, 1) == "dead", 30)
        with pytest.raises(ddip.RankDeadError) as e:
            g.run("1")
        err = e.value
        assert isinstance(err, ddip.RankError) and isinstance(err, RuntimeError)
        assert err.ranks == [1] and err.rank == 1 and err.cause == "killed by SIGKILL"
        [f] = err.failures
        assert f.rank == 1 and f.died and f.exit_signal == signal.SIGKILL
        assert str(err) == ("rank 1 is dead (killed by SIGKILL); call heal() to replace it in its slot, keeping "
                            "the other ranks' variables, or call restart() to start the group again")
        assert err.describe(restart="run %makedip -r", heal="run %makedip --heal") == \
            ("rank 1 is dead (killed by SIGKILL); run %makedip --heal to replace it in its slot, keeping the "
             "other ranks' variables, or run %makedip -r to start the group again")
        # Only requests that need the dead rank are refused.
        assert [r.value for r in g.run("2", ranks=[0, 2])] == [2, 2]
        os.kill(g.pids[2], signal.SIGKILL)
        assert wait_until(lambda: _state(g, 2) == "dead", 30)
        with pytest.raises(ddip.RankDeadError) as e:
            g.apply(abs, -1)
        assert e.value.ranks == [1, 2] and [f.rank for f in e.value.failures] == [1, 2]
        assert str(e.value).startswith("ranks 1, 2 are dead (rank 1: killed by SIGKILL; rank 2: killed by SIGKILL)")
        g.restart()
        assert [r.value for r in g.run("3")] == [3, 3, 3]


def test_a_rank_still_running_an_earlier_request_is_a_rank_busy_error(tmp_path):
    with ddip.Group(n=2, backend=None) as g:
        g.run(GATE)
        started = tmp_path / "started"
        pending = g.apply_async(lambda p: __import__("__main__").wait_for_gate(p), str(started), ranks=[1])
        with pytest.raises(ddip.RankBusyError) as e:
            g.run("1")
        assert isinstance(e.value, ddip.RankError) and isinstance(e.value, RuntimeError)
        assert e.value.ranks == [1] and e.value.rank == 1
        assert e.value.cause.startswith("still busy with an earlier request")
        assert str(e.value).startswith("rank(s) 1 still busy with an earlier request")
        assert [r.value for r in g.run("4", ranks=[0])] == [4]  # the idle rank still takes requests
        assert wait_until(started.exists, 30)
        pending.cancel()
        with pytest.raises(ddip.RemoteError) as e:
            pending.result()
        assert e.value.failures[0].ename == "KeyboardInterrupt"
        assert [r.value for r in g.run("5")] == [5, 5]


def test_a_stopped_rank_is_a_rank_unresponsive_error_until_it_answers_again():
    with ddip.Group(n=2, backend=None, heartbeat_timeout=1.0) as g:
        pid = g.pids[1]
        os.kill(pid, signal.SIGSTOP)
        try:
            assert wait_until(lambda: _state(g, 1) == "unresponsive", 30)
            # Refused at once: sent, it would wait for an answer that can't come.
            with pytest.raises(ddip.RankUnresponsiveError) as e:
                g.run("1")
            err = e.value
            assert isinstance(err, ddip.RankError) and isinstance(err, RuntimeError)
            assert err.ranks == [1] and list(err.seconds) == [1] and err.seconds[1] >= 1.0
            assert err.cause.startswith(f"no heartbeat for {err.seconds[1]:.1f} s")
            assert "wait for them to answer again, or call restart() to replace them" in str(err)
            assert [r.value for r in g.run("2", ranks=[0])] == [2]
        finally:
            os.kill(pid, signal.SIGCONT)
        assert wait_until(lambda: _state(g, 1) == "idle", 30)
        assert [r.value for r in g.run("3")] == [3, 3]


def test_a_rank_that_stops_while_running_fails_its_request_then_refuses_the_next(tmp_path):
    with ddip.Group(n=2, backend=None, heartbeat_timeout=1.0) as g:
        g.run(GATE)
        started = tmp_path / "started"
        pending = g.apply_async(lambda p: __import__("__main__").wait_for_gate(p), str(started), ranks=[1])
        assert wait_until(started.exists, 30)
        pid = g.pids[1]
        os.kill(pid, signal.SIGSTOP)
        try:
            with pytest.raises(ddip.RemoteError) as e:
                pending.result()
            [f] = e.value.failures
            assert f.rank == 1 and f.ename == "Unresponsive" and f.evalue.startswith("no heartbeat for")
            assert f.kind == ddip.FailureKind.UNRESPONSIVE
            assert e.value.headline == str(e.value).splitlines()[0]
            assert e.value.headline.endswith("failed on rank 1; root cause on rank 1: Unresponsive: " + f.evalue)
            with pytest.raises(ddip.RankUnresponsiveError) as e:
                g.run("1", ranks=[1])
            assert e.value.ranks == [1]
        finally:
            os.kill(pid, signal.SIGCONT)
        # Answering again, it is still in the request the notebook gave up on: busy, not stopped.
        assert wait_until(lambda: _state(g, 1) == "busy", 30)
        with pytest.raises(ddip.RankBusyError):
            g.run("1", ranks=[1])
        g.interrupt([1])
        assert wait_until(lambda: _state(g, 1) == "idle", 30)
        assert [r.value for r in g.run("6")] == [6, 6]


def test_a_closed_group_is_a_group_closed_error():
    g = ddip.Group(n=1, backend=None)
    pending = g.apply_async(abs, -7)
    assert pending.result() == [7]
    late = g.apply_async(abs, -8)
    g.close()
    with pytest.raises(ddip.GroupClosedError) as e:
        g.run("1")
    assert isinstance(e.value, RuntimeError) and not isinstance(e.value, ddip.RankError)
    assert e.value.cause is None and not e.value.restarted
    assert str(e.value) == "this group is closed; create a new one (or call restart())"
    with pytest.raises(ddip.GroupClosedError) as e:
        late.result()
    assert e.value.restarted and "restarted or closed since this request was sent" in str(e.value)


def test_a_start_that_times_out_is_a_start_error_with_its_ranks_and_timeout():
    with pytest.raises(ddip.StartError) as e:
        ddip.Group(n=2, backend=None, timeout=0.001, warm=False)
    err = e.value
    assert err.timeout == 0.001 and err.ranks == [0, 1] and err.failure is None
    assert str(err) == "rank(s) 0, 1 did not become ready within 0.001 s; pass timeout= to wait longer"
    assert err.describe(wait_longer="give -t SECONDS").endswith("; give -t SECONDS to wait longer")


def test_a_rank_that_exits_at_start_is_a_start_error_with_its_failure(tmp_path):
    (tmp_path / "sitecustomize.py").write_text("import os\nos._exit(4)\n")
    with pytest.raises(ddip.StartError) as e:
        ddip.Group(n=2, backend=None, env={"PYTHONPATH": str(tmp_path)})
    err = e.value
    assert err.timeout is None and len(err.ranks) == 1 and err.failure.rank == err.ranks[0]
    assert err.failure.died and err.failure.exit_code == 4
    assert str(err).startswith(f"rank {err.ranks[0]} exited while starting (exit code 4)")


def test_one_rule_puts_the_root_cause_first_whatever_the_order_failures_arrive_in():
    # The rule Group, ranch and the magics share: what vanished (died, lost, unresponsive) first,
    # then exceptions by when they were heard of, ddip's own interrupts after them, and ranks
    # ddip stopped or that never stopped last, by rank.
    F, K = ddip.RankFailure, ddip.FailureKind
    failures = [
        F(4, kind=K.STOPPED, evalue="stopped", at=1.0),
        F(3, "KeyboardInterrupt", at=2.0),
        F(2, "ValueError", "late", at=3.0),
        F(5, kind=K.STILL_RUNNING, at=0.5),
        F(1, "RuntimeError", "early", at=2.5),
        F(0, kind=K.DIED, evalue="killed by SIGKILL", exit_signal=9, at=4.0),
        F(6, kind=K.CLOSED, at=0.1),
        F(7, "TypeError", "never heard of"),
    ]
    ordered = ddip.errors.root_cause_first(failures)
    assert [f.rank for f in ordered] == [0, 1, 2, 7, 3, 4, 5, 6]
    assert [f.ename for f in ordered][:1] == ["RankDied"] and ordered[0].died
    assert [f.kind for f in ordered] == ["died", "raised", "raised", "raised", "raised", "stopped",
                                         "still running", "closed"]
    err = ddip.RemoteError(ordered)
    assert err.headline == ("code failed on ranks 0-7; root cause on rank 0: "
                            "RankDied: killed by SIGKILL")
    with pytest.raises(ValueError):
        F(0, kind="exploded")  # a kind outside the model is refused, not carried as a string


def test_a_failure_on_ranks_is_a_rank_failed_error_and_remote_error_its_earlier_name(group2):
    # "remote" means another host in ddip's words; a rank's failure has its own name, and code
    # that catches the earlier one (ipyparallel's) keeps working.
    assert ddip.RemoteError is ddip.RankFailedError
    with pytest.raises(ddip.RemoteError) as caught:
        group2.run("raise KeyError('here')", ranks=[1])
    assert type(caught.value).__name__ == "RankFailedError" and caught.value.ranks == [1]
