"""The group's life: %makedip creates, restarts, heals, kills and describes it; %dipstack looks
at its ranks (%dipstatus, the rank panel: magics/panel.py)."""

from __future__ import annotations

import importlib
import pkgutil
import time
from dataclasses import dataclass, replace

from IPython.core.error import UsageError
from IPython.core.magic import Magics, line_magic, magics_class
from IPython.core.magic_arguments import argument, magic_arguments

from ..hosts import allocation as _allocation
from ..hosts import placement as _hosts
from ..kernel import template as _template
from ..kernel.displays import notebook_env
from ..errors import HealError, RankFailedError, StartError
from ..kernel.group import Group, parse_gpus, resolve_backend
from . import render
from .flags import hosts_flags, parse, positive_seconds, rank_list, size_flags, unquote, usage_error
from .session import Session

RESTART = "run %makedip -r"  # the notebook's way to do what the API's errors call restart()
HEAL = "run %makedip --heal"  # ... and heal()
GROUP_PATH = "get_ipython().magics_manager.registry['DipMagics'].group"


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
    slurm: str | None = None  # --slurm: salloc's options; the nodes are asked of Slurm

    def describe(self) -> str:
        where = f"-g {','.join(map(str, self.gpus))}" if self.gpus is not None else f"-n {self.n}"
        if self.hosts is not None or self.slurm is not None:
            where = (f"--hosts {self.hosts}" if self.slurm is None else f"--slurm {self.slurm!r}") + "".join(
                f" --{k} {v!r}" for k, v in (("launcher", self.launcher), ("python", self.python),
                                             ("bind", self.bind)) if v is not None)
        return " ".join([where, f"--backend {self.backend}"] + ([f"-a {self.app}"] if self.app else [])
                        + (["--cold"] if self.cold else []))


def known_apps() -> list[str]:
    try:
        apps = importlib.import_module("ddip.apps")
    except ImportError:
        return []
    return sorted(m.name for m in pkgutil.iter_modules(getattr(apps, "__path__", [])) if not m.name.startswith("_"))


