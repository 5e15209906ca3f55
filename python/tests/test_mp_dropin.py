"""shmtensor.multiprocessing as a drop-in for multiprocessing: every name and submodule,
Pipe()'s fileno() and end-of-file whatever start method passed an end, multiprocessing's
exceptions, the native JoinableQueue, and concurrent.futures.ProcessPoolExecutor with our
contexts. (CPython's own suite, stock and with ours: cpython_mp/run_cpython_mp.py.)"""
import concurrent.futures
import importlib
import inspect
import multiprocessing
import multiprocessing.connection
import multiprocessing.reduction
import os
import pkgutil
import queue
import selectors
import signal
import sys
import tempfile
import threading
import time

import numpy as np
import pytest

import shmtensor
import shmtensor.multiprocessing as smp
from helpers import run_in_child

METHODS = ["fork", "spawn", "forkserver"]
STDLIB_SUBMODULES = sorted(m.name for m in pkgutil.iter_modules(multiprocessing.__path__)
                           if m.name != "popen_spawn_win32")
OURS = {"connection", "context", "queues", "spawn"}


def test_every_name_of_multiprocessing_is_reachable():
    for name in dir(multiprocessing):
        if name.startswith("__"):
            continue
        assert hasattr(smp, name), name
    assert smp.SUBWARNING == multiprocessing.SUBWARNING
    assert smp.SUBDEBUG == multiprocessing.SUBDEBUG
    assert set(dir(multiprocessing)) <= set(dir(smp))
    with pytest.raises(AttributeError):
        smp.no_such_name
    # Every name dir() lists can be had, and introspection (pydoc, IDEs) walks the module.
    for name in dir(smp):
        getattr(smp, name)
    members = dict(inspect.getmembers(smp))
    assert members["util"] is multiprocessing.util and members["Queue"] is smp.Queue
    assert not hasattr(smp, "popen_spawn_win32")  # another platform's: as on multiprocessing


@pytest.mark.parametrize("name", STDLIB_SUBMODULES)
def test_every_submodule_is_reachable_the_same_ways(name):
    stdlib = importlib.import_module("multiprocessing." + name)
    imported = importlib.import_module("shmtensor.multiprocessing." + name)
    assert getattr(smp, name) is imported
    if name in OURS:
        assert imported.__name__ == "shmtensor.multiprocessing." + name
        # Everything of the standard library's module of that name is there too.
        for attr in dir(stdlib):
            if not attr.startswith("__"):
                assert hasattr(imported, attr), "%s.%s" % (name, attr)
    else:
        assert imported is stdlib  # the module itself: one state, not a copy
    assert sys.modules["shmtensor.multiprocessing." + name] is imported


def test_submodules_of_submodules_and_from_imports():
    from shmtensor.multiprocessing.reduction import send_handle
    from shmtensor.multiprocessing.connection import Client, Listener, wait
    import shmtensor.multiprocessing.dummy.connection as dummy_connection
    assert send_handle is multiprocessing.reduction.send_handle
    assert (Client, Listener, wait) == (multiprocessing.connection.Client,
                                        multiprocessing.connection.Listener,
                                        multiprocessing.connection.wait)
    assert dummy_connection is importlib.import_module("multiprocessing.dummy.connection")
    assert smp.context.BaseContext is multiprocessing.context.BaseContext
    assert smp.pool.Pool is multiprocessing.pool.Pool
    assert smp.queues.JoinableQueue is smp.JoinableQueue
    assert smp.connection.Connection is not multiprocessing.connection.Connection


def test_spawn_is_the_module_and_torchs_function():
    import types
    assert isinstance(smp.spawn, types.ModuleType)
    assert smp.spawn.get_preparation_data is multiprocessing.spawn.get_preparation_data
    assert smp.spawn.spawn_main is multiprocessing.spawn.spawn_main
    assert callable(smp.spawn)
    assert callable(smp.spawn.spawn) and callable(smp.start_processes)


