"""shmtensor's DataLoader iterator: what a torch DataLoader with workers iterates with while
shmtensor.torch.install() is active, or when its multiprocessing_context is a
shmtensor.torch.context() (docs/torch.md, "shmtensor's DataLoader iterator").

It is torch's _MultiProcessingDataLoaderIter with the main process's path per batch in C++,
and everything else torch's own: the workers run torch's _worker_loop (seeding of random,
torch and NumPy, get_worker_info, worker_init_fn, the fetcher, IterableDataset's end,
ExceptionWrapper with the worker id), and starting, resuming (persistent_workers), pinning,
timeouts, dead workers and shutdown are torch's code. Spawn and forkserver workers get the
dataset's NumPy arrays as one shared copy for all of them (one_copy_per_array), where each
would unpickle its own.

Per batch, in the plain case (a map-style dataset, or an IterableDataset whose length was
not asked for; no pin_memory; every queue shmtensor's native one; no profiler enabled), one
C++ call (shmtensor._C._loader_next, python/src/loader_iter.cc) is torch's _next_data: it
takes the next batch from the data queue and decodes its tensor message in C++, keeps
torch's bookkeeping in torch's attributes (_rcvd_idx, _send_idx, _task_info,
_tasks_outstanding, _workers_num_tasks, _num_yielded), keeps a batch that came out of order
in _task_info as torch does and returns it at its turn, gives the next index to the next
worker as torch's _try_put_index does (on its board, below), re-raises a worker's
ExceptionWrapper as torch does, and with a `timeout` raises torch's "DataLoader timed out"
where torch's _get_data does. Any other step runs torch's _next_data: the end of the epoch,
a worker no longer active, a closed queue. A failed get of the data queue (torch's
MP_STATUS_CHECK_INTERVAL passing, an error, a SIGCHLD handler's exception) goes to torch's
_try_get_data (_get_failed), which checks the workers and raises torch's errors. Outside the
plain case, __next__ is torch's _next_data without the record_function scope torch opens for
every batch (~6 us; on torch 1.13 it allocates a tensor) unless a profiler is enabled. A
method of torch's that the C++ step does the work of, not torch's own on torch's class (a
hook), makes every batch take torch's _next_data, saying so once; a _worker_loop put on
torch's worker module is what the workers run. The batches themselves come as tensor
messages, not pickles, while install() is active (shmtensor.multiprocessing.reductions;
docs/torch.md).

The workers' tasks go on task boards, not as index messages: each worker finds its board in
shared memory as it starts (_worker_loop_on_board wraps torch's _worker_loop, handing it a
_BoardIndexQueue), and the main process's index queues are _BoardQueues, whose put writes a
task (send_idx, index) on the board where its index is an int or a list of ints (a map-style
dataset's) or None or a list of Nones (an IterableDataset's) that fits an entry (in C++, also
from _C._loader_next), and sends anything else through the queue, numbered so that the
worker takes everything in the order sent (python/src/loader_iter.cc, "Index boards").
"""
from __future__ import annotations

import collections
import contextlib
import functools
import os
import queue
import threading
import time
import warnings

import torch
from torch.utils.data import dataloader as _dl
from torch.utils.data._utils import worker as _worker
from torch.utils.data._utils import MP_STATUS_CHECK_INTERVAL
from torch._utils import ExceptionWrapper

from shmtensor import _C
from shmtensor.multiprocessing import queues as _queues
from shmtensor.multiprocessing import reductions as _reductions
from shmtensor.multiprocessing._native_wait import untimed

_MPIter = _dl._MultiProcessingDataLoaderIter
_Map = _dl._DatasetKind.Map
_profiler_enabled = torch._C._autograd._profiler_enabled

# What this iterator reads and writes of torch's: present in torch 1.13 through 2.13.
_NEEDED = ("_next_data", "_reset", "_try_get_data", "_try_put_index")

# What _C._loader_next returns when torch's _next_data takes the step.
_HANDOVER = object()

# torch's methods that the C++ step (_C._loader_next) does the work of: one that is not
# torch's own on torch's iterator class (a user's hook, put there before or after this import)
# makes every batch take torch's _next_data, which calls it.
_STEP = ("_next_data", "_try_put_index", "_process_data", "_try_get_data", "_get_data")


def _replaced_step_methods() -> list[str]:
    """The names of _STEP whose method on torch's iterator class is not torch's own (its code
    is not in torch's dataloader.py)."""
    return [name for name in _STEP
            if _code_file(_MPIter.__dict__.get(name)) != _TORCH_DATALOADER_FILE]


