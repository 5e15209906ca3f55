"""shmtensor.multiprocessing.Broadcast and shmtensor.vllm.MessageQueue with real processes
(fork, spawn, forkserver), both sharing strategies: every reader gets every message in
order, one block for all readers (writes seen both ways), the slow reader named by put's
timeout, a SIGKILLed reader's place freed and its messages' blocks given back, a SIGKILLed
writer, the vLLM method names."""
import os
import signal
import time

import numpy as np
import pytest

import shmtensor
import shmtensor.multiprocessing as smp
import shmtensor.numpy as snp
from shmtensor.vllm import MessageQueue
from helpers import own_manager_group, shm_strategy  # noqa: F401 (fixtures)

METHODS = ["fork", "spawn", "forkserver"]


def read_in_order(strategy, reader, n, results):
    smp.set_sharing_strategy(strategy)
    got = []
    for _ in range(n):
        msg = reader.get(timeout=30)
        got.append((msg["k"], int(msg["a"][0]), int(msg["a"][-1]), msg["a"].shape,
                    float(np.asarray(msg["t"])[1])))
    results.put((reader.index, got))


@pytest.mark.parametrize("method", METHODS)
def test_every_reader_gets_every_message_in_order(method, strategy):
    ctx = smp.get_context(method)
    b = smp.Broadcast(readers=3, depth=4)
    results = smp.Queue()
    n = 40
    procs = [ctx.Process(target=read_in_order, args=(strategy, b.reader(i), n, results))
             for i in range(3)]
    for p in procs:
        p.start()
    for k in range(n):
        a = np.arange(k, k + 100000, dtype=np.int64)  # 800 KB: one shared block
        b.put({"k": k, "a": a, "t": shmtensor.from_numpy(np.array([0.0, k * 0.5]))},
              timeout=30)
    by_reader = dict(results.get(timeout=60) for _ in range(3))
    for p in procs:
        p.join(30)
        assert p.exitcode == 0
    expected = [(k, k, k + 99999, (100000,), k * 0.5) for k in range(n)]
    assert by_reader == {0: expected, 1: expected, 2: expected}


def write_back(strategy, reader, done, go):
    smp.set_sharing_strategy(strategy)
    a = reader.get(timeout=30)
    a[reader.index] = 10 + reader.index
    done.put(reader.index)
    go.get(timeout=30)
    done.put(a.tolist())


@pytest.mark.parametrize("method", METHODS)
def test_one_block_for_all_readers_writes_seen_both_ways(method, strategy):
    ctx = smp.get_context(method)
    b = smp.Broadcast(readers=2)
    a = snp.zeros(8, dtype=np.int32)
    done, go = smp.Queue(), smp.Queue()
    procs = [ctx.Process(target=write_back, args=(strategy, b.reader(i), done, go))
             for i in range(2)]
    for p in procs:
        p.start()
    b.put(a)
    assert sorted(done.get(timeout=30) for _ in range(2)) == [0, 1]
    assert a.tolist() == [10, 11, 0, 0, 0, 0, 0, 0]
    a[7] = 77
    go.put(1)
    go.put(1)
    assert [done.get(timeout=30) for _ in range(2)] == [[10, 11, 0, 0, 0, 0, 0, 77]] * 2
    for p in procs:
        p.join(30)
        assert p.exitcode == 0


def read_one_then_stop(reader, attached, finish, out):
    out.put(reader.get(timeout=30))
    attached.put(os.getpid())
    finish.get(timeout=60)
    out.put([reader.get(timeout=30) for _ in range(3)])


