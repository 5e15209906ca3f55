"""shmtensor: tensors and NumPy arrays in shared memory, shared between processes.

The C++ library's Tensor, strategies and errors, for Python (docs/python.md):

    import numpy as np, shmtensor
    t = shmtensor.from_numpy(np.arange(6.0).reshape(2, 3))   # one copy, into shared memory
    a = np.asarray(t)                                          # a writable view, no copy
    b = shmtensor.numpy.zeros((1024, 1024), dtype=np.float32) # an ndarray in shared memory

shmtensor.multiprocessing is the drop-in for Python's multiprocessing.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as _np

from shmtensor import _C
from shmtensor._C import (
    ConfigurationError,
    ConnectionClosed,
    Error,
    OutOfMemoryError,
    ProtocolError,
    QueueClosed,
    SharedMemoryFullError,
    SystemCallError,
    Tensor,
    empty_cache,
    get_all_sharing_strategies,
    get_busy_poll,
    get_sharing_strategy,
    set_busy_poll,
    set_sharing_strategy,
)

if TYPE_CHECKING:
    import numpy.typing as _npt

    from shmtensor._C import _DTypeLike, _ShapeLike

__all__ = [
    "Tensor", "from_numpy", "empty", "zeros", "ones", "full",
    "get_sharing_strategy", "set_sharing_strategy", "get_all_sharing_strategies", "empty_cache",
    "set_busy_poll", "get_busy_poll",
    "Error", "SharedMemoryFullError", "SystemCallError", "OutOfMemoryError", "ProtocolError",
    "ConfigurationError", "ConnectionClosed", "QueueClosed",
]


def from_numpy(array: _npt.ArrayLike) -> Tensor:
    """A shared Tensor holding a copy of `array` (any array-like), the one copy it costs.

    Unlike torch.from_numpy, the Tensor does not alias the array: its bytes are in shared
    memory from the start. Non-native byte order is converted; dtypes a Tensor has no type
    for (uint16 and wider unsigned, strings, objects, structured) raise TypeError; use
    shmtensor.numpy.share for those.
    """
    array = _np.asanyarray(array)
    tensor = _C._empty(array.shape, array.dtype.newbyteorder("="), True)
    _np.copyto(_np.asarray(tensor), array, casting="unsafe")
    return tensor


def empty(shape: _ShapeLike, dtype: _DTypeLike = "float32") -> Tensor:
    """An uninitialised Tensor in private memory (torch.empty's default dtype float32);
    share_memory_() moves it into shared memory."""
    return _C._empty(shape, dtype, False)


def full(shape: _ShapeLike, fill_value: _npt.ArrayLike, dtype: _DTypeLike = "float32") -> Tensor:
    tensor = _C._empty(shape, dtype, False)
    if tensor.dtype == "bfloat16":
        raise TypeError("shmtensor.full: bfloat16 tensors cannot be filled from Python")
    _np.asarray(tensor)[...] = fill_value
    return tensor


def zeros(shape: _ShapeLike, dtype: _DTypeLike = "float32") -> Tensor:
    return full(shape, 0, dtype)


def ones(shape: _ShapeLike, dtype: _DTypeLike = "float32") -> Tensor:
    return full(shape, 1, dtype)


from shmtensor import numpy  # noqa: E402  (needs the names above)
