"""What travels in frame payloads: cloudpickle, pickle protocol 5, and the typed records of the
kernel-rank protocol.

A request is one record per kind (Run, Apply, Push, Pull, Debug); a rank answers each with one
Done. A debugger prompt's answer is a PromptAnswer. The records pickle by reference (this module
is imported by both sides), as the class and its fields' tuple.

Functions, lambdas and classes defined in the notebook's __main__ are pickled by value
(cloudpickle's rule for __main__), so they work in ranks without being importable there.

Requests and replies put large buffers (numpy arrays, CPU tensors) out of band: each buffer of
at least OOB_THRESHOLD bytes is copied once into shared memory that the receiver maps privately.
A request's segments come from the kernel's pool (one copy for N ranks); a reply's are fresh
memfds. Such a payload starts with the segments' table: u32 count, then (u64 id, u64 length) per
segment, in buffer order; the segments' fds travel with the frame.
"""

from __future__ import annotations

import fcntl
import io
import mmap
import operator
import os
import pickle
import struct
import sys
import weakref
from dataclasses import dataclass, field
from typing import Any, Callable

import cloudpickle

from . import _core

PROTOCOL = 5
OOB_THRESHOLD = 1 << 20  # smaller buffers stay in the pickle: a segment costs more than a copy


# Frozen, and with __slots__ where the Python has dataclass(slots=) (3.10 on); 3.9's records are the
# same but for a __dict__.
_record = dataclass(frozen=True, slots=True) if sys.version_info >= (3, 10) else dataclass(frozen=True)


def _by_fields(cls):
    """A record pickles as (class, its fields in order): the smallest pickle, and the fastest to
    make and to load (no state dict; cloudpickle names the class by reference)."""
    names = tuple(cls.__dataclass_fields__)
    if not names:
        cls.__reduce__ = lambda self: (cls, ())
    elif len(names) == 1:
        get = operator.attrgetter(names[0])
        cls.__reduce__ = lambda self: (cls, (get(self),))
    else:
        get = operator.attrgetter(*names)  # a tuple of the fields, in C
        cls.__reduce__ = lambda self: (cls, get(self))
    return cls


# -- requests: the kernel's Group (and heal) sends one to some ranks ---------------------------


@_by_fields
@_record
class Run:
    """Runs `code` in the rank's __main__ as a notebook cell (IPython's features)."""

    code: str
    values: bool = True  # False (%%dip): only the last expression's display form comes back
    cell: tuple[str, int] | None = None  # (file name, first line): JupyterLab's debugger's name for it
    silent: bool = False  # IPython's silent run: no history, no display hook, no execution count


@_by_fields
@_record
class Apply:
    """Calls fn(*args, **kwargs) in the rank; its return value comes back."""

    fn: Callable
    args: tuple = ()
    kwargs: dict = field(default_factory=dict)


@_by_fields
@_record
class Push:
    """Copies `ns` (name -> value) into the rank's namespace."""

    ns: dict


@_by_fields
@_record
class Pull:
    """The values of `names` in the rank's namespace, as a list."""

    names: tuple[str, ...]


@_by_fields
@_record
class Debug:
    """pdb, post-mortem, on the rank's last exception; prompts are asked in the notebook."""


REQUESTS = (Run, Apply, Push, Pull, Debug)


# -- replies: a rank's answer to a request ----------------------------------------------------


@_by_fields
@_record
class ErrorInfo:
    """What a rank's code raised, formatted there (IPython's traceback, the user's frames only);
    `exception` is the exception itself when the notebook can rebuild it, else None."""

    ename: str
    evalue: str
    traceback: list[str] = field(default_factory=list)  # IPython's structured traceback, lines
    exception: BaseException | None = None


@_by_fields
@_record
class Done:
    """A rank's reply to one request: the value (or the error), and for a Run the last
    expression's display form ((MIME bundle, metadata), as IPython's Out) and the execution
    count it ran as."""

    value: Any = None
    error: ErrorInfo | None = None
    format: tuple | None = None
    execution_count: int | None = None


@_by_fields
@_record
class PromptAnswer:
    """The notebook's answer to a rank's debugger prompt: the line typed (None: nobody can be
    asked, the rank goes on), or stop (the request was interrupted: the debugger quits)."""

    line: str | None = None
    stop: bool = False


_RECORDS = frozenset((*REQUESTS, ErrorInfo, Done, PromptAnswer))


