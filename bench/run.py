"""Runs every bench/bench_*.py module's main() -> str, prints the tables and writes them to
bench/results/latest.md. A module that fails is reported and the others still run; the exit
code is then 1.

    .venv/bin/python bench/run.py            every module but the long ones (what `make bench` runs)
    .venv/bin/python bench/run.py group      only bench_group.py
    .venv/bin/python bench/run.py scale      a long module (LONG = True in it) runs when named,
    DDIP_BENCH_LONG=1 make bench             or with every module when DDIP_BENCH_LONG=1
"""

from __future__ import annotations

import datetime
import importlib
import os
import platform
import sys
import time
import traceback
from pathlib import Path

HERE = Path(__file__).resolve().parent
RESULTS = HERE / "results" / "latest.md"


def _version(module: str) -> str:
    try:
        from importlib.metadata import version

        return version(module)
    except Exception:
        return "not installed"


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown CPU"


def machine_header() -> str:
    now = datetime.datetime.now().astimezone().strftime("%Y-%m-%d %H:%M %Z")
    return (f"# ddip benchmarks\n\n"
            f"Machine: {os.cpu_count()} CPUs ({_cpu_model()}), {platform.system()} {platform.release()}, "
            f"Python {platform.python_version()}; ddip {_version('ddip')}, torch {_version('torch')}, "
            f"ipyparallel {_version('ipyparallel')}. Date: {now}.\n")


def bench_modules(only: list[str]) -> list[str]:
    names = sorted(p.stem for p in HERE.glob("bench_*.py"))
    if only:
        wanted = {o if o.startswith("bench_") else f"bench_{o}" for o in only}
        unknown = wanted - set(names)
        if unknown:
            raise SystemExit(f"no bench module named {', '.join(sorted(unknown))}; have {', '.join(names)}")
        names = [n for n in names if n in wanted]
    return names


def is_long(name: str) -> bool:
    """A module that says LONG = True (many minutes: bench_scale's 128 ranks) runs only when named, or
    with the others when DDIP_BENCH_LONG=1. Read from its source, so leaving it out imports nothing."""
    return any(line.strip().startswith("LONG = True") for line in (HERE / f"{name}.py").read_text().splitlines())


def main(argv: list[str]) -> int:
    if str(HERE) not in sys.path:
        sys.path.insert(0, str(HERE))
    names = bench_modules(argv)
    header = machine_header()
    print(header, flush=True)
    sections, failed = [header], []
    for name in names:
        if not argv and is_long(name) and os.environ.get("DDIP_BENCH_LONG") != "1":
            section = (f"## {name}: left out (long)\n\nRun it with `.venv/bin/python bench/run.py "
                       f"{name.removeprefix('bench_')}`, or with every module: `DDIP_BENCH_LONG=1 make bench`.\n")
            print(section, flush=True)
            sections.append(section)
            continue
        print(f"== {name}", file=sys.stderr, flush=True)
        t0 = time.monotonic()
        try:
            text = importlib.import_module(name).main()
            section = f"## {name}\n\n{text.rstrip()}\n"
        except BaseException as exc:
            if isinstance(exc, KeyboardInterrupt):
                raise
            failed.append(name)
            tb = traceback.format_exc()
            print(tb, file=sys.stderr, flush=True)
            section = f"## {name}: FAILED\n\n```\n{tb.rstrip()}\n```\n"
        print(f"== {name} took {time.monotonic() - t0:.0f} s", file=sys.stderr, flush=True)
        print(section, flush=True)
        sections.append(section)
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text("\n".join(sections))
    print(f"written to {RESULTS.relative_to(HERE.parent)}", file=sys.stderr)
    if failed:
        print(f"FAILED: {', '.join(failed)}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
