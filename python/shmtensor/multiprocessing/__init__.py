"""shmtensor.multiprocessing: a drop-in replacement for multiprocessing (as
torch.multiprocessing is) in which NumPy arrays and shmtensor Tensors travel through shared
memory.

Everything multiprocessing has is here. Added or replaced:
  * Queue, SimpleQueue, Pipe and get_context(): shmtensor's native transport (a pickle and
    its shared blocks in one message; fds by SCM_RIGHTS);
  * reducers for numpy.ndarray and shmtensor.Tensor, registered with
    multiprocessing.reduction.ForkingPickler, so multiprocessing's own Queue, Pipe and Pool
    send arrays by reference too (set_share_threshold() says from what size an array that is
    not in shared memory is copied into it rather than pickled);
  * get/set_sharing_strategy, get_all_sharing_strategies, and torch's spawn,
    start_processes, ProcessContext, ProcessRaisedException, ProcessExitedException.

Pickles that carry shared memory are single-use (docs/python.md).
"""
import multiprocessing
from multiprocessing import *  # noqa: F401,F403

from shmtensor.multiprocessing.context import get_context
from shmtensor.multiprocessing.connection import Pipe
from shmtensor.multiprocessing.queues import Queue, SimpleQueue
from shmtensor.multiprocessing.reductions import (get_share_threshold, init_reductions,
                                                  set_share_threshold)
from shmtensor.multiprocessing.spawn import (ProcessContext, ProcessExitedException,
                                             ProcessRaisedException, spawn, start_processes)

__all__ = list(multiprocessing.__all__) + [
    "get_sharing_strategy", "set_sharing_strategy", "get_all_sharing_strategies",
    "get_share_threshold", "set_share_threshold", "spawn", "start_processes",
    "ProcessContext", "ProcessRaisedException", "ProcessExitedException",
]


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
