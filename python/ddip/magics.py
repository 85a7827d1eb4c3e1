"""IPython magics: %makedip, %%dip, %autodip, %dipush, %dipull, %dipstatus, %dipstack.

    %load_ext ddip
    %makedip -n 3
    %%dip --see all
    import os; print(os.environ["RANK"])

One `DipMagics` instance per shell owns the group. Rank output is written to the notebook as it
arrives; values, display() calls and tracebacks become the notebook's own display/error outputs.
"""

from __future__ import annotations

import html
import importlib
import importlib.util
import pkgutil
import sys
import time
from dataclasses import dataclass, replace

from IPython.core.error import UsageError
from IPython.core.magic import Magics, line_cell_magic, line_magic, magics_class
from IPython.core.magic_arguments import argument, magic_arguments, parse_argstring
from IPython.display import publish_display_data

from .displays import RankDisplays, notebook_env
from .errors import GroupClosedError, HealError, RankDeadError, RankError, RemoteError, StartError, merge_failures
from .group import Group, resolve_backend, parse_gpus
from . import hosts as _hosts
from . import template as _template

NO_GROUP = "no group: run %makedip -n 2 (or -g all) first"
RESTART = "run %makedip -r"  # how errors that say "call restart()" to API users say it in a notebook
_WHERE = {"remote": "remote", "local": "local", "everywhere": "everywhere", "both": "everywhere"}


@dataclass(frozen=True)
class GroupSpec:
    """What %makedip was asked for; -r reuses it, overriding only the flags given again."""

    n: int | None = None
    gpus: tuple | None = None
    backend: str = "auto"
    timeout: float = 60.0
    app: str | None = None
    cold: bool = False  # --cold: start ranks cold instead of forking them from the rank template
    # Groups across hosts (see ddip.hosts): --hosts, --launcher, --python, --bind.
    hosts: str | None = None
    launcher: str | None = None
    python: str | None = None
    bind: str | None = None

    def describe(self) -> str:
        where = f"-g {','.join(map(str, self.gpus))}" if self.gpus is not None else f"-n {self.n}"
        if self.hosts is not None:
            where = f"--hosts {self.hosts}" + "".join(
                f" --{k} {v!r}" for k, v in (("launcher", self.launcher), ("python", self.python),
                                             ("bind", self.bind)) if v is not None)
        return " ".join([where, f"--backend {self.backend}"] + ([f"-a {self.app}"] if self.app else [])
                        + (["--cold"] if self.cold else []))


class CellError(Exception):
    """A %%dip cell failed. IPython's custom-exception hook shows `entries` (the ranks' own
    tracebacks, merged) instead of a local traceback of the magic's internals, and the cell
    still counts as failed, so "Run All" stops there."""

    def __init__(self, message: str, entries=()):
        super().__init__(message)
        self.entries = list(entries)  # (ename, evalue, structured traceback lines)

    def show(self, shell):
        for ename, evalue, stb in self.entries:
            shell._showtraceback(type(ename, (Exception,), {}), evalue, stb)


def _header(text: str) -> str:
    return f"\x1b[1;31m{text}\x1b[0m"


def _failure_entries(failures) -> list:
    """One entry per distinct traceback, naming every rank that raised it (root cause first)."""
    entries = []
    for f, ranks in merge_failures(failures):
        if f.died:
            body = [f"{f.ename}: {f.evalue}"]
            if f.stderr_tail:
                body.append("last lines of its stderr:\n" + f.stderr_tail.rstrip("\n"))
        else:
            body = list(f.traceback) or [f"{f.ename}: {f.evalue}"]
        who = f"rank {ranks[0]}" if len(ranks) == 1 else \
            f"ranks {', '.join(map(str, ranks))} (the same traceback on each)"
        entries.append((f.ename, f.evalue, [_header(f"[{who}]")] + body))
    return entries


def _brief_entries(failures) -> list:
    """For push/pull: the message alone; the worker's own frames would only confuse."""
    return [(f.ename, f.evalue, [_header(f"[rank {f.rank}]"), f"{f.ename}: {f.evalue}"]) for f in failures]


def _usage(fn) -> str:
    # magic_arguments formats usage as reST ("::" and an indented block); show it plainly.
    text = fn.parser.format_usage().replace("::", "")
    return "usage: " + " ".join(text.split())


def _unquote(text: str) -> str:
    # IPython splits magic arguments without removing quotes: -a "--see all" arrives quoted.
    text = text.strip()
    if len(text) >= 2 and text[0] == text[-1] and text[0] in "'\"":
        return text[1:-1]
    return text


def _known_apps() -> list[str]:
    try:
        apps = importlib.import_module("ddip.apps")
    except ImportError:
        return []
    return sorted(m.name for m in pkgutil.iter_modules(getattr(apps, "__path__", [])) if not m.name.startswith("_"))