def _code_file(function) -> str | None:
    code = getattr(function, "__code__", None)
    return None if code is None else os.path.realpath(code.co_filename)


_TORCH_DATALOADER_FILE = _code_file(_MPIter.__init__)


def _native(q, unbounded: bool) -> bool:
    """Whether q is a shmtensor Queue (its native queue open), unbounded if asked."""
    if type(q) is _BoardQueue:
        q = q._queue
    return (type(q) is _queues.Queue and q._q is not None
            and (not unbounded or q._maxsize == 0))


# ---- Index boards (python/src/loader_iter.cc, "Index boards") ------------------------------

_WAKE = _C._INDEX_BOARD_WAKE
_DUE = object()  # what _IndexBoardReader.take returns when a task message comes first
_torch_worker_loop = _worker._worker_loop  # torch's own, whose signature the boards need
_WORKER_ID = 10  # where torch 1.13 to 2.13 pass the worker id to _worker_loop (index queue: 2)


def _worker_loop_takes_boards() -> bool:
    """Whether this torch's _worker_loop takes its index queue and worker id where
    _worker_loop_on_board looks for them (else no loader gets boards)."""
    import inspect
    try:
        names = list(inspect.signature(_torch_worker_loop).parameters)
    except (TypeError, ValueError):
        return False
    return (len(names) > _WORKER_ID and names[2] == "index_queue"
            and names[_WORKER_ID] == "worker_id")


_BOARDS = _worker_loop_takes_boards()


# Slots of a board at most: a board is memory the worker's pages touch, 16 + 8 x index_words
# bytes a slot, and a task that finds its board full goes as a message.
_MAX_SLOTS = 256


def _board_shape(loader) -> tuple[int, int]:
    """(slots, index_words) of each worker's board: twice the tasks torch keeps out per
    worker, 4 to _MAX_SLOTS, and the batch size clamped to 16..512 (a longer batch goes as a
    message)."""
    batch = loader.batch_size
    if batch is None:
        batch = getattr(loader.batch_sampler, "batch_size", None)
    batch = batch if type(batch) is int else 16
    prefetch = loader.prefetch_factor if type(loader.prefetch_factor) is int else 2
    return min(max(2 * prefetch, 4), _MAX_SLOTS), min(max(batch, 16), 512)


class _BoardQueue:
    """The main process's side of a worker's index queue: a task (send_idx, index) with an
    int, a list of ints, None or a list of Nones that fits goes on the worker's board;
    anything else through the queue, as (entries posted before it, object). Every other
    attribute is the queue's."""

    def __init__(self, q: _queues.Queue, board: _C._IndexBoardWriter) -> None:
        self._queue = q
        self._board = board

    def put(self, obj, block: bool = True, timeout=None) -> None:
        q = self._queue
        native = q._check()
        if (type(obj) is tuple and len(obj) == 2
                and self._board.put(obj[0], obj[1], native)):
            return
        try:
            data, blocks = _reductions.dumps((self._board.posted, obj))
        except Exception as e:  # noqa: BLE001 (the queue's put reports it so)
            # Reported and dropped as the queue's put does, and not counted: the worker
            # would wait for it before taking a later entry.
            q._on_queue_feeder_error(e, obj)
            return
        q._put_here = True
        q._put_unbounded(native, data, blocks)  # torch's index queues are unbounded
        self._board.announce(native)

    def __getattr__(self, name: str):
        return getattr(self._queue, name)

    def __repr__(self) -> str:
        return "<_BoardQueue of %r>" % (self._queue,)


class _BoardIndexQueue:
    """A worker's index queue: its get() returns the tasks of its board and the objects sent
    through the queue in the order the main process sent them. torch's _worker_loop calls
    get(timeout=...) and nothing else."""

    def __init__(self, q: _queues.Queue, board: _C._IndexBoardReader) -> None:
        self._queue = q
        self._board = board
        self._pending: collections.deque = collections.deque()  # (entries before it, object)

    def get(self, block: bool = True, timeout=None):
        board = self._board
        pending = self._pending
        deadline = None
        while True:
            if pending and pending[0][0] <= board.taken:
                return pending.popleft()[1]
            task = board.take(_DUE)
            if task is not None and task is not _DUE:
                return task
            if task is None and board.about_to_sleep():
                continue  # a task came meanwhile
            if deadline is None:
                deadline = (time.monotonic() + timeout if block and timeout is not None
                            else None if block else 0.0)
            wait = None if deadline is None else max(deadline - time.monotonic(), 0.0)
            native = self._queue._check()
            try:
                item = native.get(wait) if wait is not None else untimed(native.get)
            finally:
                if task is None:
                    board.woke()
            if item is None:
                raise queue.Empty
            data, blocks = item
            if data == _WAKE:
                continue
            board.received()
            pending.append(_reductions.loads(data, blocks))

    def __getattr__(self, name: str):
        return getattr(self._queue, name)


