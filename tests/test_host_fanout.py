"""A request to ranks on other hosts crosses each host's link once, and their replies come back as
one frame per host (issue 34, item 1): each host's agent writes the request to its ranks and
gathers their replies, byte-equal ones as one entry that the notebook unpickles once. Four
network-namespace hosts with their own sshd (netns_hosts.py), four ranks on each.

Needs root, iproute2 and openssh (as test_multihost.py); skipped otherwise.
"""

from __future__ import annotations

import collections
import os
import sys
import tempfile

import numpy as np
import pytest

import ddip
from ddip.kernel import group as _group

from netns_hosts import Hosts, _missing

_why_not = _missing()
pytestmark = pytest.mark.skipif(_why_not is not None, reason=_why_not or "")

HOSTS = ("A", "B", "C", "D")
PER_HOST = 4
N = len(HOSTS) * PER_HOST


@pytest.fixture(scope="module")
def hosts():
    h = Hosts(HOSTS)
    yield h
    h.close()


@pytest.fixture(scope="module")
def group(hosts):
    # Each agent holds its ranks' replies until the last of them replied, however slowly a loaded
    # machine runs them: one frame per host and request, which the tests count.
    old, _group.REPLY_WINDOW_MS = _group.REPLY_WINDOW_MS, 120_000
    try:
        g = ddip.Group(hosts=",".join(f"{hosts.addr[h]}:{PER_HOST}" for h in HOSTS),
                       launcher=hosts.launcher, backend=None, timeout=120)
    finally:
        _group.REPLY_WINDOW_MS = old
    yield g
    g.close()


def _reply_frames(g) -> int:
    return g.runtime.coord.host_reply_frames


def test_a_request_comes_back_as_one_reply_frame_per_host(group):
    before = _reply_frames(group)
    for _ in range(3):
        assert [r.value for r in group.run("pass")] == [None] * N
    assert _reply_frames(group) - before == 3 * len(HOSTS)


def test_each_rank_gets_its_own_value_and_output_alike_ones_too(group):
    seen = []
    before = _reply_frames(group)
    results = group.run("import os\nr = int(os.environ['RANK'])\nprint('rank', r)\nprint('same line')\nr * 10",
                        on_output=lambda rank, stream, text: seen.append((rank, stream, text)))
    assert [r.rank for r in results] == list(range(N))
    assert [r.value for r in results] == [10 * i for i in range(N)]
    # each rank's output came before its reply: it is in the rank's own result
    assert [r.stdout for r in results] == [f"rank {i}\nsame line\n" for i in range(N)]
    assert sorted(rank for rank, stream, text in seen if "same line" in text) == list(range(N))
    # One list, alike on every rank, sent once per host: each rank's result has a list of its own.
    results = group.run("[1, 2]")
    values = [r.value for r in results]
    assert values == [[1, 2]] * N
    assert len({id(v) for v in values}) == N
    values[0].append(3)
    assert values[1] == [1, 2]
    assert _reply_frames(group) - before == 2 * len(HOSTS)


def _calls(group, ranks) -> collections.Counter:
    """The functions the notebook calls during one run("pass") to `ranks`, counted (after a first
    run to warm up): Python functions by their code, C functions by name."""
    group.run("pass", ranks=ranks)
    counts = collections.Counter()

    def count(frame, event, arg):
        if event == "call":
            self = frame.f_locals.get("self")
            counts[(frame.f_code.co_filename, frame.f_code.co_name, type(self).__name__)] += 1
        elif event == "c_call":
            counts[("C", arg.__qualname__, None)] += 1

    sys.setprofile(count)
    try:
        group.run("pass", ranks=ranks)
    finally:
        sys.setprofile(None)
    return counts