def test_a_slow_reader_is_named_by_puts_timeout(strategy):
    ctx = smp.get_context("fork")
    b = smp.Broadcast(readers=2, depth=2)
    attached, finish, out = smp.Queue(), smp.Queue(), smp.Queue()
    slow = ctx.Process(target=read_one_then_stop, args=(b.reader(1), attached, finish, out))
    slow.start()
    fast = b.reader(0)  # this process reads as reader 0
    b.put(0)
    pid = attached.get(timeout=30)
    assert out.get(timeout=30) == 0
    assert fast.get(timeout=5) == 0
    b.put(1)
    b.put(2)  # reader 1 is now 2 behind: its queue is full
    assert [fast.get(timeout=5) for _ in range(2)] == [1, 2]
    with pytest.raises(shmtensor.BroadcastTimeout) as info:
        b.put("never", timeout=0.2)
    assert isinstance(info.value, TimeoutError)
    assert (info.value.reader, info.value.pid, info.value.behind) == (1, pid, 2)
    assert info.value.delivered == []
    assert f"reader 1 (pid {pid}) is 2 messages behind" in str(info.value)
    finish.put(1)
    b.put(3, timeout=30)
    assert out.get(timeout=30) == [1, 2, 3]
    assert fast.get(timeout=5) == 3  # the timed-out message went to no reader
    slow.join(30)
    assert slow.exitcode == 0


def attach_and_hang(reader, attached):
    reader.get(timeout=30)
    attached.put(os.getpid())
    signal.pause()


def broadcast_with_victim(depth):
    """A Broadcast of 2 readers whose reader 1 is a forked process that took message 0 (an
    array of zeros) and hangs, and whose reader 0 is this process: (b, victim, its pid,
    reader 0)."""
    b = smp.Broadcast(readers=2, depth=depth)
    attached = smp.Queue()
    victim = smp.get_context("fork").Process(target=attach_and_hang,
                                             args=(b.reader(1), attached))
    victim.start()
    mine = b.reader(0)
    b.put(np.zeros(100000))
    return b, victim, attached.get(timeout=30), mine


def kill_victim(victim, pid):
    os.kill(pid, signal.SIGKILL)
    victim.join(30)
    assert victim.exitcode == -signal.SIGKILL


def test_a_sigkilled_readers_place_is_freed_and_its_blocks_given_back(strategy):
    b, victim, pid, mine = broadcast_with_victim(depth=3)
    assert mine.get(timeout=5).shape == (100000,)
    for k in range(3):
        b.put(np.full(100000, k))
        assert mine.get(timeout=5)[0] == k
    assert (b.behind(1), b.reader_pid(1)) == (3, pid)
    kill_victim(victim, pid)
    b.put(np.full(100000, 9), timeout=30)  # finds reader 1 dead: its 3 messages dropped
    assert (b.behind(1), b.reader_pid(1)) == (0, 0)
    assert mine.get(timeout=5)[0] == 9
    # the leak fixture then finds no block, fd or /dev/shm name of the dropped messages


def test_a_dead_readers_messages_are_dropped_before_its_queue_fills(strategy):
    b, victim, pid, mine = broadcast_with_victim(depth=8)
    for k in range(2):
        b.put(np.full(100000, k))
    assert [mine.get(timeout=5)[0] for _ in range(3)] == [0, 0, 1]
    kill_victim(victim, pid)
    assert (b.behind(1), b.reader_pid(1)) == (2, pid)
    time.sleep(0.15)  # more than the 100 ms between the writer's looks at a reader
    b.put(np.full(100000, 7))  # finds reader 1 dead, 2 of 8 behind: its messages dropped
    assert (b.behind(1), b.reader_pid(1)) == (0, 0)
    assert mine.get(timeout=5)[0] == 7
    # the leak fixture then finds no block, fd or /dev/shm name of the dropped messages


def write_then_die(strategy, conn):
    smp.set_sharing_strategy(strategy)
    b = smp.Broadcast(readers=1)
    conn.send(b.reader(0))
    for k in range(3):
        b.put(np.full(20000, k))
    conn.send("put")
    os.kill(os.getpid(), signal.SIGKILL)


@pytest.mark.parametrize("method", ["fork", "spawn"])
def test_a_sigkilled_writers_readers_take_what_was_put_then_queue_closed(method, strategy):
    ctx = smp.get_context(method)
    mine, theirs = smp.Pipe()
    writer = ctx.Process(target=write_then_die, args=(strategy, theirs))
    writer.start()
    reader = mine.recv()
    assert mine.recv() == "put"
    writer.join(30)
    assert writer.exitcode == -signal.SIGKILL
    assert [int(reader.get(timeout=5)[0]) for _ in range(3)] == [0, 1, 2]
    with pytest.raises(shmtensor.QueueClosed, match=f"its writer \\(pid {writer.pid}\\) died"):
        reader.get(timeout=5)


