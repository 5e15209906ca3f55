# shmtensor — the commands a new user and CI need.
#
#   make run     install missing Debian packages, build what the demo needs, run the flagship demo
#   make test    check the layers (make layers), install missing Debian packages, build, run
#                every test; then the torch 2.x lane: the Python package built against torch
#                2.x from PyPI in a virtual environment (build-torch2/), its Python and torch
#                tests run there
#   make layers  tools/ci/check_layers: docs/architecture.md's rules (includes point down;
#                system calls and system headers only in src/os), in well under a second
#   make torch2  that lane alone
#   make asan    the same tests built with AddressSanitizer + UndefinedBehaviorSanitizer
#   make tsan    the same tests built with ThreadSanitizer
#   make debian13  `make test` in a Debian 13 tree made with debootstrap (by hand, as root;
#                tools/ci/debian13)
#   make pythons shmtensor.multiprocessing's and NumPy's tests on pyenv's Python 3.12 and 3.13
#                (by hand; tools/ci/python_versions)
#   make format  clang-format every C++ file in place
#   make clean   remove every build directory
#
# Works as root on a fresh Debian bookworm machine, and in CI (no stdin). As another user
# it installs with sudo when sudo exists, and otherwise prints what to install.

BUILD_TYPE  ?= RelWithDebInfo
JOBS        ?= $(shell nproc)
CTEST_JOBS  ?= 2
# ccache (Debian's), outside the clone (~/.cache/ccache): an entry is found by a hash of the
# compiler, its arguments and the preprocessed source with every header it read, so a stale
# entry cannot be returned. Paths under this directory are hashed relative to it and the
# working directory is not hashed, so build/, the torch 2.x lane's build-torch2/ and a
# sanitizer build's rebuild share the objects whose compile commands are the same (the
# library's, in one run; everything, in a later run). A machine without a cache, or with
# CCACHE_DISABLE=1, builds the same objects itself. SHMTENSOR_CCACHE=0: no launcher at all.
SHMTENSOR_CCACHE ?= 1
# (Looked up when a recipe runs: `make deps` installs it.)
LAUNCHER    := -DCMAKE_CXX_COMPILER_LAUNCHER=$(if $(filter-out 0,$(SHMTENSOR_CCACHE)),$$(command -v ccache))
export CCACHE_BASEDIR  ?= $(CURDIR)
export CCACHE_NOHASHDIR ?= true
# The Python module is built for /usr/bin/python3 (Debian's, with NumPy), never for
# another python3 that comes first on PATH.
CMAKE       := cmake -G Ninja -DCMAKE_BUILD_TYPE=$(BUILD_TYPE) -DCMAKE_EXPORT_COMPILE_COMMANDS=ON \
               -DPython_EXECUTABLE=/usr/bin/python3 $(LAUNCHER)
# --timeout: ctest's default is 1500 s per test, so one hung test (a fork child stuck in a
# sanitizer lock did that) costs 25 of CI's 90 minutes. The slowest test takes about 6 s
# under TSan on 2 cores; 300 s leaves room for a loaded machine.
# -LE long: tests of tens of minutes (the 1,000,000-sample blog workload) run only when asked
# for: `ctest --test-dir build -L long`.
CTEST       := ctest --output-on-failure -j$(CTEST_JOBS) --timeout 300 -LE long
# A failed run prints its failed tests' output again at the end, where CI's tail shows it.
FAILED      := tools/ci/show_failed_tests

# What each package is for: docs/dependencies.md.
# CPython's own test package, for its multiprocessing suite (python.cpython_mp.*): the one of
# /usr/bin/python3's version, or, before python3 is installed, of the Debian release's
# (12: Python 3.11, 13: Python 3.13).
PY_VERSION   := $(or $(shell /usr/bin/python3 -c 'import sys; print("%d.%d" % sys.version_info[:2])' 2>/dev/null), \
                     $(if $(filter 13,$(shell cut -d. -f1 /etc/debian_version 2>/dev/null)),3.13,3.11))
DEB_PACKAGES := g++ make cmake ninja-build pkg-config ccache python3 libpython$(PY_VERSION)-testsuite \
                libgtest-dev libgmock-dev googletest libbenchmark-dev libcli11-dev \
                clang libclang-rt-dev \
                pybind11-dev python3-dev python3-numpy python3-pytest python3-mypy \
                python3-pip python3-setuptools python3-wheel python3-venv \
                python3-torch libtorch-dev

