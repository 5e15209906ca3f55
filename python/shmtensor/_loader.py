"""shmtensor's DataLoader iterator: what a torch DataLoader with workers iterates with while
shmtensor.torch.install() is active, or when its multiprocessing_context is a
shmtensor.torch.context() (docs/torch.md, "shmtensor's DataLoader iterator").

It is torch's _MultiProcessingDataLoaderIter with the main process's path per batch made
cheaper, and everything else torch's own: the workers run torch's _worker_loop (seeding of
random, torch and NumPy, get_worker_info, worker_init_fn, the fetcher, IterableDataset's end,
ExceptionWrapper with the worker id), and starting, resuming (persistent_workers), pinning,
timeouts, dead workers and shutdown are torch's code. Spawn and forkserver workers get the
dataset's NumPy arrays as one shared copy for all of them (one_copy_per_array), where each
would unpickle its own. What differs, per batch: no record_function scope around __next__
unless a profiler is enabled (torch opens one for every batch: ~6 us here, and on torch 1.13
it allocates a tensor). The batches themselves come as tensor messages, not pickles, while
install() is active (shmtensor.multiprocessing.reductions; docs/torch.md).
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
_NEEDED = ("_next_data", "_reset")


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

    _warn_length = False  # set by _reset (which torch's __init__ calls)

    def _reset(self, loader, first_iter=False):
        self._warn_length = (self._dataset_kind != _Map
                             and loader._IterableDataset_len_called is not None)
        super()._reset(loader, first_iter)

    def __next__(self):
        if self._warn_length or _profiler_enabled():
            return super().__next__()  # torch's: the profiler's scope, IterableDataset's warning
        if self._sampler_iter is None:
            self._reset()  # as torch: a TypeError (an iterator used after it was exhausted)
        data = self._next_data()
        self._num_yielded += 1
        return data


_said = set()


def say_torch_iterator(reason: str) -> None:
    """Once per reason and process: a RuntimeWarning that torch's iterator is used, and why."""
    if reason in _said:
        return
    _said.add(reason)
    warnings.warn("shmtensor.torch: DataLoader workers use torch's own iterator: " + reason,
                  RuntimeWarning, stacklevel=4)
