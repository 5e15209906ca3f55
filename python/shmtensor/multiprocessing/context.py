"""multiprocessing.context, with contexts whose Queue, SimpleQueue, JoinableQueue and Pipe
are shmtensor's (and so are the Pool's queues): hand one to code that takes a
multiprocessing context (torch's DataLoader(multiprocessing_context=...) does,
concurrent.futures.ProcessPoolExecutor(mp_context=...) too). Every other name is the
standard library module's."""
from __future__ import annotations

import multiprocessing
import multiprocessing.context as _mpcontext
from typing import TYPE_CHECKING

from shmtensor.multiprocessing._reexport import reexport

if TYPE_CHECKING:
    from typing_extensions import TypeAlias

    from shmtensor.multiprocessing import connection as _connection
    from shmtensor.multiprocessing import queues as _queues

    # What get_context() returns.
    _Context: TypeAlias = "ForkContext | SpawnContext | ForkServerContext"

__getattr__, __dir__ = reexport(globals(), _mpcontext)


# (type: ignore[misc] below: the queues and Pipe are shmtensor's classes, not the ones
# multiprocessing's stubs name; they have their API.)
class _NativeTransport:
    def Queue(self, maxsize: int = 0) -> _queues.Queue:
        from shmtensor.multiprocessing.queues import Queue
        return Queue(maxsize, ctx=self)

    def JoinableQueue(self, maxsize: int = 0) -> _queues.JoinableQueue:
        from shmtensor.multiprocessing.queues import JoinableQueue
        return JoinableQueue(maxsize, ctx=self)

    def SimpleQueue(self) -> _queues.SimpleQueue:
        from shmtensor.multiprocessing.queues import SimpleQueue
        return SimpleQueue(ctx=self)

    def Pipe(self, duplex: bool = True) -> tuple[_connection.Connection, _connection.Connection]:
        from shmtensor.multiprocessing.connection import Pipe
        return Pipe(duplex)

    def get_context(self, method: str | None = None) -> _Context:
        # None: this context (multiprocessing's Lock, Event... are made with
        # ctx.get_context(), and a semaphore made for fork cannot go to a spawned child).
        if method is None:
            return self  # type: ignore[return-value]  # (a context: the classes below)
        return get_context(method)


class ForkContext(_NativeTransport, _mpcontext.ForkContext):  # type: ignore[misc]
    pass


class SpawnContext(_NativeTransport, _mpcontext.SpawnContext):  # type: ignore[misc]
    pass


class ForkServerContext(_NativeTransport, _mpcontext.ForkServerContext):  # type: ignore[misc]
    pass


_contexts: dict[str, _Context] = {"fork": ForkContext(), "spawn": SpawnContext(),
                                  "forkserver": ForkServerContext()}


def get_context(method: str | None = None) -> _Context:
    """Like multiprocessing.get_context, with shmtensor's queues and Pipe. None: the
    current default start method."""
    if method is None:
        method = multiprocessing.get_start_method()
    try:
        return _contexts[method]
    except KeyError:
        raise ValueError("cannot find context for %r" % method) from None