def create_named_then_die(strategy, name, conn):
    smp.set_sharing_strategy(strategy)
    b = smp.Broadcast(readers=1, name=name)
    conn.send("made")
    assert conn.recv() == "put"
    b.put(snp.full(20000, 4, dtype=np.int32))
    conn.send("put")
    os.kill(os.getpid(), signal.SIGKILL)


def test_a_sigkilled_creators_name_goes_and_its_reader_takes_what_was_put(
        strategy, own_manager_group):
    """A named Broadcast's creator (the writer) SIGKILLed: its name goes (the manager
    removes a dead creator's names), a reader opened by name before takes the message
    put, then QueueClosed names the dead writer."""
    name = f"bcast_killed_{os.getpid()}_{strategy}"
    mine, theirs = smp.Pipe()
    writer = smp.get_context("spawn").Process(target=create_named_then_die,
                                              args=(strategy, name, theirs))
    writer.start()
    assert mine.recv() == "made"
    reader = smp.Broadcast.open(name).reader(0)
    mine.send("put")
    assert mine.recv() == "put"
    writer.join(30)
    assert writer.exitcode == -signal.SIGKILL
    got = reader.get(timeout=5)
    assert got.shape == (20000,) and int(got[0]) == 4 and int(got[-1]) == 4
    with pytest.raises(shmtensor.QueueClosed, match=f"its writer \\(pid {writer.pid}\\) died"):
        reader.get(timeout=5)
    deadline = time.monotonic() + 10
    while True:
        try:
            smp.Broadcast.open(name)
        except shmtensor.NameNotFoundError:
            break
        assert time.monotonic() < deadline, "the dead creator's name is still there"
        time.sleep(0.05)
    del got, reader


def test_rebuilt_from_its_parts():
    b = smp.Broadcast(readers=1)
    frame = b._parts()
    opened = smp.Broadcast._from_parts(frame.data, [os.dup(fd) for fd in frame.fds])
    frame.mark_sent()
    assert opened.readers == 1
    b.put({"x": 5})
    assert opened.reader(0).get(timeout=5) == {"x": 5}
    with pytest.raises(TimeoutError):
        opened.reader(0).get(timeout=0.05)


def vllm_reader(handle, rank, out):
    mq = MessageQueue.create_from_handle(handle, rank)
    mq.wait_until_ready()
    out.put((rank, mq.dequeue(timeout=30), mq.broadcast_object()))


@pytest.mark.parametrize("method", ["spawn"])
def test_vllm_message_queue_names(method):
    ctx = smp.get_context(method)
    mq = MessageQueue(n_reader=2, n_local_reader=2, local_reader_ranks=[5, 6])
    handle = mq.export_handle()
    out = smp.Queue()
    procs = [ctx.Process(target=vllm_reader, args=(handle, rank, out)) for rank in (5, 6)]
    for p in procs:
        p.start()
    mq.wait_until_ready()
    mq.enqueue(("step", 1), timeout=30)
    assert mq.broadcast_object(np.arange(3)).tolist() == [0, 1, 2]
    got = sorted((r, m, a.tolist()) for r, m, a in (out.get(timeout=60) for _ in range(2)))
    assert got == [(5, ("step", 1), [0, 1, 2]), (6, ("step", 1), [0, 1, 2])]
    for p in procs:
        p.join(30)
        assert p.exitcode == 0