class _RankOutput:
    """Writes the shown ranks' output into the notebook live, labelling it when the rank changes."""

    def __init__(self, shown: list[int]):
        self.shown = set(shown)
        self.labelled = len(shown) > 1
        self.last_rank = None
        self.at_line_start = {"stdout": True, "stderr": True}
        self.displays = RankDisplays()

    def _label(self, rank, stream_name):
        if self.labelled and rank != self.last_rank:
            stream = getattr(sys, stream_name)
            if not self.at_line_start[stream_name]:
                stream.write("\n")
            stream.write(f"[rank {rank}]\n")
            self.at_line_start[stream_name] = True
        self.last_rank = rank

    def on_output(self, rank, stream_name, text):
        if rank not in self.shown or not text:
            return
        self._label(rank, stream_name)
        stream = getattr(sys, stream_name)
        stream.write(text)
        stream.flush()  # live: send it now, not at ipykernel's next flush interval
        self.at_line_start[stream_name] = text.endswith("\n")

    def on_display(self, rank, msg):
        if rank not in self.shown:
            return
        if msg.get("clear"):
            # The cell's output goes (now, or with wait=True when the next output comes), labels
            # with it: the next output is labelled again.
            self.last_rank = None
            self.at_line_start = {"stdout": True, "stderr": True}
        elif not msg.get("update"):  # an update redraws a display in place: nothing new to label
            self._label(rank, "stdout")
        # Keep display output after the text printed before it.
        sys.stdout.flush()
        sys.stderr.flush()
        self.displays.show(rank, msg)


def show_value(rank: int, count, fmt):
    """The last expression's value as Out[RANK:N]; rich bundles keep every MIME type."""
    data, metadata = fmt
    label = f"Out[{rank}:{count}]:"
    sys.stdout.flush()
    sys.stderr.flush()
    if set(data) <= {"text/plain"}:
        text = data.get("text/plain", "")
        sep = "\n" if "\n" in text else " "  # as IPython does for multi-line reprs
        publish_display_data({"text/plain": f"{label}{sep}{text}"}, metadata)
    else:
        publish_display_data({"text/plain": label})
        publish_display_data(data, metadata)


