"""CUDA tensors from Python, on the fake driver (docs/cuda.md, "Testing without a GPU"): the
device API, CudaError, and CUDA tensors through shmtensor.multiprocessing between spawn and
forkserver processes, two devices; a forked child is refused with CudaError.

The driver is chosen at its first use in the process, so the environment is set before
anything here touches CUDA; spawned and forkserver children inherit it.
"""
import os

from cuda_env import D1, FAKE_ONLY, I1, REAL_DRIVER  # noqa: F401 (first: sets the driver)

import multiprocessing  # noqa: E402
import pickle  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402

import numpy as np  # noqa: E402
import pytest  # noqa: E402

import shmtensor  # noqa: E402
import shmtensor.multiprocessing as smp  # noqa: E402
from helpers import run_in_child  # noqa: E402

METHODS = ["spawn", "forkserver"]


def host(t):
    """A CUDA tensor's values as a NumPy array (one copy to the host)."""
    return np.asarray(t.cpu())


# ---- the device API -------------------------------------------------------------------------


def test_device_names_as_torch_names_them():
    cpu = shmtensor.device("cpu")
    assert (cpu.type, cpu.index, str(cpu), repr(cpu)) == ("cpu", None, "cpu", "device(type='cpu')")
    one = shmtensor.device("cuda:1")
    assert (one.type, one.index, str(one)) == ("cuda", 1, "cuda:1")
    assert repr(one) == "device(type='cuda', index=1)"
    assert one == shmtensor.device("cuda", 1) == shmtensor.device(1) == shmtensor.device(one)
    assert shmtensor.device("cuda") == shmtensor.device("cuda:0")  # no current device: cuda:0
    assert one != shmtensor.device(0) and one != cpu and one != "cuda:1"
    assert len({one, shmtensor.device(1), cpu, shmtensor.device("cpu")}) == 2
    assert pickle.loads(pickle.dumps(one)) == one
    for bad in ["gpu", "cuda:", "cuda:-1", "cuda:x", "cuda:1:2", "CPU"]:
        with pytest.raises(ValueError, match="not a device"):
            shmtensor.device(bad)
    with pytest.raises(ValueError, match=">= 0"):
        shmtensor.device(-1)
    with pytest.raises(TypeError, match="not a bool"):
        shmtensor.device(True)
    with pytest.raises(TypeError, match="not float"):
        shmtensor.device(1.0)
    with pytest.raises(ValueError, match="no device index"):
        shmtensor.device("cpu", 0)


def test_torch_device_is_read_by_its_attributes():
    class TorchLikeDevice:  # torch.device's attributes, without importing torch
        type, index = "cuda", 1

    assert shmtensor.device(TorchLikeDevice()) == shmtensor.device("cuda:1")
    TorchLikeDevice.type = "mps"
    with pytest.raises(ValueError, match="no device of type 'mps'"):
        shmtensor.device(TorchLikeDevice())


@FAKE_ONLY
def test_cuda_module_sees_the_fake_devices():
    assert shmtensor.cuda.is_available()
    assert shmtensor.cuda.device_count() == 2
    assert shmtensor.cuda.unavailable_reason() == ""
    shmtensor.cuda.synchronize()
    shmtensor.cuda.synchronize("cuda:1")
    with pytest.raises(ValueError, match="not a CUDA device"):
        shmtensor.cuda.synchronize("cpu")
    assert issubclass(shmtensor.CudaError, shmtensor.Error)
    assert not issubclass(shmtensor.CudaError, (OSError, ValueError))


@pytest.mark.parametrize("device", ["cuda:1", 1, shmtensor.device("cuda", 1)])
@FAKE_ONLY
def test_factories_on_a_device(device):
    e = shmtensor.empty((2, 3), "int32", device=device)
    z = shmtensor.zeros((2, 3), "bfloat16", device=device)
    o = shmtensor.ones(4, "bool", device=device)
    f = shmtensor.full((2,), 1 + 2j, "complex64", device=device)
    for t in (e, z, o, f):
        assert t.device == shmtensor.device("cuda:1")
        assert t.is_cuda and t.is_shared()  # device memory is shared from birth
    assert z.to(device="cpu", dtype="float32").numpy().tolist() == [[0.0] * 3] * 2
    assert host(o).tolist() == [True] * 4
    assert host(f).tolist() == [1 + 2j, 1 + 2j]
    assert repr(f) == "tensor([1.+2.j, 1.+2.j], device='cuda:1', dtype=complex64)"
    cpu = shmtensor.zeros(3)
    assert cpu.device == shmtensor.device("cpu") and not cpu.is_cuda
    assert repr(cpu) == "tensor([0., 0., 0.], dtype=float32)"


