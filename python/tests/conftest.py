"""The leak check every Python test runs under (autouse), like the C++ LeakCheckedTest.

After each test: no new fd, no new shmtensor mapping (memfd:shmtensor / /dev/shm/shmtensor_
in /proc/self/maps) and no new /dev/shm/shmtensor_* name of ours (waiting up to 2 s for
names unlinked by exiting children or the manager's sweep). What the process keeps for reuse
is given back first with shmtensor.empty_cache(), as the C++ fixture does.

"Ours": names whose creator pid (shmtensor_<pid>_...) is this process, a live descendant of
it, or a process that no longer exists. The last case
counts because spawned children are not forked from here; the tests run under the dev_shm
resource lock (CTest) or `flock -o /tmp/shmtensor-ipc.lock`, so no unrelated shmtensor
process comes and goes meanwhile.

Fds that multiprocessing keeps open for the rest of the process on purpose (the
resource_tracker's pipe, the forkserver's sockets), started lazily by the first test that
needs them, are not leaks.
"""
import gc
import os
import time

import pytest

import shmtensor

def _is_open(fd):
    try:
        os.fstat(fd)
        return True
    except OSError:
        return False


def open_fds():
    # Checked afterwards: the directory listing's own fd shows in the listing, then closes
    # (and its number is the next one a test would get).
    return set(fd for fd in map(int, os.listdir("/proc/self/fd")) if _is_open(fd))


def shmtensor_mappings():
    with open("/proc/self/maps") as f:
        return [l.rstrip("\n") for l in f if "memfd:shmtensor" in l or "/dev/shm/shmtensor_" in l]


def shm_names():
    try:
        return set(n for n in os.listdir("/dev/shm") if n.startswith("shmtensor_"))
    except FileNotFoundError:
        return set()


def _creator(name):
    try:
        return int(name[len("shmtensor_"):].split("_", 1)[0])
    except ValueError:
        return None


def _parent_of(pid):
    try:
        with open(f"/proc/{pid}/stat") as f:
            stat = f.read()
    except OSError:
        return None
    return int(stat[stat.rindex(")") + 2:].split()[1])


def _is_ours(pid):
    me = os.getpid()
    if pid is None:
        return False
    if pid == me:
        return True
    seen = 0
    p = pid
    while p and p > 1 and seen < 64:
        parent = _parent_of(p)
        if parent is None:
            return p == pid  # the creator is gone: see the module docstring
        if parent == me:
            return True
        p = parent
        seen += 1
    return False


def _multiprocessing_fds():
    """Fds multiprocessing keeps open on purpose for the life of the process."""
    fds = set()
    try:
        from multiprocessing import resource_tracker
        fd = getattr(resource_tracker._resource_tracker, "_fd", None)
        if fd is not None:
            fds.add(fd)
    except Exception:
        pass
    try:
        # shmtensor's own: the connection to the fd keeper, kept for the process's life.
        from shmtensor.multiprocessing import keeper
        fd = keeper._connection_fd()
        if fd is not None:
            fds.add(fd)
    except Exception:
        pass
    try:
        from multiprocessing import forkserver
        fs = forkserver._forkserver
        fd = getattr(fs, "_forkserver_alive_fd", None)
        if fd is not None:
            fds.add(fd)
    except Exception:
        pass
    return fds


@pytest.fixture(scope="session", autouse=True)
def _real_driver_opened():
    """With the real CUDA driver (SHMTENSOR_CUDA_TEST_REAL=1), the device is used once before
    any test: the driver opens fds of its own at its first use and keeps them (docs/cuda.md),
    which the leak check must not count."""
    if os.environ.get("SHMTENSOR_CUDA_TEST_REAL") == "1" and shmtensor.cuda.is_available():
        shmtensor.zeros((1,), device="cuda:0").cpu()
        shmtensor.empty_cache()
    yield


@pytest.fixture(autouse=True)
def leak_check(request):
    gc.collect()
    shmtensor.empty_cache()
    fds = open_fds()
    names = shm_names()
    mappings = len(shmtensor_mappings())
    yield
    gc.collect()
    shmtensor.empty_cache()
    # Names of exiting children, and the pipes of a multiprocessing.Queue (its feeder thread
    # closes them when it ends, after the test has dropped the queue), go a moment later.
    deadline = time.monotonic() + 2.0
    while True:
        extra = sorted(n for n in shm_names() - names if _is_ours(_creator(n)))
        leaked = []
        for fd in sorted(open_fds() - fds - _multiprocessing_fds()):
            try:
                leaked.append((fd, os.readlink(f"/proc/self/fd/{fd}")))
            except OSError:
                continue  # closed meanwhile (the listing's own fd, among others)
        if (not extra and not leaked) or time.monotonic() > deadline:
            break
        time.sleep(0.02)
        gc.collect()
    problems = [f"leaked /dev/shm name: {n}" for n in extra]
    problems += [f"leaked fd {fd} -> {target}" for fd, target in leaked]
    maps = shmtensor_mappings()
    if len(maps) > mappings:
        problems += [f"shmtensor mapping left: {m}" for m in maps]
    if problems:
        pytest.fail("leak check after the test:\n  " + "\n  ".join(problems), pytrace=False)
