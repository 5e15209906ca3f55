"""DLPack both ways (docs/python.md, "DLPack"): Tensor.__dlpack__ (0.6 and 1.0 capsules, the
array API's stream / max_version / dl_device / copy) and shmtensor.from_dlpack (zero-copy
import of NumPy arrays, torch tensors, shmtensor tensors and raw capsules), on the CPU and,
on the fake driver, CUDA; a foreign producer's capsules are made by hand
(dlpack_capsules.py) to count its deleter's calls.
"""
from cuda_env import D1, FAKE_ONLY, I1, REAL_DRIVER  # noqa: F401 (first: sets the driver)

import gc  # noqa: E402
import weakref  # noqa: E402

import numpy as np  # noqa: E402
import pytest  # noqa: E402

import shmtensor  # noqa: E402
import shmtensor.multiprocessing as smp  # noqa: E402
from dlpack_capsules import IS_COPIED, READ_ONLY, Producer, capsule_name, versioned_flags  # noqa: E402

KINT, KUINT, KFLOAT, KBFLOAT, KCOMPLEX, KBOOL = 0, 1, 2, 4, 5, 6


def host(t):
    return np.asarray(t.cpu())


def report(q, r):
    """Gets tensors and sends back what it saw: device, shape, values (a spawn child)."""
    items = q.get()
    r.put([(str(t.device), t.shape, t.is_shared(), host(t).tolist()) for t in items])


def sent_to_a_child(items, method="spawn"):
    ctx = smp.get_context(method)
    q, r = ctx.Queue(), ctx.Queue()
    p = ctx.Process(target=report, args=(q, r))
    p.start()
    q.put(items)
    seen = r.get(timeout=60)
    p.join(60)
    assert p.exitcode == 0
    return seen


# ---- NumPy -> shmtensor -----------------------------------------------------------------------


def test_numpy_array_is_viewed_with_its_strides_and_offset():
    base = np.arange(24, dtype=np.float32).reshape(4, 6)
    a = base[1:, 1:5:2]  # an offset and strides, not contiguous
    t = shmtensor.from_dlpack(a)
    assert t.shape == a.shape and t.strides == a.strides and t.dtype == a.dtype
    assert t.data_ptr() == a.ctypes.data and not t.is_shared() and not t.is_cuda
    np.testing.assert_array_equal(np.asarray(t), a)
    np.asarray(t)[0, 0] = -1  # our write, in NumPy's memory
    assert base[1, 1] == -1
    a[2, 1] = -2  # NumPy's write, in ours
    assert np.asarray(t)[2, 1] == -2


@pytest.mark.parametrize("dtype", ["uint8", "int8", "int16", "int32", "int64", "float16",
                                   "float32", "float64", "complex64", "complex128"])
def test_numpy_dtypes(dtype):
    a = (np.arange(10) - 3).astype(dtype).reshape(2, 5)
    t = shmtensor.from_dlpack(a)
    assert t.dtype == np.dtype(dtype)
    assert np.asarray(t).tobytes() == a.tobytes()


def test_the_producer_is_released_when_the_last_tensor_goes():
    a = np.arange(6.0)
    alive = weakref.ref(a)
    t = shmtensor.from_dlpack(a)
    view = t.narrow(0, 2, 2)
    del a, t
    gc.collect()
    assert alive() is not None  # the view holds the storage, which holds the array
    assert np.asarray(view).tolist() == [2.0, 3.0]
    del view
    gc.collect()
    assert alive() is None


def test_share_memory_moves_the_bytes_and_releases_the_producer():
    a = np.arange(12, dtype=np.int32).reshape(3, 4)
    alive = weakref.ref(a)
    t = shmtensor.from_dlpack(a)
    view = t.select(1, 2)
    del a
    assert t.share_memory_() is t and t.is_shared() and view.is_shared()
    gc.collect()
    assert alive() is None  # given back at the move, not at the end
    assert np.asarray(t).tolist() == np.arange(12).reshape(3, 4).tolist()
    assert np.asarray(view).tolist() == [2, 6, 10]


