"""shmtensor.multiprocessing: a drop-in replacement for multiprocessing (as
torch.multiprocessing is) in which NumPy arrays and shmtensor Tensors travel through shared
memory. Change `import multiprocessing` to `import shmtensor.multiprocessing as
multiprocessing`.

Every name and submodule multiprocessing has is here, reached the same way
(`shmtensor.multiprocessing.util`, `from shmtensor.multiprocessing.reduction import
send_handle`, `shmtensor.multiprocessing.SUBWARNING`). Added or replaced:
  * Queue, SimpleQueue, JoinableQueue, Pipe, Pool and get_context(): shmtensor's transport
    (a pickle and its shared blocks in one message; fds by SCM_RIGHTS), with
    multiprocessing's API and errors; the submodules connection, context and queues hold
    them, with everything else of the standard library's modules of those names;
  * reducers for numpy.ndarray and shmtensor.Tensor, registered with
    multiprocessing.reduction.ForkingPickler, so multiprocessing's own Queue, Pipe and Pool
    send arrays by reference too (set_share_threshold() says from what size an array that is
    not in shared memory is copied into it rather than pickled);
  * get/set_sharing_strategy, get_all_sharing_strategies, and torch.multiprocessing's
    start_processes, ProcessContext, ProcessRaisedException, ProcessExitedException and
    spawn: the module multiprocessing.spawn, callable as torch's spawn(fn, nprocs=...).

Pickles that carry shared memory are single-use; where behaviour differs from
multiprocessing, docs/python.md says so.
"""
import importlib
import multiprocessing
from multiprocessing import *  # noqa: F401,F403

from shmtensor.multiprocessing import _reexport

_reexport.install_aliases()

from shmtensor.multiprocessing import connection, context, queues, spawn  # noqa: E402
from shmtensor.multiprocessing.context import get_context  # noqa: E402
from shmtensor.multiprocessing.connection import Pipe  # noqa: E402
from shmtensor.multiprocessing.queues import JoinableQueue, Queue, SimpleQueue  # noqa: E402
from shmtensor.multiprocessing.reductions import (get_share_threshold, init_reductions,  # noqa: E402
                                                  set_share_threshold)
from shmtensor.multiprocessing.spawn import (ProcessContext, ProcessExitedException,  # noqa: E402
                                             ProcessRaisedException, start_processes)

__all__ = list(multiprocessing.__all__) + [
    "get_sharing_strategy", "set_sharing_strategy", "get_all_sharing_strategies",
    "get_share_threshold", "set_share_threshold", "spawn", "start_processes",
    "ProcessContext", "ProcessRaisedException", "ProcessExitedException",
]


_getattr_of_multiprocessing, _dir_with_multiprocessing = _reexport.reexport(globals(),
                                                                            multiprocessing)


def __getattr__(name):
    """multiprocessing's submodules, and its other names (SUBDEBUG, SUBWARNING, ...)."""
    if name in _reexport.ALIASED:
        return importlib.import_module(__name__ + "." + name)
    return _getattr_of_multiprocessing(name)


def __dir__():
    return sorted(set(_dir_with_multiprocessing()) | _reexport.ALIASED)


def Pool(processes=None, initializer=None, initargs=(), maxtasksperchild=None):
    """multiprocessing.Pool with shmtensor's queues (get_context().Pool)."""
    return get_context().Pool(processes, initializer, initargs, maxtasksperchild)


def get_sharing_strategy():
    import shmtensor
    return shmtensor.get_sharing_strategy()


def set_sharing_strategy(strategy):
    """'file_descriptor' (default: memfds, no name in /dev/shm) or 'file_system' (named
    objects in /dev/shm). Arrays already shared keep their segment."""
    import shmtensor
    shmtensor.set_sharing_strategy(strategy)


def get_all_sharing_strategies():
    import shmtensor
    return shmtensor.get_all_sharing_strategies()


init_reductions()