@magics_class
class DipMagics(Magics):
    """The ddip magics and the state they share: the group, its spec and %autodip."""

    def __init__(self, shell):
        super().__init__(shell)
        self.group: Group | None = None
        self.spec: GroupSpec | None = None
        self.autodip_args: str | None = None  # the %%dip flags while %autodip is on, else None
        self.last_results = None  # RankResults of the last %%dip cell, for inspection
        self._running_local = False  # a %%dip local body must not be rewritten by %autodip

    # -- helpers ----------------------------------------------------------------------------

    def _group(self) -> Group:
        if self.group is None or self.group.closed:
            raise UsageError(NO_GROUP)
        return self.group

    @staticmethod
    def _parse(fn, line: str):
        usage = _usage(fn)
        try:
            return parse_argstring(fn, line)
        except UsageError as exc:
            raise UsageError(f"{exc}\n{usage}") from None
        except ValueError as exc:  # unbalanced quotes
            raise UsageError(f"cannot split the arguments ({exc})\n{usage}") from None

    @staticmethod
    def _usage_error(fn, message: str):
        return UsageError(f"{message}\n{_usage(fn)}")

    def _autodip_state(self) -> str:
        if self.autodip_args is None:
            return "autodip is off"
        return f"autodip is on (cells run as %%dip {self.autodip_args})".replace(" )", ")")

    # -- %makedip ---------------------------------------------------------------------------

    @magic_arguments()
    @argument("-g", "--gpus", metavar="GPUS", help="one rank per listed GPU: 'all' or ids like 0,1,3 (in that order); "
                                                 "across hosts 'node1:0,1 node2:2,3', or ids for every --hosts host")
    @argument("-n", "--nprocs", metavar="NPROCS", type=int, help="this many CPU ranks")
    @argument("-a", "--app", metavar="APP", help="set the group up for an app (ddip.apps.APP), e.g. fastai")
    @argument("-r", "--restart", action="store_true", help="kill the group and start it again (new flags override)")
    @argument("-k", "--kill", action="store_true", help="kill the group")
    @argument("--heal", action="store_true",
              help="rebuild torch.distributed on every rank (same ranks, fresh port), keeping their variables")
    @argument("-i", "--info", action="store_true", help="print pids, rank -> device, backend, app and %%autodip")
    @argument("-v", "--verbose", action="store_true", help="print progress while the group starts")
    @argument("--cold", action="store_true", help="start ranks as fresh processes, not forked from the warm rank template")
    @argument("-t", "--timeout", metavar="TIMEOUT", type=float, help="seconds to wait for the group to come up (60)")
    @argument("--backend", choices=["gloo", "nccl", "none", "auto"],
              help="torch.distributed backend (auto: nccl on GPUs, gloo on CPU, none without torch)")
    @argument("--hosts", metavar="HOSTS",
              help="ranks on several hosts, numbered host by host: node1:4,node2:4 (CPU ranks), "
                   "'node1[0,1] node2[2,3]' (one rank per listed GPU), or node1,node2 with -g 0,1 (the "
                   "same GPUs on each); localhost runs here")
    @argument("--launcher", metavar="LAUNCHER",
              help="how --hosts are reached: ssh (default; 'ssh -F cfg' adds ssh options), slurm "
                   "(srun in an allocation), or a template with {host} and {command}")
    @argument("--python", metavar="PATH", help="the Python to run on the hosts (default: this one's path)")
    @argument("--bind", metavar="ADDRESS",
              help="this machine's address the hosts connect back to (default: the one that routes "
                   "to the first remote host)")
    @line_magic
    def makedip(self, line=""):
        """Create (-n/-g), restart (-r), kill (-k) or describe (-i) the group of ranks."""
        fn = self.makedip
        args = self._parse(fn, line)
        creating = args.gpus is not None or args.nprocs is not None or args.hosts is not None
        options = (creating or args.app is not None or args.timeout is not None or args.backend is not None
                   or args.cold)

        if args.kill:
            if args.restart or options or args.info or args.heal:
                raise self._usage_error(fn, "-k kills the group and takes no other flag (but -v)")
            self._kill(args.verbose)
            return
        if args.heal:
            if args.restart or options or args.info:
                raise self._usage_error(fn, "--heal rebuilds the running group's torch.distributed and takes "
                                            "no other flag")
            self._heal()
            return

        # Everything is checked before anything is stopped or started: bad input changes nothing.
        spec = self._new_spec(fn, args, creating)
        running = self.group is not None and not self.group.closed

        if spec is None:  # no flags that make a group
            if args.restart:
                raise self._usage_error(fn, "-r: there is no group to restart; create one with -n N or -g all")
            if args.info or running:
                self._print_info()
                return
            raise self._usage_error(fn, "give -n N (N CPU ranks) or -g all / -g 0,1 (one rank per GPU)")

        if running and not args.restart:
            if replace(spec, timeout=None) == replace(self.spec, timeout=None):  # -t only matters at start
                print(f"the group is already running ({spec.describe()}, pids {self.group.pids}); "
                      f"%makedip -r restarts it")
                if args.info:
                    self._print_info()
                return
            raise self._usage_error(fn, f"a group is already running ({self.spec.describe()}): "
                                        f"add -r to replace it with {spec.describe()}, or -k to kill it first")

        reuse = None
        if running and replace(spec, app=None, timeout=None) == replace(self.spec, app=None, timeout=None):
            # The same ranks again: restarted in place, so a Group handle taken from the magics
            # earlier (`g = ...registry["DipMagics"].group`) stays the group they drive.
            reuse, pids = self.group, self.group.pids
            if args.verbose:
                print(f"stopping ranks (pids {pids}) ...", flush=True)
            reuse.close()
            print(f"killed the group (pids {pids})")
        elif running:
            old = self.group
            self._kill(args.verbose, keep_autodip=True)
            print(f"(a Group object taken earlier ({old!r}) is closed now; the new group is "
                  f"get_ipython().magics_manager.registry['DipMagics'].group)")
        elif args.restart and self.group is not None:
            self.group = None  # closed behind our back (group.close() in a cell): start afresh
        self._start(spec, args.verbose, reuse)
        if args.info:
            self._print_info()

    def _new_spec(self, fn, args, creating) -> GroupSpec | None:
        # Across hosts -g says each host's GPUs (-g 0,1 with --hosts, or -g 'node1:0,1 node2:2,3').
        across = args.hosts is not None or (args.gpus is not None and _hosts.host_qualified(_unquote(args.gpus)))
        if not across and (args.launcher is not None or args.python is not None or args.bind is not None):
            raise self._usage_error(fn, "--launcher, --python and --bind go with --hosts")
        if args.app is not None and args.app not in _known_apps():  # before anything else is asked for
            known = _known_apps()
            raise self._usage_error(fn, f"-a {args.app}: no such app; known apps: "
                                        f"{', '.join(known) if known else '(none installed)'}")
        base = self.spec if (args.restart and self.spec is not None) else None
        if base is None and not creating:
            if args.app is not None or args.timeout is not None or args.backend is not None or args.cold:
                if not args.restart:
                    raise self._usage_error(fn, "say how many ranks: add -n N (CPU) or -g all / -g 0,1 (GPUs)")
            return None
        spec = base or GroupSpec()
        if creating:
            gpus = None
            if args.gpus is not None and not across:
                try:
                    parse_gpus(args.gpus)  # checked now; kept as given (positions stay positions)
                    gpus = tuple(x.strip() for x in _unquote(args.gpus).split(",") if x.strip())
                except ValueError as exc:
                    raise self._usage_error(fn, f"-g {args.gpus}: {exc}") from None
            n = args.nprocs
            if n is not None and n < 1:
                raise self._usage_error(fn, f"-n {n}: give a positive number of ranks")
            if n is not None and gpus is not None and n != len(gpus):
                raise self._usage_error(fn, f"-n {n} but -g lists {len(gpus)} GPUs; give one or the other")
            spec = replace(spec, n=None if gpus is not None else n, gpus=gpus, hosts=None, launcher=None,
                           python=None, bind=None)
            if across:
                spec = self._hosts_spec(fn, args, replace(spec, n=None, gpus=None))
        if args.backend is not None:
            spec = replace(spec, backend=args.backend)
        if args.timeout is not None:
            if not args.timeout > 0:
                raise self._usage_error(fn, f"-t {args.timeout:g}: give a positive number of seconds")
            spec = replace(spec, timeout=args.timeout)
        if args.app is not None:
            spec = replace(spec, app=args.app)
        if args.cold:
            spec = replace(spec, cold=True)
        try:
            resolve_backend(None if spec.backend == "none" else spec.backend, spec.gpus if spec.hosts is None
                            else [g for h in _hosts.parse_hosts(spec.hosts) for g in (h.gpus or [])])
        except ValueError as exc:
            raise self._usage_error(fn, f"--backend {spec.backend}: {exc}") from None
        return spec

    def _hosts_spec(self, fn, args, spec: GroupSpec) -> GroupSpec:
        if args.nprocs is not None:
            raise self._usage_error(fn, "--hosts says the ranks of every host (node1:4,node2:4): leave out -n")
        hosts = _unquote(args.hosts) if args.hosts is not None else None
        if args.gpus is not None:
            try:  # -g 0,1 on every host listed by name, or -g 'node1:0,1 node2:2,3'
                hosts = _hosts.with_gpus(hosts, _unquote(args.gpus))
            except ValueError as exc:
                raise self._usage_error(fn, f"-g {_unquote(args.gpus)}: {exc}") from None
        launcher = _unquote(args.launcher) if args.launcher is not None else None
        try:
            _hosts.layout(hosts, launcher, args.python, args.bind)  # checked before anything starts
        except ValueError as exc:
            raise self._usage_error(fn, f"--hosts {hosts}: {exc}") from None
        return replace(spec, hosts=hosts, launcher=launcher, python=args.python, bind=args.bind)

    def _start(self, spec: GroupSpec, verbose: bool, reuse: Group | None = None):
        if spec.hosts is not None:
            what = f"{_hosts.layout(spec.hosts, spec.launcher, spec.python, spec.bind).size} rank(s) on {spec.hosts}"
        else:
            what = (f"{len(parse_gpus(list(spec.gpus) if spec.gpus != ('all',) else 'all'))} GPU rank(s)"
                    if spec.gpus is not None else f"{spec.n} CPU rank(s)")
        if verbose:
            print(f"starting {what} ({spec.describe()}), waiting up to {spec.timeout:g} s ...", flush=True)
            if spec.cold:
                print("rank template: not used (--cold); ranks start cold", flush=True)
            else:
                print(_template.status() if _template.enabled() else
                      "rank template: off (DDIP_PREWARM=0); ranks start cold", flush=True)
        t0 = time.monotonic()
        backend = None if spec.backend == "none" else spec.backend
        # Remembered even if the start fails, so `%makedip -r` (perhaps with -t) tries it again.
        self.spec = replace(spec, app=None)
        try:
            if reuse is not None:
                reuse.timeout = spec.timeout
                reuse.restart()
                group = reuse
            elif spec.hosts is not None:
                group = Group(hosts=spec.hosts, launcher=spec.launcher, python=spec.python, bind=spec.bind,
                              backend=backend, timeout=spec.timeout, env=notebook_env() or None)
            else:
                group = Group(n=spec.n, gpus=(list(spec.gpus) if spec.gpus != ("all",) else "all")
                              if spec.gpus is not None else None,
                              backend=backend, timeout=spec.timeout, warm=False if spec.cold else None,
                              env=notebook_env() or None)
        except StartError as exc:
            self.group = None
            text = exc.describe(wait_longer="give -t SECONDS") + "\n(no group is running; %makedip -r tries again)"
            raise CellError(text, [("StartError", text, [_header("StartError"), text])]) from None
        except KeyboardInterrupt:
            self.group = None
            # Group() has already stopped whatever it had started.
            text = "the start was interrupted; no group is running (%makedip -r tries again)"
            raise CellError(text, [("KeyboardInterrupt", text, [_header("KeyboardInterrupt"), text])]) from None
        self.group = group
        if verbose:
            print(f"ready in {time.monotonic() - t0:.1f} s: pids {group.pids}, backend {group.backend or 'none'}", flush=True)
        if spec.app is not None:
            if verbose:
                print(f"setting the group up for {spec.app} ...", flush=True)
            try:
                module = importlib.import_module(f"ddip.apps.{spec.app}")
                setup = getattr(module, "setup_group", None)
                if setup is None:
                    raise UsageError(f"ddip.apps.{spec.app} has no setup_group(group)")
                setup(group)
            except BaseException as exc:
                # No group half set up: the ranks would run without the app the user asked for.
                group.close()
                self.group = None
                if isinstance(exc, RemoteError):
                    first = exc.failures[0]
                    ranks = exc.ranks
                    text = (f"-a {spec.app}: the app's setup failed on rank{'s' if len(ranks) > 1 else ''} "
                            f"{', '.join(map(str, ranks))} "
                            f"({first.ename}: {first.evalue}); the group was stopped. Fix the cause "
                            f"(is {spec.app} installed where the ranks run?) and run %makedip -r, or "
                            f"start without -a")
                    raise CellError(text, [("AppSetupError", text, [_header("AppSetupError"), text]
                                            + _failure_entries(exc.failures)[0][2][1:])]) from None
                if isinstance(exc, KeyboardInterrupt):
                    text = f"the {spec.app} setup was interrupted; no group is running (%makedip -r tries again)"
                    raise CellError(text, [("KeyboardInterrupt", text, [_header("KeyboardInterrupt"), text])]) from None
                text = (f"-a {spec.app}: the app's setup failed in the notebook ({type(exc).__name__}: {exc}); "
                        f"the group was stopped (%makedip -r tries again, or start without -a)")
                raise CellError(text, [("AppSetupError", text, [_header("AppSetupError"), text])]) from None
            self.spec = spec  # the app counts only once its setup succeeded
        if not verbose:
            print(f"{what} ready: pids {group.pids}, backend {group.backend or 'none'}" +
                  (f", app {spec.app}" if spec.app else ""))

    def _heal(self):
        group = self._group()
        try:
            report = group.heal()
        except HealError as exc:
            raise CellError(str(exc), [("HealError", str(exc), [_header("HealError"), str(exc)])]) from None
        except RankError as exc:  # a dead rank: nothing was changed
            raise UsageError(f"%makedip --heal: {exc.describe(restart=RESTART)}") from None
        except RuntimeError as exc:  # no backend, ranks of a larger world: nothing was changed
            raise UsageError(f"%makedip --heal: {exc}") from None
        print(f"healed in {report.seconds:.2f} s: torch.distributed's default group rebuilt on all "
              f"{report.world_size} ranks (MASTER_PORT {report.port}); their variables are kept"
              + (f"; rank(s) {', '.join(map(str, report.released))} were released from what they ran"
                 if report.released else ""))

    def _kill(self, verbose: bool, keep_autodip: bool = False):
        if self.group is None or self.group.closed:
            print("no group is running")
            return
        pids = self.group.pids
        if verbose:
            print(f"stopping ranks (pids {pids}) ...", flush=True)
        self.group.close()
        self.group = None
        print(f"killed the group (pids {pids})")
        if self.autodip_args is not None and not keep_autodip:
            # Every following cell would fail with "no group"; the notebook runs locally again.
            self._set_autodip(None)
            print("autodip is now off")

    def _print_info(self):
        if self.group is None or self.group.closed:
            print("no group is running")
            print(self._autodip_state())
            return
        g = self.group
        print(f"group: {self.spec.describe()}")
        print(f"backend: {g.backend or 'none'}")
        print(f"app: {self.spec.app or 'none'}")
        print(f"pids: {g.pids}")
        for rank in g.rank_ids:
            print(f"  rank {rank} -> {g.device(rank)}")
        threads, who = g.omp_num_threads
        print(f"threads per rank: OMP_NUM_THREADS={threads} (set by {who})")
        print(self._autodip_state())

    # -- %%dip ------------------------------------------------------------------------------

    @magic_arguments()
    @argument("where", nargs="?", choices=["remote", "local", "everywhere"],
              help="remote: the group (default); local: the notebook only; everywhere: the notebook, then the group")
    @argument("--to", choices=["remote", "local", "both"], help="the same as `where` (both = everywhere)")
    @argument("-S", "--see", metavar="all|none|RANKS", help="whose output to show: all, none or ranks like 0,2 (0)")
    @argument("-q", "--quiet", action="store_true", help="show no rank's output (errors still show)")
    @argument("--timeout", metavar="SECONDS", type=float, help="interrupt the ranks after this many seconds")
    @argument("--push", metavar="VAR", nargs="+", help="(line magic) copy these notebook variables to every rank")
    @line_cell_magic
    def dip(self, line="", cell=None):
        """Run a cell on the group's ranks (remote), in the notebook (local), or both (everywhere)."""
        fn = self.dip
        if cell is None and "--push" not in line:
            raise self._usage_error(fn, "as a line magic %dip takes --push VAR ...; "
                                        "to run code on the ranks, start the cell with %%dip")
        args = self._parse(fn, line)
        if cell is None:
            if not args.push:
                raise self._usage_error(fn, "as a line magic %dip takes --push VAR ...; "
                                            "to run code on the ranks, start the cell with %%dip")
            self._push(args.push)
            return
        if args.push:
            raise self._usage_error(fn, "--push goes on a line of its own (%dip --push VAR); not with %%dip")
        where = self._where(fn, args)
        if args.timeout is not None and not args.timeout > 0:
            raise self._usage_error(fn, f"--timeout {args.timeout:g}: give a positive number of seconds")
        if where == "local":
            self._run_local(cell)
            return
        group = self._group()
        shown = self._shown(fn, args, group)
        if where == "everywhere":
            self._run_local(cell)
        self._run_remote(group, cell, shown, args.timeout)

    @staticmethod
    def _where(fn, args) -> str:
        where = args.where or "remote"
        if args.to is not None:
            to = _WHERE[args.to]
            if args.where is not None and to != where:
                raise DipMagics._usage_error(fn, f"'{args.where}' and --to {args.to} disagree; give one")
            where = to
        return where

    @staticmethod
    def _shown(fn, args, group) -> list[int]:
        if args.quiet:
            if args.see not in (None, "none"):
                raise DipMagics._usage_error(fn, f"-q shows no rank; it contradicts --see {args.see}")
            return []
        see = _unquote(args.see or str(group.rank_ids[0])).lower()
        if see == "all":
            return list(group.rank_ids)
        if see == "none":
            return []
        return DipMagics._ranks(fn, "--see", args.see, see, group, "all, none or ranks like 0,2")

    @staticmethod
    def _ranks(fn, flag, given, text, group, form="ranks like 0,2") -> list[int]:
        """'0,2' -> [0, 2], each a rank of the group, in the order given, once each."""
        try:
            ranks = [int(r) for r in text.split(",") if r.strip()]
        except ValueError:
            raise DipMagics._usage_error(fn, f"{flag} {given}: give {form}") from None
        bad = [r for r in ranks if r not in group.rank_ids]
        if bad or not ranks:
            raise DipMagics._usage_error(fn, f"{flag} {given}: the group's ranks are "
                                             f"{', '.join(map(str, group.rank_ids))}")
        return sorted(set(ranks), key=ranks.index)

    def _run_local(self, cell: str):
        self._running_local = True
        try:
            result = self.shell.run_cell(cell, store_history=False)
        finally:
            self._running_local = False
        if not result.success:
            # The notebook's own traceback has been shown; fail the cell without adding to it.
            raise CellError("the cell failed in the notebook; it did not run on the ranks")

    def _run_remote(self, group: Group, cell: str, shown: list[int], timeout):
        out = _RankOutput(shown)
        error = None
        try:
            # Only the display form of the last value travels (values=False): the object stays in
            # the rank, so a CUDA tensor never starts CUDA here and nothing big is copied back.
            results = group.run(cell, on_output=out.on_output, on_display=out.on_display, timeout=timeout,
                                values=False)
        except RemoteError as exc:
            results, error = exc.results or [], exc
        except KeyboardInterrupt as exc:
            # Group.run has already interrupted every rank and waited for them; no need for a
            # traceback of our own frames. (Raised again as a CellError so the cell counts as failed.)
            msg = (str(exc) or "interrupted")
            # A Ctrl-C that lands while we write output escapes Group.run before it interrupts
            # the ranks; make sure none is left running the cell.
            busy = [r["rank"] for r in group.status() if r["state"] == "busy"]
            if busy:
                group.interrupt(busy)
            body = [_header("KeyboardInterrupt"), msg]
            for r in getattr(exc, "results", None) or []:
                if r.stacks:
                    body += [_header(f"[rank {r.rank}] did not stop; where it was:"), r.stacks.rstrip("\n")]
            raise CellError(msg, [("KeyboardInterrupt", msg, body)]) from None
        except TimeoutError as exc:
            body = [_header("TimeoutError"), str(exc)]
            for r in getattr(exc, "results", None) or []:
                if r.stacks:
                    body += [_header(f"[rank {r.rank}] did not stop; where it was:"), r.stacks.rstrip("\n")]
            raise CellError(str(exc), [("TimeoutError", str(exc), body)]) from None
        except (RankError, GroupClosedError) as exc:  # refused before it was sent: nothing ran
            text = exc.describe(restart=RESTART)
            # The same name as a rank that dies while running a cell.
            ename = "RankDied" if isinstance(exc, RankDeadError) else type(exc).__name__
            raise CellError(text, [(ename, text, [_header(ename), text])]) from None
        except RuntimeError as exc:  # anything else from the runtime: its message, not our frames
            ename, text = type(exc).__name__, str(exc)
            raise CellError(text, [(ename, text, [_header(ename), text])]) from None
        self.last_results = results
        for r in results:
            if r.rank in out.shown and r.ok and r.format is not None:
                show_value(r.rank, r.execution_count, r.format)
        if error is not None:
            if error.heal is not None:  # what happened to the group, before the ranks' tracebacks
                print(error.heal.describe(), file=sys.stderr, flush=True)
            raise CellError(str(error).splitlines()[0], _failure_entries(error.failures)) from None

    # -- %autodip ---------------------------------------------------------------------------

    @magic_arguments()
    @argument("state", nargs="?", choices=["on", "off"], help="on: every cell runs as %%%%dip; off: as written")
    @argument("-a", "--args", default="", metavar='"..."',
              help='%%%%dip flags for every cell, e.g. -a "--see all" (or --args=-q)')
    @line_magic
    def autodip(self, line=""):
        """Run every following cell as if it began with %%dip (a cell starting with % runs as written)."""
        fn = self.autodip
        args = self._parse(fn, line)
        args.args = _unquote(args.args)
        if args.state is None:
            if args.args:
                raise self._usage_error(fn, "-a goes with on: %autodip on -a \"--see all\"")
            print(self._autodip_state())
            return
        if args.state == "off":
            if args.args:
                raise self._usage_error(fn, "-a goes with on, not off")
            self._set_autodip(None)
            print(self._autodip_state())
            return
        self._group()
        # Check the flags now, so a typo fails here rather than in every following cell.
        dip_args = self._parse(self.dip, args.args)
        if dip_args.push:
            raise self._usage_error(fn, "--push is not a cell flag; use %dipush VAR")
        self._where(self.dip, dip_args)
        self._shown(self.dip, dip_args, self._group())
        self._set_autodip(args.args.strip())
        print(self._autodip_state())

    def _set_autodip(self, dip_args: str | None):
        transforms = self.shell.input_transformers_cleanup
        if self._autodip_transform in transforms:
            transforms.remove(self._autodip_transform)
        self.autodip_args = dip_args
        if dip_args is not None:
            # Cleanup transforms run before IPython turns %%magics into calls, so the rewritten
            # cell is an ordinary %%dip cell.
            transforms.append(self._autodip_transform)

    def _autodip_transform(self, lines: list[str]) -> list[str]:
        if self.autodip_args is None or self._running_local or not lines:
            return lines
        if lines[0].startswith("%") or not "".join(lines).strip():
            return lines
        return [f"%%dip {self.autodip_args}".rstrip() + "\n"] + lines

    # -- %dipush / %dipull / %dipstatus -----------------------------------------------------

    @magic_arguments()
    @argument("names", nargs="+", metavar="VAR", help="notebook variables to copy to every rank")
    @line_magic
    def dipush(self, line=""):
        """Copy notebook variables into every rank's namespace."""
        args = self._parse(self.dipush, line)
        self._push(args.names)

    def _push(self, names: list[str]):
        group = self._group()
        bad = [n for n in names if not n.isidentifier()]
        if bad:
            raise UsageError(f"not variable names: {', '.join(bad)}")
        missing = [n for n in names if n not in self.shell.user_ns]
        if missing:
            raise UsageError(f"not defined in the notebook: {', '.join(missing)}; nothing was pushed")
        try:
            group.push({n: self.shell.user_ns[n] for n in names})
        except RemoteError as exc:
            raise CellError(str(exc).splitlines()[0], _brief_entries(exc.failures)) from None

    @magic_arguments()
    @argument("-r", "--rank", type=int, default=None, metavar="RANK", help="the rank to copy from (default: 0)")
    @argument("names", nargs="+", metavar="VAR", help="rank variables to copy into the notebook")
    @line_magic
    def dipull(self, line=""):
        """Copy variables from rank 0 (or -r RANK) into the notebook."""
        args = self._parse(self.dipull, line)
        group = self._group()
        rank = group.rank_ids[0] if args.rank is None else args.rank
        if rank not in group.rank_ids:
            raise self._usage_error(self.dipull, f"-r {rank}: the group's ranks are "
                                                 f"{', '.join(map(str, group.rank_ids))}")
        bad = [n for n in args.names if not n.isidentifier()]
        if bad:
            raise UsageError(f"not variable names: {', '.join(bad)}")
        try:
            values = group.pull(args.names, rank=rank)
        except RemoteError as exc:
            raise CellError(str(exc).splitlines()[0], _brief_entries(exc.failures)) from None
        self.shell.user_ns.update(zip(args.names, values))

    @line_magic
    def dipstatus(self, line=""):
        """A table of the ranks: pid, device, state (idle / busy / dead), memory, heartbeat."""
        if line.strip():
            raise UsageError(f"%dipstatus takes no arguments (got {line.strip()!r})")
        group = self._group()
        rows = group.status()
        header = ["rank", "pid", "device", "state", "busy for", "memory", "heartbeat"]
        if group.gpus is not None:
            header.append("GPU")
        table = []
        for r in rows:
            row = [str(r["rank"]), str(r["pid"]), r["device"], r["state"],
                   "-" if r["busy_s"] is None else f"{r['busy_s']:.1f} s",
                   "-" if r["rss_mb"] is None else f"{r['rss_mb']:.0f} MiB",
                   "-" if r["heartbeat_ms"] is None or r["heartbeat_ms"] < 0 else f"{r['heartbeat_ms'] / 1000:.1f} s ago"]
            if group.gpus is not None:
                g = r.get("gpu")
                row.append("- (CUDA not started)" if not g else
                           f"GPU {g['index']} {g['name']}, {g['used_mib']} MiB used")
            table.append(row)
        widths = [max(len(h), *(len(row[i]) for row in table)) for i, h in enumerate(header)]
        text = "\n".join("  ".join(c.ljust(w) for c, w in zip(row, widths)).rstrip() for row in [header] + table)
        cells = lambda tag, row: "".join(f"<{tag}>{html.escape(c)}</{tag}>" for c in row)  # noqa: E731
        markup = ("<table><thead><tr>" + cells("th", header) + "</tr></thead><tbody>"
                  + "".join("<tr>" + cells("td", row) + "</tr>" for row in table) + "</tbody></table>")
        publish_display_data({"text/plain": text, "text/html": markup})

    @magic_arguments()
    @argument("-r", "--ranks", metavar="RANKS", help="ranks like 0,2 (default: all)")
    @argument("-t", "--timeout", type=float, default=3.0, metavar="SECONDS",
              help="how long to wait for the ranks to answer (3)")
    @line_magic
    def dipstack(self, line=""):
        """Print every selected rank's Python stack (all threads) without stopping it."""
        fn = self.dipstack
        args = self._parse(fn, line)
        group = self._group()
        ranks = None
        if args.ranks is not None:
            ranks = self._ranks(fn, "-r", args.ranks, _unquote(args.ranks), group)
        if not args.timeout > 0:
            raise self._usage_error(fn, f"-t {args.timeout:g}: give a positive number of seconds")
        for rank, text in group.stacks(ranks, timeout=args.timeout).items():
            print(f"[rank {rank}]")
            print(text.rstrip("\n"))

    def close(self):
        self._set_autodip(None)
        if self.group is not None:
            self.group.close()
            self.group = None


