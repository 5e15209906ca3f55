"""shmtensor.numpy: arrays allocated in shared memory, share(), is_shared(), _block_of(), and
the .base chain that keeps a block alive through any view."""
import gc
import weakref

import numpy as np
import pytest

import shmtensor
import shmtensor.numpy as snp
from helpers import run_in_child

ANY_DTYPES = [np.bool_, np.uint8, np.int16, np.uint16, np.int32, np.uint32, np.int64,
              np.uint64, np.float16, np.float32, np.float64, np.complex64, np.complex128,
              np.longdouble, ">i4", "<f8", "S5", "U3", "datetime64[ms]", "timedelta64[s]",
              [("x", "<i4"), ("y", "f8", (2,))], "V7"]


def tensor_at_end_of_base_chain(a):
    base = a
    while isinstance(base, (np.ndarray, memoryview)):
        base = base.base if isinstance(base, np.ndarray) else base.obj
    return base


@pytest.mark.parametrize("dtype", ANY_DTYPES, ids=str)
@pytest.mark.parametrize("shape", [(), 0, 5, (3, 4), (2, 0, 3)], ids=str)
def test_factories_any_dtype(dtype, shape):
    dtype = np.dtype(dtype)
    expected_shape = (shape,) if isinstance(shape, int) else shape
    for a in (snp.empty(shape, dtype), snp.zeros(shape, dtype)):
        assert type(a) is np.ndarray
        assert a.shape == expected_shape
        assert a.dtype == dtype
        assert a.flags.c_contiguous and a.flags.writeable
        assert snp.is_shared(a)
        assert isinstance(tensor_at_end_of_base_chain(a), shmtensor.Tensor)
    z = snp.zeros(shape, dtype)
    assert z.tobytes() == b"\0" * z.nbytes


def test_default_dtype_is_float64_like_numpy():
    assert snp.empty(3).dtype == np.float64
    assert snp.zeros((2, 2)).dtype == np.float64
    assert snp.ones(2).dtype == np.float64
    assert snp.full(2, 7).dtype == np.array(7).dtype  # fill_value's, as np.full
    assert snp.full(2, 1.5, np.float32).tolist() == [1.5, 1.5]
    assert snp.ones((2, 3), "i2").tolist() == [[1, 1, 1], [1, 1, 1]]
    assert snp.full(3, b"ab", "S2").tolist() == [b"ab"] * 3


def test_fortran_order():
    a = snp.zeros((3, 4), "f4", order="F")
    assert a.flags.f_contiguous and not a.flags.c_contiguous
    assert snp.is_shared(a) and snp.is_shared(a.T)
    like = snp.empty_like(a)
    assert like.flags.f_contiguous and snp.is_shared(like)
    assert snp.zeros_like(np.ones((2, 2), "i8")).tolist() == [[0, 0], [0, 0]]
    with pytest.raises(ValueError, match="order must be 'C' or 'F'"):
        snp.empty(3, order="K")


def test_bad_arguments():
    with pytest.raises(TypeError, match="holds Python objects"):
        snp.empty(3, object)
    with pytest.raises(TypeError, match="holds Python objects"):
        snp.zeros(2, [("a", "i4"), ("b", "O")])
    with pytest.raises(ValueError, match="negative dimensions"):
        snp.zeros((2, -1))
    with pytest.raises(TypeError):
        snp.zeros(2.5)


def test_base_chain_keeps_the_block_alive_through_any_view():
    a = snp.full((10, 10), 3.0)
    block = weakref.ref(tensor_at_end_of_base_chain(a))
    views = [a[2:8, ::3].T, a.reshape(100)[::-7], a.view(np.uint8)[::5],
             np.asarray(memoryview(a)), a[np.newaxis, 5], a.real, a[..., 1]]
    expected = [np.array(v) for v in views]
    del a
    gc.collect()
    assert block() is not None
    for v, e in zip(views, expected):
        assert snp.is_shared(v)
        np.testing.assert_array_equal(v, e)
    del v, views
    gc.collect()
    assert block() is None