def _builtins_only(obj) -> bool:
    """A Run or a Done whose fields are built-in values only (exact types: a subclass made in
    the notebook's __main__ must go by value, through cloudpickle)."""
    t = type(obj)
    if t is Run:
        cell = obj.cell
        return type(obj.code) is str and (cell is None or (type(cell) is tuple and type(cell[0]) is str
                                                            and type(cell[1]) is int))
    if t is Done:
        return (obj.value is None and obj.error is None and obj.format is None
                and type(obj.execution_count) in (int, type(None)))
    return False


class _Pickler(cloudpickle.CloudPickler):
    def reducer_override(self, obj):
        t = type(obj)
        if t in _RECORDS or (t is type and obj in _RECORDS):
            return NotImplemented  # every request and reply: by reference, without the checks below
        if _is_get_ipython(obj):
            # A notebook function calling get_ipython() means the shell it runs in, not the
            # kernel's (which can't be pickled): send IPython's function by reference.
            return getattr, (sys.modules["IPython"], "get_ipython")
        torch = sys.modules.get("torch")
        if torch is not None and type(obj) in (torch.Tensor, torch.nn.Parameter) and _cuda_tensor(obj):
            # Bytes through the CPU; rebuilt on the receiver's own device (see _rebuild_cuda_tensor).
            cpu = obj.detach().to("cpu").contiguous()
            flat = cpu.reshape(-1).view(torch.uint8).numpy()
            return _rebuild_cuda_tensor, (flat, obj.dtype, tuple(obj.shape), obj.requires_grad,
                                          type(obj) is torch.nn.Parameter)
        if torch is not None and type(obj) is torch.Tensor and _whole_cpu_tensor(torch, obj):
            # torch's own pickling copies the bytes in band; as a uint8 array they go out of band.
            flat = obj.detach().reshape(-1).view(torch.uint8).numpy()
            return _rebuild_tensor, (flat, obj.dtype, tuple(obj.shape), obj.requires_grad)
        return super().reducer_override(obj)


def _is_get_ipython(obj) -> bool:
    shell = sys.modules.get("IPython.core.interactiveshell")
    return shell is not None and getattr(obj, "__func__", None) is shell.InteractiveShell.get_ipython


def _whole_cpu_tensor(torch, t) -> bool:
    """A dense CPU tensor that is its storage's only view: nothing is lost by sending its bytes."""
    try:
        return (t.device.type == "cpu" and t.layout == torch.strided and not t.is_quantized
                and t.grad_fn is None and not t.is_conj() and not t.is_neg() and t.is_contiguous()
                and t.storage_offset() == 0 and t.nbytes >= OOB_THRESHOLD
                and t.untyped_storage().nbytes() == t.nbytes)
    except (AttributeError, RuntimeError, TypeError):
        return False


def _cuda_tensor(t) -> bool:
    try:
        return t.device.type == "cuda" and str(t.layout) == "torch.strided"
    except (AttributeError, RuntimeError, TypeError):
        return False


def _own_cuda_device(torch):
    """Where a CUDA tensor lands when it arrives, like torch.load's map_location: in a rank,
    its own GPU (device LOCAL_RANK); in the notebook, its current device if the notebook's own
    code started CUDA, else the CPU (ddip never starts CUDA in the notebook)."""
    if "DDIP_SLOT" in os.environ:
        if torch.cuda.is_available():
            return torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
        return None
    if torch.cuda.is_initialized():
        return torch.device("cuda", torch.cuda.current_device())
    return None


def _rebuild_cuda_tensor(flat, dtype, shape, requires_grad, parameter=False):
    import torch

    t = torch.from_numpy(flat).view(dtype).reshape(shape)
    device = _own_cuda_device(torch)
    if device is not None:
        t = t.to(device)
    if parameter:
        return torch.nn.Parameter(t, requires_grad=requires_grad)
    return t.requires_grad_(requires_grad) if requires_grad else t


def _rebuild_tensor(flat, dtype, shape, requires_grad):
    import torch

    t = torch.from_numpy(flat).view(dtype).reshape(shape)
    return t.requires_grad_(requires_grad) if requires_grad else t


def dumps(obj, buffer_callback=None) -> bytes:
    if _builtins_only(obj):
        # What cloudpickle would write too, at a fraction of its cost (no Python-level hooks):
        # a cell's request, and the reply to a cell that had no value to send.
        return pickle.dumps(obj, PROTOCOL)
    f = io.BytesIO()
    _Pickler(f, protocol=PROTOCOL, buffer_callback=buffer_callback).dump(obj)
    return f.getvalue()


def loads(data, buffers=None):
    return pickle.loads(data, buffers=buffers)


MAX_SEGMENTS = _core.MAX_FDS  # fds one frame can carry
_NO_SEGMENTS = struct.pack("<I", 0)  # the table of a payload with every buffer in band


