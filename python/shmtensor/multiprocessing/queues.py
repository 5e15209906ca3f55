"""Queue, JoinableQueue and SimpleQueue on shmtensor's native transport (a SOCK_SEQPACKET
socket pair, a ring and a shared control block, include/shmtensor/queue.h); every other
name of multiprocessing.queues is the standard library's.

The API is multiprocessing's. put() pickles at once and sends at once when there is room;
an object that cannot be pickled goes to _on_queue_feeder_error and is dropped, as
multiprocessing's feeder thread does (SimpleQueue.put() raises, as multiprocessing's). A Queue without maxsize never blocks in
put(), as multiprocessing's does not: an item that finds the transport full (its ring's
4,096 slots and the socket's buffer) waits in this handle's buffer, which a feeder thread
sends in order (started then, and only then); join_thread() waits for it to drain,
cancel_join_thread() lets the process exit without, and a process waits for it at exit
otherwise, as multiprocessing's Queue does. A Queue with maxsize blocks in put() while it
is full, and SimpleQueue.put() blocks while the transport is full, as multiprocessing's
(whose SimpleQueue writes to a pipe directly). Items put by one thread arrive in order;
close() is local, as in multiprocessing: this handle can no longer put or get, other
processes go on (its buffer is still sent).
"""
from __future__ import annotations

import collections
import multiprocessing.connection
import multiprocessing.queues
import multiprocessing.util
import os
import queue as _queue
import sys
import threading
import time
import traceback
import weakref
from typing import TYPE_CHECKING

from shmtensor import _C
from shmtensor.multiprocessing import reductions
from shmtensor.multiprocessing._native_wait import untimed
from shmtensor.multiprocessing._reexport import reexport
from shmtensor.multiprocessing.frames import frame_reduce, fds_of


if TYPE_CHECKING:
    from collections.abc import Iterable, Sequence
    from typing import Any, TypeVar

    from shmtensor._C import Tensor, _Queue
    from shmtensor.multiprocessing import keeper

    _Q = TypeVar("_Q", bound="Queue")

__getattr__, __dir__ = reexport(globals(), multiprocessing.queues)

_feeder_lock = threading.Lock()


def _timeout(block: bool, timeout: float | None) -> float | None:
    """What a put or get passes to the native queue: 0 for a non-blocking call, else the
    caller's timeout as a float (the native module's to_timeout is the one rule for the
    rest: negative is 0, NaN a ValueError)."""
    if not block:
        return 0.0
    if timeout is None:
        return None
    return float(timeout)


class _Feeder:
    """The items of one Queue handle that found the transport full, and the thread that
    sends them in order (blocking puts). One per handle and process, made on first need."""

    def __init__(self, q: _Queue) -> None:
        # (data, blocks), the first one being sent; each one's task (a JoinableQueue's)
        # was counted by put() (begin_task), so it is sent as counted.
        self.pending: collections.deque[tuple[bytes, list[Tensor]]] = collections.deque()
        self.cond = threading.Condition(threading.Lock())
        self.closing = False
        self.join_cancelled = False
        self.thread = threading.Thread(target=self._run, args=(q,), daemon=True,
                                       name="shmtensor-QueueFeederThread")
        self.thread.start()
        self.finalizer = multiprocessing.util.Finalize(
            self, _Feeder.flush, (self.pending, self.cond, self.thread), exitpriority=-5)

    def _run(self, q: _Queue) -> None:
        while True:
            with self.cond:
                while not self.pending and not self.closing:
                    self.cond.wait()
                if not self.pending:
                    return
                data, blocks = self.pending[0]
            try:
                q.put(data, blocks, None, True)
            except Exception:  # as multiprocessing's feeder: say so, drop the item, go on
                print("shmtensor Queue feeder thread: an item could not be sent", file=sys.stderr)
                traceback.print_exc()
            with self.cond:
                self.pending.popleft()
                del data, blocks
                self.cond.notify_all()

    def close(self) -> None:
        """The thread ends once it has sent what it holds."""
        with self.cond:
            self.closing = True
            self.cond.notify_all()

    @staticmethod
    def flush(pending: collections.deque[tuple[bytes, list[Tensor]]],
              cond: threading.Condition, thread: threading.Thread) -> None:
        """Waits until every buffered item is sent (join_thread(), and at process exit)."""
        with cond:
            while pending and thread.is_alive():
                cond.wait()


