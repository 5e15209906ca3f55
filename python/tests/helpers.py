"""Helpers for the Python tests: running code in a forked child with a verdict, the fixture
`strategy` (shmtensor's, or torch's for the torch tests) and a manager group of a test's own."""
import os
import sys
import time
import traceback

import pytest


def start_in_child(fn):
    """Forks; the child runs fn() and exits 0, or prints the traceback and exits 1 if it
    raised (an assert included). Returns the child's pid (wait_child takes it)."""
    sys.stdout.flush()
    sys.stderr.flush()
    pid = os.fork()
    if pid == 0:
        code = 0
        try:
            fn()
        except BaseException:
            traceback.print_exc()
            code = 1
        finally:
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(code)
    return pid


def wait_child(pid):
    """The exit status of start_in_child's child (128 + signal if killed)."""
    _, status = os.waitpid(pid, 0)
    return os.waitstatus_to_exitcode(status) if os.WIFEXITED(status) else 128 + os.WTERMSIG(status)


def run_in_child(fn):
    """start_in_child(fn), waited for: the child's exit status."""
    return wait_child(start_in_child(fn))


def forget_inherited_forkserver():
    """In a forked child: forget the parent's forkserver, so that this process starts its
    own. multiprocessing keeps the server's pid in its state, and a forked child that asks
    for a forkserver child calls waitpid() on a pid that is not its child
    (ChildProcessError), a limit of the standard library's."""
    from multiprocessing import forkserver
    fs = forkserver._forkserver
    if fs._forkserver_alive_fd is not None:
        os.close(fs._forkserver_alive_fd)
    fs._forkserver_pid = fs._forkserver_address = fs._forkserver_alive_fd = None


@pytest.fixture(name="strategy", params=["file_descriptor", "file_system"])
def torch_strategy(request):
    """The fixture `strategy` of the torch tests (imported by them): each test runs under
    both of torch's sharing strategies, torch's own setting restored afterwards."""
    import torch.multiprocessing as tmp  # noqa: PLC0415 (torch only where a test asks)
    old = tmp.get_sharing_strategy()
    tmp.set_sharing_strategy(request.param)
    yield request.param
    tmp.set_sharing_strategy(old)


@pytest.fixture(name="strategy", params=["file_descriptor", "file_system"])
def shm_strategy(request):
    """The fixture `strategy` of the shmtensor.multiprocessing tests (imported by them): each
    test runs under both of shmtensor's sharing strategies, the setting restored afterwards."""
    import shmtensor  # noqa: PLC0415
    old = shmtensor.get_sharing_strategy()
    shmtensor.set_sharing_strategy(request.param)
    yield request.param
    shmtensor.set_sharing_strategy(old)


@pytest.fixture
def own_manager_group(monkeypatch):
    """A manager group of this test's own, as the C++ tests' (its daemon exits by itself)."""
    monkeypatch.setenv("SHMTENSOR_MANAGER_GROUP", "py%d-%d" % (os.getpid(), time.monotonic_ns()))
    monkeypatch.setenv("SHMTENSOR_MANAGER_GRACE_MS", "300")


def assert_each_is_pickled(cases, encode):
    """For each {what: obj} of `cases`: no tensor message (encode(obj) is None), a pickle
    from reductions.dumps, and an object of obj's type from reductions.loads."""
    from shmtensor.multiprocessing import reductions  # noqa: PLC0415
    for what, obj in cases.items():
        assert encode(obj) is None, what
        data, blocks = reductions.dumps(obj)
        assert data[:1] == b"\x80", what  # a pickle starts with PROTO
        got = reductions.loads(data, blocks)
        assert type(got) is type(obj), what
