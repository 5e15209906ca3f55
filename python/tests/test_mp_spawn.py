"""spawn / start_processes / ProcessContext (torch's semantics) and Pool.map of arrays."""
import os
import signal
import time

import numpy as np
import pytest

import shmtensor.multiprocessing as smp
import shmtensor.numpy as snp


def ok(i, q):
    q.put(i * 10)


def raises(i):
    if i == 1:
        raise ValueError("bad input in child %d" % i)
    time.sleep(30)  # stopped by the parent once the other child failed


def exits(i, code):
    os._exit(code)


def killed(i):
    os.kill(os.getpid(), signal.SIGKILL)


def sleeps(i, seconds):
    time.sleep(seconds)


def test_spawn_runs_every_process():
    q = smp.get_context("spawn").SimpleQueue()
    smp.spawn(ok, args=(q,), nprocs=3)
    assert sorted(q.get() for _ in range(3)) == [0, 10, 20]


def test_spawn_propagates_the_child_traceback():
    with pytest.raises(smp.ProcessRaisedException) as info:
        smp.spawn(raises, nprocs=2)
    e = info.value
    assert e.error_index == 1
    assert "-- Process 1 terminated with the following error:" in str(e)
    assert "Traceback (most recent call last)" in str(e)
    assert "ValueError: bad input in child 1" in str(e)
    assert 'in raises' in str(e)


@pytest.mark.parametrize("method", ["fork", "forkserver"])
def test_start_processes_exit_code_and_signal(method):
    with pytest.raises(smp.ProcessExitedException) as info:
        smp.start_processes(exits, args=(3,), nprocs=1, start_method=method)
    assert info.value.exit_code == 3
    assert str(info.value) == "process 0 terminated with exit code 3"
    with pytest.raises(smp.ProcessExitedException) as info:
        smp.start_processes(killed, nprocs=1, start_method=method)
    assert info.value.signal_name == "SIGKILL"
    assert info.value.exit_code == -signal.SIGKILL
    assert str(info.value) == "process 0 terminated with signal SIGKILL"


def test_join_with_timeout_returns_false_while_running():
    ctx = smp.start_processes(sleeps, args=(1.0,), nprocs=2, join=False, start_method="fork")
    assert len(ctx.pids()) == 2
    assert ctx.join(timeout=0.01) is False
    while not ctx.join(timeout=5):
        pass
    assert ctx.join() is True


def test_exceptions_pickle():
    import pickle
    e = pickle.loads(pickle.dumps(smp.ProcessExitedException("m", 1, 2, 3, "SIGTERM")))
    assert (e.msg, e.error_index, e.pid, e.exit_code, e.signal_name) == ("m", 1, 2, 3, "SIGTERM")
    e = pickle.loads(pickle.dumps(smp.ProcessRaisedException("m", 1, 2)))
    assert (e.msg, e.error_index, e.pid) == ("m", 1, 2)


def double(a):
    a *= 2  # in place: the caller's shared array
    return a.sum(), np.full(100000, a[0])


@pytest.mark.parametrize("method", ["fork", "spawn", "forkserver"])
def test_pool_map_of_arrays(method):
    arrays = [snp.full(50000, float(i)) for i in range(4)]
    with smp.get_context(method).Pool(2) as pool:
        results = pool.map(double, arrays)
    for i, (total, filled) in enumerate(results):
        assert total == 2.0 * i * 50000
        assert filled.shape == (100000,) and filled[0] == 2.0 * i
        assert arrays[i][0] == 2.0 * i  # the worker wrote into our memory
        assert snp.is_shared(filled)