# Handles with a feeder, so that a forked child drops its parent's (it has no such thread,
# and its parent sends those items).
_feeding: weakref.WeakSet[Queue] = weakref.WeakSet()


def _forget_feeders_after_fork() -> None:
    for q in list(_feeding):
        q.__dict__.pop("_feeder", None)
    _feeding.clear()


os.register_at_fork(after_in_child=_forget_feeders_after_fork)


class Queue:
    _feeder: _Feeder | None = None  # a _Feeder once an unbounded put found the transport full
    _joinable = False  # whether this class's queues count tasks (JoinableQueue)

    def __init__(self, maxsize: int = 0, *, ctx: object = None, name: str | None = None) -> None:
        """name: a named queue, which any process of this user opens with Queue.open(name)
        (docs/python.md, "Named queues"); FileExistsError (shmtensor.NameExistsError) when
        the name is taken. The name goes when this process drops its last handle of the
        queue, exits or dies, or Queue.unlink(name) is called."""
        self._maxsize = max(int(maxsize), 0)
        self._q: _Queue | None = (
            _C._Queue(self._maxsize, joinable=self._joinable) if name is None
            else _C._queue_create_named(name, self._maxsize, joinable=self._joinable))

    @classmethod
    def open(cls: type[_Q], name: str) -> _Q:
        """The queue created under `name` by any process of this user, which need not have
        started this one. FileNotFoundError (shmtensor.NameNotFoundError) when there is
        none; JoinableQueue.open: ValueError when that queue is not a JoinableQueue (a
        Queue opens either kind)."""
        q = cls.__new__(cls)
        q._q = _C._queue_open_named(name, joinable=cls._joinable)
        q._maxsize = q._q.maxsize
        return q

    @staticmethod
    def unlink(name: str) -> None:
        """Removes the name; handles of the queue keep working. FileNotFoundError when there
        is none."""
        _C._queue_unlink_named(name)

    def _check(self) -> _Queue:
        if self._q is None:
            # shmtensor.QueueClosed is a ValueError, as multiprocessing's for a closed Queue.
            raise _C.QueueClosed("Queue %r is closed: close() was called on this handle, which "
                                 "can no longer put or get (other handles of the queue are not "
                                 "affected)" % self)
        return self._q

    def put(self, obj: object, block: bool = True, timeout: float | None = None) -> None:
        q = self._check()
        self._put_here = True
        try:
            data, blocks = reductions.dumps(obj)
        except Exception as e:
            # As multiprocessing's feeder thread: reported, the item dropped, put() returns.
            self._on_queue_feeder_error(e, obj)
            return
        if self._maxsize == 0:
            return self._put_unbounded(q, data, blocks)
        if not q.put(data, blocks, _timeout(block, timeout)):
            raise _queue.Full

    def _put_unbounded(self, q: _Queue, data: bytes, blocks: list[Tensor]) -> None:
        feeder = self._feeder
        if feeder is None:
            if q.put(data, blocks, 0.0):
                return
            with _feeder_lock:
                feeder = self._feeder
                if feeder is None:
                    feeder = self.__dict__["_feeder"] = _Feeder(q)
                    _feeding.add(self)
                    if self.__dict__.get("_join_cancelled"):
                        feeder.join_cancelled = True
                        feeder.finalizer.cancel()
                    # A handle dropped without close(): its thread sends what it holds, then ends.
                    weakref.finalize(self, feeder.close)
        with feeder.cond:
            # Nothing buffered: try again at once (behind nothing of this handle's).
            if not feeder.pending and q.put(data, blocks, 0.0):
                return
            # A JoinableQueue's item is an unfinished task from now on, as in multiprocessing
            # (a join() anywhere waits for it).
            q.begin_task()
            feeder.pending.append((data, blocks))
            feeder.cond.notify_all()

    @staticmethod
    def _on_queue_feeder_error(e: Exception, obj: object) -> None:
        """Called, in the thread that called put(), when `obj` cannot be pickled; the item
        is dropped. multiprocessing's hook of the same name (a subclass may override it);
        by default the traceback goes to stderr."""
        traceback.print_exc()

    def get(self, block: bool = True, timeout: float | None = None) -> Any:
        q = self._check()
        self._raise_deferred()
        t = _timeout(block, timeout)
        item = q.get(t) if t is not None else untimed(q.get)
        if item is None:
            raise _queue.Empty
        return reductions.loads(*item)

    def put_many(self, objs: Iterable[object], block: bool = True,
                 timeout: float | None = None) -> int:
        """Puts every object of `objs` in order, as put() each, in one call: consumers
        asleep are woken once for the batch. Returns how many were put: all of them, or,
        when not blocking or when `timeout` (in all) passed first, the first ones that
        found room (the others are not put). An extension of multiprocessing's API."""
        q = self._check()
        items = [reductions.dumps(obj) for obj in objs]
        return q.put_many(items, _timeout(block, timeout))

    def get_many(self, max_items: int, block: bool = True,
                 timeout: float | None = None) -> list[Any]:
        """Waits for one object as get() does, then takes up to `max_items` - 1 more that
        are there already: a list of 1 to `max_items` objects. Raises queue.Empty when none
        came. An item that cannot be received is consumed (as by get()): the others are
        returned, and its error is raised by a later get or get_many of this queue object
        (one per call, oldest first). An extension of multiprocessing's API."""
        q = self._check()
        max_items = int(max_items)
        if max_items < 1:
            raise ValueError("max_items must be at least 1, not %d" % max_items)
        self._raise_deferred()
        t = _timeout(block, timeout)
        if t is not None:
            items = q.get_many(max_items, t)
        else:
            items = untimed(lambda s: q.get_many(max_items, s))
        if not items:
            raise _queue.Empty
        out = []
        errors = []
        for item in items:
            try:
                out.append(reductions.loads(*item))
            except Exception as e:  # consumed; the others are still returned
                errors.append(e)
        del items, item  # the kept errors' tracebacks must not keep the batch alive
        if errors:
            self.__dict__.setdefault("_deferred", []).extend(errors[0 if out else 1:])
            if not out:
                raise errors[0]
        return out

    def set_busy_poll(self, seconds: float | None) -> None:
        """This queue's get() in this process looks for an item without sleeping for up to
        `seconds` (adapting to how long items take to come) before it blocks, in place of
        the process's shmtensor.set_busy_poll: a consumer that waits a few tens of
        microseconds per item saves its producer a wake-up and itself a sleep. 0 never
        polls; None (the default) follows the process's setting. Other processes' handles
        of the queue are not affected. An extension of multiprocessing's API."""
        self._check().set_busy_poll(None if seconds is None else float(seconds))

    def _raise_deferred(self) -> None:
        deferred = self.__dict__.get("_deferred")
        if deferred:
            raise deferred.pop(0)

    def put_nowait(self, obj: object) -> None:
        return self.put(obj, False)

    def get_nowait(self) -> Any:
        return self.get(False)

    def _native(self) -> _Queue:
        """The native queue, also after close(): qsize(), full() and a JoinableQueue's
        task_done() and join() work on a closed handle, as multiprocessing's."""
        q = self._q
        return q if q is not None else self.__dict__["_closed_q"]

    def qsize(self) -> int:
        return self._native().qsize()

    def _poll(self, timeout: float | None) -> bool:
        # The readiness fd may be readable with nothing there (a sender that signalled
        # over ~1 ms after its item was taken); _ready_now() says what is there and clears
        # such a signal, so that poll() is exact when it answers, as a pipe's is
        # (multiprocessing.Pool's result handler calls get() after a True poll()).
        q = self._check()
        deadline = None if timeout is None else time.monotonic() + max(0.0, timeout)
        while True:
            left = None if deadline is None else max(0.0, deadline - time.monotonic())
            if not multiprocessing.connection.wait([q], left):
                return False
            if q._ready_now():
                return True
            if deadline is not None and time.monotonic() >= deadline:
                return False

    def empty(self) -> bool:
        q = self._q
        if q is None and self.__dict__.get("_put_here"):
            # As multiprocessing's: close() of a queue this handle put into closes its
            # reader (empty() then raises), of one it never put into is a no-op.
            raise OSError("handle is closed")
        return self._native().qsize() == 0

    def full(self) -> bool:
        return self._maxsize > 0 and self._native().qsize() >= self._maxsize

    def close(self) -> None:
        if self._q is not None:
            self.__dict__["_closed_q"] = self._q
        self._q = None
        feeder = self._feeder
        if feeder is not None:
            feeder.close()

    def join_thread(self) -> None:
        """Waits until every item this handle buffered is sent."""
        feeder = self._feeder
        if feeder is not None and not feeder.join_cancelled:
            _Feeder.flush(feeder.pending, feeder.cond, feeder.thread)

    def cancel_join_thread(self) -> None:
        """This process may exit with items still buffered (they are lost)."""
        feeder = self._feeder
        if feeder is not None:
            feeder.join_cancelled = True
            feeder.finalizer.cancel()
        else:
            self.__dict__["_join_cancelled"] = True

    def __reduce__(self) -> tuple[Any, ...]:
        return frame_reduce(_rebuild_queue, self._check()._frame(), (type(self), self._maxsize))


