"""Sharing strategies from Python, switched at run time, in this process and in children
started by fork, spawn and forkserver."""
import multiprocessing
import os

import numpy as np
import pytest

import shmtensor
import shmtensor.numpy as snp


@pytest.fixture(autouse=True)
def default_strategy():
    yield
    shmtensor.set_sharing_strategy("file_descriptor")


def own_names():
    prefix = f"shmtensor_{os.getpid()}_"
    return [n for n in os.listdir("/dev/shm") if n.startswith(prefix)]


def mapping_kinds(array):
    """'memfd' or 'named' for the mapping that holds array's first byte."""
    address = array.ctypes.data
    with open("/proc/self/maps") as f:
        for line in f:
            lo, hi = (int(x, 16) for x in line.split()[0].split("-"))
            if lo <= address < hi:
                if "memfd:shmtensor" in line:
                    return "memfd"
                if "/dev/shm/shmtensor_" in line:
                    return "named"
                return line
    return None


def test_the_strategies():
    assert shmtensor.get_sharing_strategy() == "file_descriptor"
    assert shmtensor.get_all_sharing_strategies() == {"file_descriptor", "file_system"}


def test_switched_at_run_time():
    fd_array = snp.full(100, 1.0)
    assert mapping_kinds(fd_array) == "memfd"
    assert own_names() == []
    shmtensor.set_sharing_strategy("file_system")
    assert shmtensor.get_sharing_strategy() == "file_system"
    named = snp.full(100, 2.0)
    assert mapping_kinds(named) == "named"
    assert len(own_names()) == 1
    private = shmtensor.full(10, 3, "int32")
    private.share_memory_()
    assert mapping_kinds(np.asarray(private)) == "named"
    shmtensor.set_sharing_strategy("file_descriptor")
    again = snp.full(100, 4.0)
    assert mapping_kinds(again) == "memfd"
    # Arrays made under the other strategy are unaffected.
    assert named.sum() == 200.0 and fd_array.sum() == 100.0
    del named, private
    shmtensor.empty_cache()
    assert own_names() == []


def allocate_in_child(strategy, queue):
    import numpy
    import shmtensor
    import shmtensor.numpy
    shmtensor.set_sharing_strategy(strategy)
    a = shmtensor.numpy.full((64, 64), 3, numpy.int16)
    queue.put((shmtensor.get_sharing_strategy(), shmtensor.numpy.is_shared(a), int(a.sum())))


@pytest.mark.parametrize("method", ["fork", "spawn", "forkserver"])
@pytest.mark.parametrize("strategy", ["file_descriptor", "file_system"])
def test_children_of_every_start_method(method, strategy):
    ctx = multiprocessing.get_context(method)
    queue = ctx.SimpleQueue()
    p = ctx.Process(target=allocate_in_child, args=(strategy, queue))
    p.start()
    result = queue.get()
    p.join()
    queue.close()
    assert p.exitcode == 0
    assert result == (strategy, True, 3 * 64 * 64)
    # The parent's strategy is its own.
    assert shmtensor.get_sharing_strategy() == "file_descriptor"