@FAKE_ONLY
def test_copies_between_devices_keep_values_and_views():
    a = np.arange(24, dtype=np.float64).reshape(4, 6)
    t = shmtensor.from_numpy(a)
    c0 = t.cuda()
    assert c0.device == shmtensor.device("cuda:0")
    c1 = c0.cuda(1)
    assert c1.device == shmtensor.device("cuda:1")
    np.testing.assert_array_equal(host(c1), a)
    view = c1.transpose(0, 1).narrow(0, 1, 3)  # a strided view on the device
    assert view.is_cuda and not view.is_contiguous()
    np.testing.assert_array_equal(host(view), a.T[1:4])
    assert view.to("cuda:0").device == shmtensor.device("cuda:0")
    np.testing.assert_array_equal(host(view.to("cuda:0")), a.T[1:4])
    assert c1.to(1).data_ptr() == c1.data_ptr()  # already there: no copy
    assert c1.cuda("cuda:1").data_ptr() == c1.data_ptr()
    assert t.cpu().data_ptr() == t.data_ptr()
    np.testing.assert_array_equal(host(c1.to(dtype="int16")), a.astype(np.int16))
    # Writes on a device, element ops through host copies.
    assert view.fill_(-1) is view  # columns 1 to 3 of c1
    want = a.copy()
    want[:, 1:4] = -1
    np.testing.assert_array_equal(host(c1), want)
    c1.select(0, 0).copy_(shmtensor.from_numpy(np.full(6, 9.0)))
    assert host(c1)[0].tolist() == [9.0] * 6
    with pytest.raises(ValueError, match="not a CUDA device"):
        t.cuda("cpu")


def test_no_host_view_of_device_memory():
    t = shmtensor.zeros((2, 2), device="cuda")
    with pytest.raises(BufferError, match="device memory: call .cpu"):
        memoryview(t)
    with pytest.raises(ValueError, match="device memory: call .cpu"):
        t.__array_interface__
    with pytest.raises(TypeError, match=r"numpy\(\) of a cuda:0 tensor.*\.cpu\(\)"):
        t.numpy()
    with pytest.raises(ValueError, match="device memory: call .cpu"):
        np.asarray(t)  # NumPy reports __array_interface__'s error


@FAKE_ONLY
def test_a_device_this_process_does_not_see():
    with pytest.raises(ValueError, match="cuda:5: this process sees 2 CUDA device"):
        shmtensor.zeros(3, device="cuda:5")
    with pytest.raises(ValueError, match="cuda:2: this process sees 2"):
        shmtensor.zeros(3).cuda(2)


def test_without_a_driver_cuda_is_a_cuda_error():
    code = (
        "import shmtensor\n"
        "assert not shmtensor.cuda.is_available()\n"
        "assert shmtensor.cuda.device_count() == 0\n"
        "reason = shmtensor.cuda.unavailable_reason()\n"
        "assert '/nonexistent/libcuda.so.1' in reason, reason\n"
        "try:\n"
        "    shmtensor.zeros(3, device='cuda')\n"
        "except shmtensor.CudaError as e:\n"
        "    assert '/nonexistent/libcuda.so.1' in str(e) and e.result == 0, (str(e), e.result)\n"
        "else:\n"
        "    raise AssertionError('no CudaError')\n"
        "assert shmtensor.zeros(3).numpy().tolist() == [0.0] * 3\n"
        "print('ok')\n")
    env = {k: v for k, v in os.environ.items() if k != "SHMTENSOR_CUDA_DRIVER"}
    env["SHMTENSOR_CUDA_LIBRARY"] = "/nonexistent/libcuda.so.1"
    r = subprocess.run([sys.executable, "-c", code], env=env, stdout=subprocess.PIPE,
                       stderr=subprocess.STDOUT, text=True, timeout=120)
    assert (r.returncode, r.stdout) == (0, "ok\n"), r.stdout


# ---- through shmtensor.multiprocessing -----------------------------------------------------


def echo_and_write(inq, outq):
    """Gets tensors, reports what it saw, writes 7 into each, and sends them back."""
    items = inq.get()
    outq.put([(str(t.device), t.shape, host(t).tolist()) for t in items])
    for t in items:
        if t.numel():
            t.fill_(7)
    outq.put(items)


def sample_tensors():
    a = shmtensor.from_numpy(np.arange(12, dtype=np.float32).reshape(3, 4)).cuda(0)
    b = shmtensor.from_numpy(np.arange(6, dtype=np.int64)).cuda(I1)
    return [a, a.transpose(0, 1).narrow(0, 1, 2), b, shmtensor.empty((0, 5), device=D1)]


def expected_sights(items):
    return [(str(t.device), t.shape, host(t).tolist()) for t in items]


