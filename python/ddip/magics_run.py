"""%%diprun: run a cell as a script on N fresh processes with `ddip run`, as torchrun would.

    %load_ext ddip
    %%diprun -n 2
    import torch.distributed as dist
    dist.init_process_group("gloo")
    print(dist.get_rank())

The cell is written to a temporary file and each rank runs `python that_file.py` with torchrun's
environment. Unlike %%dip there is no persistent group: every cell starts its ranks from scratch
and they end with it. Labelled output ([rank] ...) reaches the notebook as it is printed;
interrupting the kernel forwards SIGINT to the ranks (a second interrupt kills them).
"""

from __future__ import annotations

import codecs
import os
import re
import selectors
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile

from IPython.core.error import UsageError
from IPython.core.magic import Magics, cell_magic, magics_class
from IPython.core.magic_arguments import argument, magic_arguments, parse_argstring

from .cli import binary
from .group import LabelledOutput


class DipRunError(RuntimeError):
    """`ddip run` exited with a non-zero code; its report (which rank failed, how) is above."""


def _usage(fn) -> str:
    # magic_arguments formats usage as reST ("::" and an indented block); show it plainly.
    return "usage: " + " ".join(fn.parser.format_usage().replace("::", "").split())


@magics_class
class DipRunMagics(Magics):
    @magic_arguments()
    @argument("-n", "--nproc-per-node", type=int, default=None, metavar="N",
              help="number of ranks (CPU processes); default 1")
    @argument("--gpus", default=None, metavar="LIST",
              help="one rank per listed GPU, in this order (e.g. 3,1 or all)")
    @argument("--tee", default=None, metavar="RANKS",
              help="ranks whose output is shown: all (default), none, or a list such as 0")
    @argument("--log-dir", default=None, metavar="DIR",
              help="also keep each rank's full stdout/stderr in DIR/rank<i>.stdout|stderr")
    @argument("--timeout", type=float, default=None, metavar="SECONDS",
              help="stop every rank after this many seconds")
    @cell_magic
    def diprun(self, line, cell):
        """Run the cell as a script on N ranks with `ddip run` (torchrun's environment)."""
        __tracebackhide__ = True
        usage = _usage(self.diprun)
        try:
            args = parse_argstring(self.diprun, line)
        except UsageError as exc:
            raise UsageError(f"{exc}\n{usage}") from None
        except ValueError as exc:  # unbalanced quotes
            raise UsageError(f"cannot split the arguments ({exc})\n{usage}") from None
        if args.nproc_per_node is not None and args.gpus is not None:
            raise UsageError(f"give -n or --gpus, not both\n{usage}")
        if args.nproc_per_node is not None and args.nproc_per_node < 1:
            raise UsageError(f"-n must be at least 1 (got {args.nproc_per_node})\n{usage}")
        if args.timeout is not None and args.timeout <= 0:
            raise UsageError(f"--timeout must be positive (got {args.timeout:g})\n{usage}")
        flags = []
        for flag, value in (("-n", args.nproc_per_node), ("--gpus", args.gpus), ("--tee", args.tee),
                            ("--log-dir", args.log_dir), ("--timeout", args.timeout)):
            if value is not None:
                flags += [flag, _unquote(str(value))]
        workdir = tempfile.mkdtemp(prefix="ddip-diprun-")
        try:
            script = os.path.join(workdir, "cell.py")
            with open(script, "w") as f:
                f.write(cell)  # a plain script, as the ranks run plain Python
            code = _stream([binary(), "run", "--die-with-parent", *flags, "--", sys.executable, script])
        finally:
            shutil.rmtree(workdir, ignore_errors=True)
        if code == "interrupted":
            raise KeyboardInterrupt
        if code != 0:
            raise DipRunError(f"ddip run exited with code {code}") from None


def _unquote(text: str) -> str:
    # IPython hands magic arguments over with their quotes: --gpus "3,1" arrives quoted.
    parts = shlex.split(text)
    return parts[0] if len(parts) == 1 else text


def _rank_env() -> dict:
    env = dict(os.environ)
    # ipykernel points matplotlib at its inline backend; in a rank that would draw nowhere.
    if env.get("MPLBACKEND", "").startswith("module://matplotlib_inline"):
        del env["MPLBACKEND"]
    return env


class _Relabel:
    """`ddip run`'s labelled output ("[rank] " after every '\n' and every '\r' that text follows;
    every piece it writes ends in one of them), written to the notebook by a LabelledOutput: ranks'
    redrawn bars take turns in place instead of overwriting each other's text."""

    _TAG = re.compile(r"\[(\d+)\] ")

    def __init__(self):
        self.out = LabelledOutput("[{}] ")
        self.partial = {"stdout": "", "stderr": ""}  # a read can end inside a piece
        self.last = {"stdout": None, "stderr": None}  # whose text came last, per stream

    def write(self, stream: str, text: str, final: bool = False):
        text = self.partial[stream] + text
        cut = len(text) if final else max(text.rfind("\n"), text.rfind("\r")) + 1
        self.partial[stream] = text[cut:]
        for piece in re.findall(r"[^\r\n]*(?:\r\n|\r|\n)|[^\r\n]+", text[:cut]):
            tag = self._TAG.match(piece)
            if tag:
                rank, piece = int(tag.group(1)), piece[tag.end():]
            elif piece.strip("\r\n"):
                rank = None  # ddip run's own message
            else:
                rank = self.last[stream]  # "\r" or the "\n" of "\r\n": the last writer's
            self.last[stream] = rank
            label = "" if rank is None else f"[{rank}] "
            self.out.write((rank, stream), label, stream, piece)


def _stream(argv: list[str]):
    """Runs `ddip run`, copying its labelled output to the notebook as it arrives. Returns its
    exit code, or "interrupted" when the kernel was interrupted."""
    # Its own session: jupyter_client interrupts the kernel's whole process group, and the
    # launcher must get each interrupt once (from here), or the second copy would kill the ranks.
    # --die-with-parent ties it to the kernel instead.
    proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, env=_rank_env(), start_new_session=True)
    interrupted = False
    sel = selectors.DefaultSelector()
    try:
        # A read can end inside a UTF-8 character: decode incrementally, per stream.
        out = _Relabel()
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
        proc.stdout.close()
        proc.stderr.close()
    return "interrupted" if interrupted else code


_magics: DipRunMagics | None = None


def load_ipython_extension(ip):
    global _magics
    if _magics is not None and _magics.shell is ip:
        return
    _magics = DipRunMagics(ip)
    ip.register_magics(_magics)


def unload_ipython_extension(ip):
    global _magics
    if _magics is None:
        return
    ip.magics_manager.magics["cell"].pop("diprun", None)
    _magics = None