def test_a_numpy_import_sent_to_another_process_arrives_with_its_values():
    a = np.arange(20, dtype=np.float64).reshape(4, 5)
    t = shmtensor.from_dlpack(a[:, 1:4])
    seen = sent_to_a_child([t])
    assert seen == [("cpu", (4, 3), True, a[:, 1:4].tolist())]
    assert t.is_shared()  # sending shared it in place; the array is no longer aliased
    a[0, 1] = 100
    assert np.asarray(t)[0, 0] == 1.0


def test_read_only_array_is_copied_or_refused():
    a = np.arange(4.0)
    a.flags.writeable = False
    t = shmtensor.from_dlpack(a)  # a Tensor is writable: a copy
    assert np.asarray(t).tolist() == [0.0, 1.0, 2.0, 3.0]
    assert t.data_ptr() != a.ctypes.data
    np.asarray(t)[0] = 9
    assert a[0] == 0
    with pytest.raises(BufferError, match="read-only"):
        shmtensor.from_dlpack(a, copy=False)


def test_what_a_tensor_cannot_hold_is_a_buffer_error():
    with pytest.raises(BufferError, match="negative strides"):
        shmtensor.from_dlpack(np.arange(5.0)[::-1])
    with pytest.raises(BufferError, match="type code 1 of 16 bits has no shmtensor dtype"):
        shmtensor.from_dlpack(np.arange(3, dtype=np.uint16))


@FAKE_ONLY
def test_copy_and_device_arguments():
    a = np.arange(6.0)
    c = shmtensor.from_dlpack(a, copy=True)
    assert c.data_ptr() != a.ctypes.data and np.asarray(c).tolist() == a.tolist()
    z = shmtensor.from_dlpack(a, copy=False)
    assert z.data_ptr() == a.ctypes.data
    on_device = shmtensor.from_dlpack(a, device="cuda:1")
    assert on_device.device == shmtensor.device("cuda:1")
    assert host(on_device).tolist() == a.tolist()
    with pytest.raises(BufferError, match="copy=False"):
        shmtensor.from_dlpack(a, device="cuda:0", copy=False)
    assert shmtensor.from_dlpack(a, device="cpu").data_ptr() == a.ctypes.data


# ---- capsules ---------------------------------------------------------------------------------


def test_a_raw_capsule_is_taken_once():
    a = np.arange(3, dtype=np.int64)
    capsule = a.__dlpack__()
    t = shmtensor.from_dlpack(capsule)
    assert np.asarray(t).tolist() == [0, 1, 2] and t.data_ptr() == a.ctypes.data
    assert capsule_name(capsule) == "used_dltensor"
    with pytest.raises(BufferError, match="consumed already"):
        shmtensor.from_dlpack(capsule)
    with pytest.raises(ValueError, match="neither device nor copy"):
        shmtensor.from_dlpack(np.arange(2.0).__dlpack__(), copy=True)
    with pytest.raises(TypeError, match="not a DLPack capsule: a capsule named 'shmtensor.Storage'"):
        shmtensor.from_dlpack(shmtensor._C._storage_capsule(shmtensor.zeros(2)))


def test_foreign_deleter_runs_exactly_once():
    source = shmtensor.from_numpy(np.arange(8, dtype=np.int16))  # owns the memory
    for versioned in (False, True):
        p = Producer(source.data_ptr() + 2, (3,), (2,), KINT, 16, versioned=versioned,
                     keep=source)
        t = shmtensor.from_dlpack(p.capsule())
        assert np.asarray(t).tolist() == [1, 3, 5] and p.calls == 0
        view = t[1]
        del t
        gc.collect()
        assert p.calls == 0
        del view
        gc.collect()
        assert p.calls == 1
        # Moved by share_memory_: released then, once.
        p = Producer(source.data_ptr(), (4,), None, KINT, 16, versioned=versioned, keep=source)
        t = shmtensor.from_dlpack(p.capsule())
        t.share_memory_()
        assert p.calls == 1
        np.asarray(t)[0] = 99  # the shared copy, not the producer's memory
        assert np.asarray(source)[0] == 0
        del t
        gc.collect()
        assert p.calls == 1


