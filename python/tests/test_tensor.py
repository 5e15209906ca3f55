"""shmtensor.Tensor: NumPy round trips of every dtype and shape, the buffer protocol, the
array interface, DLPack, share_memory_, views, and writes seen through fork."""
import gc
import weakref

import numpy as np
import pytest

import shmtensor
from helpers import run_in_child

# (NumPy dtype, PEP 3118 format character)
DTYPES = [
    (np.bool_, "?"), (np.uint8, "B"), (np.int8, "b"), (np.int16, "h"), (np.int32, "i"),
    (np.int64, "q"), (np.float16, "e"), (np.float32, "f"), (np.float64, "d"),
    (np.complex64, "Zf"), (np.complex128, "Zd"),
]
SHAPES = [(), (0,), (7,), (3, 4), (2, 3, 4), (1, 0, 3), (2, 1, 1, 5)]


def sample(dtype, shape):
    rng = np.random.default_rng(sum(shape) + 7 * len(shape))
    n = int(np.prod(shape))
    if np.dtype(dtype).kind == "b":
        values = rng.integers(0, 2, n).astype(bool)
    elif np.dtype(dtype).kind in "iu":
        info = np.iinfo(dtype)
        values = rng.integers(info.min, info.max, n, dtype=np.int64, endpoint=True).astype(dtype)
    elif np.dtype(dtype).kind == "c":
        values = (rng.standard_normal(n) + 1j * rng.standard_normal(n)).astype(dtype)
    else:
        values = rng.standard_normal(n).astype(dtype)
    return values.reshape(shape)


@pytest.mark.parametrize("dtype,fmt", DTYPES, ids=[np.dtype(d).name for d, _ in DTYPES])
@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_round_trip_every_dtype_and_shape(dtype, fmt, shape):
    a = sample(dtype, shape)
    t = shmtensor.from_numpy(a)
    assert t.is_shared()
    assert t.shape == shape
    assert t.dtype == np.dtype(dtype)
    assert t.numel() == a.size
    assert t.nbytes == a.nbytes
    assert t.itemsize == a.itemsize
    assert t.ndim == len(shape)
    back = np.asarray(t)
    assert back.dtype == np.dtype(dtype)
    assert back.shape == shape
    np.testing.assert_array_equal(back, a)
    assert back.flags.writeable
    m = memoryview(t)
    assert m.format == fmt
    assert m.itemsize == np.dtype(dtype).itemsize
    assert m.shape == shape
    assert not m.readonly
    m.release()
    # One memory: a write through one view shows in another, and in the tensor's repr.
    if a.size:
        back.reshape(-1)[-1] = a.reshape(-1)[0]
        assert np.asarray(t).reshape(-1)[-1] == a.reshape(-1)[0]
        assert np.shares_memory(back, np.asarray(t))


def test_from_numpy_copies_once_and_does_not_alias():
    a = np.arange(10, dtype=np.int32)
    t = shmtensor.from_numpy(a)
    a[0] = 99
    assert np.asarray(t)[0] == 0
    assert not np.shares_memory(a, np.asarray(t))


@pytest.mark.parametrize("make", [
    lambda: np.arange(60.0).reshape(6, 10)[::2, ::-3],
    lambda: np.asfortranarray(np.arange(12).reshape(3, 4)),
    lambda: np.arange(12, dtype=">i4").reshape(3, 4),
    lambda: np.broadcast_to(np.arange(3.0), (4, 3)),
    lambda: [[1, 2], [3, 4]],
], ids=["strided", "fortran", "big_endian", "broadcast", "list"])
def test_from_numpy_of_any_layout(make):
    a = np.asarray(make())
    t = shmtensor.from_numpy(a)
    assert t.is_contiguous()
    assert t.dtype == a.dtype.newbyteorder("=")
    np.testing.assert_array_equal(np.asarray(t), a)


@pytest.mark.parametrize("dtype", [np.uint16, np.uint32, np.uint64, "U3", "S3", object,
                                   [("x", "i4")], "datetime64[s]"], ids=str)
