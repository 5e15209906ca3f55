"""A user's program, for type checkers: test_typing.py runs `mypy --strict` on it and expects
no error (it is not run). It uses the package the way docs/python.md shows, so that a stub or
an annotation that goes wrong shows here as an error."""
from __future__ import annotations

import multiprocessing.connection
import queue
from typing import Any

import numpy as np
import numpy.typing as npt

import shmtensor
import shmtensor.multiprocessing as smp
import shmtensor.numpy as snp
from shmtensor.multiprocessing.connection import Connection
from shmtensor.multiprocessing.queues import Queue


def tensors() -> float:
    t: shmtensor.Tensor = shmtensor.from_numpy(np.arange(6.0).reshape(2, 3))
    shape: tuple[int, ...] = t.shape
    rows: int = t.size(0)
    strides: tuple[int, ...] = t.stride()
    view: shmtensor.Tensor = t.view((3, 2)).transpose(0, 1).permute(1, 0).contiguous()
    view = t.permute([1, 0]).select(0, 1).narrow(0, 0, 1)[0]
    assert t.is_shared() and t.share_memory_() is t
    a: npt.NDArray[Any] = np.asarray(t)
    b = t.numpy()
    z = shmtensor.zeros((2, 2), dtype=np.int64)
    e = shmtensor.empty(4, "bfloat16").clone()
    dtype = t.dtype
    if isinstance(dtype, np.dtype):  # else the string "bfloat16"
        print(dtype.itemsize, t.itemsize, t.nbytes, t.ndim, len(t), repr(t))
    print(shape, rows, strides, view.numel(), z.dim(), e.element_size(), t.storage_offset())
    print(t.__array_interface__["typestr"], t.__dlpack_device__(), np.from_dlpack(t).shape)
    shmtensor.set_sharing_strategy("file_system")
    strategies: set[str] = shmtensor.get_all_sharing_strategies()
    assert shmtensor.get_sharing_strategy() in strategies
    shmtensor.set_busy_poll(50e-6)
    shmtensor.empty_cache()
    return float(a.sum() + b.sum()) + shmtensor.get_busy_poll()


def devices() -> int:
    d: shmtensor.device = shmtensor.device("cuda", 1)
    kind: str = d.type
    index: int | None = d.index
    if not shmtensor.cuda.is_available():
        return shmtensor.cuda.device_count() + len(shmtensor.cuda.unavailable_reason())
    t = shmtensor.zeros((2, 3), "float32", device=d).fill_(1.5)
    u = shmtensor.empty(3, device=0).copy_(shmtensor.ones(3)).to("cuda:0", dtype="int16")
    back: shmtensor.Tensor = shmtensor.from_dlpack(t.cuda().cpu(), copy=False)
    on_device: bool = t.is_cuda and t.device == d
    shmtensor.cuda.synchronize(t.device)
    capsule = u.__dlpack__(stream=1, max_version=(1, 0))
    try:
        shmtensor.full(2, 0.5, device="cuda:9")
    except shmtensor.CudaError as e:
        print(e.result)
    print(kind, index, on_device, back.data_ptr(), capsule, u.__dlpack_device__())
    return t.numel()


def arrays() -> bool:
    a = snp.zeros((1000, 1000), dtype="float32")
    b = snp.share(np.ones(10))
    c = snp.full(3, 7.0, order="F")
    d = snp.empty_like(a, shape=(2, 2))
    print(snp.ones(2).sum(), snp.empty(3, np.int8).dtype, snp.zeros_like(b).shape, c, d)
    return snp.is_shared(a[10:20, ::2])


def worker(q: Queue, conn: Connection) -> None:
    item = q.get(timeout=5.0)
    conn.send(item * 2)
    conn.send_bytes(b"done")
    conn.close()


def processes() -> None:
    q = smp.Queue(maxsize=4)
    parent, child = smp.Pipe()
    reader, writer = smp.Pipe(duplex=False)
    p = smp.Process(target=worker, args=(q, child))
    p.start()
    q.put(snp.zeros(10))
    q.put_nowait(1)
    sent: int = q.put_many([np.ones(3), "x"], timeout=1.0)
    try:
        batch: list[Any] = q.get_many(8, block=False)
    except queue.Empty:
        batch = []
    q.set_busy_poll(None)
    print(parent.recv(), parent.recv_bytes(maxlength=16), parent.poll(0.1), sent, batch)
    buf = bytearray(16)
    writer.send_bytes(memoryview(b"0123456789"), 2, 4)
    n: int = reader.recv_bytes_into(buf)
    ready = multiprocessing.connection.wait([reader, parent], timeout=0)
    print(n, ready, q.qsize(), q.empty(), q.full(), reader.fileno(), writer.closed)
    p.join()
    q.close()
    q.join_thread()
    jq = smp.JoinableQueue()
    jq.put(1)
    jq.task_done()
    jq.join()
    sq = smp.SimpleQueue()
    sq.put(2)
    print(sq.get(), sq.empty())
    ctx = smp.get_context("spawn")
    with ctx.Pool(2) as pool:
        print(pool.map(spawned_square, [-1, -2]))
    print(smp.Pool, smp.cpu_count(), smp.get_share_threshold())
    smp.set_share_threshold(1 << 16)
    smp.set_sharing_strategy(smp.get_sharing_strategy())


def spawned_square(x: int) -> int:
    return x * x


def spawned(rank: int, total: int) -> None:
    print(rank, total)


def spawn() -> None:
    context = smp.spawn(spawned, args=(2,), nprocs=2, join=False)
    if context is not None:
        while not context.join(timeout=1.0):
            pass
        print(context.pids())
    try:
        smp.start_processes(spawned, args=(2,), nprocs=1, start_method="fork")
    except smp.ProcessRaisedException as e:
        print(e.error_index, e.pid, e.msg)
    except smp.ProcessExitedException as e:
        print(e.exit_code, e.signal_name)


def errors() -> None:
    try:
        shmtensor.from_numpy(np.zeros(1 << 40))
    except shmtensor.SharedMemoryFullError as e:
        print(e.requested, e.available)
    except shmtensor.SystemCallError as e:
        print(e.errno, e.strerror, e.syscall)
    except (shmtensor.ProtocolError, shmtensor.ConfigurationError, shmtensor.QueueClosed) as e:
        print(e)
    except shmtensor.ConnectionClosed as e:
        print(isinstance(e, EOFError))
    except shmtensor.Error as e:
        print(isinstance(e, RuntimeError))


if __name__ == "__main__":
    raise SystemExit("for type checkers: see python/tests/test_typing.py")