def test_versioned_capsule_flags_and_versions():
    source = shmtensor.from_numpy(np.arange(4, dtype=np.float32))
    ro = Producer(source.data_ptr(), (4,), (1,), KFLOAT, 32, versioned=True, flags=READ_ONLY,
                  keep=source)
    t = shmtensor.from_dlpack(ro.capsule())
    assert t.data_ptr() != source.data_ptr() and np.asarray(t).tolist() == [0, 1, 2, 3]
    assert ro.calls == 1  # the copy is made, the producer's memory given back
    ro = Producer(source.data_ptr(), (4,), (1,), KFLOAT, 32, versioned=True, flags=READ_ONLY,
                  keep=source)
    capsule = ro.capsule()
    with pytest.raises(ValueError, match="neither device nor copy"):
        shmtensor.from_dlpack(capsule, copy=False)
    tensor, readonly = shmtensor._C._from_dlpack(capsule)
    assert readonly and tensor.data_ptr() == source.data_ptr()
    del tensor
    gc.collect()
    assert ro.calls == 1
    future = Producer(source.data_ptr(), (4,), (1,), KFLOAT, 32, versioned=True, version=(2, 0))
    capsule = future.capsule()
    with pytest.raises(BufferError, match="DLPack 2.0 capsule: shmtensor reads DLPack 1.x"):
        shmtensor.from_dlpack(capsule)
    assert capsule_name(capsule) == "dltensor_versioned" and future.calls == 0  # not taken
    bool_bytes = shmtensor.from_numpy(np.array([True, False, True]))
    b = Producer(bool_bytes.data_ptr(), (3,), None, KBOOL, 8, versioned=True, keep=bool_bytes)
    assert np.asarray(shmtensor.from_dlpack(b.capsule())).tolist() == [True, False, True]
    bf = Producer(source.data_ptr() + 2, (2,), (2,), KBFLOAT, 16, versioned=True, keep=source)
    assert shmtensor.from_dlpack(bf.capsule()).dtype == "bfloat16"
    gc.collect()


@FAKE_ONLY
def test_a_refused_capsule_is_left_to_its_producer():
    source = shmtensor.from_numpy(np.arange(4, dtype=np.float32))
    cases = [
        (dict(code=KFLOAT, bits=32, device=(4, 0)), BufferError, r"device \(4, 0\)"),
        (dict(code=KFLOAT, bits=32, byte_offset=1), BufferError, "not aligned for float32"),
        (dict(code=KUINT, bits=32), BufferError, "type code 1 of 32 bits"),
        (dict(code=KFLOAT, bits=32, device=(2, 7)), ValueError, "cuda:7: this process sees 2"),
    ]
    for kwargs, error, message in cases:
        p = Producer(source.data_ptr(), (2,), None, keep=source, **kwargs)
        capsule = p.capsule()
        with pytest.raises(error, match=message):
            shmtensor.from_dlpack(capsule)
        assert capsule_name(capsule) == "dltensor" and p.calls == 0


# ---- shmtensor -> consumers -------------------------------------------------------------------


