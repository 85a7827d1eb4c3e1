"""Slurm nodes asked for from the notebook: `Group(slurm="-N 4 --gpus-per-node 8 -t 2:00:00")`
and `%makedip --slurm "..."`, from a notebook outside any allocation (a login node, an Open
OnDemand JupyterLab).

The allocation is held by `salloc OPTIONS python -c HOLD`, a child of the kernel in a session of
its own (the kernel's interrupts don't reach it). Once Slurm grants the nodes, salloc runs HOLD
here, which prints the job's SLURM_* environment and then waits for EOF on its stdin, a pipe from
the kernel: closing the pipe (the group's close) or the kernel's death (the kernel's end of the
pipe closes with it) ends HOLD, and salloc gives the job back. While the job is still pending,
salloc gets SIGHUP when the kernel dies (PR_SET_PDEATHSIG), on which salloc revokes the request.
So no watcher process of ours is needed: salloc itself holds the job and lets it go.

The ranks then start as inside any allocation: srun job steps (the "slurm" launcher) run with the
granted job's SLURM_JOB_ID and SLURM_JOB_NODELIST.
"""

from __future__ import annotations

import json
import os
import re
import selectors
import shutil
import signal
import subprocess
import sys
import threading
import time
from typing import Callable

from .. import _core
from .placement import slurm_hosts

# Runs here, inside the granted allocation: the job's environment as one JSON line, then held
# until the kernel closes (or loses) the pipe.
GRANTED = b"ddip-slurm-job-granted "
HOLD = ("import json, os, sys\n"
        f"print({GRANTED.decode()!r} + json.dumps({{k: v for k, v in os.environ.items() if k.startswith('SLURM_')}}),"
        " flush=True)\n"
        "sys.stdin.buffer.read()\n")

# Execs salloc with PR_SET_PDEATHSIG set to SIGHUP, which salloc answers at any time by giving the
# job (or the pending request) back. Exits at once if the kernel is already gone.
ARM = ("import ctypes, os, signal, sys\n"
       "ctypes.CDLL(None, use_errno=True).prctl(1, int(signal.SIGHUP), 0, 0, 0)\n"
       "os.getppid() == int(sys.argv[1]) or os._exit(1)\n"
       "os.execvp(sys.argv[2], sys.argv[2:])\n")

POLL_S = 1.0  # how often the pending job's state and reason are asked of squeue


class SlurmRequestError(ValueError):
    """Slurm refused the request (salloc's own message is in the text); nothing was allocated."""


def split_options(options: str) -> list[str]:
    """'-N 4 --gpus-per-node 8 -t 2:00:00' as salloc's words (shell quoting, no shell)."""
    if not isinstance(options, str) or not options.strip():
        raise ValueError(f"slurm= takes salloc's options as one string, e.g. '-N 4 -t 2:00:00', got {options!r}")
    try:
        words = _core.plan.split_words(options)
    except ValueError as exc:
        raise ValueError(f"slurm={options!r}: {exc}") from None
    for word in words:
        if word in ("--no-shell", "--help", "-h", "--usage", "-V", "--version") or word.startswith("--no-shell="):
            raise ValueError(f"slurm={options!r}: {word} is not for a job ddip holds (it runs salloc with a command "
                             f"of its own); leave it out")
    return words


def _counts(spec: str) -> list[int]:
    """Slurm's per-node counts, '4(x2),2' -> [4, 4, 2]."""
    out = []
    for item in filter(None, spec.split(",")):
        m = re.fullmatch(r"(\d+)(?:\(x(\d+)\))?", item.strip())
        if m is None:
            raise ValueError(f"can't read Slurm's per-node count {spec!r}")
        out += [int(m[1])] * int(m[2] or 1)
    return out


def ranks_per_node(env: dict) -> tuple[list[int], int]:
    """(ranks on each node, GPUs per node) for the job whose environment is `env`: the tasks per
    node when the options asked for tasks (--ntasks-per-node, -n), else one rank per GPU of
    --gpus-per-node, else one rank per node. Each rank uses the GPU of its LOCAL_RANK."""
    nodes = int(env.get("SLURM_JOB_NUM_NODES") or env.get("SLURM_NNODES") or 1)
    gpus = env.get("SLURM_GPUS_PER_NODE", "")
    per_gpu = int(gpus.rsplit(":", 1)[-1]) if re.fullmatch(r"(?:[\w.-]+:)?\d+", gpus) else 0
    if any(k in env for k in ("SLURM_NTASKS_PER_NODE", "SLURM_NTASKS", "SLURM_NPROCS")):
        ranks = _counts(env.get("SLURM_TASKS_PER_NODE", ""))
        if per_gpu and max(ranks) > per_gpu:
            raise ValueError(f"{max(ranks)} tasks on a node with {per_gpu} GPUs: one rank per GPU at most")
        return ranks, per_gpu
    return [per_gpu or 1] * nodes, per_gpu


