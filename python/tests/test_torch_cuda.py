"""torch's CUDA tensors through torch.multiprocessing with shmtensor.torch.install(): by fd,
moved into the sender's device arena once (docs/cuda.md, "torch's CUDA tensors"). Needs a
GPU, a CUDA torch and SHMTENSOR_CUDA_TEST_REAL=1 (tools/gpu/python_check runs it there);
everywhere else each test skips with the reason.
"""
import os
import signal
import time
import warnings
from multiprocessing.reduction import ForkingPickler

import numpy as np
import pytest

torch = pytest.importorskip("torch")

import shmtensor  # noqa: E402
import shmtensor.torch as st  # noqa: E402
import torch.multiprocessing as tmp  # noqa: E402

# Collected and skipped (not a module-level skip, which pytest reports as no tests run).
if os.environ.get("SHMTENSOR_CUDA_TEST_REAL") != "1":
    _WHY_NOT = "needs a GPU (SHMTENSOR_CUDA_TEST_REAL=1, tools/gpu/python_check)"
elif not torch.cuda.is_available():
    _WHY_NOT = "this torch has no CUDA device"
elif not st.has_bridge():
    _WHY_NOT = f"no torch bridge: {st.bridge_unavailable_reason()}"
else:
    _WHY_NOT = None
pytestmark = pytest.mark.skipif(_WHY_NOT is not None, reason=_WHY_NOT or "")

MiB = 1 << 20


@pytest.fixture(scope="module", autouse=True)
def cuda_ready():
    """torch's CUDA initialised before the leak check records this process's fds (the
    driver opens fds of its own at first use and keeps them)."""
    if _WHY_NOT is None:
        torch.zeros(1, device="cuda").cpu()
    yield


@pytest.fixture(autouse=True)
def installed():
    st.install()
    yield
    st.uninstall()


def _child(target):
    """A spawn child running target(inq, outq), started: (process, inq, outq)."""
    ctx = tmp.get_context("spawn")
    inq, outq = ctx.Queue(), ctx.Queue()
    p = ctx.Process(target=target, args=(inq, outq))
    p.start()
    return p, inq, outq


def _ours(t):
    """Whether t's storage is a block of a shmtensor device arena."""
    return st._bridge.block_of_storage(t.untyped_storage()) is not None


# ---- children (spawned: module-level functions) -----------------------------------------------


def _echo_and_write(inq, outq):
    t = inq.get(timeout=60)
    outq.put((str(t.device), t.dtype, tuple(t.shape), _ours(t), t[:4].tolist()))
    t[0:2] = -1  # the producer must see this
    torch.cuda.synchronize()
    outq.put(t)  # back: the same storage there (identity)
    outq.put(("seen", float(inq.get(timeout=60)[5])))  # after the producer's write below
    outq.put(("done", None))


def _produce_and_exit(inq, outq):
    kill_me = inq.get(timeout=60)
    t = torch.arange(4096, device="cuda", dtype=torch.float32) * 2
    outq.put(t)
    torch.cuda.synchronize()
    shmtensor.cuda.complete_fences()
    outq.put(("sent", os.getpid()))
    if kill_me:
        time.sleep(60)  # SIGKILLed by the test


def _hold_and_wait(inq, outq):
    t = inq.get(timeout=60)
    outq.put(("holding", float(t[-1])))
    time.sleep(60)  # SIGKILLed by the test


def _receive_parameter(inq, outq):
    w = inq.get(timeout=60)
    outq.put((type(w) is torch.nn.Parameter, w.requires_grad, _ours(w),
              w.detach().cpu().tolist()))


def _receive_grad(inq, outq):
    t = inq.get(timeout=60)
    outq.put((t.requires_grad, t.is_leaf, _ours(t), t.detach().cpu().tolist()))


# ---- tests --------------------------------------------------------------------------------------


def test_a_cuda_tensor_travels_by_fd_writes_are_seen_both_ways_and_it_comes_back_as_itself():
    p, inq, outq = _child(_echo_and_write)
    t = torch.arange(1024, device="cuda", dtype=torch.float32)
    inq.put(t)
    device, dtype, shape, ours_there, head = outq.get(timeout=60)
    assert (device, dtype, shape, ours_there, head) == ("cuda:0", torch.float32, (1024,), True,
                                                         [0.0, 1.0, 2.0, 3.0])
    assert _ours(t)  # moved into this process's device arena when it was sent
    back = outq.get(timeout=60)
    assert back.untyped_storage().data_ptr() == t.untyped_storage().data_ptr()
    torch.cuda.synchronize()
    assert t[:4].tolist() == [-1.0, -1.0, 2.0, 3.0]  # the consumer's write
    t[5] = 42
    inq.put(t)
    assert outq.get(timeout=60) == ("seen", 42.0)
    assert outq.get(timeout=60) == ("done", None)
    p.join(60)
    assert p.exitcode == 0


