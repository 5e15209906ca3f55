"""The multiprocessing API of shmtensor.multiprocessing: re-exports, contexts, the native
Queue / SimpleQueue / Pipe methods and their errors."""
import multiprocessing
import os
import multiprocessing.context
import queue
import threading

import numpy as np
import pytest

import shmtensor
import shmtensor.multiprocessing as smp


def test_everything_multiprocessing_has_is_here():
    for name in multiprocessing.__all__:
        assert hasattr(smp, name), name
        assert name in smp.__all__
    for name in ["spawn", "start_processes", "ProcessContext", "ProcessRaisedException",
                 "ProcessExitedException", "get_sharing_strategy", "set_sharing_strategy",
                 "get_all_sharing_strategies", "set_share_threshold"]:
        assert name in smp.__all__
    assert smp.Process is multiprocessing.Process
    assert smp.get_all_sharing_strategies() == shmtensor.get_all_sharing_strategies()


@pytest.mark.parametrize("method", ["fork", "spawn", "forkserver"])
def test_get_context(method):
    ctx = smp.get_context(method)
    assert isinstance(ctx, multiprocessing.context.BaseContext)
    assert ctx.get_start_method() == method
    assert isinstance(ctx.Queue(), smp.Queue)
    assert isinstance(ctx.SimpleQueue(), smp.SimpleQueue)
    a, b = ctx.Pipe()
    assert isinstance(a, smp.connection.Connection)
    assert ctx.get_context("fork") is smp.get_context("fork")
    assert ctx.get_context() is ctx


def wait_event(event, q):
    q.put(event.is_set())


@pytest.mark.parametrize("method", ["spawn", "forkserver"])
def test_synchronization_objects_of_a_context_reach_its_children(method):
    # multiprocessing makes them with ctx.get_context(): it must be this context, not the
    # default (fork) one, whose semaphores cannot be passed to a spawned child.
    ctx = smp.get_context(method)
    event, q = ctx.Event(), ctx.Queue()
    event.set()
    p = ctx.Process(target=wait_event, args=(event, q))
    p.start()
    assert q.get(timeout=60) is True
    p.join(60)
    assert p.exitcode == 0
    with pytest.raises(ValueError):
        smp.get_context("nope")


def test_queue_methods():
    q = smp.Queue(maxsize=2)
    assert q.empty() and not q.full() and q.qsize() == 0
    with pytest.raises(queue.Empty):
        q.get_nowait()
    with pytest.raises(queue.Empty):
        q.get(timeout=0.05)
    q.put(1)
    q.put_nowait({"a": np.arange(3)})
    assert q.full() and q.qsize() == 2
    with pytest.raises(queue.Full):
        q.put(3, timeout=0.05)
    with pytest.raises(queue.Full):
        q.put_nowait(3)
    assert q.get() == 1
    assert q.get(block=False)["a"].tolist() == [0, 1, 2]
    q.close()
    q.join_thread()
    q.cancel_join_thread()
    for call in (lambda: q.put(1), q.get, lambda: q.put_many([1]), lambda: q.get_many(1)):
        with pytest.raises(shmtensor.QueueClosed) as info:
            call()
        assert isinstance(info.value, ValueError)  # as multiprocessing's closed Queue
        assert str(info.value) == (
            "Queue %r is closed: close() was called on this handle, which can no longer put or "
            "get (other handles of the queue are not affected)" % q)


def _put_batches(q, n, batch):
    for start in range(0, n, batch):
        objs = [(i, np.full(5, i, dtype=np.int64)) for i in range(start, min(start + batch, n))]
        assert q.put_many(objs) == len(objs)


@pytest.mark.parametrize("method", ["fork", "spawn"])
def test_queue_put_many_and_get_many_across_processes(method):
    # A bounded queue smaller than a batch: the producer wakes the consumer before it
    # waits for room. Every item arrives once, in order, with its array.
    ctx = smp.get_context(method)
    q = ctx.Queue(maxsize=8)
    p = ctx.Process(target=_put_batches, args=(q, 1000, 64))
    p.start()
    got = []
    while len(got) < 1000:
        batch = q.get_many(50, timeout=60)
        assert 1 <= len(batch) <= 50
        got.extend(batch)
    assert [i for i, _ in got] == list(range(1000))
    assert all(a.tolist() == [i] * 5 for i, a in got)
    p.join(60)
    assert p.exitcode == 0
    with pytest.raises(queue.Empty):
        q.get_many(10, block=False)


