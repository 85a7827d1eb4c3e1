"""The magics' flags: flag groups shared by the magics that take them (decorators adding the same
magic_arguments to each, as IPython's own magics do), and parsing and checks every magic does the
same way. A bad flag or value is a UsageError that ends with the magic's usage line. Every magic's
line goes through parse(), which drops a trailing `# comment` first."""

from __future__ import annotations

import shlex

from IPython.core.error import UsageError
from IPython.core.magic_arguments import argument, parse_argstring


def flag_group(*arguments):
    """A decorator adding these magic_arguments `argument(...)`s to a magic, in the order given
    (the order the usage line shows them)."""

    def add(fn):
        for arg in reversed(arguments):  # decorators apply bottom-up
            fn = arg(fn)
        return fn

    return add


# How many ranks, as CPU processes or one per GPU: %makedip and %%diprun.
size_flags = flag_group(
    argument("-n", "--nprocs", "--nproc-per-node", dest="nprocs", metavar="N", type=int,
             help="this many CPU ranks"),
    argument("-g", "--gpus", metavar="GPUS", help="one rank per listed GPU: 'all' or ids like 0,1,3 (in that order)"),
)

# Ranks on several hosts: %makedip.
hosts_flags = flag_group(
    argument("--hosts", metavar="HOSTS",
             help="ranks on several hosts, numbered host by host: node1:4,node2:4 (CPU ranks), "
                  "'node1[0,1] node2[2,3]' (one rank per listed GPU), or node1,node2 with -g 0,1 (the "
                  "same GPUs on each; -g 'node1:0,1 node2:2,3' alone names each host's); localhost runs here"),
    argument("--launcher", metavar="LAUNCHER",
             help="how --hosts are reached: ssh (default; 'ssh -F cfg' adds ssh options), slurm "
                  "(srun in an allocation), or a launcher command with {host} and {command}"),
    argument("--python", metavar="PATH", help="the Python to run on the hosts (default: this one's path)"),
    argument("--bind", metavar="ADDRESS",
             help="this machine's address the hosts connect back to (default: the one that routes "
                  "to the first remote host)"),
)

def _ranks_by_earlier_name(value: str) -> str:
    # `%%dip remote` said `ranks` before "remote" came to mean another host only: still taken.
    return "ranks" if value == "remote" else value


# Where a cell runs and whose output shows: %%dip, and every cell while %autodip is on.
cell_flags = flag_group(
    argument("where", nargs="?", choices=["ranks", "local", "everywhere"], type=_ranks_by_earlier_name,
             help="ranks: the group's (default; 'remote', its earlier name, too); local: the notebook only; "
                  "everywhere: the notebook, then the ranks"),
    argument("--to", choices=["ranks", "local", "both"], type=_ranks_by_earlier_name,
             help="the same as `where` (both = everywhere)"),
    argument("-S", "--see", metavar="all|none|RANKS", help="whose output to show: all, none or ranks like 0,2 (0)"),
    argument("-q", "--quiet", action="store_true", help="show no rank's output (errors still show)"),
    argument("--raw", action="store_true",
             help="show every rank's lines and tracebacks as they are, without collapsing repeats "
                  "into one '[ranks 0-7]' line"),
    argument("--tabs", action="store_true",
             help="each rank's output in a tab of its own, rank 0's in front (JupyterLab; ipywidgets, the "
                  "notebook extra): every rank's, or those --see names"),
    argument("-r", "--ranks", metavar="RANKS",
             help="run on these ranks only, like 0,2 (default: every rank); the others stay as they are"),
    argument("--timeout", metavar="SECONDS", type=float, help="interrupt the ranks after this many seconds"),
)


def usage(fn) -> str:
    # magic_arguments formats usage as reST ("::" and an indented block); show it plainly.
    return "usage: " + " ".join(fn.parser.format_usage().replace("::", "").split())


def usage_error(fn, message: str) -> UsageError:
    return UsageError(f"{message}\n{usage(fn)}")


def without_comment(line: str) -> str:
    """The line without its trailing `# comment`, read as a shell reads one: the comment starts at
    a word that begins with `#` outside quotes, and runs to the end. A `#` inside quotes ('#1') or
    inside a word (a#b) stays. Words are found as IPython's parse_argstring finds them (shlex,
    not POSIX: quotes kept, no escapes), so what is left splits into the very words it would have
    got. A quote left open before any comment leaves the line as it is, for parse() to report."""
    lex = shlex.shlex(line, posix=False)
    lex.whitespace_split = True
    lex.commenters = ""  # as IPython's arg_split: a # inside a word is part of it
    pos = 0
    try:
        for word in lex:  # each word is the line's own text, quotes included
            start = line.index(word, pos)
            if word.startswith("#") and (start == 0 or line[start - 1] in lex.whitespace):
                return line[:start].rstrip()
            pos = start + len(word)
    except ValueError:  # a quote left open: there is no comment after it
        pass
    return line


def parse(fn, line: str):
    """The magic's flags, or a UsageError with its usage line. A trailing `# comment` is no
    flag: `%makedip -n 2  # -g all for GPUs` is `%makedip -n 2`."""
    try:
        return parse_argstring(fn, without_comment(line))
    except UsageError as exc:
        raise usage_error(fn, str(exc)) from None
    except ValueError as exc:  # unbalanced quotes
        raise usage_error(fn, f"cannot split the arguments ({exc})") from None


def unquote(text: str) -> str:
    """A flag's value as the user meant it: IPython splits magic arguments without removing
    quotes, so -a "--see all" arrives as '"--see all"'."""
    text = text.strip()
    if text[:1] not in ("'", '"'):
        return text
    try:
        parts = shlex.split(text)
    except ValueError:  # a quote left open: the value is what was typed
        return text
    return parts[0] if len(parts) == 1 else text


def positive_seconds(fn, flag: str, seconds):
    if seconds is not None and not seconds > 0:
        raise usage_error(fn, f"{flag} {seconds:g}: give a positive number of seconds")
    return seconds


def rank_list(fn, flag: str, given: str, rank_ids, form: str = "ranks like 0,2") -> list[int]:
    """'0,2' -> [0, 2], each one of rank_ids, in the order given, once each."""
    text = unquote(given)
    try:
        ranks = [int(r) for r in text.split(",") if r.strip()]
    except ValueError:
        raise usage_error(fn, f"{flag} {given}: give {form}") from None
    if not ranks or any(r not in rank_ids for r in ranks):
        raise usage_error(fn, f"{flag} {given}: the group's ranks are {', '.join(map(str, rank_ids))}")
    return sorted(set(ranks), key=ranks.index)
