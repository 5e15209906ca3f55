"""shmtensor: tensors and NumPy arrays in shared memory, shared between processes.

The C++ library's Tensor, strategies and errors, for Python (docs/python.md):

    import numpy as np, shmtensor
    t = shmtensor.from_numpy(np.arange(6.0).reshape(2, 3))   # one copy, into shared memory
    a = np.asarray(t)                                          # a writable view, no copy
    b = shmtensor.numpy.zeros((1024, 1024), dtype=np.float32) # an ndarray in shared memory
    c = shmtensor.zeros((1024,), device="cuda:0")              # device memory (docs/cuda.md)

shmtensor.multiprocessing is the drop-in for Python's multiprocessing.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Any

import numpy as _np

from shmtensor import _C
from shmtensor._C import (
    ConfigurationError,
    ConnectionClosed,
    CudaError,
    Error,
    NameExistsError,
    NameNotFoundError,
    OutOfMemoryError,
    ProtocolError,
    QueueClosed,
    SharedMemoryFullError,
    SystemCallError,
    Tensor,
    device,
    empty_cache,
    get_all_sharing_strategies,
    get_busy_poll,
    get_sharing_strategy,
    set_busy_poll,
    set_sharing_strategy,
)

if TYPE_CHECKING:
    import numpy.typing as _npt

    from shmtensor._C import _DeviceLike, _DTypeLike, _ShapeLike

__all__ = [
    "Tensor", "device", "from_numpy", "from_dlpack", "empty", "zeros", "ones", "full",
    "get_sharing_strategy", "set_sharing_strategy", "get_all_sharing_strategies", "empty_cache",
    "set_busy_poll", "get_busy_poll",
    "Error", "SharedMemoryFullError", "SystemCallError", "OutOfMemoryError", "ProtocolError",
    "ConfigurationError", "ConnectionClosed", "QueueClosed", "CudaError", "NameExistsError",
    "NameNotFoundError",
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


def empty(shape: _ShapeLike, dtype: _DTypeLike = "float32",
          device: _DeviceLike | None = None) -> Tensor:
    """An uninitialised Tensor (torch.empty's default dtype float32): in private memory on
    the CPU, which share_memory_() moves into shared memory; on a CUDA device (device="cuda:1",
    an int, a shmtensor.device), device memory that is shared from birth."""
    return _C._empty(shape, dtype, False, device)


def full(shape: _ShapeLike, fill_value: _npt.ArrayLike, dtype: _DTypeLike = "float32",
         device: _DeviceLike | None = None) -> Tensor:
    tensor = _C._empty(shape, dtype, False)
    if tensor.dtype == "bfloat16":
        raise TypeError("shmtensor.full: bfloat16 tensors cannot be filled from Python")
    _np.asarray(tensor)[...] = fill_value
    return tensor if device is None else tensor.to(device)


def zeros(shape: _ShapeLike, dtype: _DTypeLike = "float32",
          device: _DeviceLike | None = None) -> Tensor:
    return _C._zeros(shape, dtype, device)


def ones(shape: _ShapeLike, dtype: _DTypeLike = "float32",
         device: _DeviceLike | None = None) -> Tensor:
    return full(shape, 1, dtype, device)


_DLPACK_CUDA = 2
# The stream a CUDA producer orders its work before: the legacy default stream, on which
# shmtensor's own copies run.
_LEGACY_DEFAULT_STREAM = 1


def from_dlpack(x: Any, *, device: _DeviceLike | None = None,
                copy: bool | None = None) -> Tensor:
    """A Tensor over the memory of `x` without a copy: a torch tensor, a NumPy array, a
    shmtensor Tensor, anything with __dlpack__ (DLPack 1.0 asked for, 0.6 taken), or a
    DLPack capsule; on the CPU or a CUDA device. Writes are seen both ways, until
    share_memory_() (which sending the tensor does) moves the bytes into shared memory:
    then the producer's memory is given back to it (its deleter runs) and the Tensor
    keeps the shared copy.

    As the Python array API's from_dlpack: copy=True copies (into private memory, or the
    device arena), copy=False never copies (BufferError where a copy is needed), None
    copies only where needed: a read-only source (a Tensor cannot be read-only), or a
    `device` other than the source's. A shmtensor Tensor gives back a Tensor on its own
    storage. BufferError for what a Tensor cannot hold (another device type, a dtype it
    lacks, negative strides).
    """
    target = None if device is None else _C.device(device)
    if isinstance(x, _np.ndarray) and not x.flags.writeable:
        # NumPy 1.x refuses to export a read-only array (DLPack 0.6 cannot say so).
        if copy is False:
            raise BufferError("from_dlpack(copy=False) of a read-only array: a Tensor is "
                              "always writable; pass copy=None or True")
        x = _np.array(x)  # a writable copy, which the Tensor then views
        copy = None
    if _is_capsule(x):
        if device is not None or copy is not None:
            raise ValueError("from_dlpack of a capsule takes neither device nor copy")
        tensor, readonly = _C._from_dlpack(x)
        return tensor.clone() if readonly else tensor
    dl_device = x.__dlpack_device__()
    kwargs: dict[str, Any] = {}
    if dl_device[0] == _DLPACK_CUDA:
        kwargs["stream"] = _LEGACY_DEFAULT_STREAM
    try:
        capsule = x.__dlpack__(max_version=(1, 0), **kwargs)
    except TypeError:
        capsule = x.__dlpack__(**kwargs)  # a producer of DLPack 0.6 only
    tensor, readonly = _C._from_dlpack(capsule)
    del capsule
    copied = False
    if target is not None and target != tensor.device:
        if copy is False:
            raise BufferError(f"from_dlpack(copy=False): the source is on {tensor.device}, "
                              f"not {target}")
        tensor, copied = tensor.to(target), True
    if readonly and copy is False:
        raise BufferError("from_dlpack(copy=False) of a read-only DLPack tensor: a Tensor is "
                          "always writable; pass copy=None or True")
    if (readonly or copy) and not copied:
        tensor = tensor.clone()
    return tensor


def _is_capsule(x: object) -> bool:
    return type(x).__name__ == "PyCapsule" and not hasattr(x, "__dlpack__")


from shmtensor import cuda, numpy  # noqa: E402  (need the names above)
