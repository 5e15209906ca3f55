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

__all__ = ["is_available", "device_count", "unavailable_reason", "synchronize"]


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
