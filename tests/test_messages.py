"""ddip.messages, in one process: what a frame's payload carries, in band and out of band.

The same functions run on both ends of every request and reply (tests/test_group.py sends them
between real processes); here each property is checked on its own: which buffers leave the
pickle, that the receiver maps them writable without touching the sender's bytes, that a failed
pickle gives back what it stored, and that segments are released once nothing refers to them."""

from __future__ import annotations

import gc
import os
import pickle
import threading

import numpy as np
import pytest

from ddip import messages as M


def _reply(obj):
    """obj packed as a rank packs a reply (one fresh memfd per large buffer), and its fds."""
    return M.dumps_framed(obj, lambda raw: (0, M.memfd_with(raw)), os.close)


def _reply_fds() -> int:
    """This process's fds on reply memfds (only the code under test makes them)."""
    n = 0
    for fd in os.listdir("/proc/self/fd"):
        try:
            n += os.readlink(f"/proc/self/fd/{fd}").startswith("/memfd:ddip-reply")
        except OSError:
            pass
    return n


def test_small_values_stay_in_the_pickle():
    stored = []
    payload, handles = M.dumps_framed({"x": np.arange(10), "s": "text"}, stored.append, None)
    assert handles == [] and stored == []
    out = M.loads_framed(payload, [])
    assert out["s"] == "text" and out["x"].tolist() == list(range(10))