@pytest.mark.parametrize("how", ["exits", "sigkilled"])
def test_the_consumer_keeps_the_tensor_of_a_producer_that_is_gone(how):
    p, inq, outq = _child(_produce_and_exit)
    inq.put(how == "sigkilled")
    t = outq.get(timeout=60)
    status, pid = outq.get(timeout=60)
    assert status == "sent"
    if how == "sigkilled":
        os.kill(pid, signal.SIGKILL)
    p.join(60)
    assert p.exitcode == (-signal.SIGKILL if how == "sigkilled" else 0)
    assert torch.equal(t, torch.arange(4096, device="cuda", dtype=torch.float32) * 2)
    t += 1  # still writable
    assert float(t[10]) == 21.0


def test_a_sigkilled_consumers_blocks_come_back_and_device_memory_returns_to_its_baseline():
    shmtensor.empty_cache()
    torch.cuda.empty_cache()
    torch.cuda.synchronize()
    baseline = torch.cuda.mem_get_info()[0]
    for _ in range(3):
        p, inq, outq = _child(_hold_and_wait)
        t = torch.full((16 * MiB,), 3.0, device="cuda")  # 64 MiB
        inq.put(t)
        assert outq.get(timeout=60) == ("holding", 3.0)
        os.kill(p.pid, signal.SIGKILL)
        p.join(60)
        del t
    shmtensor.empty_cache()
    torch.cuda.empty_cache()
    deadline = time.monotonic() + 20
    while True:
        free = torch.cuda.mem_get_info()[0]
        if free >= baseline - 4 * MiB or time.monotonic() > deadline:
            break
        time.sleep(0.2)
        shmtensor.empty_cache()
    assert free >= baseline - 4 * MiB, (baseline - free) / MiB


def test_a_leaf_that_requires_grad_travels_by_fd_and_requires_grad_there():
    p, inq, outq = _child(_receive_grad)
    w = torch.ones(8, device="cuda", requires_grad=True)
    inq.put(w)
    assert outq.get(timeout=60) == (True, True, True, [1.0] * 8)
    p.join(60)
    assert p.exitcode == 0


def test_a_cuda_parameter_travels_by_fd_and_is_a_parameter_there():
    p, inq, outq = _child(_receive_parameter)
    w = torch.nn.Parameter(torch.full((8,), 2.0, device="cuda"))
    inq.put(w)
    assert outq.get(timeout=60) == (True, True, True, [2.0] * 8)
    assert _ours(w)
    p.join(60)
    assert p.exitcode == 0


def test_a_storage_torchs_ipc_shares_already_stays_with_torch():
    p, inq, outq = _child(_receive_grad)
    t = torch.ones(8, device="cuda")
    st.uninstall()
    ForkingPickler.dumps(t)  # torch's own CUDA IPC shares it (its sent-data DataPtr now)
    st.install()
    st._cuda_to_torch_said[0] = True  # (the warning is the test below's)
    inq.put(t)
    assert outq.get(timeout=60)[2:] == (False, [1.0] * 8)  # torch's path, not moved
    assert not _ours(t)
    p.join(60)


def test_what_shmtensor_does_not_take_goes_to_torch_saying_so_once():
    st._cuda_to_torch_said[0] = False
    w = torch.ones(4, device="cuda", requires_grad=True)
    nonleaf = w * 2  # torch's reducer refuses it (autograd does not cross processes)
    with pytest.warns(RuntimeWarning, match="goes to torch's own CUDA IPC"):
        with pytest.raises(RuntimeError, match="non-leaf tensor which requires_grad"):
            ForkingPickler.dumps(nonleaf)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # said once: no second warning
        with pytest.raises(RuntimeError, match="non-leaf tensor which requires_grad"):
            ForkingPickler.dumps(nonleaf)


def test_torch_and_shmtensor_cuda_tensors_convert_by_dlpack_without_a_copy():
    x = torch.arange(12, device="cuda", dtype=torch.float32).reshape(3, 4)
    s = shmtensor.from_dlpack(x)
    assert (str(s.device), tuple(s.shape), s.data_ptr()) == ("cuda:0", (3, 4), x.data_ptr())
    back = torch.from_dlpack(s)
    assert back.data_ptr() == x.data_ptr()
    back[0, 0] = 100
    torch.cuda.synchronize()
    assert float(x[0, 0]) == 100.0
    y = shmtensor.zeros((5,), device="cuda:0")
    ty = torch.from_dlpack(y)
    ty += 7
    torch.cuda.synchronize()
    assert np.asarray(y.cpu()).tolist() == [7.0] * 5


def test_cupy_cuda_arrays_convert_by_dlpack_without_a_copy():
    cupy = pytest.importorskip("cupy")
    a = cupy.arange(6, dtype=cupy.float32)
    s = shmtensor.from_dlpack(a)
    assert s.data_ptr() == a.data.ptr
    b = cupy.from_dlpack(shmtensor.zeros((3,), device="cuda:0"))
    b += 2
    assert cupy.asnumpy(b).tolist() == [2.0, 2.0, 2.0]
