"""%%diprun: run a cell as a script on N fresh processes with `ddip run`, as torchrun would.

    %load_ext ddip
    %%diprun -n 2
    import torch.distributed as dist
    dist.init_process_group("gloo")
    print(dist.get_rank())

The cell is written to a temporary file and each rank runs `python that_file.py` with torchrun's
environment. With --hosts, the file travels with the launch to every other host (`ddip run
--ship`): those hosts need not share this machine's filesystem. Unlike %%dip there is no persistent group: every cell starts its ranks from scratch
and they end with it. Labelled output ([rank] ...) reaches the notebook as it is printed;
interrupting the kernel forwards SIGINT to the ranks (a second interrupt kills them). A rank's
breakpoint() asks through the notebook's input box, labelled with the rank, and the line typed goes
to that rank (`ddip run --prompt-records` hands each prompt here; this writes the answer to its
stdin).
"""

from __future__ import annotations

import codecs
import os
import selectors
import shutil
import signal
import subprocess
import sys
import tempfile

from IPython.core.magic import Magics, cell_magic, magics_class
from IPython.core.magic_arguments import argument, magic_arguments

from ..labels import rank_label
from ..launch.program import binary
from . import render
from .flags import parse, size_flags, unquote, usage_error


class DipRunError(render.CellError):
    """`ddip run` exited with a non-zero code; its report (which rank failed, how) is above. A
    CellError: the cell fails showing the message, not this magic's frames."""


@magics_class
class DipRunMagics(Magics):
    """%%diprun. It shares no state with the other magics: each cell starts and ends its ranks."""

    @magic_arguments()
    @size_flags
    @argument("--show", default=None, metavar="RANKS",
              help="ranks whose output is shown: all (default), none, or a list such as 0")
    @argument("--log-dir", default=None, metavar="DIR",
              help="also keep each rank's full stdout/stderr in torchrun's layout: "
                   "DIR/<run id>_<random>/attempt_0/<rank>/stdout.log|stderr.log")
    @argument("--timeout", default=None, metavar="SECONDS",  # a string: ddip run judges it
              help="stop every rank after this many seconds (time at a rank's debugger prompt not counted)")
    @argument("--hosts", default=None, metavar="HOSTS",
              help="ranks on several hosts, numbered host by host: node1:4,node2:4, 'node1[0,1] node2[2,3]', "
                   "or node1,node2 with -g 0,1; localhost runs here; the cell travels with the launch")
    @argument("--launcher", default=None, metavar="LAUNCHER",
              help="how --hosts are reached: ssh (default; 'ssh -F cfg' adds ssh options), slurm, or a "
                   "launcher command with {host} and {command}")
    @argument("--ddip", default=None, metavar="PATH",
              help="the ddip program on the other hosts (default: this one's path)")
    @cell_magic
    def diprun(self, line, cell):
        """Run the cell as a script on N ranks with `ddip run` (torchrun's environment)."""
        __tracebackhide__ = True
        fn = self.diprun
        args = parse(fn, line)
        flags = []
        for flag, value in (("-n", args.nprocs), ("--gpus", args.gpus), ("--show", args.show),
                            ("--log-dir", args.log_dir), ("--timeout", args.timeout), ("--hosts", args.hosts),
                            ("--launcher", args.launcher), ("--ddip", args.ddip)):
            if value is not None:
                flags += [flag, unquote(str(value))]
        # Across hosts (--hosts, or -g naming hosts as 'node1:0,1'), other hosts can't see this
        # machine's temporary file: the script always travels with the launch.
        across = args.hosts is not None or (args.gpus is not None and ":" in unquote(str(args.gpus)))
        workdir = tempfile.mkdtemp(prefix="ddip-diprun-")
        try:
            script = os.path.join(workdir, "cell.py")
            with open(script, "w") as f:
                f.write(cell)  # a plain script, as the ranks run plain Python
            command = [*flags, *(["--ship", script] if across else []), "--", sys.executable, script]
            _check(fn, command)
            # --raw: each rank's lines labelled as its own, as RunOutput takes them (its prompts and
            # redrawn bars are per rank); %%diprun does not collapse repeats yet.
            code = _stream([binary(), "run", "--die-with-parent", "--prompt-records", "--raw", *command])
        finally:
            shutil.rmtree(workdir, ignore_errors=True)
        # The ranks' own report is above (ddip run names the rank that failed first, and how); the
        # cell fails without a traceback of this magic's frames.
        if code == "interrupted":
            raise render.CellError.of("KeyboardInterrupt", "interrupted: ddip run forwarded the stop to every "
                                                           "rank (their report is above)")
        if code != 0:
            raise DipRunError.of("DipRunError", f"ddip run exited with code {code} (its report, above, "
                                                     f"names the rank that failed first and how)")