def console_line() -> Callable[..., None]:
    """How the wait is shown: in a Jupyter kernel one display redrawn in place; elsewhere one
    line of stderr redrawn with a carriage return (and ended by the last, final=True)."""
    try:
        from IPython import get_ipython
        from IPython.display import display
    except ImportError:
        get_ipython = None
    shell = get_ipython() if get_ipython is not None else None
    if shell is not None and getattr(shell, "kernel", None) is not None:
        handle = None

        def show(text: str, final: bool = False):
            nonlocal handle
            if handle is None:
                handle = display({"text/plain": text}, raw=True, display_id=True)
            else:
                handle.update({"text/plain": text}, raw=True)
        return show
    width = 0

    def write(text: str, final: bool = False):
        nonlocal width
        sys.stderr.write("\r" + text.ljust(width) + ("\n" if final else ""))
        sys.stderr.flush()
        width = len(text)
    return write


class SlurmAllocation:
    """A Slurm job granted to this kernel and held by a salloc child until close(). Made by
    request(); a group made with slurm= owns one and ends it when it closes."""

    def __init__(self, proc: subprocess.Popen, job: str, env: dict, options: str):
        self._proc = proc
        self.job = job
        self.env = env  # the job's SLURM_* variables, as salloc gave them to its command
        self.options = options
        self.nodes = slurm_hosts(env)

    @classmethod
    def request(cls, options: str, on_wait: Callable[..., None] | None = None) -> "SlurmAllocation":
        """Asks Slurm for nodes (salloc OPTIONS) and waits until they are granted, showing the
        job's state and Slurm's reason while it is pending (on_wait(text, final=False): one line,
        redrawn; console_line() by default). Ctrl-C
        cancels the request. Slurm's refusal raises SlurmRequestError with its message."""
        words = split_options(options)
        if shutil.which("salloc") is None:
            raise SlurmRequestError("slurm= needs Slurm's salloc on PATH (is this a Slurm login node?); "
                                    "nothing was asked for")
        show = on_wait or console_line()
        argv = ["salloc", "--job-name=ddip", *words, sys.executable, "-c", HOLD]
        if threading.current_thread() is threading.main_thread():
            # PR_SET_PDEATHSIG follows the thread that forks: only the main one lives as long as we do.
            argv = [sys.executable, "-c", ARM, str(os.getpid()), *argv]
        proc = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                start_new_session=True)
        waiting = _Waiting(proc, options, show)
        try:
            env = waiting.until_granted()
        except BaseException:
            waiting.cancel()
            raise
        return cls(proc, env["SLURM_JOB_ID"], env, options)

    def hosts(self) -> dict:
        """The group's host list: each node with its ranks (a count, or the GPUs they use)."""
        ranks, gpus = ranks_per_node(self.env)
        if len(ranks) != len(self.nodes):
            raise ValueError(f"Slurm job {self.job}: {len(self.nodes)} nodes but tasks for {len(ranks)}")
        return {node: (list(range(n)) if gpus else n) for node, n in zip(self.nodes, ranks)}

    def launcher_env(self) -> dict:
        """The environment srun runs in: ours without the kernel's own Slurm job, and the
        granted job's instead."""
        return {**{k: v for k, v in os.environ.items() if not k.startswith("SLURM_")}, **self.env}

    @property
    def closed(self) -> bool:
        return self._proc.poll() is not None

    def close(self, timeout: float = 30.0):
        """Gives the job back: HOLD's stdin closes, it exits, salloc relinquishes the job and
        exits. Idempotent."""
        p = self._proc
        if p.stdin is not None and not p.stdin.closed:
            try:
                p.stdin.close()
            except OSError:
                pass
        try:
            p.wait(timeout)
        except subprocess.TimeoutExpired:
            _scancel(self.job)
            p.send_signal(signal.SIGHUP)  # salloc's "release and exit now"
            p.wait()
        for f in (p.stdout, p.stderr):
            if f is not None:
                f.close()

    def __repr__(self):
        state = "ended" if self.closed else "held"
        return f"<ddip SlurmAllocation job {self.job} on {','.join(self.nodes)} {state}>"