def dumps_framed(obj, put, discard) -> tuple[bytes, list]:
    """Pickles obj with every buffer of OOB_THRESHOLD bytes or more out of band:
    put(buffer) -> (segment id, handle) stores one (the kernel: a pooled segment, whose id is its
    handle; a rank: a fresh memfd, whose fd is its handle). Returns the payload (the segments'
    table, then the pickle) and the handles, to travel with it; discard(handle) undoes a put
    if pickling fails half-way."""
    if _builtins_only(obj):  # no buffer to take out of band: an empty table, at once
        return _NO_SEGMENTS + pickle.dumps(obj, PROTOCOL), []
    big = []

    def out_of_band(pb: pickle.PickleBuffer) -> bool:
        raw = pb.raw()
        if raw.nbytes < OOB_THRESHOLD or len(big) == MAX_SEGMENTS:
            return True  # in band (beyond MAX_SEGMENTS too: a frame carries no more fds)
        big.append(raw)
        return False

    body = dumps(obj, buffer_callback=out_of_band)
    stored = []
    try:
        for raw in big:
            stored.append(put(raw))
    except BaseException:
        for _, handle in stored:
            discard(handle)
        raise
    table = struct.pack(f"<I{2 * len(big)}Q", len(big),
                        *[x for (seg, _), raw in zip(stored, big) for x in (seg, raw.nbytes)])
    return table + body, [handle for _, handle in stored]


# Before 3.13, mmap keeps a dup of the fd for as long as the mapping lives (for resize(), which
# ddip never calls): one fd per received buffer. 3.13 can leave it out.
_UNTRACKED = {"trackfd": False} if sys.version_info >= (3, 13) else {}


class _Mapping(mmap.mmap):
    """A private mapping of a received segment (a subclass, so it can carry a finalizer)."""


def loads_framed(payload: bytes, fds: list[int], release=None):
    """Unpickles what dumps_framed made. Each segment is mapped privately (writable,
    copy-on-write); release(segment id), if given, is called once nothing refers to it."""
    if not fds and payload[:4] == _NO_SEGMENTS:  # most requests and replies: nothing to map
        return pickle.loads(memoryview(payload)[4:])
    buffers = []
    try:
        (count,) = struct.unpack_from("<I", payload)
        table = struct.unpack_from(f"<{2 * count}Q", payload, 4)
        body = memoryview(payload)[4 + 16 * count:]
        for i in range(count):
            seg, nbytes = table[2 * i], table[2 * i + 1]
            m = _Mapping(fds[i], nbytes, flags=mmap.MAP_PRIVATE, prot=mmap.PROT_READ | mmap.PROT_WRITE,
                         **_UNTRACKED)
            if release is not None:
                weakref.finalize(m, release, seg)
            buffers.append(memoryview(m))
    finally:
        for fd in fds:
            os.close(fd)
    return pickle.loads(body, buffers=buffers)


def memfd_with(raw) -> int:
    """A fresh memfd holding a copy of `raw` (a rank's reply: no pool, the kernel's private
    mapping keeps the pages alive after the rank closes its fd)."""
    fd = os.memfd_create("ddip-reply", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
    try:
        os.ftruncate(fd, raw.nbytes)
        # Written, not copied into a mapping: a write that covers whole pages gets them without
        # zeroing them first (a fault on a fresh mapping clears every page, as costly as the copy).
        data = raw.cast("B")
        done = 0
        while done < len(data):
            n = os.pwrite(fd, data[done:], done)
            if n <= 0:
                raise OSError(f"could not write a {raw.nbytes}-byte reply buffer into shared memory "
                              f"(wrote {done} bytes): is /dev/shm or memory full?")
            done += n
        # Its size is final: a receiver's mapping can never be cut short under it (SIGBUS).
        fcntl.fcntl(fd, fcntl.F_ADD_SEALS, fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW)
    except BaseException:
        os.close(fd)
        raise
    return fd


def picklable(value) -> bool:
    """Whether value can be sent to a rank (large buffers aren't copied for the check)."""
    try:
        dumps(value, buffer_callback=lambda buffer: False)
        return True
    except Exception:
        return False


class RemoteValue:
    """Stands in for a value that could not be pickled back from a rank: its type and repr."""

    def __init__(self, type_name: str, text: str):
        self.type_name = type_name
        self.text = text

    def __repr__(self) -> str:
        return self.text

    def __eq__(self, other):
        return isinstance(other, RemoteValue) and (self.type_name, self.text) == (other.type_name, other.text)
