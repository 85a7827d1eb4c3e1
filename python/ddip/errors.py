"""Errors that name the rank and the cause of every failure."""

from __future__ import annotations

import enum
import re
from dataclasses import dataclass, field

from .labels import ranks_named

_ANSI = re.compile(r"\x1b\[[0-9;]*[A-Za-z]")


def strip_ansi(text: str) -> str:
    return _ANSI.sub("", text)


class FailureKind(str, enum.Enum):
    """How a rank failed. A str, so `f.kind == "died"` reads as well as `FailureKind.DIED`."""

    RAISED = "raised"  # its code raised (ename/evalue/traceback are the exception's)
    DIED = "died"  # its process exited (exit_code / exit_signal, stderr_tail)
    LOST = "lost"  # it ran on another host whose link (or launcher) is gone
    UNRESPONSIVE = "unresponsive"  # it answered no heartbeat for the heartbeat timeout
    STILL_RUNNING = "still running"  # interrupted after another failure, it did not stop
    STOPPED = "stopped"  # ddip stopped it because another rank failed (ranch)
    CLOSED = "closed"  # the group was closed (or its runtime failed) while it ran

    def __str__(self) -> str:
        return self.value


# The label a failure that is not an exception shows where an exception shows its type; these
# are the words docs/troubleshooting.md lists. Code tests `kind`, never these.
_LABELS = {FailureKind.DIED: "RankDied", FailureKind.LOST: "RankDied", FailureKind.UNRESPONSIVE: "Unresponsive",
           FailureKind.STILL_RUNNING: "StillRunning", FailureKind.STOPPED: "Stopped", FailureKind.CLOSED: "Closed"}

# Root cause first: a rank that vanished is what the others then trip over; then what ranks
# raised, in the order the kernel heard of it (KeyboardInterrupt after the others: ddip's own
# interrupts of the peers); last, ranks that ddip stopped or that never stopped. `ddip run`
# orders by the same rule in C++ (cpp/tools/run_policy.cpp: the first failure reported is the
# root cause, ranks it stopped come after).
_ORDER = {FailureKind.DIED: 0, FailureKind.LOST: 0, FailureKind.UNRESPONSIVE: 0, FailureKind.RAISED: 1,
          FailureKind.STOPPED: 3, FailureKind.STILL_RUNNING: 3, FailureKind.CLOSED: 4}


@dataclass
class RankFailure:
    """Why one rank failed: `kind` says how (an exception it raised, its death, ...). For a
    raised exception `ename` is its type; for the other kinds, the label its message shows."""

    rank: int
    ename: str = ""  # the exception's type name; for other kinds, filled in from `kind`
    evalue: str = ""  # exception message, or "killed by SIGKILL" / "exit code 3"
    traceback: list[str] = field(default_factory=list)  # IPython's lines, with ANSI colours
    stderr_tail: str = ""  # for a dead rank: the last lines it wrote to stderr
    exit_code: int | None = None
    exit_signal: int | None = None
    exception: BaseException | None = None  # the exception object the rank raised, when it could be pickled
    kind: FailureKind = FailureKind.RAISED
    at: float | None = None  # time.monotonic() when the kernel heard of it: orders the root cause

    def __post_init__(self):
        self.kind = FailureKind(self.kind)
        if not self.ename:
            self.ename = _LABELS.get(self.kind, "Exception")

    @property
    def died(self) -> bool:
        """The rank's process is gone: it exited, or its host is lost."""
        return self.kind in (FailureKind.DIED, FailureKind.LOST)

    def describe(self) -> str:
        """Plain text: the headline and the rank's traceback (or stderr tail)."""
        head = f"rank {self.rank}: {self.ename}: {self.evalue}" if self.evalue else f"rank {self.rank}: {self.ename}"
        body = strip_ansi("\n".join(self.traceback)).strip("\n")
        if self.died and self.stderr_tail:
            body = "last lines of its stderr:\n" + "\n".join("    " + l for l in self.stderr_tail.splitlines())
        return head + ("\n" + body if body else "")


def root_cause_first(failures) -> list[RankFailure]:
    """The failures, root cause first, by one rule for Group, ranch and the magics (above _ORDER)."""
    def key(f: RankFailure):
        order = _ORDER[f.kind]
        if f.kind is FailureKind.RAISED and f.ename == "KeyboardInterrupt":
            order = 2
        if order >= 3:  # ddip's own doing after the root cause: by rank, not by when
            return order, 0.0, f.rank
        return order, f.at if f.at is not None else float("inf"), f.rank
    return sorted(failures, key=key)