def _check(fn, command: list[str]):
    """`ddip run` judges the values of its own flags (-n 0, --show 5, --gpus 0,0): asked first with
    --check, which starts nothing, its usage errors become this magic's (exit code 2 there can't
    be a rank's, as it would be from the real run)."""
    check = subprocess.run([binary(), "run", "--check", *command], stdin=subprocess.DEVNULL,
                           capture_output=True, text=True, errors="replace", env=_rank_env())
    if check.returncode == 2:
        raise usage_error(fn, check.stderr.strip())
    if check.returncode != 0:  # it could not plan (no free port, say): as a failed run says it
        sys.stderr.write(check.stderr)
        raise DipRunError.of("DipRunError", f"ddip run exited with code {check.returncode}")


def _rank_env() -> dict:
    env = dict(os.environ)
    # ipykernel points matplotlib at its inline backend; in a rank that would draw nowhere.
    if env.get("MPLBACKEND", "").startswith("module://matplotlib_inline"):
        del env["MPLBACKEND"]
    return env


def _stream(argv: list[str]):
    """Runs `ddip run`, copying its labelled output to the notebook as it arrives. Returns its
    exit code, or "interrupted" when the kernel was interrupted."""
    # Its own session: jupyter_client interrupts the kernel's whole process group, and the
    # launcher must get each interrupt once (from here), or the second copy would kill the ranks.
    # --die-with-parent ties it to the kernel instead.
    # Its stdin carries the lines typed at the ranks' debugger prompts (Prompter).
    proc = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, env=_rank_env(), start_new_session=True)
    interrupted = False
    sel = selectors.DefaultSelector()
    try:
        # A read can end inside a UTF-8 character: decode incrementally, per stream.
        out = render.RunOutput(on_prompt=Prompter(proc.stdin))
        for pipe, name in ((proc.stdout, "stdout"), (proc.stderr, "stderr")):
            sel.register(pipe, selectors.EVENT_READ, (name, codecs.getincrementaldecoder("utf-8")("replace")))
        while sel.get_map():
            try:
                for key, _ in sel.select(timeout=0.5):
                    name, decoder = key.data
                    data = os.read(key.fd, 65536)
                    out.write(name, decoder.decode(data, final=not data), final=not data)
                    if not data:
                        sel.unregister(key.fileobj)
            except KeyboardInterrupt:
                # The launcher forwards it to every rank; a second one makes it kill them.
                interrupted = True
                if proc.poll() is None:
                    proc.send_signal(signal.SIGINT)
        code = proc.wait()
    except BaseException:
        # Anything unexpected here (a third interrupt, say): the ranks must not outlive the cell;
        # they die with the launcher (PR_SET_PDEATHSIG).
        if proc.poll() is None:
            proc.kill()
        proc.wait()
        raise
    finally:
        sel.close()
        for pipe in (proc.stdin, proc.stdout, proc.stderr):
            try:
                pipe.close()
            except OSError:  # stdin: ddip run has gone, with what was left unsent
                pass
    return "interrupted" if interrupted else code


class Prompter:
    """A rank waits at a debugger prompt: asked with input() (the kernel's stdin channel: an input
    box under the cell, as %debug's), and the line typed written to `ddip run`'s stdin, which sends
    it to that rank only. A frontend that can't take input ends that stdin: every rank's prompt is
    then answered by nobody, and the rank says so and goes on (ddip.rank.run_debug).
    KeyboardInterrupt (the stop button) goes to the caller, which forwards SIGINT to the ranks."""

    def __init__(self, stdin):
        self.stdin = stdin

    def __call__(self, rank: int, prompt: str):
        if self.stdin.closed:
            return
        try:
            line = input(f"{rank_label(rank)} {prompt}")
        except (EOFError, NotImplementedError, OSError):  # StdinNotImplementedError among them
            sys.stderr.write(f"ddip: {rank_label(rank)} stopped at a debugger prompt, but this frontend can't "
                             f"take input (a Jupyter client needs allow_stdin); it goes on\n")
            self.stdin.close()
            return
        try:
            self.stdin.write((line + "\n").encode("utf-8", "replace"))
            self.stdin.flush()
        except OSError:  # ddip run has ended meanwhile
            pass