def import_in_child(q):
    import shmtensor.multiprocessing.util as util
    from shmtensor.multiprocessing.reduction import ForkingPickler
    q.put((util is multiprocessing.util, ForkingPickler is multiprocessing.reduction.ForkingPickler,
           type(smp.spawn).__name__))


@pytest.mark.parametrize("method", ["spawn", "forkserver"])
def test_submodules_import_in_a_child_that_starts_afresh(method):
    ctx = smp.get_context(method)
    q = ctx.SimpleQueue()
    p = ctx.Process(target=import_in_child, args=(q,))
    p.start()
    assert q.get() == (True, True, "_CallableModule")
    p.join(60)
    assert p.exitcode == 0


def write_square(i, path):
    with open("%s.%d" % (path, i), "w") as f:
        f.write(str(i * i))


def test_spawn_called_as_torchs_spawn(tmp_path):
    smp.spawn(write_square, args=(str(tmp_path / "out"),), nprocs=2)
    assert [(tmp_path / ("out.%d" % i)).read_text() for i in range(2)] == ["0", "1"]


def put_one(q):
    q.put(1)


@pytest.mark.parametrize("method", ["spawn", "forkserver"])
def test_a_queue_of_the_fork_context_reaches_a_child_of_another_start_method(method):
    # multiprocessing refuses this (a fork context's SemLock, CPython 3.11.5+'s
    # test_mixed_startmethod asserts the refusal); ours has no SemLock to refuse.
    q = smp.get_context("fork").Queue()
    p = smp.get_context(method).Process(target=put_one, args=(q,))
    p.start()
    assert q.get(timeout=60) == 1
    p.join(60)
    assert p.exitcode == 0


# ---- Pipe ------------------------------------------------------------------------------


def send_three_then_exit(conn):
    for i in range(3):
        conn.send(np.full(1000, i, dtype=np.int64))


@pytest.mark.parametrize("method", METHODS)
def test_a_pipe_end_given_to_a_child_reaches_eof_when_the_child_exits(method):
    """The pattern of multiprocessing.connection.wait()'s documentation: the parent closes
    its copy of the writer, reads until EOFError, while the Process object lives."""
    ctx = smp.get_context(method)
    r, w = ctx.Pipe(duplex=False)
    p = ctx.Process(target=send_three_then_exit, args=(w,))
    p.start()
    w.close()
    got = []
    while True:
        assert multiprocessing.connection.wait([r], timeout=60) == [r]
        try:
            got.append(int(r.recv()[0]))
        except EOFError:
            break
    assert got == [0, 1, 2]
    p.join(60)
    assert p.exitcode == 0
    r.close()
    del p  # the Popen (and anything it held) goes; the leak check looks after this


def test_fileno_is_the_socket_and_readable_exactly_while_a_message_is_there():
    a, b = smp.Pipe()
    assert os.readlink("/proc/self/fd/%d" % b.fileno()).startswith("socket:")
    with selectors.DefaultSelector() as sel:
        sel.register(b, selectors.EVENT_READ)
        assert sel.select(0) == []
        a.send({"x": np.arange(5)})
        a.send_bytes(b"raw")
        assert [key.fileobj for key, _ in sel.select(5)] == [b]
        assert b.recv()["x"].tolist() == [0, 1, 2, 3, 4]
        assert [key.fileobj for key, _ in sel.select(0)] == [b]
        assert b.recv_bytes() == b"raw"
        assert sel.select(0) == []
        a.close()
        assert [key.fileobj for key, _ in sel.select(5)] == [b]  # the hang-up
    with pytest.raises(EOFError):
        b.recv()
    b.close()


def receive_handle_and_write(conn, data):
    fd = multiprocessing.reduction.recv_handle(conn)
    os.write(fd, data)
    os.close(fd)
    conn.send("written")