def _worker_loop_on_board(boards, shape, loop, *args):
    """`loop` (the worker module's _worker_loop when the worker was started, a hook put
    there; None: torch's own), its index queue read through the worker's board (of `boards`,
    the workers' boards in one tensor, by the worker id)."""
    _starting.target = None  # a fork child: the thread that started it had it set
    q = args[2]
    if _native(q, True) and len(args) > _WORKER_ID:
        board = _C._IndexBoardReader(boards, args[_WORKER_ID], *shape)
        args = args[:2] + (_BoardIndexQueue(q, board),) + args[3:]
    return (_torch_worker_loop if loop is None else loop)(*args)


# The target that torch's __init__, on this thread, starts its workers with (_BoardTarget);
# torch's _worker_loop on any other thread, whose loaders have no boards.
_starting = threading.local()


class _WorkerModule(type(_worker)):
    """torch's worker module, whose _worker_loop (which torch's __init__ reads as it starts
    each worker) is _starting.target on a thread that has one, the module's own otherwise."""

    @property
    def _worker_loop(self):
        target = getattr(_starting, "target", None)
        return target if target is not None else self.__dict__["_worker_loop"]

    @_worker_loop.setter
    def _worker_loop(self, value) -> None:
        self.__dict__["_worker_loop"] = value


_worker.__class__ = _WorkerModule


class _BoardTarget:
    """While active on this thread: the workers torch starts on it run _worker_loop_on_board
    with these boards (other threads' loaders start torch's _worker_loop meanwhile)."""

    def __init__(self, boards, shape) -> None:
        # The module's _worker_loop as it is now, carried to the worker (pickled by name for
        # spawn and forkserver, as torch's iterator passes it): a function put there after
        # torch was imported (a user's wrapper, a profiler's) runs, as under torch's iterator.
        # torch's own goes as None: pickled by name, torch's module would answer with this
        # very target (_WorkerModule), which is not the function.
        loop = _worker.__dict__["_worker_loop"]
        self.target = functools.partial(_worker_loop_on_board, boards, shape,
                                        None if loop is _torch_worker_loop else loop)

    def __enter__(self):
        self.outer = getattr(_starting, "target", None)  # an iterator made meanwhile (nested)
        _starting.target = self.target
        return self

    def __exit__(self, *exc) -> None:
        _starting.target = self.outer


_C._loader_setup(_HANDOVER, ExceptionWrapper, queue.Empty, float(MP_STATUS_CHECK_INTERVAL),
                 _reductions, _BoardQueue, _worker._IterableDatasetStopIteration)
_loader_next = _C._loader_next


class _RaisingQueue:
    """A data queue whose get raises the error a native get gave (for _get_failed)."""

    def __init__(self, error: BaseException):
        self.error = error

    def get(self, timeout=None):
        raise self.error


class _WithContext:
    """A DataLoader as torch's iterator __init__ reads it (attributes only), its
    multiprocessing_context another: the loader itself is left alone, so another thread's
    iterator, or the user, never sees the swap."""

    def __init__(self, loader, context):
        self.__dict__["_loader"] = loader
        self.__dict__["multiprocessing_context"] = context

    def __getattr__(self, name):
        return getattr(self.__dict__["_loader"], name)


def _usable_cpus() -> int:
    """The CPUs this process may run on (its affinity mask)."""
    return len(os.sched_getaffinity(0))


def unavailable_reason() -> str | None:
    """Why torch's own iterator must be used instead, or None."""
    if os.environ.get("SHMTENSOR_DATALOADER_ITERATOR", "shmtensor") == "torch":
        return "SHMTENSOR_DATALOADER_ITERATOR=torch"
    missing = [name for name in _NEEDED if not hasattr(_MPIter, name)]
    if missing:
        return ("this torch %s's _MultiProcessingDataLoaderIter has no %s"
                % (torch.__version__, ", ".join(missing)))
    return None