def _rebuild_queue(data: bytes, fd_refs: Sequence[keeper.FdRef], cls: type[_Q],
                   maxsize: int) -> _Q:
    q = cls.__new__(cls)
    q._maxsize = maxsize
    q._q = _C._queue_of_frame(data, fds_of(fd_refs))
    return q


class JoinableQueue(Queue):
    """A Queue that counts unfinished tasks, as multiprocessing.JoinableQueue: each item
    put is one, counted in the queue's shared control block before it can be got;
    task_done() marks one done, join() waits until none is left. Both work on a closed
    handle, as multiprocessing's. name: as Queue's; JoinableQueue.open(name) opens it,
    and task_done() and join() count the tasks of every process that holds it."""

    _joinable = True

    def task_done(self) -> None:
        """Raises ValueError when called more times than there were items put."""
        self._native().task_done()

    def join(self) -> None:
        untimed(self._native().join)


class SimpleQueue(Queue):
    def __init__(self, *, ctx: object = None) -> None:
        super().__init__(0)

    def _check(self) -> _Queue:
        if self._q is None:
            raise OSError("handle is closed")  # multiprocessing's, from its closed pipe
        return self._q

    def put(self, obj: object) -> None:  # type: ignore[override]  # multiprocessing's
        q = self._check()
        data, blocks = reductions.dumps(obj)  # raises here, as multiprocessing's
        q.put(data, blocks, None)

    def empty(self) -> bool:
        return self._check().qsize() == 0  # OSError once closed, as multiprocessing's

    def get(self) -> Any:  # type: ignore[override]  # multiprocessing's SimpleQueue.get
        return super().get()

    # multiprocessing.Pool reaches into its SimpleQueues: _writer.send, _reader.recv,
    # _reader.poll, _reader/_writer.close in workers, and _rlock while it drains the task
    # queue at terminate(). The native queue needs none of them: each item goes to one
    # reader as a whole, so closing a "side" would only break the other.
    @property
    def _reader(self) -> _Side:
        return _Side(self)

    @property
    def _writer(self) -> _Side:
        return _Side(self)

    @property
    def _rlock(self) -> threading.Lock:
        lock = self.__dict__.get("_lock")
        if lock is None:
            lock = self.__dict__["_lock"] = threading.Lock()
        return lock


class _Side:
    def __init__(self, q: SimpleQueue) -> None:
        self._q = q

    def send(self, obj: object) -> None:
        self._q.put(obj)

    def recv(self) -> Any:
        return self._q.get()

    def poll(self, timeout: float | None = 0.0) -> bool:
        return self._q._poll(timeout)

    def close(self) -> None:
        pass

    @property
    def closed(self) -> bool:
        return self._q._q is None

    def fileno(self) -> int:
        return self._q._check().fileno()
