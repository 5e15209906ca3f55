"""Arrays through shmtensor.multiprocessing with real processes (fork, spawn, forkserver),
on the native Queue and Pipe and on multiprocessing's own Queue (the ForkingPickler
reducers): every dtype and shape, views, non-contiguous arrays, write visibility both ways,
identity."""
import multiprocessing

import numpy as np
import pytest

import shmtensor
import shmtensor.multiprocessing as smp
import shmtensor.numpy as snp

METHODS = ["fork", "spawn", "forkserver"]

DTYPES = ["?", "i1", "u1", "i2", "u2", "i4", "u4", "i8", "u8", "f2", "f4", "f8", "g",
          "c8", "c16", "G", ">i4", "<f8", ">c16", "S5", "U3", "V6", "M8[ns]", "m8[s]",
          [("a", "i4"), ("b", "f8", (2,)), ("c", "S3")]]


def sample_arrays():
    """(name, array) pairs covering dtypes, shapes, views; big ones exceed the share
    threshold (64 KiB) so that they go through shared memory."""
    rng = np.random.default_rng(7)
    out = []
    for i, dt in enumerate(DTYPES):
        dt = np.dtype(dt)
        for n in (3, 70000 // dt.itemsize + 1):
            raw = rng.integers(0, 256, size=n * dt.itemsize, dtype=np.uint8)
            a = raw.view(dt) if dt.kind not in "Mm" else raw.view("i8")[: n // 2].view(dt)
            if dt.kind == "f" or dt.kind == "c":
                a = a.copy()
                a[np.isnan(a)] = 0
            out.append((f"{i}:{dt}-{n}", a))
    big = np.arange(200000, dtype=np.float64).reshape(400, 500)
    out += [
        ("0d", np.array(3.5)),
        ("empty", np.zeros((0, 4), np.int32)),
        ("3d", np.arange(24, dtype=np.int16).reshape(2, 3, 4)),
        ("transposed", big.T),
        ("fortran", np.asfortranarray(big)),
        ("strided", big[::3, 1::7]),
        ("negative", big[::-2, ::-1]),
        ("broadcast", np.broadcast_to(np.arange(500.0), (400, 500))),
        ("readonly", np.frombuffer(bytes(range(256)) * 512, dtype=np.uint8)),
        ("shared", snp.full((300, 100), 7, dtype=np.int64)),
        ("shared-view", snp.full((300, 100), 7, dtype=np.int64)[10:20, ::-3]),
        ("shared-small", snp.full(3, 1.5)),
        ("object", np.array([1, "x", None], dtype=object)),
    ]
    return out


def assert_same(name, a, b):
    assert type(b) is np.ndarray, name
    if a.nbytes >= smp.get_share_threshold():
        assert b.dtype == a.dtype, name
    else:  # NumPy's own pickling (protocol 4) turns non-native byte order native
        assert b.dtype in (a.dtype, a.dtype.newbyteorder("=")), name
    assert b.shape == a.shape, name
    if a.dtype.kind == "f" or a.dtype.kind == "c":
        np.testing.assert_array_equal(a, b, err_msg=name)
    elif b.dtype == a.dtype:
        assert a.tobytes() == b.tobytes(), name
    else:
        assert a.tolist() == b.tolist(), name
    assert b.flags.writeable == a.flags.writeable, name


def echo(inq, outq, n):
    for _ in range(n):
        outq.put(inq.get())


def make_queues(kind, ctx):
    if kind == "native":
        return ctx.Queue(), ctx.Queue()
    plain = multiprocessing.get_context(ctx.get_start_method())
    return plain.Queue(), plain.Queue()


@pytest.mark.parametrize("kind", ["native", "plain"])
@pytest.mark.parametrize("method", METHODS)
def test_round_trip_every_dtype_and_view(method, kind):
    ctx = smp.get_context(method)
    inq, outq = make_queues(kind, ctx)
    samples = sample_arrays()
    p = ctx.Process(target=echo, args=(inq, outq, 2))
    p.start()
    inq.put(samples)  # one message with everything
    inq.put(dict(samples))
    back = outq.get(timeout=60)
    back_dict = outq.get(timeout=60)
    p.join(60)
    assert p.exitcode == 0
    for (name, a), (name2, b) in zip(samples, back):
        assert name == name2
        if a.dtype.hasobject:
            assert list(a) == list(b)
            continue
        assert_same(name, a, b)
        assert_same(name, a, back_dict[name])


def pipe_echo(conn):
    while True:
        obj = conn.recv()
        if obj is None:
            return
        conn.send(obj)


@pytest.mark.parametrize("method", METHODS)
def test_pipe_round_trip(method):
    ctx = smp.get_context(method)
    a, b = ctx.Pipe()
    p = ctx.Process(target=pipe_echo, args=(b,))
    p.start()
    b.close()
    for name, arr in sample_arrays()[:12]:
        a.send(arr)
        assert_same(name, arr, a.recv())
    a.send(None)
    a.close()
    p.join(60)
    assert p.exitcode == 0


def writer(inq, outq):
    a = inq.get()
    a[0, :] = 1  # visible to the parent
    outq.put("written")
    assert inq.get() == "your turn"
    outq.put(float(a[1, 0]))  # the parent's write, seen here


@pytest.mark.parametrize("kind", ["native", "plain"])
@pytest.mark.parametrize("method", METHODS)
def test_writes_visible_both_ways(method, kind):
    ctx = smp.get_context(method)
    inq, outq = make_queues(kind, ctx)
    a = snp.zeros((2, 1000))
    p = ctx.Process(target=writer, args=(inq, outq))
    p.start()
    inq.put(a)
    assert outq.get(timeout=60) == "written"
    assert a[0].tolist() == [1.0] * 1000
    a[1, 0] = 5
    inq.put("your turn")
    assert outq.get(timeout=60) == 5.0
    p.join(60)
    assert p.exitcode == 0


def identity_child(inq, outq):
    x, y = inq.get()  # the same array twice in one message
    z = inq.get()  # and again in another message
    outq.put((x.ctypes.data == y.ctypes.data, x.ctypes.data == z.ctypes.data,
              snp.is_shared(z)))
    outq.put(z[5:])  # a view, sent back to its creator


@pytest.mark.parametrize("kind", ["native", "plain"])
@pytest.mark.parametrize("method", METHODS)
def test_identity(method, kind):
    ctx = smp.get_context(method)
    inq, outq = make_queues(kind, ctx)
    a = snp.zeros(100000)
    p = ctx.Process(target=identity_child, args=(inq, outq))
    p.start()
    inq.put((a, a))
    inq.put(a)
    assert outq.get(timeout=60) == (True, True, True)
    back = outq.get(timeout=60)
    assert back.ctypes.data == a[5:].ctypes.data  # the creator's own memory
    back[0] = 9
    assert a[5] == 9
    p.join(60)
    assert p.exitcode == 0


def test_unshared_array_is_copied_once_and_is_shared_on_arrival():
    ctx = smp.get_context("fork")
    q = ctx.Queue()
    a = np.arange(100000.0)
    q.put(a)
    b = q.get()
    assert snp.is_shared(b)
    assert not np.shares_memory(a, b)
    assert b.tolist() == a.tolist()


def test_small_arrays_stay_in_the_pickle_and_threshold_is_settable():
    q = smp.Queue()
    small = np.arange(10.0)
    q.put(small)
    assert not snp.is_shared(q.get())
    old = smp.get_share_threshold()
    assert old == 64 * 1024
    smp.set_share_threshold(0)
    try:
        q.put(small)
        got = q.get()
        assert snp.is_shared(got) and got.tolist() == small.tolist()
    finally:
        smp.set_share_threshold(old)
    with pytest.raises(ValueError) as info:  # a bad argument: a plain ValueError
        smp.set_share_threshold(-1)
    assert type(info.value) is ValueError
    assert str(info.value) == ("set_share_threshold(-1): the share threshold is a number of "
                               "bytes >= 0")
    assert smp.get_share_threshold() == old


def tensor_child(q, r):
    t = q.get()
    np.asarray(t)[0] = 42
    r.put(t)


@pytest.mark.parametrize("method", ["fork", "spawn"])
def test_shmtensor_tensor_travels_by_reference(method):
    ctx = smp.get_context(method)
    q, r = ctx.Queue(), ctx.Queue()
    t = shmtensor.from_numpy(np.arange(12, dtype=np.float32).reshape(3, 4))
    p = ctx.Process(target=tensor_child, args=(q, r))
    p.start()
    try:
        q.put(t)
        back = r.get(timeout=60)
        p.join(60)
    finally:
        # A put or get that failed leaves the child waiting in q.get(): end it, or the
        # interpreter's exit would wait for it (and the test would end at ctest's timeout).
        if p.is_alive():
            p.terminate()
            p.join(10)
    assert isinstance(back, shmtensor.Tensor)
    assert np.asarray(t)[0, 0] == 42
    assert np.asarray(back).tolist() == np.asarray(t).tolist()


def put_numbered(q, n):
    for i in range(n):
        q.put((i, snp.full(8, float(i))))
    q.close()


def test_busy_polling_setting_and_a_native_queue_while_polling():
    with pytest.raises(ValueError):
        shmtensor.set_busy_poll(-1e-6)
    with pytest.raises(ValueError):
        shmtensor.set_busy_poll(2.0)
    shmtensor.set_busy_poll(100e-6)
    try:
        assert shmtensor.get_busy_poll() == pytest.approx(100e-6)
        ctx = smp.get_context("fork")
        q = ctx.Queue()
        p = ctx.Process(target=put_numbered, args=(q, 500))
        p.start()
        for i in range(500):
            n, a = q.get()
            assert n == i and a[7] == float(i)
        p.join(60)
        assert p.exitcode == 0
    finally:
        shmtensor.set_busy_poll(0)
    assert shmtensor.get_busy_poll() == 0