# What `make run` needs: the build's configure step (GoogleTest, Google Benchmark and CLI11
# included: one build directory serves `make run` and `make test`), the Python package and
# torch. The rest (clang for the fuzzers, the test runners, CPython's test suite, the venv
# and pip tools) comes with `make test`.
RUN_ONLY_NOT := clang libclang-rt-dev python3-pytest python3-mypy libpython$(PY_VERSION)-testsuite \
                python3-pip python3-setuptools python3-wheel python3-venv
PACKAGES     := $(if $(filter run,$(MAKECMDGOALS)),$(filter-out $(RUN_ONLY_NOT),$(DEB_PACKAGES)),$(DEB_PACKAGES))

# Sanitizer builds skip benchmarks and examples: CI has 2 cores and 90 minutes.
LEAN := -DSHMTENSOR_BUILD_BENCHMARKS=OFF -DSHMTENSOR_BUILD_EXAMPLES=OFF
# ... and are built at -O1 with line tables only (-g1: a report still names file and line),
# which halves their compile time against -O2 -g (93 s -> 44 s for one ASan test file).
SANITIZED := $(LEAN) -DCMAKE_CXX_FLAGS_RELWITHDEBINFO="-O1 -g1 -DNDEBUG"

# detect_leaks: LeakSanitizer at exit. abort_on_error: a crash a test can see (not exit 1).
# handle_sigbus=0 (ASan and TSan): by default the sanitizers catch SIGBUS, print a report
# and exit or abort, so a process that SIGBUS kills (what shared memory does when /dev/shm
# is full) would seem to die of something else, and tests that check how such a death is
# reported (DataLoaderErrorsTest.BusError...) fail under sanitizers only. SIGSEGV stays
# theirs; no test relies on a SIGSEGV death.
export ASAN_OPTIONS  ?= detect_leaks=1:abort_on_error=1:strict_string_checks=1:handle_sigbus=0
export UBSAN_OPTIONS ?= print_stacktrace=1:halt_on_error=1
# die_after_fork=0: the tests fork from a process that already has threads (gtest's death
# tests, our own threads). TSan's default is to kill such a child, because only
# async-signal-safe calls are safe there in general; our children run library code on
# purpose (that is the fork start method) and the library's fork handlers keep its locks
# consistent, so we let them run and TSan keeps checking them.
export TSAN_OPTIONS  ?= die_after_fork=0:halt_on_error=1:second_deadlock_stack=1:handle_sigbus=0

.PHONY: all configure run test layers torch2 asan tsan odr deps debian13 pythons format clean

# cmake is re-run every time (a second or two): it picks up new files and options.
all: configure
	cmake --build build -j$(JOBS)

configure: deps
	$(CMAKE) -S . -B build

# What `make run` runs, and only that: the demo, the daemon, the Python package with its
# torch bridge (shmtensor_python depends on shmtensor._torch where that is built).
RUN_TARGETS := demo shmtensor-manager shmtensor_python
run: configure
	cmake --build build -j$(JOBS) --target $(RUN_TARGETS)
	./build/examples/demo
	@echo
	@if /usr/bin/python3 -c 'import torch' 2>/dev/null; then \
	  PYTHONPATH=build/python /usr/bin/python3 python/bench/bench_torch.py --demo; \
	else echo "torch demo skipped: /usr/bin/python3 cannot import torch (python3-torch)"; fi

# The layers first: a rule broken fails in a second, before the build. The torch 2.x lane's
# build runs (niced) beside the main build's tests, which take turns at /dev/shm (the C++ ones
# leave a core idle; the Python ones do not, and run slower beside it); its tests run after them.
LANE := JOBS=$(JOBS) CTEST_JOBS=$(CTEST_JOBS) BUILD_TYPE=$(BUILD_TYPE) tools/ci/torch2_lane build-torch2
test: deps layers all
	@echo "torch 2.x lane: building beside the tests (log: build/torch2-lane-build.log)"
	@$(LANE:tools/%=setsid nice -n 10 tools/%) build > build/torch2-lane-build.log 2>&1 & lane=$$!; \
	$(CTEST) --test-dir build || { $(FAILED) build; kill -- -$$lane 2>/dev/null; exit 1; }; \
	wait $$lane || { tail -n 80 build/torch2-lane-build.log; \
	                 echo "torch 2.x lane: the build failed (build/torch2-lane-build.log)"; exit 1; }; \
	cat build/torch2-lane-build.log
	$(LANE) test