def test_the_notebooks_work_per_request_grows_with_the_hosts_not_the_ranks(group):
    # Four ranks per host against one: the same number of frames each way. The one call per rank
    # left is making its RankResult (and its list of displays); replies that came alike are
    # handed to every rank of their host in one pass.
    one_per_host = _calls(group, [h * PER_HOST for h in range(len(HOSTS))])
    every = _calls(group, None)
    grew = {key: every[key] - one_per_host[key] for key in every
            if every[key] - one_per_host[key] >= N - len(HOSTS)}
    assert set(grew) <= {("<string>", "__init__", "RankResult"), ("C", "list", None)}, grew


def test_errors_on_some_ranks_are_each_ranks_own(group):
    code = ("import os\nr = int(os.environ['RANK'])\n"
            "if r % 5 == 0:\n    raise ValueError(f'bad {r}')\n'ok'")
    with pytest.raises(ddip.RemoteError) as info:
        group.run(code)
    assert info.value.ranks == [r for r in range(N) if r % 5 == 0]
    by_rank = {r.rank: r for r in info.value.results}
    for rank, r in by_rank.items():
        if rank % 5 == 0:
            assert (r.error.ename, r.error.evalue, r.value) == ("ValueError", f"bad {rank}", None)
        else:
            assert (r.error, r.value) == (None, "ok")
    # the ranks serve on
    assert [r.value for r in group.run("1 + 1")] == [2] * N


def test_a_reply_the_notebook_cannot_unpickle_fails_each_of_its_ranks_and_only_them(group, tmp_path):
    # Every rank returns an object of a module only the ranks can import: one reply per host,
    # which the notebook can't unpickle; each rank gets the failure, named, and the group goes on.
    (tmp_path / "only_in_ranks.py").write_text("class Thing:\n    pass\n")
    with pytest.raises(ddip.RemoteError) as info:
        group.run(f"import sys\nsys.path.insert(0, {str(tmp_path)!r})\nimport only_in_ranks\nonly_in_ranks.Thing()")
    assert info.value.ranks == list(range(N))
    for r in info.value.results:
        assert r.error.ename == "UnpicklingError" and "only_in_ranks" in r.error.evalue, r.error
        assert "is what it returned importable here?" in r.error.evalue
    assert [r.value for r in group.run("1 + 1")] == [2] * N


def test_a_push_crosses_each_hosts_link_once(group, hosts):
    # In band (a str) and out of band (a numpy array, through shared memory): once per host.
    arr = np.arange(2 << 20, dtype=np.float64)  # 16 MiB
    text = "x" * (8 << 20)
    for value, size in ((text, len(text)), (arr, arr.nbytes)):
        before = hosts.link_counters()
        group.push(big=value)
        after = hosts.link_counters()
        for h in HOSTS:
            received = after[h][0] - before[h][0]
            assert size <= received < 2 * size, (h, received, size)
    results = group.run("float(big.sum()), big.shape, big.dtype.str")
    assert [r.value for r in results] == [(float(arr.sum()), arr.shape, "<f8")] * N


GATE = """
import os, time
def gate(path):
    if int(os.environ["RANK"]) != 2:
        return "quick"
    for _ in range(2400):  # until the notebook has seen the others' replies
        if os.path.exists(path):
            return "released"
        time.sleep(0.05)
    return "never released"
"""


def test_a_rank_that_hangs_does_not_hold_its_hosts_other_replies(hosts):
    # The default window: replies held for the host's slowest rank only that long.
    g = ddip.Group(hosts=f"{hosts.addr['A']}:3", launcher=hosts.launcher, backend=None, timeout=120)
    try:
        g.run(GATE)
        path = os.path.join(tempfile.mkdtemp(prefix="ddip-test-gate-"), "open")
        done = []

        def on_done(result):
            done.append(result.rank)
            if set(done) >= {0, 1} and not os.path.exists(path):
                open(path, "w").close()  # rank 2 finishes only after the others' replies arrived

        pending = g.apply_async(lambda p: __import__("__main__").gate(p), path)
        results = pending.results(on_done=on_done)
        assert done == [0, 1, 2] or done == [1, 0, 2]
        assert [r.value for r in results] == ["quick", "quick", "released"]
    finally:
        g.close()