_magics: DipMagics | None = None
_previous_exc = None  # the shell's custom exception handling before ours, restored on unload


def _install_exc_handler(shell):
    global _previous_exc
    _previous_exc = (shell.custom_exceptions, shell.CustomTB)
    prev_types, prev_handler = _previous_exc

    def handler(shell, etype, value, tb, tb_offset=None):
        if isinstance(value, CellError):
            value.show(shell)
            return []
        return prev_handler(etype, value, tb, tb_offset)

    shell.set_custom_exc(tuple(t for t in prev_types if t is not CellError) + (CellError,), handler)


def load_ipython_extension(ip):
    global _magics
    if _magics is not None and _magics.shell is ip:
        return
    _magics = DipMagics(ip)
    ip.register_magics(_magics)
    _template.prewarm()  # in the background: the first %makedip forks its ranks from it
    _install_exc_handler(ip)


def unload_ipython_extension(ip):
    global _magics, _previous_exc
    if _magics is None:
        return
    _magics.close()
    if _previous_exc is not None:
        ip.custom_exceptions, ip.CustomTB = _previous_exc
        _previous_exc = None
    for kind in ("line", "cell"):
        for name in ("makedip", "dip", "autodip", "dipush", "dipull", "dipstatus", "dipstack"):
            ip.magics_manager.magics[kind].pop(name, None)
    _magics = None