def test_export_versions_and_keywords():
    t = shmtensor.from_numpy(np.arange(6, dtype=np.int32).reshape(2, 3))
    assert capsule_name(t.__dlpack__()) == "dltensor"
    assert capsule_name(t.__dlpack__(max_version=(0, 8))) == "dltensor"
    v = t.__dlpack__(max_version=(1, 3), dl_device=(1, 0), copy=False)
    assert capsule_name(v) == "dltensor_versioned" and versioned_flags(v) == 0
    back = shmtensor.from_dlpack(v)
    assert back.data_ptr() == t.data_ptr() and back.is_shared()  # our own: the same storage
    copied = t.__dlpack__(max_version=(1, 0), copy=True)
    assert versioned_flags(copied) == IS_COPIED
    c = shmtensor.from_dlpack(copied)
    assert c.data_ptr() != t.data_ptr() and np.asarray(c).tolist() == [[0, 1, 2], [3, 4, 5]]
    b = shmtensor.from_numpy(np.array([True, False]))
    with pytest.raises(BufferError, match="no boolean type"):
        b.__dlpack__()
    assert np.asarray(shmtensor.from_dlpack(b.__dlpack__(max_version=(1, 0)))).tolist() == [
        True, False]
    with pytest.raises(BufferError, match="stream must be None"):
        t.__dlpack__(stream=1)
    with pytest.raises(BufferError, match="cannot export to DLPack device \\(3, 0\\)"):
        t.__dlpack__(dl_device=(3, 0))
    with pytest.raises(BufferError, match="cannot be exported to cuda:0 without a copy"):
        t.__dlpack__(dl_device=(2, 0), copy=False)
    on_device = shmtensor.from_dlpack(t.__dlpack__(max_version=(1, 0), dl_device=(2, 0)))
    assert on_device.device == shmtensor.device("cuda:0")
    assert host(on_device).tolist() == [[0, 1, 2], [3, 4, 5]]
    with pytest.raises(TypeError, match="copy is True, False or None"):
        t.__dlpack__(copy=1)


def test_numpy_consumes_our_tensors():
    t = shmtensor.from_numpy(np.arange(6.0).reshape(2, 3))
    d = np.from_dlpack(t.transpose(0, 1))
    np.testing.assert_array_equal(d, np.arange(6.0).reshape(2, 3).T)
    np.asarray(t)[1, 2] = -5
    assert d[2, 1] == -5


# ---- torch, both ways -------------------------------------------------------------------------


def test_torch_tensor_is_imported_without_a_copy():
    torch = pytest.importorskip("torch")
    x = torch.arange(24, dtype=torch.float64).reshape(4, 6)[1:, ::2]
    t = shmtensor.from_dlpack(x)
    assert t.shape == tuple(x.shape) and t.stride() == x.stride()
    assert t.data_ptr() == x.data_ptr()
    x[0, 0] = -1
    assert np.asarray(t)[0, 0] == -1
    np.asarray(t)[2, 2] = -2
    assert x[2, 2].item() == -2
    for dtype in (torch.bfloat16, torch.complex64, torch.int8, torch.float16):
        y = torch.arange(6).to(dtype).reshape(2, 3)
        u = shmtensor.from_dlpack(y)
        assert u.data_ptr() == y.data_ptr()
        assert torch.equal(torch.from_dlpack(u), y)  # and back, no copy either
        assert torch.from_dlpack(u).data_ptr() == y.data_ptr()


def test_a_torch_import_sent_to_another_process_arrives_with_its_values():
    torch = pytest.importorskip("torch")
    x = torch.arange(12, dtype=torch.int32).reshape(3, 4)
    t = shmtensor.from_dlpack(x)
    seen = sent_to_a_child([t, t.narrow(1, 1, 2)])
    assert seen == [("cpu", (3, 4), True, np.arange(12).reshape(3, 4).tolist()),
                    ("cpu", (3, 2), True, np.arange(12).reshape(3, 4)[:, 1:3].tolist())]
    x[0, 0] = 100  # sending moved t's bytes into shared memory: x is torch's alone now
    assert np.asarray(t)[0, 0] == 0 and t.data_ptr() != x.data_ptr()


class Spy:
    """Passes __dlpack__ through to a Tensor, recording the keywords the consumer used."""

    def __init__(self, t):
        self.t, self.calls = t, []

    def __dlpack_device__(self):
        return self.t.__dlpack_device__()

    def __dlpack__(self, **kwargs):
        self.calls.append(sorted(kwargs))
        return self.t.__dlpack__(**kwargs)