def merge_failures(failures) -> list[tuple[RankFailure, list[int]]]:
    """Failures with the same type, message and traceback (or death), once each, in order,
    with the ranks that had them."""
    merged: dict[str, tuple[RankFailure, list[int]]] = {}
    for f in failures:
        # Ranks that ran the same code number their cells alike, but don't count on it.
        key = re.sub(r"In\[\d+\]", "In[*]", f.describe().split(": ", 1)[1])
        merged.setdefault(key, (f, []))[1].append(f.rank)
    return [(f, sorted(ranks)) for f, ranks in merged.values()]


@dataclass
class HealReport:
    """What a heal of the group's torch.distributed did (Group.heal(), or by itself after a rank
    raised while its peers waited for it in a collective)."""

    ok: bool
    seconds: float
    world_size: int = 0
    failed: list[int] = field(default_factory=list)  # ranks whose exception left the others waiting
    released: list[int] = field(default_factory=list)  # ranks freed from the broken collective
    port: int | None = None  # MASTER_PORT of the rebuilt group
    reason: str = ""  # why it could not heal
    replaced: dict[int, int] = field(default_factory=dict)  # dead rank -> the pid of the new process in its slot
    copied_from: int | None = None  # the survivor whose namespace the new ranks got a copy of
    copied: list[str] = field(default_factory=list)  # the variables copied into them
    skipped: dict[str, str] = field(default_factory=dict)  # variables not copied -> why
    # Those of `skipped` that were copied_from's own identity (its rank, GPU, data shard): never
    # handed to another rank, the user sets them again there.
    identity: list[str] = field(default_factory=list)

    def describe(self, way_out: str = "%makedip -r (g.restart()) starts fresh ranks") -> str:
        if not self.ok:
            return f"ddip could not heal the group: {self.reason}. {way_out}."
        what = ""
        if self.failed and self.released:
            what = (f" rank{'s' if len(self.failed) > 1 else ''} {', '.join(map(str, self.failed))} raised "
                    f"while rank{'s' if len(self.released) > 1 else ''} {', '.join(map(str, self.released))} "
                    f"waited in a collective;")
        kept = "every rank kept its variables" if not self.replaced else "every surviving rank kept its variables"
        if self.port is None:  # a group without torch.distributed: its dead ranks replaced, nothing rebuilt
            return f"ddip healed the group in {self.seconds:.2f} s:{self.replacement().rstrip(';')}; {kept}." + self.redo()
        return (f"ddip healed the group in {self.seconds:.2f} s:{what}{self.replacement()} torch.distributed's "
                f"default group was rebuilt on all {self.world_size} ranks (same ranks and world size, "
                f"MASTER_PORT {self.port}), and {kept}. Make again what held the old group: "
                f"wrap the model in DistributedDataParallel / fully_shard again, and re-create subgroups "
                f"and optimizers built on them (ZeroRedundancyOptimizer); then run the step again."
                + self.redo())

    def replacement(self) -> str:
        """What replacing dead ranks did: who, and what the new ranks have ("" when none was)."""
        if not self.replaced:
            return ""
        who = "; ".join(f"rank {r} is a new process (pid {pid})" for r, pid in sorted(self.replaced.items()))
        if self.copied_from is None:
            has = "with an empty namespace"
        else:
            has = (f"with a copy of rank {self.copied_from}'s variables"
                   + (f" ({', '.join(self.copied)})" if self.copied else " (none could be copied)"))
            if self.skipped:
                by_why: dict[str, list[str]] = {}
                for name, why in sorted(self.skipped.items()):
                    by_why.setdefault(why, []).append(name)
                has += "; not copied: " + "; ".join(f"{', '.join(n)} ({why})" for why, n in by_why.items())
        return f" dead rank(s) replaced: {who}, in the same slot (rank, GPU, environment), {has};"

    def redo(self) -> str:
        """What the user must do on the new ranks ("" when none was replaced): only what the copy
        (or its absence) left undone."""
        if not self.replaced:
            return ""
        ranks = ", ".join(map(str, sorted(self.replaced)))
        todo = []
        if self.copied_from is None:
            todo.append(f"run your set-up cell again on it (%%dip -r {ranks}), or heal with copy_from")
        else:
            if self.identity:
                todo.append(f"set {', '.join(self.identity)} again: they were rank {self.copied_from}'s own "
                            f"(a rank, a GPU, a data shard), so they were not copied")
            others = sorted(set(self.skipped) - set(self.identity))
            if others:
                todo.append(f"make again what was not copied ({', '.join(others)})")
        if self.port is not None:  # torch.distributed rebuilt: DDP's wrapper is the old group's
            todo.append("wrap the model in DDP again there too")
        return f" On rank(s) {ranks}: {'; '.join(todo)}." if todo else ""


