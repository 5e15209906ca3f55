"""multiprocessing.context, with contexts whose Queue, SimpleQueue, JoinableQueue and Pipe
are shmtensor's (and so are the Pool's queues): hand one to code that takes a
multiprocessing context (torch's DataLoader(multiprocessing_context=...) does,
concurrent.futures.ProcessPoolExecutor(mp_context=...) too). Every other name is the
standard library module's."""
import multiprocessing
import multiprocessing.context as _mpcontext

from shmtensor.multiprocessing._reexport import reexport

__getattr__, __dir__ = reexport(globals(), _mpcontext)


class _NativeTransport:
    def Queue(self, maxsize=0):
        from shmtensor.multiprocessing.queues import Queue
        return Queue(maxsize, ctx=self)

    def JoinableQueue(self, maxsize=0):
        from shmtensor.multiprocessing.queues import JoinableQueue
        return JoinableQueue(maxsize, ctx=self)

    def SimpleQueue(self):
        from shmtensor.multiprocessing.queues import SimpleQueue
        return SimpleQueue(ctx=self)

    def Pipe(self, duplex=True):
        from shmtensor.multiprocessing.connection import Pipe
        return Pipe(duplex)

    def get_context(self, method=None):
        # None: this context (multiprocessing's Lock, Event... are made with
        # ctx.get_context(), and a semaphore made for fork cannot go to a spawned child).
        if method is None:
            return self
        return get_context(method)


class ForkContext(_NativeTransport, _mpcontext.ForkContext):
    pass


class SpawnContext(_NativeTransport, _mpcontext.SpawnContext):
    pass


class ForkServerContext(_NativeTransport, _mpcontext.ForkServerContext):
    pass


_contexts = {"fork": ForkContext(), "spawn": SpawnContext(), "forkserver": ForkServerContext()}


def get_context(method=None):
    """Like multiprocessing.get_context, with shmtensor's queues and Pipe. None: the
    current default start method."""
    if method is None:
        method = multiprocessing.get_start_method()
    try:
        return _contexts[method]
    except KeyError:
        raise ValueError("cannot find context for %r" % method) from None
