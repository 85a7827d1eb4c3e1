"""Debian roots made with debootstrap: the bullseye toolchain the wheels are built with, and the
bare bullseye and trixie systems tests/test_install.py installs them on.

A root is cached under DDIP_CACHE (default /var/cache/ddip-tests) in a folder named by a hash of
what it is made of (suite, packages, mirror, this file), so a second run reuses it and a change
makes a new one. Commands run in a root through `run`: a private mount and PID namespace (every
mount and process it makes ends with it), chroot, and only the host's network settings, CA
bundle and pip configuration brought in, so pip there reaches the same package index as here.

Needs root and debootstrap (Debian's package); `missing()` says which is lacking.
"""

from __future__ import annotations

import fcntl
import hashlib
import os
import re
import shlex
import shutil
import subprocess
import sys
import threading
from pathlib import Path

CACHE = Path(os.environ.get("DDIP_CACHE", "/var/cache/ddip-tests"))
MIRROR = os.environ.get("DDIP_DEBIAN_MIRROR", "http://deb.debian.org/debian")
CA_BUNDLE = "/etc/ssl/certs/ca-certificates.crt"


def missing() -> str | None:
    """Why roots can't be made here, or None."""
    if os.geteuid() != 0:
        return "making Debian roots needs root (debootstrap, chroot, mount namespaces)"
    for tool in ("debootstrap", "unshare", "chroot"):
        if shutil.which(tool) is None:
            return f"{tool} is not installed (apt-get install debootstrap util-linux coreutils)"
    return None


# Raise when the way roots are made changes, so cached roots are made anew.
RECIPE = "1"

# The roots the release builds and tests/test_install.py use: the wheels' toolchain and sysroot,
# and the bare systems (no compiler, no headers) the wheels are installed on.
BUILD_ROOT = ("bullseye-build", "bullseye", ["g++", "libssl-dev"])
BARE_PACKAGES = ["python3", "python3-venv"]
BARE_SUITES = ("bullseye", "trixie")


def bare(suite: str, log=sys.stderr) -> Path:
    return ensure(f"{suite}-bare", suite, BARE_PACKAGES, log=log)


def build_root(log=sys.stderr) -> Path:
    return ensure(*BUILD_ROOT, sysroot=True, log=log)


def _key(*parts: str) -> str:
    h = hashlib.sha256(RECIPE.encode())
    for p in parts:
        h.update(p.encode() + b"\0")
    return h.hexdigest()[:12]


def _relative_links(root: Path) -> None:
    """Absolute symlinks made relative (as `symlinks -rc` does), so that a compiler and linker
    given --sysroot=ROOT find what they point to inside ROOT rather than on this machine."""
    for dirpath, dirnames, filenames in os.walk(root):
        for name in dirnames + filenames:
            link = Path(dirpath, name)
            if link.is_symlink() and os.readlink(link).startswith("/"):
                target = root / os.readlink(link).lstrip("/")
                link.unlink()
                link.symlink_to(os.path.relpath(target, link.parent))