class HealError(RuntimeError):
    """Group.heal() could not rebuild torch.distributed; `report` says why (`report.reason`).
    Refused before anything was changed (a dead rank, a group without torch.distributed), its
    `report.seconds` is 0; for a dead rank, `__cause__` is the RankDeadError with its failures."""

    def __init__(self, report: HealReport, way_out: str | None = None):
        super().__init__(report.describe(way_out) if way_out else report.describe())
        self.report = report


class RankFailedError(Exception):
    """One or more ranks failed (torch elastic's ChildFailedError, for ranks). `failures` lists
    them, root cause (earliest) first. `heal` is the HealReport when the failure broke a
    collective and ddip healed the group (or tried). Its text shows identical tracebacks once,
    with the ranks that raised them ("ranks 0-126: ValueError ..." beside "rank 127: KeyError
    ..."); describe(collapse=False) shows each rank's.

    `RemoteError` is the same class under its earlier name (ipyparallel's), kept for code that
    catches it; in ddip's words "remote" means another host, and a rank is a rank."""

    def __init__(self, failures: list[RankFailure], results=None, what: str = "code",
                 heal: HealReport | None = None, collectives=None):
        self.failures = list(failures)
        self.results = results
        self.heal = heal
        # Where ranks did not stop: which collective each rank was in (a CollectivePicture)
        self.collectives = collectives
        self.what = what
        first = self.failures[0]
        # which ranks failed and the root cause, on one line
        self.headline = (f"{what} failed on {ranks_named(f.rank for f in self.failures)}; "
                         f"root cause on rank {first.rank}: {first.ename}: {first.evalue}")
        super().__init__(self.describe())

    def describe(self, collapse: bool = True) -> str:
        """The headline, then each failure's traceback; collapse=False: one per rank, root cause
        first, where the default shows identical ones once."""
        lines = [self.headline]
        if self.collectives is not None and self.collectives.known:
            lines += ["", self.collectives.describe()]
        groups = merge_failures(self.failures) if collapse else [(f, [f.rank]) for f in self.failures]
        for f, same in groups:
            lines.append("")
            lines.append(f"--- {ranks_named(same)}: " + f.describe().split(": ", 1)[1].rstrip("\n"))
        if self.heal is not None:
            lines += ["", self.heal.describe()]
        return "\n".join(lines)

    @property
    def ranks(self) -> list[int]:
        """The failing ranks, in rank order (`failures` is in root-cause order)."""
        return sorted(f.rank for f in self.failures)


RemoteError = RankFailedError  # the earlier name, public: `except ddip.RemoteError` keeps working


class StartError(RuntimeError):
    """The group could not be started: a rank exited or could not be reached (`cause` says how),
    or did not become ready in time (`timeout`: the seconds waited). `ranks`: the ranks it
    names; `failure`: the RankFailure of a rank that exited while starting."""

    def __init__(self, cause: str, ranks=(), timeout: float | None = None, failure: RankFailure | None = None):
        self.cause = cause
        self.ranks = sorted(ranks)
        self.timeout = timeout
        self.failure = failure
        super().__init__(self.describe())

    def describe(self, wait_longer: str = "pass timeout=") -> str:
        """The message; `wait_longer` says how to wait longer (the magics: give -t SECONDS)."""
        if self.timeout is None:
            return self.cause
        return f"{self.cause}; {wait_longer} to wait longer"


def _ranks_text(ranks) -> str:
    return ", ".join(map(str, ranks))


class RankError(RuntimeError):
    """A request the group refused, before sending anything, because of the state of some of its
    ranks. `ranks`: those ranks, in rank order (`rank`: the first); `cause`: why, in words.
    describe(restart) words the way out as the caller would take it (the magics: %makedip -r)."""

    def __init__(self, ranks, cause: str):
        self.ranks = sorted(ranks)
        self.cause = cause
        super().__init__(self.describe())

    @property
    def rank(self) -> int:
        return self.ranks[0]

    def describe(self, restart: str = "call restart()", heal: str = "call heal()") -> str:
        """The message; `restart` and `heal` word those ways out as the caller takes them (the magics:
        run %makedip -r, run %makedip --heal); a subclass names heal where it applies."""
        return f"rank(s) {_ranks_text(self.ranks)}: {self.cause}; {restart} to start the group again"