def _busy_poll_is_none(q):
    assert q._q.busy_poll is None


def _put_numbers(q, n):
    for i in range(n):
        q.put((i, np.full(3, i)))


@pytest.mark.parametrize("method", ["fork", "spawn"])
def test_queue_set_busy_poll(method):
    """A queue's own busy-poll budget in this process: validated, shown by the handle, and
    every item still arrives once, in order, while its gets poll."""
    ctx = smp.get_context(method)
    q = ctx.Queue()
    assert q._q.busy_poll is None  # follows the process's setting
    for bad in (-1e-6, 1.5, float("nan")):
        with pytest.raises(ValueError):
            q.set_busy_poll(bad)
    assert q._q.busy_poll is None
    q.set_busy_poll(200e-6)
    assert q._q.busy_poll == pytest.approx(200e-6)
    assert shmtensor.get_busy_poll() == 0  # the process's is untouched
    p = ctx.Process(target=_put_numbers, args=(q, 500))
    p.start()
    got = [q.get(timeout=60) for _ in range(500)]
    assert [i for i, _ in got] == list(range(500))
    assert all(a.tolist() == [i] * 3 for i, a in got)
    p.join(60)
    assert p.exitcode == 0
    with pytest.raises(queue.Empty):
        q.get(timeout=0.01)
    if method == "fork":
        child = ctx.Process(target=_busy_poll_is_none, args=(q,))
        child.start()
        child.join(60)
        assert child.exitcode == 0  # a forked child's handle follows its own process
    q.set_busy_poll(None)
    assert q._q.busy_poll is None


def test_a_thread_keeps_its_pickler_but_not_after_a_large_or_failed_message():
    """Native messages reuse the thread's pickler (making one costs more than a small
    message); its memo table keeps the size of its largest message, so a large message, or
    one that failed, makes the next one use a new pickler. Each message's bytes stay its own."""
    from shmtensor.multiprocessing import reductions
    first = reductions.dumps((1, "a"))[0]
    kept = reductions._local.sender
    second = reductions.dumps((2, "b"))[0]
    assert reductions._local.sender is kept
    assert reductions.loads(first, []) == (1, "a") and reductions.loads(second, []) == (2, "b")
    big = [[i] for i in range(200_000)]  # > 1 MiB pickled
    data, blocks = reductions.dumps(big)
    assert len(data) > reductions._KEEP_PICKLER_UP_TO
    assert reductions._local.sender is None
    assert reductions.loads(data, blocks) == big
    reductions.dumps(3)
    kept = reductions._local.sender
    with pytest.raises(RuntimeError, match="refused to pickle"):
        reductions.dumps([1, _RefusesToPickle()])
    assert reductions._local.sender is None
    assert reductions.loads(*reductions.dumps((4, "d"))) == (4, "d")


class _RefusesToPickle:
    def __reduce__(self):
        raise RuntimeError("refused to pickle")


class _Unpicklable:
    def __reduce__(self):
        return (_refuse, ())


def _refuse():
    raise RuntimeError("refused to unpickle")


def test_queue_batches_timeouts_and_errors():
    q = smp.Queue(maxsize=3)
    assert q.put_many([1, 2, 3, 4, 5], timeout=0.05) == 3
    assert q.put_many([6], block=False) == 0
    assert q.get_many(10) == [1, 2, 3]
    with pytest.raises(queue.Empty):
        q.get_many(10, timeout=0.05)
    with pytest.raises(ValueError, match="at least 1"):
        q.get_many(0)
    # An item that cannot be unpickled: the others of its batch are returned, its error
    # is raised by the next call, then the queue goes on.
    assert q.put_many([7, _Unpicklable(), 8]) == 3
    assert q.get_many(10) == [7, 8]
    with pytest.raises(RuntimeError, match="refused to unpickle"):
        q.get_many(10, block=False)
    q.put(9)
    assert q.get() == 9
    # Two of them: one error per call, then the queue goes on.
    assert q.put_many([_Unpicklable(), 10, _Unpicklable()]) == 3
    assert q.get_many(10) == [10]
    with pytest.raises(RuntimeError, match="refused to unpickle"):
        q.get()
    with pytest.raises(RuntimeError, match="refused to unpickle"):
        q.get_many(10)
    with pytest.raises(queue.Empty):
        q.get_many(10, block=False)