layers:
	tools/ci/check_layers

# torch 2.x (pinned: torch==2.13.0, a CPU wheel) in build-torch2/venv, made with the first
# python3.11 on PATH (SHMTENSOR_TORCH2_PYTHON names another): tools/ci/torch2_lane.
torch2: deps
	$(LANE)

asan: deps
	$(CMAKE) -S . -B build-asan -DSHMTENSOR_SANITIZE=address,undefined $(SANITIZED)
	cmake --build build-asan -j$(JOBS)
	$(CTEST) --test-dir build-asan || { $(FAILED) build-asan; exit 1; }

# One Definition Rule check: the library and every test program built with link-time
# optimisation and warnings as errors (without the libtorch bridge: torch's headers are not
# ours to check), where GCC compares the definitions of each type and inline function across
# translation units (-Wodr) and fails the link on a mismatch (two different `RecvResult`s in
# one namespace were such a case). A build, not a test run: the code is the same as `make test`'s.
# -O0 without -g: GCC compares the types while it reads the objects at link time, at any
# optimisation level, so optimised code and debug info would only make this build slower
# (it links every test program's copy of the static library again).
odr: deps
	$(CMAKE) -S . -B build-odr $(LEAN) -DSHMTENSOR_BUILD_TORCH=OFF \
	  -DCMAKE_BUILD_TYPE=Debug -DCMAKE_CXX_FLAGS_DEBUG=-O0 \
	  -DCMAKE_CXX_FLAGS="-flto=auto -Wodr -Werror" \
	  -DCMAKE_EXE_LINKER_FLAGS="-flto=auto -Wodr -Werror" \
	  -DCMAKE_SHARED_LINKER_FLAGS="-flto=auto -Wodr -Werror"
	cmake --build build-odr -j$(JOBS)

# ThreadSanitizer (GCC 12) cannot place its shadow memory when the kernel randomizes mmap
# with more bits than it expects (vm.mmap_rnd_bits > 28, common on recent kernels:
# "FATAL: ThreadSanitizer: unexpected memory mapping"). Without ASLR it always can, so the
# tests run under `setarch -R` where that is allowed (Docker's default seccomp profile
# forbids it; there, `sysctl vm.mmap_rnd_bits=28` on the host is the fix if TSan fails).
NO_ASLR := $(shell setarch $$(uname -m) -R true 2>/dev/null && echo setarch $$(uname -m) -R)

# Without the Python package: its tests do not run under ThreadSanitizer (docs/python.md).
tsan: deps
	$(CMAKE) -S . -B build-tsan -DSHMTENSOR_SANITIZE=thread $(SANITIZED) -DSHMTENSOR_BUILD_PYTHON=OFF
	cmake --build build-tsan -j$(JOBS)
	$(NO_ASLR) $(CTEST) --test-dir build-tsan || { $(FAILED) build-tsan; exit 1; }

deps:
	@missing=""; \
	if ! command -v dpkg-query >/dev/null; then \
	  echo "not a Debian system: make sure these (or their equivalents) are installed:"; \
	  echo "  $(PACKAGES)"; exit 0; \
	fi; \
	for p in $(PACKAGES); do \
	  dpkg-query -W -f='$${Status}' $$p 2>/dev/null | grep -q 'install ok installed' \
	    || missing="$$missing $$p"; \
	done; \
	[ -z "$$missing" ] && exit 0; \
	if [ "$$(id -u)" = 0 ]; then sudo=""; \
	elif command -v sudo >/dev/null; then sudo="sudo"; \
	else echo "missing Debian packages; as root, run:"; \
	     echo "  apt-get update && apt-get install -y --no-install-recommends$$missing"; \
	     exit 1; \
	fi; \
	echo "installing:$$missing"; \
	$$sudo env DEBIAN_FRONTEND=noninteractive apt-get update && \
	$$sudo env DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends $$missing

debian13:
	tools/ci/debian13

pythons:
	tools/ci/python_versions 3.12 3.13

format:
	git ls-files '*.h' '*.cc' | xargs clang-format -i

clean:
	rm -rf build build-asan build-tsan build-odr build-fuzz build-torch2 build-py3.*