def test_torch_consumes_our_tensors_with_the_version_it_asks_for():
    torch = pytest.importorskip("torch")
    t = shmtensor.from_numpy(np.arange(12, dtype=np.float32).reshape(3, 4))
    spy = Spy(t.narrow(1, 1, 2))
    x = torch.from_dlpack(spy)
    assert x.tolist() == [[1.0, 2.0], [5.0, 6.0], [9.0, 10.0]]
    x[0, 0] = -1
    assert np.asarray(t)[0, 1] == -1
    b = shmtensor.from_numpy(np.array([True, False, True]))
    # torch.from_dlpack asks for DLPack 1.0 (max_version) from torch 2.9 on (pytorch#145000);
    # before, it calls __dlpack__() bare (Debian 13's torch 2.6 does, as 1.13 does).
    if tuple(int(v) for v in torch.__version__.split("+")[0].split(".")[:2]) >= (2, 9):
        assert spy.calls == [["max_version"]]  # DLPack 1.0 asked for, and given
        assert torch.from_dlpack(b).tolist() == [True, False, True]  # kDLBool, in 1.0 only
    else:
        assert spy.calls == [[]]  # DLPack 0.6
        with pytest.raises(BufferError, match="no boolean type"):
            torch.from_dlpack(b)


# ---- CUDA (the fake driver) -------------------------------------------------------------------


def test_cuda_tensor_exports_its_device_and_honours_the_stream():
    t = shmtensor.from_numpy(np.arange(6, dtype=np.float32)).cuda(I1)
    assert t.__dlpack_device__() == (2, I1)
    for stream in (None, 1, 2, -1, 0x7F0000001000):
        back = shmtensor.from_dlpack(t.__dlpack__(stream=stream, max_version=(1, 0)))
        assert back.data_ptr() == t.data_ptr() and back.device == t.device  # our own storage
    with pytest.raises(ValueError, match="stream 0 is ambiguous"):
        t.__dlpack__(stream=0)
    with pytest.raises(ValueError, match="stream -2 is not a stream"):
        t.__dlpack__(stream=-2)
    with pytest.raises(TypeError, match="stream is an int or None"):
        t.__dlpack__(stream="1")
    cpu = shmtensor.from_dlpack(t.__dlpack__(stream=1, dl_device=(1, 0)))
    assert not cpu.is_cuda and np.asarray(cpu).tolist() == [0, 1, 2, 3, 4, 5]
    with pytest.raises(BufferError, match=f"{D1} tensor cannot be exported to cpu"):
        t.__dlpack__(stream=1, dl_device=(1, 0), copy=False)
    other = shmtensor.from_dlpack(t.__dlpack__(stream=1, dl_device=(2, 0)))
    assert other.device == shmtensor.device("cuda:0") and host(other).tolist() == host(t).tolist()


def test_foreign_cuda_memory_is_wrapped_written_both_ways_and_moved_on_share():
    source = shmtensor.from_numpy(np.arange(12, dtype=np.float32).reshape(3, 4)).cuda(I1)
    p = Producer(source.data_ptr() + 4, (3, 2), (4, 1), KFLOAT, 32, device=(2, I1),
                 versioned=True, keep=source)
    t = shmtensor.from_dlpack(p.capsule())
    assert t.device == shmtensor.device(D1) and t.is_cuda and not t.is_shared()
    assert t.data_ptr() == source.data_ptr() + 4
    assert host(t).tolist() == [[1, 2], [5, 6], [9, 10]]
    t.select(0, 0).fill_(-1)  # our write, in the producer's device memory
    assert host(source)[0].tolist() == [0, -1, -1, 3]
    source.select(0, 2).fill_(7)  # the producer's, in ours
    assert host(t)[2].tolist() == [7, 7]
    seen = sent_to_a_child([t])  # sharing moves it into the device arena, once
    assert seen == [(D1, (3, 2), True, [[-1, -1], [5, 6], [7, 7]])]
    assert t.is_shared() and p.calls == 1
    source.fill_(0)
    assert host(t).tolist() == [[-1, -1], [5, 6], [7, 7]]
    del t
    gc.collect()
    assert p.calls == 1


def test_foreign_cuda_memory_released_when_the_last_tensor_goes():
    source = shmtensor.zeros((4,), "int64", device="cuda:0")
    p = Producer(source.data_ptr(), (4,), None, KINT, 64, device=(2, 0), keep=source)
    t = shmtensor.from_dlpack(p.capsule())
    assert host(t).tolist() == [0] * 4 and p.calls == 0
    del t
    gc.collect()
    assert p.calls == 1
