"""NumPy arrays in shared memory.

Arrays made here are ordinary numpy.ndarray objects whose bytes lie in a shmtensor block
(shared memory of the current sharing strategy). Each one keeps its block alive through its
`.base` (a shmtensor.Tensor), and so does every slice or view of it, however deep. Any dtype
without Python objects works, including structured, string and non-native byte-order dtypes.

    import shmtensor.numpy as snp
    a = snp.zeros((1000, 1000), dtype="float32")   # in shared memory, no copy ever made
    b = snp.share(existing_array)                  # one copy into shared memory
    snp.is_shared(a[10:20, ::2])                   # True
"""
from __future__ import annotations

import operator
from typing import TYPE_CHECKING

import numpy as _np

from shmtensor import _C

if TYPE_CHECKING:
    from typing import Any, Literal

    import numpy.typing as _npt
    from typing_extensions import TypeAlias

    from shmtensor._C import Tensor, _ShapeLike

    _Order: TypeAlias = Literal["C", "F"]
    _OrderKACF: TypeAlias = Literal["K", "A", "C", "F"]

__all__ = ["empty", "zeros", "ones", "full", "empty_like", "zeros_like", "share", "is_shared"]


def _shape(shape):
    try:
        return (operator.index(shape),)
    except TypeError:
        return tuple(operator.index(n) for n in shape)


def empty(shape: _ShapeLike, dtype: _npt.DTypeLike = float,
          order: _Order = "C") -> _npt.NDArray[Any]:
    """numpy.empty in shared memory: an uninitialised ndarray."""
    return _allocate(shape, dtype, order, zero=False)


def _allocate(shape, dtype, order, zero):
    dtype = _np.dtype(dtype)
    if dtype.hasobject:
        raise TypeError(f"shmtensor.numpy: dtype {dtype} holds Python objects, which are "
                        "pointers into one process and cannot live in shared memory")
    if order not in ("C", "F"):
        raise ValueError(f"order must be 'C' or 'F', not {order!r}")
    shape = _shape(shape)
    nbytes = dtype.itemsize
    for n in shape:
        if n < 0:
            raise ValueError("negative dimensions are not allowed")
        nbytes *= n
    block = _C._empty((nbytes,), "uint8", True)
    if zero:
        _np.asarray(block).fill(0)
    return _np.ndarray(shape, dtype, buffer=block, order=order)


def zeros(shape: _ShapeLike, dtype: _npt.DTypeLike = float,
          order: _Order = "C") -> _npt.NDArray[Any]:
    """numpy.zeros in shared memory."""
    return _allocate(shape, dtype, order, zero=True)


def ones(shape: _ShapeLike, dtype: _npt.DTypeLike = float,
         order: _Order = "C") -> _npt.NDArray[Any]:
    """numpy.ones in shared memory."""
    return full(shape, 1, dtype, order)


def full(shape: _ShapeLike, fill_value: _npt.ArrayLike, dtype: _npt.DTypeLike = None,
         order: _Order = "C") -> _npt.NDArray[Any]:
    """numpy.full in shared memory; dtype None takes fill_value's, as NumPy does."""
    if dtype is None:
        dtype = _np.array(fill_value).dtype
    a = empty(shape, dtype, order)
    a[...] = fill_value
    return a


def _like(a, dtype, order, shape):
    a = _np.asanyarray(a)
    fortran = order == "F" or (order in ("K", "A") and a.flags.f_contiguous
                               and not a.flags.c_contiguous)
    return (a.shape if shape is None else shape, a.dtype if dtype is None else dtype,
            "F" if fortran else "C")


def empty_like(a: _npt.ArrayLike, dtype: _npt.DTypeLike = None, order: _OrderKACF = "K",
               shape: _ShapeLike | None = None) -> _npt.NDArray[Any]:
    """numpy.empty_like in shared memory (order 'K' and 'A' keep Fortran order)."""
    return _allocate(*_like(a, dtype, order, shape), zero=False)


def zeros_like(a: _npt.ArrayLike, dtype: _npt.DTypeLike = None, order: _OrderKACF = "K",
               shape: _ShapeLike | None = None) -> _npt.NDArray[Any]:
    """numpy.zeros_like in shared memory."""
    return _allocate(*_like(a, dtype, order, shape), zero=True)


def share(a: _npt.ArrayLike) -> _npt.NDArray[Any]:
    """`a` itself if its memory is already shared (is_shared(a)); otherwise a copy of it in
    shared memory (C order, or Fortran order if `a` is Fortran-contiguous), made once."""
    a = _np.asanyarray(a)
    if is_shared(a):
        return a
    out = empty_like(a)
    _np.copyto(out, a, casting="no")
    return out


def is_shared(a: object) -> bool:
    """Whether the array's memory lies in a shmtensor block that is in shared memory."""
    block = _C._block_of(a)
    return block is not None and block[0].is_shared()


def _block_of(a: object) -> tuple[Tensor, int] | None:
    """(block, byte_offset) or None, for shmtensor.multiprocessing's reducers.

    block is a 1-d uint8 shmtensor.Tensor over the whole storage that holds `a`'s bytes,
    found through `a`'s chain of .base objects (ndarrays and memoryviews ending at a Tensor);
    byte_offset is the offset of `a`'s first element (a.ctypes.data) in it. With `a`'s dtype,
    shape and strides, np.ndarray(a.shape, a.dtype, buffer=block, offset=byte_offset,
    strides=a.strides) views the same memory. None if the chain ends elsewhere, or `a`
    reaches outside the storage.
    """
    return _C._block_of(a)