class ShmtensorDataLoaderIter(_MPIter):
    """torch's multiprocessing DataLoader iterator with shmtensor's path per batch."""

    _boards = None  # (the workers' boards, shape), until _reset wraps the queues

    def __init__(self, loader, context=None):
        """`context`: the multiprocessing context to start the workers and make the queues
        with in place of the loader's (None: the loader's)."""
        # Spawn and forkserver workers each get a pickle of the dataset: its NumPy arrays
        # are copied into shared memory once for all of them (its tensors move there in
        # place at the first pickle, as with torch).
        target = contextlib.nullcontext()
        if _BOARDS:
            shape = _board_shape(loader)
            boards = _C._make_index_boards(loader.num_workers, *shape)
            self._boards = (boards, shape)
            target = _BoardTarget(boards, shape)
        with _reductions.one_copy_per_array(), target:
            super().__init__(loader if context is None else _WithContext(loader, context))
        if loader.num_workers >= _usable_cpus() and _native(self._worker_result_queue, False):
            # The workers and this process outnumber the CPUs: a get that polled would keep
            # a CPU from the worker making the batch it waits for.
            self._worker_result_queue.set_busy_poll(0)

    _warn_length = False  # set by _reset (which torch's __init__ calls)
    _plain = False  # whether __next__ may take the C++ path: set by _reset

    def _reset(self, loader, first_iter=False):
        if self._boards is not None:
            # Before torch's _reset sends the first tasks: each worker's index queue becomes
            # its board's (the workers read theirs through their boards since they started).
            boards, shape = self._boards
            self._boards = None
            self._index_queues = [
                _BoardQueue(q, _C._IndexBoardWriter(boards, w, *shape))
                if _native(q, True) else q for w, q in enumerate(self._index_queues)]
        self._warn_length = (self._dataset_kind != _Map
                             and loader._IterableDataset_len_called is not None)
        # An IterableDataset's too, but for one whose length was asked for: torch's __next__
        # warns when it yields more than that length.
        self._iterable_step = self._dataset_kind != _Map
        self._plain = ((self._dataset_kind == _Map or not self._warn_length)
                       and not self._pin_memory
                       and _native(self._data_queue, False)
                       and all(_native(q, True) for q in self._index_queues))
        if self._plain and (replaced := _replaced_step_methods()):
            self._plain = False
            say_once("torch's %s replaced on _MultiProcessingDataLoaderIter: every batch "
                     "takes torch's _next_data, which calls it, instead of shmtensor's C++ step"
                     % ", ".join(replaced))
        super()._reset(loader, first_iter)

    def __next__(self):
        if self._plain and self._sampler_iter is not None and not _profiler_enabled():
            data = _loader_next(self)
            if data is not _HANDOVER:
                return data
        elif self._warn_length or _profiler_enabled():
            return super().__next__()  # torch's: the profiler's scope, IterableDataset's warning
        elif self._sampler_iter is None:
            self._reset()  # as torch: a TypeError (an iterator used after it was exhausted)
        data = self._next_data()
        self._num_yielded += 1
        return data

    def _get_failed(self, error: BaseException):
        """torch's _try_get_data on a get of the data queue that raised `error` (queue.Empty
        when MP_STATUS_CHECK_INTERVAL passed): its check of the workers, its RuntimeError for
        a dead one, else `error` re-raised, or (False, None) for queue.Empty."""
        data_queue = self._data_queue
        raising = self._data_queue = _RaisingQueue(error)
        try:
            return self._try_get_data()
        finally:
            self._data_queue = data_queue
            # The error's traceback holds this call's frames (and so this iterator) and the
            # stand-in that holds the error: that cycle would keep an iterator dropped
            # mid-epoch, and its workers, until the garbage collector runs.
            raising.error = None
            del error


_said = set()


def say_torch_iterator(reason: str) -> None:
    """Once per reason and process: a RuntimeWarning that torch's iterator is used, and why."""
    say_once("DataLoader workers use torch's own iterator: " + reason, stacklevel=5)


def say_once(what: str, stacklevel: int = 4) -> None:
    """`what`, as a RuntimeWarning from shmtensor.torch, once per process."""
    if what in _said:
        return
    _said.add(what)
    warnings.warn("shmtensor.torch: " + what, RuntimeWarning, stacklevel=stacklevel)