def test_large_buffers_travel_out_of_band_and_arrive_writable():
    big = np.arange(M.OOB_THRESHOLD // 8 * 3, dtype=np.int64)  # 3 MiB
    payload, fds = _reply({"big": big, "small": np.ones(4)})
    assert len(fds) == 1  # only the big one left the pickle
    assert len(payload) < M.OOB_THRESHOLD // 4  # and its bytes are not in the payload
    out = M.loads_framed(payload, fds)
    assert np.array_equal(out["big"], big) and out["small"].tolist() == [1.0] * 4
    out["big"][0] = -1  # private, copy-on-write: the receiver may write to what it got
    assert big[0] == 0


def test_the_receiver_closes_every_fd_it_was_given():
    before = _reply_fds()
    payload, fds = _reply([np.zeros(M.OOB_THRESHOLD, dtype=np.uint8) for _ in range(3)])
    assert len(fds) == 3
    arrays = M.loads_framed(payload, fds)
    for fd in fds:  # the fds that came with the frame are closed at once...
        with pytest.raises(OSError):
            os.fstat(fd)
    assert all(a.nbytes == M.OOB_THRESHOLD for a in arrays)
    del arrays
    gc.collect()
    assert _reply_fds() == before  # ...and nothing is left once the arrays are gone


def test_a_segment_is_released_once_nothing_refers_to_it():
    released = []
    payload, fds = _reply(np.ones(M.OOB_THRESHOLD, dtype=np.uint8))
    arr = M.loads_framed(payload, fds, released.append)
    view = arr[10:20]
    del arr
    gc.collect()
    assert released == []  # a slice still holds the mapping
    del view
    gc.collect()
    assert released == [0]


def test_a_pickle_that_fails_half_way_gives_back_what_it_stored():
    class Unpicklable:
        def __reduce__(self):
            raise TypeError("not today")

    kept, discarded = [], []

    def put(raw):
        kept.append(raw.nbytes)
        return len(kept), len(kept)

    with pytest.raises(TypeError, match="not today"):
        M.dumps_framed([np.ones(M.OOB_THRESHOLD, dtype=np.uint8), Unpicklable()], put, discarded.append)
    assert discarded == [h for h in range(1, len(kept) + 1)]


def test_notebook_functions_travel_by_value():
    # What cloudpickle does for __main__, checked on a function made to look like the notebook's.
    ns = {"__name__": "__main__"}
    exec("def triple(x):\n    return 3 * x\n", ns)
    payload, _ = M.dumps_framed(ns["triple"], None, None)
    assert b"triple" in payload
    assert M.loads_framed(payload, [])(5) == 15


def test_picklable_says_what_can_be_sent():
    assert M.picklable(np.ones(M.OOB_THRESHOLD * 2, dtype=np.uint8))  # without copying it out
    assert not M.picklable(threading.Lock())
    assert M.RemoteValue("Lock", "<lock>") == pickle.loads(pickle.dumps(M.RemoteValue("Lock", "<lock>")))


def test_cpu_tensors_go_out_of_band_as_their_bytes():
    torch = pytest.importorskip("torch")
    t = torch.arange(M.OOB_THRESHOLD // 4, dtype=torch.float32).reshape(256, -1)
    payload, fds = _reply(t)
    assert len(fds) == 1
    back = M.loads_framed(payload, fds)
    assert back.dtype == t.dtype and back.shape == t.shape and torch.equal(back, t)
    view = torch.arange(10)[2:5]  # a view of a bigger storage: pickled by torch itself, intact
    assert M.loads_framed(*_reply(view)).tolist() == [2, 3, 4]


# -- the protocol's records -------------------------------------------------------------------------

def _records():
    err = M.ErrorInfo("ValueError", "bad", ["Traceback ...", "ValueError: bad"], ValueError("bad"))
    return [M.Run("x = 1"), M.Run("1", values=False, cell=("/tmp/cell.py", 3), silent=True),
            M.Apply(divmod, (7, 2), {"k": 1}), M.Push({"a": np.arange(3)}), M.Pull(("a", "b")), M.Debug(),
            M.Done(), M.Done([1, 2], None, ({"text/plain": "[1, 2]"}, {}), 4), M.Done(error=err),
            M.PromptAnswer("next"), M.PromptAnswer(stop=True)]


@pytest.mark.parametrize("record", _records(), ids=lambda r: type(r).__name__)
def test_every_record_round_trips_through_a_frame(record):
    payload, fds = _reply(record)
    back = M.loads_framed(payload, fds)
    assert type(back) is type(record)
    for name in type(record).__dataclass_fields__:
        a, b = getattr(back, name), getattr(record, name)
        if isinstance(b, dict) and "a" in b:
            assert (a["a"] == b["a"]).all()
        elif isinstance(b, M.ErrorInfo):
            assert (a.ename, a.evalue, a.traceback, repr(a.exception)) == (b.ename, b.evalue, b.traceback,
                                                                          repr(b.exception))
        else:
            assert a == b, name


def test_records_are_typed_and_fixed():
    run = M.Run("pass")
    with pytest.raises(AttributeError):
        run.code = "import os"  # frozen: a request is what was sent
    assert not hasattr(run, "__dict__")  # __slots__: no field but its own
    assert set(M.REQUESTS) == {M.Run, M.Apply, M.Push, M.Pull, M.Debug}


def test_a_record_pickles_by_reference_as_its_fields():
    # The class by name (importable in both processes), then the fields' tuple: no state dict.
    data = M.dumps(M.Run("pass"))
    assert b"ddip.messages" in data and b"Run" in data and b"__dict__" not in data
    assert len(data) < 80


def test_a_reply_buffer_travels_out_of_band_inside_a_record():
    big = np.arange(M.OOB_THRESHOLD, dtype=np.uint8)
    payload, fds = _reply(M.Done(value=big))
    assert len(fds) == 1 and len(payload) < M.OOB_THRESHOLD
    back = M.loads_framed(payload, fds)
    assert (back.value == big).all()


def test_a_cell_request_and_an_empty_reply_take_plain_pickle_the_rest_cloudpickle():
    for record in (M.Run("x = 1"), M.Run("1", cell=("/tmp/c.py", 2)), M.Done(execution_count=3)):
        assert M.dumps(record) == pickle.dumps(record, M.PROTOCOL)
    # A str subclass made in the notebook's __main__ must travel by value, as cloudpickle sends it.
    ns = {"__name__": "__main__"}
    exec("class Code(str):\n    pass\n", ns)
    data = M.dumps(M.Run(ns["Code"]("x = 2")))
    assert data != pickle.dumps(M.Run("x = 2"), M.PROTOCOL) and b"Code" in data
    exec("def triple(x):\n    return 3 * x\n", ns)
    assert pickle.loads(M.dumps(M.Done(value=ns["triple"], execution_count=2))).value(2) == 6  # by value