@magics_class
class DipMagics(Magics):
    """%makedip, %dipstack. Named DipMagics (not GroupMagics) because the group is
    reached from Python as registry['DipMagics'].group, as docs/magics.md says."""

    def __init__(self, shell, session: Session):
        super().__init__(shell)
        self.session = session

    @property
    def group(self) -> Group | None:
        return self.session.group

    @property
    def last_results(self):
        return self.session.last_results

    # -- %makedip -----------------------------------------------------------------------------------

    # The flags in the order `%makedip?` and docs/magics.md list them: the most used first.
    @magic_arguments()
    @size_flags
    @argument("-r", "--restart", action="store_true", help="kill the group and start it again (new flags override)")
    @argument("-k", "--kill", action="store_true", help="kill the group (and turn %%autodip off)")
    @argument("--heal", action="store_true",
              help="rebuild torch.distributed on every rank (same ranks, fresh port), keeping their variables; "
                   "a dead rank is replaced by a new process in its slot")
    @argument("--copy-from", metavar="RANK", type=int,
              help="with --heal: give the replaced rank a copy of this living rank's variables")
    @argument("-i", "--info", action="store_true",
              help="print the group's flags, backend, app, pids, rank -> device, OMP_NUM_THREADS (and who "
                   "chose it) and the %%autodip state")
    @argument("-v", "--verbose", action="store_true",
              help="print progress while the group starts or stops, and the rank template's state (warm "
                   "or cold ranks, and why)")
    @argument("--backend", choices=["gloo", "nccl", "none", "auto"],
              help="torch.distributed backend (auto: nccl on GPUs, gloo on CPU, none without torch)")
    @argument("-t", "--timeout", metavar="SECONDS", type=float, help="seconds to wait for the group to come up (60)")
    @argument("-a", "--app", metavar="APP", help="set the group up for an app (ddip.apps.APP), e.g. fastai")
    @argument("--cold", action="store_true", help="start ranks as fresh processes, not forked from the warm rank template")
    @hosts_flags
    @argument("--slurm", metavar="OPTIONS",
              help="ask Slurm for nodes with salloc's options ('-N 4 --gpus-per-node 8 -t 2:00:00') and put "
                   "the ranks on them: one per task of --ntasks-per-node, else one per GPU, else one per node; "
                   "the wait is shown, Ctrl-C cancels it, -k ends the job")
    @line_magic
    def makedip(self, line=""):
        """Create (-n/-g), restart (-r), kill (-k) or describe (-i) the group of ranks."""
        fn = self.makedip
        args = parse(fn, line)
        s = self.session
        creating = (args.gpus is not None or args.nprocs is not None or args.hosts is not None
                    or args.slurm is not None)
        options = (creating or args.app is not None or args.timeout is not None or args.backend is not None
                   or args.cold)

        if args.kill:
            if args.restart or options or args.info or args.heal or args.copy_from is not None:
                raise usage_error(fn, "-k kills the group and takes no other flag (but -v)")
            self._kill(args.verbose)
            return
        if args.heal or args.copy_from is not None:
            self._heal(fn, args, options)
            return

        # Everything is checked before anything is stopped or started: bad input changes nothing.
        spec = self._new_spec(fn, args, creating)
        running = s.running

        if spec is None:  # no flags that make a group
            if args.restart:
                raise usage_error(fn, "-r: there is no group to restart; create one with -n N or -g all")
            if args.info or running:
                self._print_info()
                return
            raise usage_error(fn, "give -n N (N CPU ranks) or -g all / -g 0,1 (one rank per GPU)")

        if running and not args.restart:
            if replace(spec, timeout=None) == replace(s.spec, timeout=None):  # -t only matters at start
                print(f"the group is already running ({spec.describe()}, pids {s.group.pids}); "
                      f"%makedip -r restarts it")
                if args.info:
                    self._print_info()
                return
            raise usage_error(fn, f"a group is already running ({s.spec.describe()}): "
                                  f"add -r to replace it with {spec.describe()}, or -k to kill it first")

        self._replace(spec, args, running)
        if args.info:
            self._print_info()

    def _replace(self, spec: GroupSpec, args, running: bool):
        """Starts the group `spec` says, in place of the running one if any."""
        s = self.session
        reuse = allocation = None
        if running and replace(spec, app=None, timeout=None) == replace(s.spec, app=None, timeout=None):
            # The same ranks again: restarted in place, so a Group handle taken from the magics
            # earlier (`g = ...registry["DipMagics"].group`) stays the group they drive (and keeps
            # its Slurm job, if it asked for one).
            reuse, pids = s.group, s.group.pids
            if args.verbose:
                print(f"stopping ranks (pids {pids}) ...", flush=True)
            if reuse.slurm_job is None:
                reuse.close()
            print(f"killed the group (pids {pids})" if reuse.slurm_job is None else
                  f"restarting the group in Slurm job {reuse.slurm_job} (pids {pids})")
        elif spec.slurm is not None:
            # The nodes first: while Slurm keeps the request pending (Ctrl-C cancels it), or when
            # it refuses, the running group is left as it is.
            allocation = self._ask_slurm(spec.slurm)
        try:
            if reuse is None and running:
                old = s.group
                self._kill(args.verbose, keep_autodip=True)
                print(f"(a Group object taken earlier ({old!r}) is closed now; the new group is {GROUP_PATH})")
            elif reuse is None and args.restart and s.group is not None:
                s.group = None  # closed behind our back (group.close() in a cell): start afresh
            self._start(spec, args.verbose, reuse, allocation)
        except BaseException:
            if allocation is not None:
                allocation.close()  # a job no group took (the group gives back its own: idempotent)
            raise

    @staticmethod
    def _ask_slurm(options: str):
        try:
            return _allocation.SlurmAllocation.request(options)
        except _allocation.SlurmRequestError as exc:
            raise render.CellError.of("SlurmRequestError", f"--slurm {options!r}: {exc}") from None
        except KeyboardInterrupt:
            raise render.CellError.of("KeyboardInterrupt", f"the request for Slurm nodes (salloc {options}) was "
                                                           f"cancelled; nothing else changed") from None

    def _new_spec(self, fn, args, creating) -> GroupSpec | None:
        # Across hosts -g says each host's GPUs (-g 0,1 with --hosts, or -g 'node1:0,1 node2:2,3').
        across = args.hosts is not None or (args.gpus is not None and _hosts.host_qualified(unquote(args.gpus)))
        if not across and (args.launcher is not None or (args.slurm is None and (
                args.python is not None or args.bind is not None))):
            raise usage_error(fn, "--launcher, --python and --bind go with --hosts (--python and --bind with "
                                  "--slurm too)")
        if args.app is not None and args.app not in known_apps():  # before anything else is asked for
            known = known_apps()
            raise usage_error(fn, f"-a {args.app}: no such app; known apps: "
                                  f"{', '.join(known) if known else '(none installed)'}")
        base = self.session.spec if (args.restart and self.session.spec is not None) else None
        if base is None and not creating:
            if args.app is not None or args.timeout is not None or args.backend is not None or args.cold:
                if not args.restart:
                    raise usage_error(fn, "say how many ranks: add -n N (CPU) or -g all / -g 0,1 (GPUs)")
            return None
        spec = base or GroupSpec()
        if creating:
            gpus = None
            if args.gpus is not None and not across:
                try:
                    parse_gpus(args.gpus)  # checked now; kept as given (positions stay positions)
                    gpus = tuple(x.strip() for x in unquote(args.gpus).split(",") if x.strip())
                except ValueError as exc:
                    raise usage_error(fn, f"-g {args.gpus}: {exc}") from None
            n = args.nprocs
            if n is not None and n < 1:
                raise usage_error(fn, f"-n {n}: give a positive number of ranks")
            if n is not None and gpus is not None and n != len(gpus):
                raise usage_error(fn, f"-n {n} but -g lists {len(gpus)} GPUs; give one or the other")
            spec = replace(spec, n=None if gpus is not None else n, gpus=gpus, hosts=None, launcher=None,
                           python=None, bind=None, slurm=None)
            if args.slurm is not None:
                spec = self._slurm_spec(fn, args, across, spec)
            if across:
                spec = self._hosts_spec(fn, args, replace(spec, n=None, gpus=None))
        if args.backend is not None:
            spec = replace(spec, backend=args.backend)
        if args.timeout is not None:
            spec = replace(spec, timeout=positive_seconds(fn, "-t", args.timeout))
        if args.app is not None:
            spec = replace(spec, app=args.app)
        if args.cold:
            spec = replace(spec, cold=True)
        try:
            if spec.slurm is None:  # with --slurm the GPUs are known once the job is granted
                resolve_backend(None if spec.backend == "none" else spec.backend, spec.gpus if spec.hosts is None
                                else [g for h in _hosts.parse_hosts(spec.hosts) for g in (h.gpus or [])])
        except ValueError as exc:
            raise usage_error(fn, f"--backend {spec.backend}: {exc}") from None
        return spec

    @staticmethod
    def _slurm_spec(fn, args, across: bool, spec: GroupSpec) -> GroupSpec:
        if across or args.gpus is not None or args.nprocs is not None or args.launcher is not None:
            raise usage_error(fn, "--slurm asks Slurm for the nodes and places the ranks itself (say how many "
                                  "with salloc's --ntasks-per-node or --gpus-per-node): leave out -n, -g, --hosts "
                                  "and --launcher")
        options = unquote(args.slurm)
        try:
            _allocation.split_options(options)
        except ValueError as exc:
            raise usage_error(fn, f"--slurm: {exc}") from None
        return replace(spec, n=None, slurm=options, python=args.python, bind=args.bind)

    @staticmethod
    def _hosts_spec(fn, args, spec: GroupSpec) -> GroupSpec:
        if args.nprocs is not None:
            raise usage_error(fn, "--hosts says the ranks of every host (node1:4,node2:4): leave out -n")
        hosts = unquote(args.hosts) if args.hosts is not None else None
        if args.gpus is not None:
            try:  # -g 0,1 on every host listed by name, or -g 'node1:0,1 node2:2,3'
                hosts = _hosts.with_gpus(hosts, unquote(args.gpus))
            except ValueError as exc:
                raise usage_error(fn, f"-g {unquote(args.gpus)}: {exc}") from None
        launcher = unquote(args.launcher) if args.launcher is not None else None
        try:
            _hosts.layout(hosts, launcher, args.python, args.bind)  # checked before anything starts
        except ValueError as exc:
            raise usage_error(fn, f"--hosts {hosts}: {exc}") from None
        return replace(spec, hosts=hosts, launcher=launcher, python=args.python, bind=args.bind)

    def _start(self, spec: GroupSpec, verbose: bool, reuse: Group | None = None, allocation=None):
        s = self.session
        what = self._what(spec, reuse, allocation)
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
        s.spec = replace(spec, app=None)
        try:
            if reuse is not None:
                reuse.timeout = spec.timeout
                reuse.restart()
                group = reuse
            else:
                group = self._new_group(spec, backend, allocation)
        except StartError as exc:
            s.group = None
            ended = f"; its Slurm job {allocation.job} was given back" if allocation is not None else ""
            raise render.CellError.of("StartError", exc.describe(wait_longer="give -t SECONDS")
                                      + f"\n(no group is running{ended}; %makedip -r tries again)") from None
        except _allocation.SlurmRequestError as exc:
            s.group = None
            raise render.CellError.of("SlurmRequestError", f"--slurm {spec.slurm!r}: {exc}") from None
        except KeyboardInterrupt:
            s.group = None
            # Group() has already stopped whatever it had started.
            raise render.CellError.of("KeyboardInterrupt", "the start was interrupted; no group is running "
                                                           "(%makedip -r tries again)") from None
        s.group = group
        if verbose:
            print(f"ready in {time.monotonic() - t0:.1f} s: pids {group.pids}, backend {group.backend or 'none'}",
                  flush=True)
        if spec.app is not None:
            self._set_up_app(spec.app, group, verbose)
            s.spec = spec  # the app counts only once its setup succeeded
        if not verbose:
            print(f"{what} ready: pids {group.pids}, backend {group.backend or 'none'}" +
                  (f", app {spec.app}" if spec.app else ""))

    @staticmethod
    def _what(spec: GroupSpec, reuse: Group | None, allocation) -> str:
        """The ranks about to start, in words."""
        if allocation is not None:
            return (f"{_hosts.layout(allocation.hosts(), 'slurm').size} rank(s) on Slurm job {allocation.job} "
                    f"({','.join(allocation.nodes)})")
        if reuse is not None and reuse.slurm_job is not None:
            return f"{reuse.size} rank(s) on Slurm job {reuse.slurm_job}"
        if spec.hosts is not None:
            return f"{_hosts.layout(spec.hosts, spec.launcher, spec.python, spec.bind).size} rank(s) on {spec.hosts}"
        return (f"{len(parse_gpus(list(spec.gpus) if spec.gpus != ('all',) else 'all'))} GPU rank(s)"
                if spec.gpus is not None else f"{spec.n} CPU rank(s)")

    @staticmethod
    def _new_group(spec: GroupSpec, backend, allocation) -> Group:
        if spec.slurm is not None:
            return Group(slurm=allocation, python=spec.python, bind=spec.bind, backend=backend,
                         timeout=spec.timeout, env=notebook_env() or None)
        if spec.hosts is not None:
            return Group(hosts=spec.hosts, launcher=spec.launcher, python=spec.python, bind=spec.bind,
                         backend=backend, timeout=spec.timeout, env=notebook_env() or None)
        return Group(n=spec.n, gpus=(list(spec.gpus) if spec.gpus != ("all",) else "all")
                     if spec.gpus is not None else None,
                     backend=backend, timeout=spec.timeout, warm=False if spec.cold else None,
                     env=notebook_env() or None)

    def _set_up_app(self, app: str, group: Group, verbose: bool):
        if verbose:
            print(f"setting the group up for {app} ...", flush=True)
        try:
            module = importlib.import_module(f"ddip.apps.{app}")
            setup = getattr(module, "setup_group", None)
            if setup is None:
                raise UsageError(f"ddip.apps.{app} has no setup_group(group)")
            setup(group)
        except BaseException as exc:
            # No group half set up: the ranks would run without the app the user asked for.
            group.close()
            self.session.group = None
            if isinstance(exc, RankFailedError):
                first, ranks = exc.failures[0], exc.ranks
                text = (f"-a {app}: the app's setup failed on rank{'s' if len(ranks) > 1 else ''} "
                        f"{', '.join(map(str, ranks))} ({first.ename}: {first.evalue}); the group was stopped. "
                        f"Fix the cause (is {app} installed where the ranks run?) and run %makedip -r, or "
                        f"start without -a")
                raise render.CellError.of("AppSetupError", text,
                                          *render.failure_entries(exc.failures)[0][2][1:]) from None
            if isinstance(exc, KeyboardInterrupt):
                raise render.CellError.of("KeyboardInterrupt", f"the {app} setup was interrupted; no group is "
                                                               f"running (%makedip -r tries again)") from None
            raise render.CellError.of("AppSetupError", f"-a {app}: the app's setup failed in the notebook "
                                                       f"({type(exc).__name__}: {exc}); the group was stopped "
                                                       f"(%makedip -r tries again, or start without -a)") from None

    def _heal(self, fn, args, options):
        if not args.heal:
            raise usage_error(fn, "--copy-from goes with --heal: %makedip --heal --copy-from 0")
        if args.restart or options or args.info:
            raise usage_error(fn, "--heal rebuilds the running group's torch.distributed and takes no other "
                                  "flag but --copy-from")
        group = self.session.running_group()
        try:
            report = group.heal(copy_from=args.copy_from)
        except HealError as exc:  # refused (no backend, a dead rank on another host: nothing changed) or failed
            raise render.CellError.of("HealError", str(exc)) from None
        except ValueError as exc:  # --copy-from a dead or unknown rank, or with no rank to replace
            raise usage_error(fn, f"--copy-from: {exc}") from None
        print(render.healed(report))

    def _kill(self, verbose: bool, keep_autodip: bool = False):
        s = self.session
        if not s.running:
            print("no group is running")
            return
        pids, job = s.group.pids, s.group.slurm_job
        if verbose:
            print(f"stopping ranks (pids {pids}) ...", flush=True)
        s.group.close()
        s.group = None
        print(f"killed the group (pids {pids})" + (f"; Slurm job {job} ended" if job is not None else ""))
        if s.autodip_args is not None and not keep_autodip:
            # Every following cell would fail with "no group"; the notebook runs locally again.
            s.set_autodip(None)
            print("autodip is now off")

    def _print_info(self):
        s = self.session
        if not s.running:
            print("no group is running")
            print(s.autodip_state())
            return
        g = s.group
        print(f"group: {s.spec.describe()}")
        if g.slurm_job is not None:
            print(f"Slurm job: {g.slurm_job} (ended by %makedip -k)")
        print(f"backend: {g.backend or 'none'}")
        print(f"app: {s.spec.app or 'none'}")
        print(f"pids: {g.pids}")
        for rank in g.rank_ids:
            print(f"  rank {rank} -> {g.device(rank)}")
        threads, who = g.omp_num_threads
        print(f"threads per rank: OMP_NUM_THREADS={threads} (set by {who})")
        print(s.autodip_state())

    # -- %dipstack (%dipstatus: magics/panel.py) ------------------------------------------------

    @magic_arguments()
    @argument("-r", "--ranks", metavar="RANKS", help="ranks like 0,2 (default: all)")
    @argument("-t", "--timeout", type=float, default=3.0, metavar="SECONDS",
              help="how long to wait for the ranks to answer (3)")
    @line_magic
    def dipstack(self, line=""):
        """Print which collective each rank is in (torch's flight recorder: who has not joined the
        one the others wait in), then every selected rank's Python stack, without stopping it. It
        leads with the straggler where one rank holds the others up (g.stragglers())."""
        fn = self.dipstack
        args = parse(fn, line)
        group = self.session.running_group()
        ranks = None if args.ranks is None else rank_list(fn, "-r", args.ranks, group.rank_ids)
        positive_seconds(fn, "-t", args.timeout)
        render.print_stacks(group.stacks(ranks, timeout=args.timeout))