@pytest.mark.parametrize("kind", ["native", "plain"])
@pytest.mark.parametrize("method", METHODS)
def test_queue_round_trip_writes_seen_and_identity_kept(method, kind):
    ctx = smp.get_context(method)
    if kind == "native":
        inq, outq = ctx.Queue(), ctx.Queue()
    else:  # multiprocessing's own queues, with shmtensor's reducers (plain pickles)
        plain = multiprocessing.get_context(method)
        inq, outq = plain.Queue(), plain.Queue()
    items = sample_tensors()
    want = expected_sights(items)
    p = ctx.Process(target=echo_and_write, args=(inq, outq))
    p.start()
    inq.put(items)
    seen = outq.get(timeout=60)
    back = outq.get(timeout=60)
    p.join(60)
    assert p.exitcode == 0
    assert seen == want
    a, view, b, empty = items
    assert host(a).tolist() == [[7.0] * 4] * 3  # the child's writes, in our memory
    assert host(b).tolist() == [7] * 6
    assert [t.data_ptr() for t in back[:3]] == [t.data_ptr() for t in items[:3]]  # identity
    assert [str(t.device) for t in back] == ["cuda:0", "cuda:0", D1, D1]
    assert back[3].shape == (0, 5)
    if kind == "plain":
        inq.close(), outq.close(), inq.join_thread(), outq.join_thread()


def pipe_writer(conn):
    t = conn.recv()
    t.fill_(t.device.index + 40)
    conn.send(t)
    conn.close()


@pytest.mark.parametrize("method", METHODS)
def test_pipe_to_a_child_and_back(method):
    ctx = smp.get_context(method)
    ours, theirs = ctx.Pipe()
    t = shmtensor.zeros((2, 2), "int32", device=D1)
    p = ctx.Process(target=pipe_writer, args=(theirs,))
    p.start()
    theirs.close()
    ours.send(t)
    back = ours.recv()
    p.join(60)
    assert p.exitcode == 0
    assert host(t).tolist() == [[40 + I1] * 2] * 2  # the child writes 40 + its device index
    assert back.data_ptr() == t.data_ptr() and back.device == t.device
    ours.close()


def arg_writer(t, rank_tensor):
    t.narrow(0, 1, 1).fill_(5)
    rank_tensor.fill_(1)


@pytest.mark.parametrize("method", METHODS)
def test_process_argument(method):
    ctx = smp.get_context(method)
    t = shmtensor.zeros((3,), "float64", device="cuda:0")
    flag = shmtensor.zeros((1,), "int8", device=D1)
    p = ctx.Process(target=arg_writer, args=(t, flag))
    p.start()
    p.join(60)
    assert p.exitcode == 0
    assert host(t).tolist() == [0.0, 5.0, 0.0]
    assert host(flag).tolist() == [1]


def send_and_end(q):
    import multiprocessing.util

    from shmtensor import cuda

    hooks = [f for f in multiprocessing.util._finalizer_registry.values()
             if getattr(f, "_callback", None) is cuda.complete_fences]
    q.put((len(hooks), shmtensor.full((4,), 9, "int32", device="cuda:0")))


@pytest.mark.parametrize("method", METHODS)
def test_a_child_completes_its_fences_before_it_ends(method):
    # A multiprocessing child ends with os._exit, which runs no atexit handler: the fence
    # writes it queued before its sends are done first, in a finalizer (docs/cuda.md).
    ctx = smp.get_context(method)
    q = ctx.Queue()
    p = ctx.Process(target=send_and_end, args=(q,))
    p.start()
    p.join(60)
    assert p.exitcode == 0
    hooks, t = q.get(timeout=60)  # received after the child ended
    assert hooks == 1
    assert host(t).tolist() == [9, 9, 9, 9]


def spawn_rank(rank, t):
    t.select(0, rank).fill_(rank + 1)


def test_spawn_ranks_write_one_tensor():
    t = shmtensor.zeros((2, 3), "int16", device=D1)
    smp.spawn(spawn_rank, args=(t,), nprocs=2)
    assert host(t).tolist() == [[1, 1, 1], [2, 2, 2]]


def forked_child_uses(q, t):
    try:
        t.cpu()
    except shmtensor.CudaError as e:
        q.put(("CudaError", str(e)))
    else:
        q.put(("no error", ""))


def test_a_forked_child_gets_cuda_error_naming_the_start_method():
    t = shmtensor.ones((4,), device="cuda:0")  # CUDA used here before the fork

    def child():
        for use in (t.cpu, lambda: shmtensor.zeros(2, device=D1)):
            with pytest.raises(shmtensor.CudaError,
                               match=r"forked after CUDA.*'spawn' or 'forkserver'"):
                use()

    assert run_in_child(child) == 0
    ctx = smp.get_context("fork")
    q = ctx.Queue()
    p = ctx.Process(target=forked_child_uses, args=(q, t))
    p.start()
    kind, message = q.get(timeout=60)
    p.join(60)
    assert p.exitcode == 0
    assert kind == "CudaError" and "'spawn' or 'forkserver' start method" in message
    assert host(t).tolist() == [1.0] * 4
