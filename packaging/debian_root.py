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

import hashlib
import os
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

CACHE = Path(os.environ.get("DDIP_CACHE", "/var/cache/ddip-tests"))
MIRROR = os.environ.get("DDIP_DEBIAN_MIRROR", "http://deb.debian.org/debian")
CA_BUNDLE = "/etc/ssl/certs/ca-certificates.crt"
PIP_CONFIGS = ("/etc/pip.conf", "/etc/xdg/pip/pip.conf", "~/.config/pip/pip.conf", "~/.pip/pip.conf")


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
    SYSROOT, its links are made relative so that it serves as a compiler's --sysroot."""
    roots = CACHE / "roots"
    dest = roots / f"{name}-{_key(suite, MIRROR, str(sysroot), *sorted(packages))}"
    if (dest / ".ddip-complete").exists():
        return dest
    roots.mkdir(parents=True, exist_ok=True)
    for old in [*roots.glob(f"{name}-*"), *roots.glob(f".{name}-*")]:  # an older recipe's, a killed run's
        shutil.rmtree(old, ignore_errors=True)
    tmp = roots / f".{dest.name}.{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
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
    return dest


def _pip_sources() -> tuple[list[str], list[str]]:
    """This machine's pip configuration files, and the local folders they (or PIP_* variables)
    name as indexes or find-links: pip in a root needs both to see what pip here sees."""
    files = [p for p in (os.path.expanduser(f) for f in PIP_CONFIGS) if os.path.isfile(p)]
    values = [v for k, v in os.environ.items() if k in ("PIP_FIND_LINKS", "PIP_INDEX_URL", "PIP_EXTRA_INDEX_URL")]
    out = subprocess.run([sys.executable, "-m", "pip", "config", "list"], capture_output=True, text=True).stdout
    for line in out.splitlines():
        key, _, value = line.partition("=")
        if key.endswith(("find-links", "index-url")):
            values.append(value.strip("'\""))
    dirs = []
    for v in values:
        for item in v.split():
            path = item.removeprefix("file://").rstrip("/")
            if not (path.startswith("/") and os.path.isdir(path)):
                continue
            # A local index's pages link to files beside it (../files/...): its parent comes too.
            if path.endswith("/simple"):
                path = os.path.dirname(path)
            if path not in dirs:
                dirs.append(path)
    return files, dirs


def run(root: Path, script: str, binds: dict[str, str] | None = None, env: dict[str, str] | None = None,
        timeout: float = 600) -> subprocess.CompletedProcess:
    """Runs the shell SCRIPT as root in ROOT; BINDS maps host paths to paths in the root
    (read-only). The root's /tmp is fresh and empty each time; pip's cache is kept in CACHE."""
    files, dirs = _pip_sources()
    pip_cache = CACHE / "pip"
    pip_cache.mkdir(parents=True, exist_ok=True)
    mounts = [(str(pip_cache), "/root/.cache/pip", False)]
    mounts += [(f, f, True) for f in files]
    mounts += [(d, d, True) for d in dirs]
    mounts += [(p, p, True) for p in ("/etc/resolv.conf", "/etc/hosts", CA_BUNDLE) if os.path.exists(p)]
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


if __name__ == "__main__":
    # python packaging/debian_root.py NAME SUITE PKG... : makes (or finds) the root, prints its path
    print(ensure(sys.argv[1], sys.argv[2], sys.argv[3:], sysroot=sys.argv[1].endswith("-build")))