def _scancel(job: str):
    try:
        subprocess.run(["scancel", job], capture_output=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        pass


class _Waiting:
    """One request's wait: salloc's stderr says the job id and any refusal, HOLD's first stdout
    line says the nodes are granted, squeue says the reason while pending."""

    def __init__(self, proc: subprocess.Popen, options: str, show: Callable[..., None]):
        self.proc, self.options, self.show = proc, options, show
        self.job: str | None = None
        self.err = b""
        self.out = b""
        self.t0 = time.monotonic()
        self.shown = False

    def until_granted(self) -> dict:
        sel = selectors.DefaultSelector()
        sel.register(self.proc.stdout, selectors.EVENT_READ)
        sel.register(self.proc.stderr, selectors.EVENT_READ)
        open_pipes = 2
        next_poll = time.monotonic()
        try:
            while (granted := self._granted()) is None:
                if open_pipes == 0:
                    return self._refused()
                for key, _ in sel.select(timeout=0.2):
                    chunk = os.read(key.fd, 65536)
                    if not chunk:
                        sel.unregister(key.fileobj)
                        open_pipes -= 1
                    elif key.fileobj is self.proc.stdout:
                        self.out += chunk
                    else:
                        self.err += chunk
                        m = re.search(rb"job allocation (\d+)|job (\d+) queued", self.err)
                        if m and self.job is None:
                            self.job = (m[1] or m[2]).decode()
                if time.monotonic() >= next_poll:
                    self._show_state()
                    next_poll = time.monotonic() + POLL_S
        finally:
            sel.close()
        env = json.loads(granted)
        self.job = env["SLURM_JOB_ID"]
        if self.shown:
            self.show(f"Slurm job {self.job} granted after {time.monotonic() - self.t0:.0f} s: "
                      f"{env.get('SLURM_JOB_NODELIST', '')}", final=True)
        return env

    def _granted(self) -> bytes | None:
        """HOLD's line, once it has come: the job's environment as JSON."""
        for line in self.out.split(b"\n")[:-1]:
            if line.startswith(GRANTED):
                return line[len(GRANTED):]
        return None

    def _show_state(self):
        waited = time.monotonic() - self.t0
        if self.job is None:
            if waited < POLL_S:
                return  # most grants come at once: nothing to show
            text = f"asking Slurm for nodes (salloc {self.options}) for {waited:.0f} s"
        else:
            state = _squeue(self.job)
            text = (f"Slurm job {self.job} {state or 'PENDING'} for {waited:.0f} s "
                    f"(salloc {self.options}); Ctrl-C cancels the request")
        self.show(text)
        self.shown = True

    def _refused(self):
        self.proc.wait()
        message = "\n".join(line.removeprefix("salloc: ").removeprefix("error: ")
                            for line in (self.err + self.out).decode(errors="replace").splitlines()
                            if line.strip() and not line.startswith("Try "))
        raise SlurmRequestError(f"Slurm refused salloc {self.options} (exit code {self.proc.returncode}): "
                                f"{message or 'no message'}; nothing was allocated")

    def cancel(self):
        """The request is withdrawn (Ctrl-C, a refusal, an error): nothing of it is left."""
        if self.shown:
            self.show(f"Slurm job {self.job or '(not yet named)'}: request withdrawn", final=True)
        if self.job is not None:
            _scancel(self.job)
        p = self.proc
        if p.poll() is None:
            p.send_signal(signal.SIGHUP)  # pending: revoke the request; granted: release the job
        try:
            p.stdin.close()
        except OSError:
            pass
        try:
            p.wait(30)
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()
        for f in (p.stdout, p.stderr):
            f.close()


def _squeue(job: str) -> str:
    """'PENDING (Resources)': the job's state and Slurm's reason (squeue's %T and %r)."""
    try:
        out = subprocess.run(["squeue", "-h", "-j", job, "-o", "%T|%r"], capture_output=True, text=True,
                             timeout=10)
    except (OSError, subprocess.TimeoutExpired):
        return ""
    line = out.stdout.strip().splitlines()[:1]
    if out.returncode != 0 or not line:
        return ""
    state, _, reason = line[0].partition("|")
    return f"{state} ({reason})" if reason and reason != "None" else state
