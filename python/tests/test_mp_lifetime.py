"""Lifetimes and failures: the producer exiting right after put, SIGKILL of a producer or a
consumer (nothing leaks: the autouse leak check runs after each test), single-use pickles,
hostile pickles, and a consumer under a low fd limit."""
import multiprocessing
import os
import pickle
import resource
import signal

import numpy as np
import pytest

import shmtensor
import shmtensor.multiprocessing as smp
import shmtensor.numpy as snp
from multiprocessing.reduction import ForkingPickler
from shmtensor.multiprocessing import reductions
from helpers import shm_strategy  # noqa: F401 (fixture `strategy`)



def put_and_exit(q, strategy):
    smp.set_sharing_strategy(strategy)
    q.put(np.arange(100000.0))  # copied once into a block
    shared = snp.full(50000, 7.0)
    q.put({"a": shared, "b": shared[::2], "c": snp.full(10, 1)})  # one segment, one fd


@pytest.mark.parametrize("kind", ["native", "plain"])
@pytest.mark.parametrize("method", ["fork", "spawn"])
def test_producer_exits_right_after_put(method, kind, strategy):
    if kind == "native":
        ctx = smp.get_context(method)
    else:
        ctx = multiprocessing.get_context(method)
    q = ctx.Queue()
    p = ctx.Process(target=put_and_exit, args=(q, strategy))
    p.start()
    p.join(60)
    assert p.exitcode == 0
    a = q.get(timeout=30)
    d = q.get(timeout=30)
    assert a.tolist() == list(np.arange(100000.0))
    assert d["a"][0] == 7.0 and d["a"].shape == (50000,)
    assert np.shares_memory(d["a"], d["b"])
    assert d["c"].tolist() == [1] * 10


def put_and_wait(q, ready):
    arrays = [snp.full(20000, float(i)) for i in range(3)]
    for a in arrays:
        q.put(a)
    ready.put("sent")
    signal.pause()


def test_sigkill_of_a_producer_leaks_nothing(strategy):
    ctx = smp.get_context("fork")
    q, ready = ctx.Queue(), ctx.Queue()
    p = ctx.Process(target=put_and_wait, args=(q, ready))
    p.start()
    assert ready.get(timeout=30) == "sent"
    os.kill(p.pid, signal.SIGKILL)
    p.join(30)
    assert p.exitcode == -signal.SIGKILL
    a = q.get(timeout=30)  # still readable: the message holds it
    assert a[0] == 0.0 and a.shape == (20000,)
    del a, q  # two items left: drained when the last holder drops the queue


def get_one_and_wait(q, ready):
    kept = q.get()
    ready.put(float(kept[0]))
    signal.pause()


def test_sigkill_of_a_consumer_leaks_nothing(strategy):
    ctx = smp.get_context("fork")
    q, ready = ctx.Queue(), ctx.Queue()
    arrays = [snp.full(20000, float(i)) for i in range(3)]
    for a in arrays:
        q.put(a)
    p = ctx.Process(target=get_one_and_wait, args=(q, ready))
    p.start()
    assert ready.get(timeout=30) == 0.0
    os.kill(p.pid, signal.SIGKILL)
    p.join(30)
    del arrays, q


def test_a_pickle_is_single_use(strategy):
    a = snp.full(1000, 3.0)
    # bytes: ForkingPickler.dumps gives a view of a BytesIO, and a frame holding one that the
    # collector frees in a cycle (pytest.raises keeps the traceback) crashes CPython 3.12.1
    # (python/cpython#111049), whatever the pickle holds.
    first, second = bytes(ForkingPickler.dumps(a)), bytes(ForkingPickler.dumps(a))
    b = pickle.loads(first)
    assert b.ctypes.data == a.ctypes.data
    with pytest.raises(shmtensor.Error) as info:
        pickle.loads(first)  # refused before anything is asked of the fd keeper or the counts
    assert type(info.value) is shmtensor.Error and isinstance(info.value, RuntimeError)
    assert str(info.value) == (
        "shmtensor: this pickle was already loaded in this process (or in the one it was forked "
        "from); a pickle of shared memory is single-use (its first load took the counts it "
        "carried): send the object again instead of keeping its pickle")
    c = pickle.loads(second)  # the replay took nothing from this one
    assert c.ctypes.data == a.ctypes.data


