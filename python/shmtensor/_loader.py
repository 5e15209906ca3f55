"""shmtensor's DataLoader iterator: what a torch DataLoader with workers iterates with while
shmtensor.torch.install() is active, or when its multiprocessing_context is a
shmtensor.torch.context() (docs/torch.md, "shmtensor's DataLoader iterator").

It is torch's _MultiProcessingDataLoaderIter with the main process's path per batch made
cheaper, and everything else torch's own: the workers run torch's _worker_loop (seeding of
random, torch and NumPy, get_worker_info, worker_init_fn, the fetcher, IterableDataset's end,
ExceptionWrapper with the worker id), and starting, resuming (persistent_workers), pinning,
timeouts, dead workers and shutdown are torch's code. Spawn and forkserver workers get the
dataset's NumPy arrays as one shared copy for all of them (one_copy_per_array), where each
would unpickle its own. What differs, per batch:
  * no record_function scope around __next__ unless a profiler is enabled (torch opens one
    for every batch: ~6 us here, and on torch 1.13 it allocates a tensor);
  * with in_order, a map-style dataset and no pinning (the plain case), new tasks are sent
    to the workers in rounds: once `round` batches have been handed out, that many tasks go
    out together, each worker's in one put_many (one wake-up), instead of one message and
    one wake-up per batch. The sampler is drawn in the same order and assigned to the
    workers in torch's rotation, so every worker loads exactly the batches it would under
    torch (and its random state advances the same way); only the draws come later, never
    earlier, than torch's: at most prefetch_factor × num_workers tasks are out at any time,
    as in torch, and never fewer than that minus `round`.
Anything else (iterable datasets, in_order=False, pin_memory, a profiler) goes through
torch's methods unchanged.
"""
from __future__ import annotations

import os
import warnings

import torch
from torch.utils.data import dataloader as _dl

from shmtensor.multiprocessing import reductions as _reductions

_MPIter = _dl._MultiProcessingDataLoaderIter
_Map = _dl._DatasetKind.Map
_profiler_enabled = torch._C._autograd._profiler_enabled

# What this iterator reads and writes of torch's: present in torch 1.13 through 2.13.
_NEEDED = ("_try_put_index", "_next_index", "_next_data", "_get_data", "_reset",
           "_shutdown_workers", "_mark_worker_as_unavailable")


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

    def __init__(self, loader):
        # Spawn and forkserver workers each get a pickle of the dataset: its NumPy arrays
        # are copied into shared memory once for all of them (its tensors move there in
        # place at the first pickle, as with torch).
        with _reductions.one_copy_per_array():
            super().__init__(loader)

    # Set by _reset (which torch's __init__ calls, after starting the workers).
    _plain = False
    _warn_length = False
    _round = 1
    _owed = 0
    _deferring = False

    def _reset(self, loader, first_iter=False):
        self._plain = (self._dataset_kind == _Map and not self._pin_memory
                       and getattr(self, "_in_order", True))
        self._warn_length = (self._dataset_kind != _Map
                             and loader._IterableDataset_len_called is not None)
        # Half of what may be out: a worker still has tasks queued while the next round of
        # its own goes out.
        self._round = max(1, (self._prefetch_factor * self._num_workers) // 2)
        self._owed = 0
        self._deferring = False
        super()._reset(loader, first_iter)
        self._deferring = self._plain and self._round > 1

    def __next__(self):
        if self._warn_length or _profiler_enabled():
            return super().__next__()  # torch's: the profiler's scope, IterableDataset's warning
        if self._sampler_iter is None:
            self._reset()  # as torch: a TypeError (an iterator used after it was exhausted)
        data = self._next_data()
        self._num_yielded += 1
        return data

    def _try_put_index(self):
        if not self._deferring:
            return super()._try_put_index()
        self._owed += 1
        if self._owed >= self._round:
            self._send_owed()

    def _send_owed(self):
        """Draws the owed tasks from the sampler, in torch's rotation over the workers, and
        sends each worker its share in one message."""
        owed, self._owed = self._owed, 0
        status = self._workers_status
        cycle = self._worker_queue_idx_cycle
        task_info = self._task_info
        num_tasks = getattr(self, "_workers_num_tasks", None)  # torch 2.x
        out = {}
        for _ in range(owed):
            try:
                index = self._next_index()
            except StopIteration:
                break
            for _ in range(self._num_workers):
                w = next(cycle)
                if status[w]:
                    break
            else:
                break
            out.setdefault(w, []).append((self._send_idx, index))
            task_info[self._send_idx] = (w,)
            if num_tasks is not None:
                num_tasks[w] += 1
            self._tasks_outstanding += 1
            self._send_idx += 1
        for w, tasks in out.items():
            q = self._index_queues[w]
            put_many = getattr(q, "put_many", None)
            if put_many is not None and len(tasks) > 1:
                put_many(tasks)
            else:
                for task in tasks:
                    q.put(task)

    def _next_data(self):
        if self._deferring and self._owed and self._tasks_outstanding == 0:
            self._send_owed()  # never wait with nothing asked of the workers
        return super()._next_data()

    def _mark_worker_as_unavailable(self, worker_id, shutdown=False):
        # A worker gone: tasks go out one by one again (torch's path), the owed ones first.
        deferring, self._deferring = self._deferring, False
        owed, self._owed = self._owed, 0
        super()._mark_worker_as_unavailable(worker_id, shutdown)
        if deferring and not shutdown:
            for _ in range(owed):
                super()._try_put_index()


_said = set()


def say_torch_iterator(reason: str) -> None:
    """Once per reason and process: a RuntimeWarning that torch's iterator is used, and why."""
    if reason in _said:
        return
    _said.add(reason)
    warnings.warn("shmtensor.torch: DataLoader workers use torch's own iterator: " + reason,
                  RuntimeWarning, stacklevel=4)