def test_from_numpy_rejects_dtypes_without_a_tensor_type(dtype):
    with pytest.raises(TypeError, match="shmtensor.Tensor has no dtype for NumPy's"):
        shmtensor.from_numpy(np.zeros(3, dtype=dtype))


def test_views_export_their_strides():
    a = np.arange(24, dtype=np.int64).reshape(2, 3, 4)
    t = shmtensor.from_numpy(a)
    cases = [
        (t.permute(2, 0, 1), a.transpose(2, 0, 1)),
        (t.transpose(0, 2), a.swapaxes(0, 2)),
        (t.select(1, 2), a[:, 2]),
        (t.narrow(2, 1, 2), a[:, :, 1:3]),
        (t[1], a[1]),
        (t.view((6, 4)), a.reshape(6, 4)),
    ]
    for view, expected in cases:
        assert view.shape == expected.shape
        assert view.strides == expected.strides
        assert view.stride() == tuple(s // 8 for s in expected.strides)
        got = np.asarray(view)
        np.testing.assert_array_equal(got, expected)
        assert got.strides == expected.strides
        assert np.shares_memory(got, np.asarray(t))
    # A write through a strided view lands in the tensor.
    np.asarray(t.permute(2, 0, 1))[3, 1, 2] = -5
    assert np.asarray(t)[1, 2, 3] == -5


def test_buffer_contiguity_requests():
    t = shmtensor.from_numpy(np.arange(12.0).reshape(3, 4)).transpose(0, 1)
    assert not t.is_contiguous()
    with pytest.raises(BufferError, match="not C-contiguous"):
        np.frombuffer(t, np.float64)  # PyBUF_SIMPLE: no strides accepted
    m = memoryview(t)  # strided request: fine
    assert not m.c_contiguous and m.f_contiguous
    m.release()
    c = t.contiguous()
    assert c.is_contiguous()
    np.testing.assert_array_equal(np.frombuffer(c, np.float64), np.arange(12.0).reshape(3, 4).T.ravel())


def test_array_interface():
    a = np.arange(12.0).reshape(3, 4)
    t = shmtensor.from_numpy(a)
    iface = t.__array_interface__
    assert iface["shape"] == (3, 4)
    assert iface["typestr"] == "<f8"
    assert iface["strides"] is None
    assert iface["version"] == 3
    assert iface["data"] == (np.asarray(t).ctypes.data, False)

    class Holder:
        pass

    h = Holder()
    h.__array_interface__ = t.transpose(0, 1).__array_interface__
    assert h.__array_interface__["strides"] == (8, 32)
    got = np.asarray(h)
    np.testing.assert_array_equal(got, a.T)
    assert got.flags.writeable


def test_bfloat16_has_no_buffer_format():
    b = shmtensor.empty((2, 3), "bfloat16")
    assert b.dtype == "bfloat16"
    assert b.itemsize == 2
    with pytest.raises(BufferError, match="bfloat16 has no buffer format"):
        memoryview(b)
    with pytest.raises(TypeError, match="NumPy has no bfloat16"):
        np.asarray(b)
    capsule = b.__dlpack__()  # DLPack has bfloat16
    del capsule
    b.share_memory_()
    assert b.is_shared()


def test_dlpack_to_numpy_shares_memory():
    t = shmtensor.from_numpy(np.arange(6, dtype=np.int16).reshape(2, 3))
    assert t.__dlpack_device__() == (1, 0)
    d = np.from_dlpack(t.transpose(0, 1))
    np.testing.assert_array_equal(d, np.arange(6).reshape(2, 3).T)
    np.asarray(t)[0, 1] = 42
    assert d[1, 0] == 42
    with pytest.raises(BufferError, match="no boolean type"):
        shmtensor.from_numpy(np.ones(2, bool)).__dlpack__()
    with pytest.raises(BufferError, match="stream"):
        t.__dlpack__(stream=1)


def test_dlpack_capsule_pins_until_consumed_or_dropped():
    t = shmtensor.zeros(4, "float64")
    capsule = t.__dlpack__()
    with pytest.raises(BufferError, match="share_memory_"):
        t.share_memory_()
    del capsule  # never consumed: the capsule's destructor gives the export back
    assert t.share_memory_() is t
    u = shmtensor.zeros(4, "float64")
    d = np.from_dlpack(u)
    with pytest.raises(BufferError):
        u.share_memory_()
    del d
    gc.collect()
    u.share_memory_()
    assert u.is_shared()


def test_dlpack_to_torch_when_installed():
    torch = pytest.importorskip("torch")
    t = shmtensor.from_numpy(np.arange(12, dtype=np.float32).reshape(3, 4))
    x = torch.utils.dlpack.from_dlpack(t.narrow(1, 1, 2))
    assert x.tolist() == [[1.0, 2.0], [5.0, 6.0], [9.0, 10.0]]
    x[0, 0] = -1
    assert np.asarray(t)[0, 1] == -1
    bf = shmtensor.empty((2,), "bfloat16")
    assert torch.utils.dlpack.from_dlpack(bf).dtype == torch.bfloat16


def test_share_memory_moves_in_place_and_keeps_values():
    t = shmtensor.full((3, 5), 2.5, "float32")
    view = t.narrow(0, 1, 2)
    assert not t.is_shared() and not view.is_shared()
    assert t.share_memory_() is t
    assert t.is_shared() and view.is_shared()  # the same storage
    np.testing.assert_array_equal(np.asarray(view), np.full((2, 5), 2.5, np.float32))
    t.share_memory_()  # a no-op when shared, exports or not
    a = np.asarray(t)
    t.share_memory_()
    del a


def test_share_memory_refused_while_a_buffer_is_exported():
    t = shmtensor.ones(8, "int32")
    a = np.asarray(t)
    with pytest.raises(BufferError, match="share_memory_\\(\\) would move the bytes"):
        t.share_memory_()
    assert not t.is_shared()
    a[0] = 5
    del a
    t.share_memory_()
    assert np.asarray(t).tolist() == [5, 1, 1, 1, 1, 1, 1, 1]


def test_arrays_keep_the_tensor_alive():
    t = shmtensor.from_numpy(np.arange(100.0))
    ref = weakref.ref(t)
    a = np.asarray(t)[10:20:2]
    del t
    gc.collect()
    assert ref() is not None
    assert a.tolist() == [10.0, 12.0, 14.0, 16.0, 18.0]
    del a
    gc.collect()
    assert ref() is None


def test_writes_through_fork_are_seen_by_the_parent():
    shared = shmtensor.from_numpy(np.zeros((4, 4), np.int64))
    private = shmtensor.zeros((4, 4), "int64")  # the control: fork copies private memory

    def child():
        np.asarray(shared)[:] = np.arange(16).reshape(4, 4)
        np.asarray(private)[:] = 7

    assert run_in_child(child) == 0
    np.testing.assert_array_equal(np.asarray(shared), np.arange(16).reshape(4, 4))
    assert not np.asarray(private).any()


def test_tensor_factories_and_metadata():
    z = shmtensor.zeros((2, 3))
    assert z.dtype == np.float32 and not z.is_shared()
    assert z.size() == (2, 3) and z.size(-1) == 3 and z.dim() == 2 and len(z) == 2
    assert z.element_size() == 4 and z.storage_offset() == 0
    o = shmtensor.ones(4, np.int8)
    assert np.asarray(o).tolist() == [1, 1, 1, 1]
    f = shmtensor.full([2], 1 + 2j, "complex64")
    assert np.asarray(f).tolist() == [1 + 2j, 1 + 2j]
    assert repr(shmtensor.from_numpy(np.array([[1.0, 2.0], [3.0, 4.0]], np.float32))) == (
        "tensor([[1., 2.],\n        [3., 4.]], dtype=float32)")
    assert z[1].storage_offset() == 3
    with pytest.raises(TypeError, match="len\\(\\) of a 0-d tensor"):
        len(shmtensor.zeros(()))
    with pytest.raises(TypeError):
        shmtensor.Tensor()


def test_clone_is_private():
    t = shmtensor.from_numpy(np.arange(4))
    c = t.clone()
    assert t.is_shared() and not c.is_shared()
    np.asarray(c)[0] = 9
    assert np.asarray(t)[0] == 0