@pytest.mark.parametrize("method", ["fork", "spawn"])
def test_send_handle_and_recv_handle_go_through_the_pipe(method):
    ctx = smp.get_context(method)
    ours, child_end = ctx.Pipe()
    p = ctx.Process(target=receive_handle_and_write, args=(child_end, b"through the socket"))
    p.start()
    child_end.close()
    with tempfile.TemporaryFile() as f:
        multiprocessing.reduction.send_handle(ours, f.fileno(), p.pid)
        assert ours.recv() == "written"
        f.seek(0)
        assert f.read() == b"through the socket"
    p.join(60)
    assert p.exitcode == 0
    ours.close()


def test_pipe_errors_are_multiprocessings():
    r, w = smp.Pipe(duplex=False)
    with pytest.raises(OSError, match="write-only"):
        w.poll()
    with pytest.raises(OSError, match="write-only"):
        w.recv()
    with pytest.raises(OSError, match="read-only"):
        r.send(1)
    with pytest.raises(ValueError):
        smp.connection.Connection(None, readable=False, writable=False)
    w.send_bytes(b"0123456789", 2, 3)
    assert r.recv_bytes() == b"234"
    with pytest.raises(ValueError, match="offset is negative"):
        w.send_bytes(b"x", -1)
    with pytest.raises(ValueError, match="buffer length < offset \\+ size"):
        w.send_bytes(b"xy", 1, 5)
    w.send_bytes(b"twelve bytes")
    buf = bytearray(8)
    with pytest.raises(multiprocessing.BufferTooShort) as short:
        r.recv_bytes_into(buf)
    assert short.value.args[0] == b"twelve bytes"  # the message, as multiprocessing gives it
    w.send_bytes(b"fits")
    assert r.recv_bytes_into(buf, 2) == 4 and buf == bytearray(b"\0\0fits\0\0")
    w.send_bytes(b"too long")
    with pytest.raises(OSError, match="bad message length"):
        r.recv_bytes(3)
    assert r.closed  # a read-only end that lost a message is closed, as multiprocessing's
    a, b = smp.Pipe()
    b.close()
    with pytest.raises(BrokenPipeError):
        a.send("to nobody")
    with pytest.raises(EOFError) as eof:
        a.recv()
    assert isinstance(eof.value, shmtensor.ConnectionClosed)  # one hierarchy: shmtensor.Error
    assert isinstance(eof.value, shmtensor.Error)
    assert issubclass(shmtensor.QueueClosed, shmtensor.Error)
    assert issubclass(shmtensor.QueueClosed, ValueError)
    a.close()
    with pytest.raises(OSError, match="handle is closed"):
        a.fileno()
    with pytest.raises(OSError, match="handle is closed"):
        a.send(1)


# ---- Queue, SimpleQueue ------------------------------------------------------------------


class NotPicklable:
    def __reduce__(self):
        raise AttributeError("no pickling")


@pytest.mark.parametrize("maxsize", [0, 1])
def test_put_of_an_unpicklable_object_is_reported_and_the_queue_goes_on(maxsize, capfd):
    q = smp.Queue(maxsize)
    q.put(NotPicklable())  # returns, as multiprocessing's put()
    q.put("next")
    assert q.get(timeout=10) == "next"
    assert q.qsize() == 0
    assert "AttributeError: no pickling" in capfd.readouterr().err


def test_the_feeder_error_hook_can_be_overridden():
    seen = []

    class Hooked(smp.Queue):
        @staticmethod
        def _on_queue_feeder_error(e, obj):
            seen.append((type(e), type(obj)))

    q = Hooked(ctx=smp.get_context())
    q.put(NotPicklable())
    q.put(1)
    assert q.get(timeout=10) == 1
    assert seen == [(AttributeError, NotPicklable)]