def test_simple_queue():
    q = smp.SimpleQueue()
    assert q.empty()
    q.put("x")
    assert not q.empty()
    assert q.get() == "x"
    q.close()


@pytest.mark.parametrize("method", ["fork", "spawn"])
def test_simple_queue_fileno_is_readable_while_items_are_there(method):
    # What multiprocessing.Pool waits on: items in the ring (an int) and items sent as
    # datagrams (an array in shared memory) both make it readable, from another process.
    ctx = smp.get_context(method)
    q = ctx.SimpleQueue()
    r = q._reader
    assert multiprocessing.connection.wait([r], timeout=0) == []
    p = ctx.Process(target=_put_two, args=(q,))
    p.start()
    assert multiprocessing.connection.wait([r], timeout=30) == [r]
    assert q.get() == 7
    assert multiprocessing.connection.wait([r], timeout=30) == [r]
    assert q.get().sum() == 4096
    assert multiprocessing.connection.wait([r], timeout=0) == []
    p.join()
    assert p.exitcode == 0


def test_a_late_signal_on_an_empty_queues_fd_is_no_item_for_poll():
    # A sender descheduled between its publish and its signal for over ~1 ms leaves the
    # readiness fd readable after the consumer took the item (torch 2.6's test_fs_pool hung
    # so: Pool's result handler got True from poll() and waited in get() on an empty
    # queue). The late signal is made by hand: poll() answers what is there, and clears it.
    q = smp.SimpleQueue()
    r = q._reader
    q.put(1)
    assert q.get() == 1
    os.write(r.fileno(), (1).to_bytes(8, "little"))
    assert multiprocessing.connection.wait([r], timeout=0) == [r]  # the stale signal
    assert r.poll() is False
    assert r.poll(0.05) is False
    assert multiprocessing.connection.wait([r], timeout=0) == []  # cleared
    q.put(2)
    assert r.poll(5.0) is True
    assert q.get() == 2
    q.close()


def _put_two(q):
    q.put(7)
    q.put(np.ones(4096, dtype=np.int64))


def test_pipe_methods():
    a, b = smp.Pipe()
    assert not b.poll()
    a.send_bytes(b"hello world", 6)
    assert b.poll(1.0)
    assert b.recv_bytes() == b"world"
    a.send_bytes(b"abc")
    buf = bytearray(5)
    assert b.recv_bytes_into(buf, 1) == 3 and bytes(buf) == b"\0abc\0"
    b.send([1, "two"])
    assert a.recv() == [1, "two"]
    assert multiprocessing.connection.wait([b], timeout=0) == []
    a.send(None)
    assert multiprocessing.connection.wait([b], timeout=1) == [b]
    assert b.recv() is None
    a.close()
    with pytest.raises(EOFError):
        b.recv()
    b.close()
    with pytest.raises(OSError, match="handle is closed"):
        b.recv()
    r, w = smp.Pipe(duplex=False)
    assert r.readable and not r.writable and w.writable and not w.readable
    with pytest.raises(OSError):
        r.send(1)
    r.close()
    w.close()


def test_threads_putting_from_one_process():
    q = smp.Queue()
    n, per = 4, 50

    def produce(t):
        for i in range(per):
            q.put((t, i, np.full(20000, t * 1000 + i)))

    threads = [threading.Thread(target=produce, args=(t,)) for t in range(n)]
    for t in threads:
        t.start()
    got = {}
    for _ in range(n * per):
        t, i, a = q.get(timeout=30)
        assert a[0] == t * 1000 + i and a[-1] == t * 1000 + i
        assert i == got.get(t, -1) + 1  # one thread's items arrive in order
        got[t] = i
    for t in threads:
        t.join()
    assert got == {t: per - 1 for t in range(n)}


def child_put(q, n):
    for i in range(n):
        q.put(np.full(30000, i))


