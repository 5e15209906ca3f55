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
from __future__ import annotations

import importlib
import multiprocessing
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import multiprocessing.pool
    from collections.abc import Callable, Iterable
    from typing import Any

    # multiprocessing's names but those this module defines: to a type checker, the star
    # import would make Queue, Pipe, Pool and get_context multiprocessing's own.
    from multiprocessing import (Array as Array, AuthenticationError as AuthenticationError,
                                 Barrier as Barrier, BoundedSemaphore as BoundedSemaphore,
                                 BufferTooShort as BufferTooShort, Condition as Condition,
                                 Event as Event, Lock as Lock, Manager as Manager,
                                 Process as Process, ProcessError as ProcessError, RLock as RLock,
                                 RawArray as RawArray, RawValue as RawValue,
                                 Semaphore as Semaphore, TimeoutError as TimeoutError,
                                 Value as Value, active_children as active_children,
                                 allow_connection_pickling as allow_connection_pickling,
                                 cpu_count as cpu_count, current_process as current_process,
                                 freeze_support as freeze_support,
                                 get_all_start_methods as get_all_start_methods,
                                 get_logger as get_logger, get_start_method as get_start_method,
                                 log_to_stderr as log_to_stderr, parent_process as parent_process,
                                 reducer as reducer, set_executable as set_executable,
                                 set_forkserver_preload as set_forkserver_preload,
                                 set_start_method as set_start_method)
else:
    from multiprocessing import *  # noqa: F401,F403

from shmtensor.multiprocessing import _reexport

_reexport.install_aliases()

from shmtensor.multiprocessing import connection, context, queues  # noqa: E402
if TYPE_CHECKING:
    # At run time the name is the module shmtensor.multiprocessing.spawn, which is callable
    # as its function spawn (torch.multiprocessing.spawn(fn, nprocs=...)); type checkers
    # cannot call a module, so to them it is the function.
    from shmtensor.multiprocessing.spawn import spawn as spawn
else:
    from shmtensor.multiprocessing import spawn  # noqa: E402
# (`X as X`: re-exported, also to type checkers that want it said, mypy --strict.)
from shmtensor.multiprocessing.context import get_context as get_context  # noqa: E402
from shmtensor.multiprocessing.broadcast import Broadcast as Broadcast  # noqa: E402
from shmtensor.multiprocessing.connection import Pipe as Pipe  # noqa: E402
from shmtensor.multiprocessing.queues import (JoinableQueue as JoinableQueue,  # noqa: E402
                                              Queue as Queue, SimpleQueue as SimpleQueue)
from shmtensor.multiprocessing.reductions import (  # noqa: E402
    get_share_threshold as get_share_threshold, init_reductions,
    set_share_threshold as set_share_threshold)
from shmtensor.multiprocessing.spawn import (  # noqa: E402
    ProcessContext as ProcessContext, ProcessExitedException as ProcessExitedException,
    ProcessRaisedException as ProcessRaisedException, start_processes as start_processes)

__all__ = list(multiprocessing.__all__) + [
    "get_sharing_strategy", "set_sharing_strategy", "get_all_sharing_strategies",
    "get_share_threshold", "set_share_threshold", "spawn", "start_processes",
    "ProcessContext", "ProcessRaisedException", "ProcessExitedException", "Broadcast",
]


_getattr_of_multiprocessing, _dir_with_multiprocessing = _reexport.reexport(globals(),
                                                                            multiprocessing)


def __getattr__(name: str) -> Any:
    """multiprocessing's submodules, and its other names (SUBDEBUG, SUBWARNING, ...)."""
    if name in _reexport.ALIASED:
        return importlib.import_module(__name__ + "." + name)
    return _getattr_of_multiprocessing(name)


def __dir__() -> list[str]:
    return sorted(set(_dir_with_multiprocessing()) | _reexport.ALIASED)


def Pool(processes: int | None = None, initializer: Callable[..., object] | None = None,
         initargs: Iterable[Any] = (),
         maxtasksperchild: int | None = None) -> multiprocessing.pool.Pool:
    """multiprocessing.Pool with shmtensor's queues (get_context().Pool)."""
    return get_context().Pool(processes, initializer, initargs, maxtasksperchild)


def get_sharing_strategy() -> str:
    import shmtensor
    return shmtensor.get_sharing_strategy()


def set_sharing_strategy(strategy: str) -> None:
    """'file_descriptor' (default: memfds, no name in /dev/shm) or 'file_system' (named
    objects in /dev/shm). Arrays already shared keep their segment."""
    import shmtensor
    shmtensor.set_sharing_strategy(strategy)


def get_all_sharing_strategies() -> set[str]:
    import shmtensor
    return shmtensor.get_all_sharing_strategies()


init_reductions()