def test_a_closed_queue_answers_as_multiprocessings_does():
    # CPython 3.13's test_closed_queue_empty_exceptions: empty() of a closed queue this
    # handle never put into answers; of one it put into raises OSError; qsize() and full()
    # answer either way.
    for q in smp.Queue(), smp.JoinableQueue():
        q.close()
        q.join_thread()
        assert q.empty() and q.qsize() == 0 and not q.full()
    for q in smp.Queue(1), smp.JoinableQueue(1):
        q.put("foo")
        q.close()
        q.join_thread()
        with pytest.raises(OSError, match="is closed"):
            q.empty()
        assert q.qsize() == 1 and q.full()
        with pytest.raises(ValueError, match="is closed"):
            q.get()


def test_simple_queue_errors_are_multiprocessings():
    q = smp.SimpleQueue()
    with pytest.raises(AttributeError):
        q.put(NotPicklable())  # SimpleQueue pickles in put() and raises, as multiprocessing's
    q.close()
    q.close()
    assert q._reader.closed and q._writer.closed
    with pytest.raises(OSError, match="handle is closed"):
        q.put(1)
    with pytest.raises(OSError, match="handle is closed"):
        q.get()
    q2 = smp.Queue()
    q2.close()
    with pytest.raises(ValueError, match="is closed"):
        q2.put(1)


# ---- JoinableQueue -------------------------------------------------------------------------


def work_until_none(q, done):
    while True:
        item = q.get()
        if item is None:
            q.task_done()
            return
        time.sleep(0.0005)
        done.put(int(np.sum(item)))  # sent before the task is done
        q.task_done()


@pytest.mark.parametrize("method", METHODS)
def test_joinable_queue_join_waits_for_every_task_done(method):
    ctx = smp.get_context(method)
    q = ctx.JoinableQueue()
    assert isinstance(q, smp.JoinableQueue)
    done = ctx.Queue()
    workers = [ctx.Process(target=work_until_none, args=(q, done)) for _ in range(2)]
    for p in workers:
        p.start()
    total = 0
    for i in range(200):
        a = np.full(100_000 if i % 50 == 0 else 4, i, dtype=np.int64)  # shared and inline
        total += int(a.sum())
        q.put(a)
    q.join()
    # Every task was done, so every report is in `done` already: no waiting for one.
    assert sum(done.get_nowait() for _ in range(200)) == total
    with pytest.raises(queue.Empty):
        done.get_nowait()
    for _ in workers:
        q.put(None)
    q.join()
    for p in workers:
        p.join(60)
        assert p.exitcode == 0
    q.close()
    q.join()  # works on a closed handle, as multiprocessing's
    with pytest.raises(ValueError, match="too many times"):
        q.task_done()


def test_an_unpicklable_item_is_no_unfinished_task(capfd):
    q = smp.JoinableQueue()
    q.put(NotPicklable())  # reported and dropped: never a task (multiprocessing counts it)
    q.join()  # returns at once
    assert "AttributeError: no pickling" in capfd.readouterr().err


def test_joinable_queue_counts_items_its_feeder_thread_holds():
    # More items than the transport holds (4,096 ring slots): the rest wait in the feeder
    # thread, and are unfinished tasks from put() on, as in multiprocessing.
    q = smp.JoinableQueue()
    n = 6000
    for i in range(n):
        q.put(i)
    assert q._feeder is not None and q._feeder.pending
    ctx = smp.get_context("fork")
    done = ctx.Queue()
    p = ctx.Process(target=work_until_none, args=(q, done))
    p.start()
    q.join()
    assert sum(done.get_nowait() for _ in range(n)) == sum(range(n))
    q.put(None)
    q.join()
    p.join(60)
    assert p.exitcode == 0


# ---- Ctrl-C --------------------------------------------------------------------------------