def ensure(name: str, suite: str, packages: list[str], sysroot: bool = False, log=sys.stderr) -> Path:
    """The root NAME: Debian SUITE (minbase) with PACKAGES, made once and then reused; with
    SYSROOT, its links are made relative so that it serves as a compiler's --sysroot. Another
    process making the same root (`make test` starts making them early) is waited for."""
    roots = CACHE / "roots"
    dest = roots / f"{name}-{_key(suite, MIRROR, str(sysroot), *sorted(packages))}"
    if (dest / ".ddip-complete").exists():
        return dest
    roots.mkdir(parents=True, exist_ok=True)
    with open(roots / f".{name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes, also when its holder dies
        if not (dest / ".ddip-complete").exists():
            _make(name, suite, packages, sysroot, dest, log)
    return dest


def _make(name: str, suite: str, packages: list[str], sysroot: bool, dest: Path, log) -> None:
    roots = dest.parent
    for old in [*roots.glob(f"{name}-*"), *roots.glob(f".{name}-*")]:  # an older recipe's, a killed run's
        shutil.rmtree(old, ignore_errors=True)
    tmp = roots / f".{dest.name}.{os.getpid()}"
    print(f"debian_root: making {name} ({suite}, {len(packages)} packages) in {dest}", file=log, flush=True)
    # In a mount namespace of its own: whatever debootstrap mounts in the root goes with it.
    cmd = ["unshare", "--mount", "--propagation", "private", "debootstrap", "--variant=minbase",
           f"--include={','.join(packages)}", suite, str(tmp), MIRROR]
    proc = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    if proc.returncode != 0:
        shutil.rmtree(tmp, ignore_errors=True)
        raise RuntimeError(f"debootstrap {suite} failed ({proc.returncode}):\n{proc.stdout[-4000:]}")
    shutil.rmtree(tmp / "var/cache/apt/archives", ignore_errors=True)
    if sysroot:
        _relative_links(tmp)
    (tmp / "var/cache/apt/archives/partial").mkdir(parents=True)
    (tmp / ".ddip-complete").touch()
    os.rename(tmp, dest)


def _pip_config() -> tuple[list[str], list[str]]:
    """pip's configuration as pip itself reads it here (`pip config debug`): the files that exist
    (but the environment's own, site: a root has its own venv) and every value they and the PIP_*
    variables set."""
    out = subprocess.run([sys.executable, "-m", "pip", "config", "debug"], capture_output=True, text=True,
                         check=True).stdout
    files, values, scope, live = [], [], "", False
    for line in out.splitlines():
        if not line.startswith(" "):  # a scope: env_var, env, global, site, user
            scope, live = line.rstrip(":"), False
        elif scope == "env_var":  # "  PIP_CONSTRAINT='/x/c.txt'"
            values.append(line.strip().partition("=")[2].strip("'\""))
        elif not line.startswith("    "):  # "  /etc/pip.conf, exists: True"
            path, _, exists = line.strip().rpartition(", exists: ")
            live = exists == "True" and scope != "site"
            if live:
                files.append(path)
        elif live:  # "    global.constraint: /x/c.txt"
            values.append(line.strip().partition(": ")[2])
    return files, values


def _named_by(text: str, base: str | None = None) -> list[str]:
    """The local paths that exist among TEXT's words (absolute paths and file:// URLs; with BASE,
    also paths relative to it), and what requirement and constraint files among them name in turn."""
    found: list[str] = []
    for word in text.split():
        path = os.path.expanduser(word.removeprefix("file://"))
        if not os.path.isabs(path):
            if base is None:  # a setting's value ("180", "1"): only absolute words are paths
                continue
            path = os.path.join(base, path)
        path = os.path.normpath(path)
        if not os.path.exists(path) or path == "/" or path in found:
            continue
        if os.path.isdir(path) and path.endswith("/simple"):
            path = os.path.dirname(path)  # a local index's pages link to files beside it (../files/...)
        found.append(path)
        if os.path.isfile(path) and os.path.getsize(path) < 1 << 20:
            with open(path, errors="replace") as f:
                nested = re.findall(r"^\s*(?:-r|-c|--requirement|--constraint)[\s=]+(\S+)", f.read(), re.M)
            found += [p for p in _named_by(" ".join(nested), os.path.dirname(path)) if p not in found]
    return found


def _pip_sources() -> list[str]:
    """What pip in a root needs to see what pip here sees: the configuration files and every local
    file or folder they, the PIP_* variables and the CA variables name (indexes, find-links,
    constraints, requirements, certificates), outermost first with nothing inside another."""
    files, values = _pip_config()
    values += [os.environ[k] for k in ("SSL_CERT_FILE", "REQUESTS_CA_BUNDLE") if k in os.environ]
    paths = files + [p for v in values for p in _named_by(v)]
    paths += [p for p in ("/etc/resolv.conf", "/etc/hosts", CA_BUNDLE) if os.path.exists(p)]
    kept: list[str] = []
    for p in sorted(set(paths), key=len):  # a folder before what lies in it
        if not any(p.startswith(k.rstrip("/") + "/") for k in kept):
            kept.append(p)
    return kept


def run(root: Path, script: str, binds: dict[str, str] | None = None, env: dict[str, str] | None = None,
        timeout: float = 600) -> subprocess.CompletedProcess:
    """Runs the shell SCRIPT as root in ROOT; BINDS maps host paths to paths in the root
    (read-only). The root's /tmp is fresh and empty each time; pip's cache is kept in CACHE."""
    pip_cache = CACHE / "pip"
    pip_cache.mkdir(parents=True, exist_ok=True)
    mounts = [(str(pip_cache), "/root/.cache/pip", False)]
    mounts += [(p, p, True) for p in _pip_sources()]
    mounts += [(src, dst, True) for src, dst in (binds or {}).items()]
    r = shlex.quote(str(root))
    lines = ["set -e", "mount --make-rprivate /",
             f"mount -t proc proc {r}/proc", f"mount --rbind /dev {r}/dev",
             f"mount -t tmpfs tmpfs {r}/dev/shm", f"mount -t tmpfs tmpfs {r}/tmp",
             f"mount --rbind /sys {r}/sys"]
    for src, dst, ro in mounts:
        target = shlex.quote(str(root) + dst)
        make = f"mkdir -p {target}" if os.path.isdir(src) else f"mkdir -p $(dirname {target}) && touch {target}"
        lines.append(f"{make} && mount --bind {shlex.quote(src)} {target}")
        if ro:
            lines.append(f"mount -o remount,bind,ro {target}")
    base = {"PATH": "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin", "HOME": "/root",
            "LANG": "C.UTF-8", "TMPDIR": "/tmp"}
    base.update({k: v for k, v in os.environ.items()
                 if k.startswith("PIP_") or k in ("SSL_CERT_FILE", "REQUESTS_CA_BUNDLE")})
    base.update(env or {})
    envs = " ".join(shlex.quote(f"{k}={v}") for k, v in base.items())
    lines.append(f"chroot {r} /usr/bin/env -i {envs} /bin/sh -ec {shlex.quote(script)}")
    # PID namespace: when the script ends, everything it started is killed with it.
    cmd = ["unshare", "--mount", "--pid", "--fork", "--kill-child", "/bin/sh", "-c", "\n".join(lines)]
    return subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=timeout)


def warm() -> int:
    """Makes every root test_install.py uses, side by side (debootstrap waits mostly on the
    network and the disk): `make test` starts this first, so the install tests find them made
    (or being made: they wait on the lock) instead of making them one after the other."""
    makers = [build_root] + [lambda log, s=s: bare(s, log) for s in BARE_SUITES]
    failed = []

    def make(maker):
        try:
            print(f"debian_root: ready: {maker(log=sys.stdout)}", flush=True)
        except Exception as e:  # the install tests make it again and report it there
            failed.append(e)
            print(f"debian_root: {e}", flush=True)

    threads = [threading.Thread(target=make, args=(m,)) for m in makers]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return 1 if failed else 0


if __name__ == "__main__":
    # python packaging/debian_root.py --warm : makes (or finds) every root the install tests use
    # python packaging/debian_root.py NAME SUITE PKG... : makes (or finds) the root, prints its path
    if sys.argv[1:] == ["--warm"]:
        why = missing()
        sys.exit(print(f"debian_root: {why}") if why else warm())
    print(ensure(sys.argv[1], sys.argv[2], sys.argv[3:], sysroot=sys.argv[1].endswith("-build")))
