"""CUDA in this process, as torch.cuda names it (docs/cuda.md).

The driver (libcuda.so.1) is loaded on first use; without it, is_available() is False and
unavailable_reason() says why. Devices are this process's CUDA ordinals (CUDA_VISIBLE_DEVICES
applies); a tensor sent to another process arrives on the device with the same UUID there.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

from shmtensor import _C

if TYPE_CHECKING:
    from shmtensor._C import _DeviceLike

__all__ = ["is_available", "device_count", "unavailable_reason", "synchronize", "complete_fences"]


def is_available() -> bool:
    """Whether CUDA can be used here: the driver loads, initialises and sees a device."""
    return _C._cuda_is_available()


def device_count() -> int:
    """The CUDA devices this process sees (0 when CUDA is not available)."""
    return _C._cuda_device_count()


def unavailable_reason() -> str:
    """Why is_available() is False ("" when it is True)."""
    return _C._cuda_unavailable_reason()


def synchronize(device: _DeviceLike | None = None) -> None:
    """Waits until the work this process queued on `device` (cuda:0 when None), kernels and
    copies on any stream, is complete."""
    _C._cuda_synchronize(device)


def complete_fences() -> None:
    """Waits until the device work this process queued before the CUDA tensors it sent is
    done, so that their receivers' waits end (docs/cuda.md, "Ordering"). Runs by itself at
    exit, and at the end of a multiprocessing child (which ends with os._exit)."""
    _C._cuda_complete_fences()


class _ChildExitHook:
    """Makes every process that imports shmtensor, and every child that multiprocessing
    starts from one, run complete_fences as a multiprocessing finalizer before it ends: a
    fork or forkserver child ends with os._exit, which runs no atexit handler. Such a child
    clears the finalizers it inherited and then runs the after-fork hooks, which register it
    again; a spawn child keeps what its import registered."""

    def __call__(self) -> None:
        import multiprocessing.util

        self._register(self)
        multiprocessing.util.register_after_fork(self, _ChildExitHook._register)

    @staticmethod
    def _register(_: object) -> None:
        import multiprocessing.util

        # Lowest priority: after the queues' feeder threads flushed what they send.
        multiprocessing.util.Finalize(None, complete_fences, exitpriority=-100)


_child_exit_hook = _ChildExitHook()
_child_exit_hook()
