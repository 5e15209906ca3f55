"""Queue and SimpleQueue on shmtensor's native transport (a SOCK_SEQPACKET socket pair and a
shared control block, include/shmtensor/queue.h).

The API is multiprocessing's. Differences that follow from the transport: no feeder thread
(put() sends at once and blocks only while the kernel's socket buffer or maxsize is full), so
join_thread() and cancel_join_thread() have nothing to do; items put by one thread arrive
in order; close() is local, as in multiprocessing: this handle can no longer put or get,
other processes go on.
"""
import queue as _queue
import multiprocessing.connection
import threading

from shmtensor import _C
from shmtensor.multiprocessing import reductions
from shmtensor.multiprocessing.frames import frame_reduce, fds_of


def _timeout(block, timeout):
    if not block:
        return 0.0
    if timeout is None:
        return None
    return max(float(timeout), 0.0)


class Queue:
    def __init__(self, maxsize=0, *, ctx=None):
        self._maxsize = max(int(maxsize), 0)
        self._q = _C._Queue(self._maxsize)

    def _check(self):
        if self._q is None:
            raise ValueError("Queue %r is closed" % self)
        return self._q

    def put(self, obj, block=True, timeout=None):
        q = self._check()
        data, blocks = reductions.dumps(obj)
        if not q.put(data, blocks, _timeout(block, timeout)):
            raise _queue.Full

    def get(self, block=True, timeout=None):
        q = self._check()
        self._raise_deferred()
        item = q.get(_timeout(block, timeout))
        if item is None:
            raise _queue.Empty
        return reductions.loads(*item)

    def put_many(self, objs, block=True, timeout=None):
        """Puts every object of `objs` in order, as put() each, in one call: consumers
        asleep are woken once for the batch. Returns how many were put: all of them, or,
        when not blocking or when `timeout` (in all) passed first, the first ones that
        found room (the others are not put). An extension of multiprocessing's API."""
        q = self._check()
        items = [reductions.dumps(obj) for obj in objs]
        return q.put_many(items, _timeout(block, timeout))

    def get_many(self, max_items, block=True, timeout=None):
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
        items = q.get_many(max_items, _timeout(block, timeout))
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

    def set_busy_poll(self, seconds):
        """This queue's get() in this process looks for an item without sleeping for up to
        `seconds` (adapting to how long items take to come) before it blocks, in place of
        the process's shmtensor.set_busy_poll: a consumer that waits a few tens of
        microseconds per item saves its producer a wake-up and itself a sleep. 0 never
        polls; None (the default) follows the process's setting. Other processes' handles
        of the queue are not affected. An extension of multiprocessing's API."""
        self._check().set_busy_poll(None if seconds is None else float(seconds))

    def _raise_deferred(self):
        deferred = self.__dict__.get("_deferred")
        if deferred:
            raise deferred.pop(0)

    def put_nowait(self, obj):
        return self.put(obj, False)

    def get_nowait(self):
        return self.get(False)

    def qsize(self):
        return self._check().qsize()

    def _poll(self, timeout):
        return bool(multiprocessing.connection.wait([self._check()], timeout))

    def empty(self):
        return self.qsize() == 0

    def full(self):
        return self._maxsize > 0 and self.qsize() >= self._maxsize

    def close(self):
        self._q = None

    def join_thread(self):
        pass

    def cancel_join_thread(self):
        pass

    def __reduce__(self):
        return frame_reduce(_rebuild_queue, self._check()._frame(), (type(self), self._maxsize))


def _rebuild_queue(data, fd_refs, cls, maxsize):
    q = cls.__new__(cls)
    q._maxsize = maxsize
    q._q = _C._queue_of_frame(data, fds_of(fd_refs))
    return q


class SimpleQueue(Queue):
    def __init__(self, *, ctx=None):
        super().__init__(0)

    def put(self, obj):
        super().put(obj)

    def get(self):
        return super().get()

    # multiprocessing.Pool reaches into its SimpleQueues: _writer.send, _reader.recv,
    # _reader.poll, _reader/_writer.close in workers, and _rlock while it drains the task
    # queue at terminate(). The native queue needs none of them: each item goes to one
    # reader as a whole, so closing a "side" would only break the other.
    @property
    def _reader(self):
        return _Side(self)

    @property
    def _writer(self):
        return _Side(self)

    @property
    def _rlock(self):
        lock = self.__dict__.get("_lock")
        if lock is None:
            lock = self.__dict__["_lock"] = threading.Lock()
        return lock


class _Side:
    def __init__(self, q):
        self._q = q

    def send(self, obj):
        self._q.put(obj)

    def recv(self):
        return self._q.get()

    def poll(self, timeout=0.0):
        return self._q._poll(timeout)

    def close(self):
        pass

    def fileno(self):
        return self._q._check().fileno()
