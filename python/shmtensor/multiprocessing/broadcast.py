"""Broadcast: one writer, N readers, every reader gets every message in order
(include/shmtensor/broadcast.h; docs/transport.md, "Broadcast").

    b = Broadcast(readers=3)
    # hand b.reader(i) to process i (fork, spawn, forkserver: it pickles)
    b.put({"step": 7, "x": tensor}, timeout=5.0)        # in the process that made b
    obj = reader.get(timeout=None)                       # in reader i's process

Objects are pickled as the Queue pickles them: tensors and NumPy arrays travel as one shared
block that every reader maps (no copy per reader). put() waits while a reader is `depth`
messages behind and, at its timeout, raises shmtensor.BroadcastTimeout (a TimeoutError)
naming that reader (.reader, .pid, .behind); the message then went to no reader (unless
.delivered lists the readers that got it: docs/transport.md, "Broadcast"). A reader that
died is found by the writer's puts within 100 ms (at once when its queue is full): its
unread messages are dropped, and it is skipped until a process attaches as it again (its
first get()). After the writer closed or
died, readers take what was put, then get raises shmtensor.QueueClosed. A broadcast made
with name= is opened by any process of the user: Broadcast.open(name).reader(i).
"""
from __future__ import annotations

from typing import TYPE_CHECKING

from shmtensor import _C
from shmtensor.multiprocessing import reductions
from shmtensor.multiprocessing.frames import fds_of, frame_reduce

if TYPE_CHECKING:
    from collections.abc import Sequence
    from typing import Any

    from shmtensor.multiprocessing import keeper

__all__ = ["Broadcast", "BroadcastReader"]


class BroadcastReader:
    """Reader `index` of a Broadcast: picklable; its process attaches as that reader on its
    first get() (one process per reader at a time)."""

    def __init__(self, native: _C._BroadcastReader) -> None:
        self._r = native

    @property
    def index(self) -> int:
        return self._r.index

    def get(self, timeout: float | None = None) -> Any:
        """The next message. Raises TimeoutError when none came within `timeout` seconds
        (None: waits), shmtensor.QueueClosed once the writer closed or died and every
        message was taken."""
        item = self._r.get(None if timeout is None else float(timeout))
        if item is None:
            raise TimeoutError("Broadcast reader %d: no message within %s s" % (self.index,
                                                                                timeout))
        return reductions.loads(*item)

    def __reduce__(self) -> tuple[Any, ...]:
        return frame_reduce(_rebuild_reader, self._r._frame())


class Broadcast:
    """One writer (the process that made it), `readers` readers; `depth`: how many
    messages a reader may be behind before put() waits."""

    def __init__(self, readers: int, name: str | None = None, *, depth: int = 64) -> None:
        """name: published through the user's shmtensor-manager, so that any process of
        the user opens it (Broadcast.open(name).reader(i)) until this process drops it,
        exits or dies, or Broadcast.unlink(name); shmtensor.NameExistsError when taken."""
        self._b = _C._Broadcast(int(readers), int(depth), name)

    @classmethod
    def open(cls, name: str) -> Broadcast:
        """The broadcast published under `name`: hands out readers, cannot put.
        shmtensor.NameNotFoundError when there is none."""
        b = cls.__new__(cls)
        b._b = _C._broadcast_open(name)
        return b

    @staticmethod
    def unlink(name: str) -> None:
        """Removes the name (handles keep working)."""
        _C._broadcast_unlink(name)

    @classmethod
    def _from_parts(cls, data: bytes, fds: Sequence[int]) -> Broadcast:
        """The Broadcast whose _parts() gave `data` and `fds` (owned from the call on):
        what a registry of names keeps, and how an opener rebuilds it."""
        b = cls.__new__(cls)
        b._b = _C._broadcast_of_frame(data, list(fds))
        return b

    def _parts(self) -> _C._Frame:
        """The frame (bytes, fds) that _from_parts takes; it carries the counts that keep the
        broadcast alive while it is in flight (call mark_sent() once they are kept)."""
        return self._b._frame()

    @property
    def readers(self) -> int:
        return self._b.readers

    @property
    def depth(self) -> int:
        return self._b.depth

    def put(self, obj: object, timeout: float | None = None) -> None:
        data, blocks = reductions.dumps(obj)
        self._b.put(data, blocks, None if timeout is None else float(timeout))

    def reader(self, index: int) -> BroadcastReader:
        return BroadcastReader(self._b.reader(int(index)))

    def behind(self, index: int) -> int:
        """Messages reader `index` has not taken yet (an estimate)."""
        return self._b.behind(int(index))

    def reader_pid(self, index: int) -> int:
        """The pid attached as reader `index`; 0 when none is."""
        return self._b.reader_pid(int(index))

    def close(self) -> None:
        """No more puts; readers take what is there, then get raises QueueClosed."""
        self._b.close()

    def __reduce__(self) -> tuple[Any, ...]:
        return frame_reduce(_rebuild_broadcast, self._b._frame())


def _rebuild_reader(data: bytes, fd_refs: Sequence[keeper.FdRef]) -> BroadcastReader:
    return BroadcastReader(_C._broadcast_reader_of_frame(data, fds_of(fd_refs)))


def _rebuild_broadcast(data: bytes, fd_refs: Sequence[keeper.FdRef]) -> Broadcast:
    b = Broadcast.__new__(Broadcast)
    b._b = _C._broadcast_of_frame(data, fds_of(fd_refs))
    return b