def load_twice_and_report(replayed, other, out):
    for data in (replayed, other):
        try:
            out.put("loaded %s" % pickle.loads(data)[0])
        except Exception as e:
            out.put("%s.%s: %s" % (type(e).__module__, type(e).__name__, e))


def test_a_pickle_replayed_in_another_process_is_an_error(strategy):
    a = snp.full(1000, 3.0)
    data = bytes(ForkingPickler.dumps(a))
    other = bytes(ForkingPickler.dumps(a))  # another message naming the same block
    assert pickle.loads(data)[0] == 3.0
    # spawn: a fresh process (a forked one inherits the set of loaded nonces, and refuses the
    # replay as "already loaded", which the test above covers).
    ctx = multiprocessing.get_context("spawn")
    out = ctx.SimpleQueue()
    p = ctx.Process(target=load_twice_and_report, args=(data, other, out))
    p.start()
    p.join(30)
    assert p.exitcode == 0
    expected = {"file_descriptor": "shmtensor.Error: shmtensor: the fd keeper does not hold",
                "file_system": "shmtensor.Error: shmtensor: the fd keeper holds no ticket"}
    assert out.get().startswith(expected[strategy])
    assert out.get() == "loaded 3.0"  # the replay took nothing from the other message


class Forged:
    def __init__(self, data):
        self.data = data

    def __reduce__(self):
        return reductions._load_block, (self.data, [], os.urandom(16))


def test_hostile_and_truncated_references_are_python_exceptions():
    smp_strategy = smp.get_sharing_strategy()
    smp.set_sharing_strategy("file_system")  # a reference that needs no fd
    try:
        real = reductions._C._frame_of_blocks([shmtensor.numpy._block_of(snp.full(10, 1.0))[0]])
        data = real.data
        real.mark_sent()
    finally:
        smp.set_sharing_strategy(smp_strategy)
    for bad in [b"", b"junk", data[:20], data[:-8], b"\0" * len(data),
                data[:8] + b"\xff" * 8 + data[16:]]:
        with pytest.raises((shmtensor.ProtocolError, shmtensor.Error)):
            pickle.loads(pickle.dumps(Forged(bad)))
    block = pickle.loads(pickle.dumps(Forged(data)))  # the real one still loads, once
    assert np.asarray(block).view(np.float64)[0] == 1.0
    with pytest.raises(shmtensor.ProtocolError, match="no message count"):
        pickle.loads(pickle.dumps(Forged(data)))  # stale: its count was taken
    with pytest.raises(pickle.UnpicklingError):
        reductions.loads(b"\x80\x05K\x01." + reductions._TRAILER.pack(1000, reductions._MAGIC), [])


def keep_many(q, out, n_messages):
    resource.setrlimit(resource.RLIMIT_NOFILE, (64, 64))
    kept = []
    for _ in range(n_messages):
        kept.extend(q.get())
    total = sum(float(a[0]) for a in kept)
    out.put((len(kept), len(os.listdir("/proc/self/fd")), total))


@pytest.mark.parametrize("kind", ["native", "plain"])
def test_consumer_keeps_many_arrays_with_few_fds(kind, strategy):
    ctx = smp.get_context("fork")
    q = ctx.Queue() if kind == "native" else multiprocessing.get_context("fork").Queue()
    out = ctx.Queue()
    p = ctx.Process(target=keep_many, args=(q, out, 20))
    p.start()
    n = 0
    for m in range(20):
        batch = [snp.full(16, float(m * 250 + i)) for i in range(250)]
        n += len(batch)
        q.put(batch)
    kept, fds, total = out.get(timeout=120)
    p.join(60)
    assert kept == 5000
    assert total == float(sum(range(5000)))
    assert fds < 40