@pytest.mark.parametrize("strategy", ["file_descriptor", "file_system"])
def test_strategy_switched_at_run_time(strategy):
    old = smp.get_sharing_strategy()
    import shmtensor.numpy as snp
    try:
        a = snp.full(1000, 1.0)  # made under the old strategy
        smp.set_sharing_strategy(strategy)
        assert smp.get_sharing_strategy() == strategy
        b = snp.full(1000, 2.0)
        ctx = smp.get_context("fork")
        q = ctx.Queue()
        pq = multiprocessing.get_context("spawn").Queue()
        for queue_ in (q, pq):
            queue_.put((a, b, np.full(30000, 3.0)))
            x, y, z = queue_.get(timeout=30)
            assert x.ctypes.data == a.ctypes.data and y.ctypes.data == b.ctypes.data
            assert z[0] == 3.0
    finally:
        smp.set_sharing_strategy(old)


def _take_all(q, n, out):
    got = [q.get(timeout=60) for _ in range(n)]
    out.put(got == [(i, i * 2) for i in range(n)])


def _put_then_exit(q, n):
    for i in range(n):
        q.put((i, i * 2))  # more than the transport holds: the feeder sends the rest


@pytest.mark.parametrize("method", ["fork", "spawn"])
def test_an_unbounded_queue_never_blocks_in_put(method):
    """As multiprocessing's Queue(): 20,000 puts with no consumer yet return at once (the
    transport holds 4,096: a feeder thread sends the rest in order), and a producer that
    exits right after its puts still delivers them all (it waits for its feeder at exit)."""
    ctx = smp.get_context(method)
    q, out = ctx.Queue(), ctx.SimpleQueue()
    n = 20000
    for i in range(n):
        q.put_nowait((i, i * 2))
    assert q._feeder is not None and q._feeder.thread.is_alive()
    p = ctx.Process(target=_take_all, args=(q, n, out))
    p.start()
    q.join_thread()  # returns once the buffer is sent
    assert not q._feeder.pending
    assert out.get() is True
    p.join(60)
    assert p.exitcode == 0
    producer = ctx.Process(target=_put_then_exit, args=(q, n))
    producer.start()
    # Read before joining, as with multiprocessing: the producer waits at exit until its
    # buffer is sent, which needs room.
    assert [q.get(timeout=60) for _ in range(n)] == [(i, i * 2) for i in range(n)]
    producer.join(60)
    assert producer.exitcode == 0
    q.close()
    q._feeder.thread.join(10)
    assert not q._feeder.thread.is_alive()  # close() ends it once the buffer is empty
    out.close()


def _check_no_feeder(q):
    assert q._feeder is None  # the parent's thread and buffer stay the parent's
    q.put("child")  # room: the parent's buffer is not in the transport yet


def test_a_forked_child_does_not_send_its_parents_buffer():
    q = smp.Queue()
    for i in range(5000):
        q.put(i)
    assert q._feeder is not None
    first = [q.get(timeout=30) for _ in range(2000)]  # room for the child's item
    p = smp.get_context("fork").Process(target=_check_no_feeder, args=(q,))
    p.start()
    p.join(60)
    assert p.exitcode == 0
    rest = [q.get(timeout=30) for _ in range(3001)]
    with pytest.raises(queue.Empty):  # each item once: nothing sent twice
        q.get(timeout=0.2)
    assert first == list(range(2000)) and "child" in rest
    assert sorted(x for x in rest if x != "child") == list(range(2000, 5000))
    q.close()


def test_cancel_join_thread_before_the_feeder_exists():
    q = smp.Queue()
    q.cancel_join_thread()
    for i in range(5000):
        q.put(i)
    assert q._feeder.join_cancelled
    assert [q.get(timeout=30) for _ in range(5000)] == list(range(5000))
    q.close()


def test_simple_queue_put_blocks_when_full_as_multiprocessings():
    q = smp.SimpleQueue()
    done = threading.Event()

    def fill():
        for i in range(10000):
            q.put(i)
        done.set()
    t = threading.Thread(target=fill, daemon=True)
    t.start()
    assert not done.wait(1.0)  # blocked: the transport is full, no feeder
    assert [q.get() for _ in range(10000)] == list(range(10000))
    assert done.wait(10)
    t.join()
    q.close()