def vllm_group_rank(init, rank, world, out):
    import torch  # noqa: PLC0415 (these ranks alone need torch)
    import torch.distributed as dist  # noqa: PLC0415
    import shmtensor.torch  # noqa: PLC0415
    shmtensor.torch.install()  # torch tensors in messages: one shared block for every reader
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=world)
    try:
        # A subgroup of ranks 1, 2, 3 (rank 0 not in it), writer its group rank 1 (global 2).
        pg = dist.new_group([1, 2, 3])
        if rank == 0:
            out.put((0, None))
            return
        mq = MessageQueue.create_from_process_group(pg, 1 << 20, 4, writer_rank=1)
        if rank == 2:
            t = torch.zeros(4)
            mq.enqueue({"step": 7, "t": t}, timeout=30)
            out.put((rank, mq.broadcast_object(["sched", 1])))
            # The readers' write, one block for all: wait for both to have written.
            deadline = time.monotonic() + 30
            while t[1].item() + t[3].item() != 2 and time.monotonic() < deadline:
                time.sleep(0.01)
            out.put((rank, t.tolist()))
        else:
            msg = mq.dequeue(timeout=30)
            msg["t"][1 if rank == 1 else 3] = 1.0
            out.put((rank, (msg["step"], mq.broadcast_object())))
        dist.barrier(group=pg)
        if rank == 2:  # the name went once every reader had opened it
            with pytest.raises(shmtensor.NameNotFoundError):
                smp.Broadcast.open(mq.name)
            out.put((rank, mq.name.startswith("vllm_mq_")))
    finally:
        dist.destroy_process_group()


def test_vllm_message_queue_from_a_process_group(tmp_path, own_manager_group):
    """vLLM's create_from_process_group over a gloo subgroup: group rank 1 writes, the others
    read by the name it sent; a tensor is one block for all; the name is gone afterwards."""
    pytest.importorskip("torch")
    import shmtensor.torch  # noqa: PLC0415
    if not shmtensor.torch.has_bridge():
        pytest.skip("shmtensor._torch (the C++ bridge) is not built")
    ctx = smp.get_context("spawn")
    out = smp.Queue()
    init = f"file://{tmp_path}/rendezvous"
    procs = [ctx.Process(target=vllm_group_rank, args=(init, r, 4, out)) for r in range(4)]
    for p in procs:
        p.start()
    got = sorted((out.get(timeout=120) for _ in range(6)), key=repr)
    for p in procs:
        p.join(60)
        assert p.exitcode == 0
    assert got == sorted([(0, None), (1, (7, ["sched", 1])), (3, (7, ["sched", 1])),
                          (2, ["sched", 1]), (2, [0.0, 1.0, 0.0, 1.0]), (2, True)], key=repr)


def open_by_name(name, out):
    b = smp.Broadcast.open(name)
    a = b.reader(1).get(timeout=30)
    a[1] = 6  # seen by the writer: one block
    out.put(a.tolist())


def test_a_process_that_knows_only_the_name_opens_a_reader(strategy, own_manager_group):
    name = f"bcast_test_{os.getpid()}_{strategy}"
    b = smp.Broadcast(readers=2, name=name)
    with pytest.raises(shmtensor.NameExistsError):
        smp.Broadcast(readers=1, name=name)
    out = smp.Queue()
    p = smp.get_context("spawn").Process(target=open_by_name, args=(name, out))
    p.start()
    a = snp.full(3, 5, dtype=np.int32)
    b.put(a)
    assert b.reader(0).get(timeout=30).tolist() == [5, 5, 5]
    assert out.get(timeout=60) == [5, 6, 5]
    p.join(30)
    assert p.exitcode == 0
    assert a.tolist() == [5, 6, 5]
    smp.Broadcast.unlink(name)
    with pytest.raises(shmtensor.NameNotFoundError):
        smp.Broadcast.open(name)


def test_a_named_broadcast_takes_as_many_readers_as_one_message_carries_fds(own_manager_group):
    name = f"bcast_wide_{os.getpid()}"
    b = smp.Broadcast(readers=8, name=name)  # 41 fds (16 was the registry's limit)
    opened = smp.Broadcast.open(name)
    b.put("hello")
    assert [opened.reader(i).get(timeout=30) for i in (0, 7)] == ["hello", "hello"]
    with pytest.raises(ValueError, match=r"64 readers need 321 fds, and a named channel "
                                         r"carries at most 253 \(at most 50 readers by name"):
        smp.Broadcast(readers=64, name=name + "_64")
    del opened, b