def test_writes_through_fork_both_ways():
    a = snp.zeros(8, np.int32)
    view = a[::2]
    control = np.zeros(8, np.int32)  # not shared: the child's writes stay in the child

    def child():
        assert a.tolist() == [0, 0, 0, 0, 100, 0, 0, 0]  # the parent's write before fork
        view[:] = [1, 2, 3, 4]
        control[:] = 1

    a[4] = 100
    assert run_in_child(child) == 0
    assert a.tolist() == [1, 0, 2, 0, 3, 0, 4, 0]
    assert not control.any()


def test_share_copies_once_or_returns_the_array():
    plain = np.arange(12.0).reshape(3, 4)
    s = snp.share(plain)
    assert s is not plain and snp.is_shared(s) and not snp.is_shared(plain)
    np.testing.assert_array_equal(s, plain)
    assert not np.shares_memory(s, plain)
    assert snp.share(s) is s
    sub = s[1:, ::2]
    assert snp.share(sub) is sub  # a view of shared memory is shared already
    f = snp.share(np.asfortranarray(plain))
    assert f.flags.f_contiguous
    big_endian = np.arange(5, dtype=">u2")
    be = snp.share(big_endian)
    assert be.dtype == np.dtype(">u2") and be.tolist() == [0, 1, 2, 3, 4]
    strided = snp.share(plain[::-1, ::3])
    assert strided.flags.c_contiguous and strided.tolist() == [[8.0, 11.0], [4.0, 7.0], [0.0, 3.0]]
    assert snp.share([[1, 2], [3, 4]]).tolist() == [[1, 2], [3, 4]]
    record = np.array([(1, 2.0)], dtype=[("i", "i4"), ("f", "f8")])
    assert snp.share(record).tolist() == [(1, 2.0)]


def test_is_shared_of_other_arrays():
    assert not snp.is_shared(np.zeros(3))
    assert not snp.is_shared([1, 2])
    assert not snp.is_shared(np.asarray(shmtensor.zeros(3)))  # a private tensor's view
    t = shmtensor.from_numpy(np.arange(3))
    assert snp.is_shared(np.asarray(t)) and snp.is_shared(t.numpy())
    # A chain that leaves NumPy's own objects (as_strided wraps its source) is not followed.
    a = snp.zeros(4)
    assert not snp.is_shared(np.lib.stride_tricks.as_strided(a, (2,), (8,)))


def test_block_of_locates_the_bytes():
    a = snp.zeros((6, 5), np.float32)
    a[:] = np.arange(30).reshape(6, 5)
    for v in (a, a[2:, 1:4], a[::-2, ::-1], a.T, a[3, 2, ...], a[4:4]):
        block, offset = snp._block_of(v)
        assert block.dtype == np.uint8 and block.ndim == 1 and block.is_shared()
        assert block.nbytes == a.nbytes
        rebuilt = np.ndarray(v.shape, v.dtype, buffer=block, offset=offset, strides=v.strides)
        np.testing.assert_array_equal(rebuilt, v)
        if v.size:
            assert np.shares_memory(rebuilt, v)
    assert snp._block_of(a[1:])[1] == 20
    assert snp._block_of(np.zeros(3)) is None
    assert snp._block_of("not an array") is None
    t = shmtensor.from_numpy(np.arange(6, dtype=np.int64))
    block, offset = snp._block_of(t.numpy()[2:])
    assert offset == 16 and block.nbytes == 48


def test_empty_arrays():
    for a in (snp.empty(0), snp.zeros((3, 0)), snp.share(np.zeros((0, 2)))):
        assert a.size == 0 and snp.is_shared(a)
        block, offset = snp._block_of(a)
        assert offset == 0 and block.nbytes == 0