def interrupted_after(wait, seconds=0.3):
    """In this process's main thread: wait() raises KeyboardInterrupt when SIGINT comes
    `seconds` after it began (from a timer thread, as a terminal's Ctrl-C would)."""
    signal.signal(signal.SIGINT, signal.default_int_handler)
    timer = threading.Timer(seconds, os.kill, (os.getpid(), signal.SIGINT))
    timer.start()
    start = time.monotonic()
    signal.alarm(30)  # a wait that sleeps through SIGINT fails the test, rather than hang it
    try:
        wait()
    except KeyboardInterrupt:
        assert time.monotonic() - start < 10
        return
    finally:
        signal.alarm(0)
        timer.join()
    raise AssertionError("the wait returned")


@pytest.mark.parametrize("wait", ["Queue.get", "Queue.get_many", "SimpleQueue.get",
                                  "JoinableQueue.join", "Connection.recv",
                                  "Connection.recv_bytes", "Connection.poll(None)"])
def test_an_untimed_wait_in_the_main_thread_is_interrupted_by_ctrl_c(wait):
    def child():
        q, jq, sq = smp.Queue(), smp.JoinableQueue(), smp.SimpleQueue()
        a, b = smp.Pipe()
        jq.put("a task nobody does")
        calls = {"Queue.get": q.get, "Queue.get_many": lambda: q.get_many(4),
                 "SimpleQueue.get": sq.get, "JoinableQueue.join": jq.join,
                 "Connection.recv": b.recv, "Connection.recv_bytes": b.recv_bytes,
                 "Connection.poll(None)": lambda: b.poll(None)}
        interrupted_after(calls[wait])
        # Still usable after the interruption.
        q.put(1)
        assert q.get(timeout=10) == 1
        a.send(2)
        assert b.recv() == 2
    assert run_in_child(child) == 0


# ---- concurrent.futures --------------------------------------------------------------------


def column_sums(a):
    return a.sum(axis=0)


def fail(x):
    raise KeyError(x)


@pytest.mark.parametrize("method", METHODS)
def test_process_pool_executor_with_our_contexts(method):
    arrays = [np.full((256, 64), i, dtype=np.float32) for i in range(8)]
    with concurrent.futures.ProcessPoolExecutor(2, mp_context=smp.get_context(method)) as ex:
        sums = list(ex.map(column_sums, arrays))
        with pytest.raises(KeyError):
            ex.submit(fail, "k").result(timeout=60)
    assert [s.tolist() for s in sums] == [[256.0 * i] * 64 for i in range(8)]


def _fail_in_child(index):
    raise KeyError(f"child {index}")


def test_spawn_errors_are_shmtensor_errors():
    from shmtensor.multiprocessing.spawn import ProcessException
    assert issubclass(ProcessException, shmtensor.Error)
    assert issubclass(smp.ProcessRaisedException, ProcessException)
    assert issubclass(smp.ProcessExitedException, ProcessException)
    with pytest.raises(shmtensor.Error) as info:
        smp.spawn(_fail_in_child, nprocs=1, start_method="fork")
    assert type(info.value) is smp.ProcessRaisedException
    assert info.value.error_index == 0
    assert "KeyError: 'child 0'" in str(info.value)


def test_one_timeout_rule_for_every_call():
    q = smp.Queue()
    bounded = smp.Queue(1)
    a, b = smp.Pipe()
    start = time.monotonic()
    with pytest.raises(queue.Empty):
        q.get(timeout=-5)  # negative: one try
    assert not a.poll(-1)
    assert time.monotonic() - start < 1.0
    for call in (lambda: q.get(timeout=float("nan")), lambda: a.poll(float("nan")),
                 lambda: bounded.put(1, timeout=float("nan"))):
        with pytest.raises(ValueError, match="not NaN"):
            call()
    bounded.put(7, timeout=float("inf"))  # beyond 10**9 s: 10**9 s
    assert bounded.get(timeout=1e-12) == 7  # rounded up to a nanosecond, and found
    q.close()
    bounded.close()
    a.close()
    b.close()