class RankDeadError(RankError):
    """Ranks that died (their process exited, or their host's link is gone) before this request;
    `failures`: a RankFailure for each (exit code or signal, last lines of stderr)."""

    def __init__(self, failures: list[RankFailure]):
        self.failures = sorted(failures, key=lambda f: f.rank)
        super().__init__([f.rank for f in self.failures], self.failures[0].evalue)

    def describe(self, restart: str = "call restart()", heal: str = "call heal()") -> str:
        if len(self.failures) == 1:
            what = f"rank {self.rank} is dead ({self.cause})"
        else:
            what = (f"ranks {_ranks_text(self.ranks)} are dead ("
                    + "; ".join(f"rank {f.rank}: {f.evalue}" for f in self.failures) + ")")
        if any(f.kind is FailureKind.DIED for f in self.failures):  # a rank lost with its host can't be
            return (f"{what}; {heal} to replace it in its slot, keeping the other ranks' variables, or "
                    f"{restart} to start the group again")
        return f"{what}; {restart} to start the group again"


class RankBusyError(RankError):
    """Ranks still running an earlier request: one that was interrupted but did not stop, or an
    apply_async not yet collected. The new request was not queued behind it."""

    def __init__(self, ranks):
        super().__init__(ranks, "still busy with an earlier request (one that was interrupted but did "
                                "not stop, or an apply_async not yet collected)")

    def describe(self, restart: str = "call restart()", heal: str = "call heal()") -> str:
        return (f"rank(s) {_ranks_text(self.ranks)} {self.cause}; wait, interrupt it (g.interrupt()), "
                f"{heal} if it waits in a broken collective (it frees it, keeping every rank's variables), "
                f"or {restart} to start the group again")


class RankUnresponsiveError(RankError):
    """Ranks whose heartbeats stopped (the process is stopped or swapped out, or its host is
    unreachable); `seconds`: rank -> seconds since its last heartbeat; `hosts`: rank -> the other
    host it runs on (ranks of this machine are not in it). They may answer again; a rank on
    another host whose link stays cut is reported dead once the kernel closes that link."""

    def __init__(self, seconds: dict[int, float], hosts: dict[int, str] | None = None):
        self.seconds = dict(sorted(seconds.items()))
        self.hosts = {r: h for r, h in (hosts or {}).items() if r in self.seconds and h}
        longest = max(self.seconds.values())
        super().__init__(self.seconds, f"no heartbeat for {longest:.1f} s ("
                                       + unresponsive_cause(sorted(set(self.hosts.values()))) + ")")

    def describe(self, restart: str = "call restart()", heal: str = "call heal()") -> str:
        ranks = ", ".join(f"{r} (on {self.hosts[r]})" if r in self.hosts else str(r) for r in self.ranks)
        return (f"rank(s) {ranks} stopped answering: {self.cause}; wait for them to answer again, or "
                f"{restart} to replace them")


def unresponsive_cause(hosts: list[str]) -> str:
    """Why a rank may have stopped answering heartbeats, naming the other hosts it runs on."""
    if hosts:
        return (f"host {', '.join(hosts)} unreachable (its link is closed, and its ranks reported dead, "
                f"once it acknowledges nothing for the heartbeat timeout), or the process stopped or "
                f"swapped out")
    return "stopped, swapped out, or its host is unreachable"


class GroupClosedError(RuntimeError):
    """The group (or, for a Pending, the group the request was sent to) is closed: by close(),
    by restart(), or because the runtime failed (`cause`: that failure; None otherwise)."""

    def __init__(self, cause: str | None = None, *, restarted: bool = False):
        self.cause = cause
        self.restarted = restarted  # a Pending whose group was restarted or closed since
        super().__init__(self.describe())

    def describe(self, restart: str = "call restart()", heal: str = "call heal()") -> str:
        if self.restarted:
            return ("the group was restarted or closed since this request was sent; its ranks are gone, "
                    "and so is the request")
        why = f" after a runtime failure ({self.cause})" if self.cause else ""
        return f"this group is closed{why}; create a new one (or {restart})"
