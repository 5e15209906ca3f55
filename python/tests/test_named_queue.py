"""Named queues (docs/python.md, "Named queues"): Queue(name=...) opened with Queue.open(name)
by a process shmtensor did not start (a subprocess.Popen of a script), under both
strategies; taken and missing names; a SIGKILLed creator; another uid; a peer that opens
the name and writes a claim over the queue's ring (docs/transport.md, "A claim a peer
wrote")."""

import os
import queue
import signal
import shutil
import subprocess
import sys
import tempfile
import textwrap
import time

import numpy as np
import pytest

import shmtensor
import shmtensor.numpy as snp
from shmtensor.multiprocessing import JoinableQueue, Queue
from helpers import own_manager_group, shm_strategy  # noqa: F401 (fixtures)

# The opener: knows nothing but the name. Adds 100 in place to the array it gets (the
# sender sees it), puts an array of its own, exits before that one is received.
PEER = textwrap.dedent("""
    import sys
    import shmtensor, shmtensor.numpy as snp
    from shmtensor.multiprocessing import Queue
    name, strategy = sys.argv[1], sys.argv[2]
    shmtensor.set_sharing_strategy(strategy)
    inq, outq = Queue.open(name + "_in"), Queue.open(name + "_out")
    a = inq.get(timeout=30)
    a += 100
    mine = snp.empty(8, dtype="int64")
    mine[:] = [3 * i for i in range(8)]
    outq.put(mine)
""")


pytestmark = pytest.mark.usefixtures("own_manager_group")


def _name(tag):
    return "pynq_%s_%d" % (tag, os.getpid())


def test_a_popen_script_opens_by_name_and_arrays_go_both_ways(strategy):
    name = _name("both")
    inq, outq = Queue(name=name + "_in"), Queue(4, name=name + "_out")
    a = snp.empty(5, dtype="float32")
    a[:] = np.arange(5)
    inq.put(a)
    peer = subprocess.Popen([sys.executable, "-c", PEER, name, strategy], env=os.environ.copy())
    got = outq.get(timeout=60)
    assert peer.wait(timeout=60) == 0
    # Its array outlived it; ours was written in place by it: one memory, no copy.
    assert got.dtype == np.int64 and got.tolist() == [3 * i for i in range(8)]
    assert snp.is_shared(got)
    assert a.tolist() == [100.0, 101.0, 102.0, 103.0, 104.0]
    assert outq._maxsize == 4 and Queue.open(name + "_out")._maxsize == 4


def test_taken_missing_and_unlinked_names():
    name = _name("names")
    q = Queue(name=name)
    with pytest.raises(FileExistsError) as e:
        Queue(name=name)
    assert isinstance(e.value, shmtensor.NameExistsError)
    assert "exists (created by pid %d)" % os.getpid() in str(e.value)
    with pytest.raises(FileNotFoundError) as e:
        Queue.open(name + "_missing")
    assert isinstance(e.value, shmtensor.NameNotFoundError)
    with pytest.raises(ValueError):
        Queue(name="no/slash")
    opened = Queue.open(name)
    q.put({"k": 1})
    assert opened.get(timeout=10) == {"k": 1}
    Queue.unlink(name)
    with pytest.raises(FileNotFoundError):
        Queue.open(name)
    opened.put([2])
    assert q.get(timeout=10) == [2]
    del q, opened
    # The name was unlinked already; now it can be taken again, and goes with its creator's
    # last handle.
    q = Queue(name=name)
    del q
    with pytest.raises(FileNotFoundError):
        Queue.open(name)


def test_a_named_joinable_queue_counts_the_tasks_of_a_popen_peer(strategy):
    name = _name("joinable")
    q = JoinableQueue(name=name)
    not_joinable = Queue(name=_name("not_joinable"))
    with pytest.raises(ValueError, match='"%s" is not a JoinableQueue' % _name("not_joinable")):
        JoinableQueue.open(_name("not_joinable"))
    del not_joinable
    for i in range(3):
        q.put(snp.full(4, float(i)))
    # A peer that knows only the name takes the three items, marks two done and exits.
    peer = subprocess.Popen([sys.executable, "-c", textwrap.dedent("""
        import sys, shmtensor
        from shmtensor.multiprocessing import JoinableQueue
        shmtensor.set_sharing_strategy(sys.argv[2])
        q = JoinableQueue.open(sys.argv[1])
        got = [q.get(timeout=30).tolist() for _ in range(3)]
        assert got == [[float(i)] * 4 for i in range(3)], got
        q.task_done()
        q.task_done()
    """), name, strategy], env=os.environ.copy())
    assert peer.wait(timeout=60) == 0
    # One task is still open: join() waits for it, and returns once this process does it.
    assert q._native().join(0.05) is False
    q.task_done()
    assert q._native().join(10) is True
    q.join()
    with pytest.raises(ValueError):
        q.task_done()
    # A plain Queue.open of the same name counts items as the queue does.
    plain = Queue.open(name)
    plain.put([5])
    assert q._native().join(0.05) is False
    assert q.get(timeout=10) == [5]
    q.task_done()
    q.join()


def test_a_sigkilled_creators_name_goes_and_its_opener_keeps_the_queue(strategy):
    name = _name("killed")
    creator = subprocess.Popen([sys.executable, "-c", textwrap.dedent("""
        import sys, signal, shmtensor, shmtensor.numpy as snp
        from shmtensor.multiprocessing import Queue
        shmtensor.set_sharing_strategy(sys.argv[2])
        q = Queue(name=sys.argv[1])
        q.put(snp.full(3, 7.0))
        print("ready", flush=True)
        signal.pause()
    """), name, strategy], stdout=subprocess.PIPE, env=os.environ.copy())
    try:
        assert creator.stdout.readline() == b"ready\n"
        q = Queue.open(name)
    finally:
        creator.kill()
        assert creator.wait(timeout=60) == -signal.SIGKILL
        creator.stdout.close()
    deadline = time.monotonic() + 10
    while True:
        try:
            Queue.open(name)
        except FileNotFoundError:
            break
        assert time.monotonic() < deadline, "the name outlived its SIGKILLed creator"
        time.sleep(0.02)
    assert q.get(timeout=10).tolist() == [7.0, 7.0, 7.0]
    q.put(snp.full(2, 4.0))
    assert q.get(timeout=10).tolist() == [4.0, 4.0]


# The hostile opener: finds the queue's ring among its memfds (its magic), and forges the
# slot of the next position as claimed for writing by the process argv[2] names (its holder
# record and epoch, as the protocol writes a claim: docs/shm_layout.md, "Message ring");
# says "forged", and on a line from stdin writes the word back as the position's, given up.
FORGER = textwrap.dedent("""
    import mmap, os, struct, sys
    from shmtensor.multiprocessing import Queue
    q = Queue.open(sys.argv[1])
    victim = int(sys.argv[2])
    ring = None
    for fd in map(int, os.listdir("/proc/self/fd")):
        try:
            if os.readlink("/proc/self/fd/%d" % fd).startswith("/memfd:shmtensor") and \
                    os.pread(fd, 8, 0) == b"STTRING1":
                ring = mmap.mmap(fd, os.fstat(fd).st_size)
                break
        except OSError:
            pass
    version, count, slot_bytes, slots_offset = struct.unpack_from("<IIII", ring, 8)
    assert version == 6, version
    tail = struct.unpack_from("<Q", ring, 64)[0]
    holder = [i for i in range(127)
              if struct.unpack_from("<Q", ring, 384 + 32 * i)[0] >> 32 == victim][0]
    epoch = struct.unpack_from("<I", ring, 384 + 32 * holder + 8)[0] & 31
    index = tail % count
    at = slots_offset + index * slot_bytes

    def store(pos, state, who=0, ep=0):  # the word, kept less its slot's index (<< 14)
        word = (pos << 14) | (state << 12) | (who << 5) | ep
        struct.pack_into("<Q", ring, at, (word - (index << 14)) % (1 << 64))

    store(tail, 1, holder, epoch)  # WRITING, by the victim
    print("forged", tail, flush=True)
    sys.stdin.readline()
    store(tail + count, 0)  # FREE for the next lap: the position is given up
    print("restored", flush=True)
""")


def test_a_claim_a_peer_forges_over_a_named_queue_is_reported_to_a_get_without_timeout(strategy):
    name = _name("forged")
    q = Queue(name=name)
    q.put(0)
    assert q.get(timeout=10) == 0  # this process holds a record of the ring now
    peer = subprocess.Popen([sys.executable, "-c", FORGER, name, str(os.getpid())],
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, env=os.environ.copy())
    try:
        line = peer.stdout.readline().split()
        assert line[0] == b"forged"
        q.put(1)
        q.put(snp.full(3, 2.0))  # behind the forged position
        start = time.monotonic()
        with pytest.raises(shmtensor.ProtocolError,
                           match="position %d has been claimed for writing by process %d for "
                                 "more than 1 s" % (int(line[1]), os.getpid())):
            q.get()
        assert time.monotonic() - start < 5
        peer.stdin.write(b"go\n")
        peer.stdin.flush()
        assert peer.stdout.readline() == b"restored\n"
        assert peer.wait(timeout=60) == 0
    finally:
        if peer.poll() is None:
            peer.kill()
            peer.wait()
        peer.stdin.close()
        peer.stdout.close()
    # Nothing was lost: both items, in order.
    assert q.get(timeout=10) == 1
    assert q.get(timeout=10).tolist() == [2.0, 2.0, 2.0]
    with pytest.raises(queue.Empty):
        q.get(timeout=0.05)


def test_another_uid_is_refused(monkeypatch):
    if os.geteuid() != 0:
        pytest.skip("needs root to act as another uid")
    top = tempfile.mkdtemp(prefix="shmtensor-nq-", dir="/tmp")
    os.chmod(top, 0o755)  # the other uid reaches the manager's own 0700 directory
    manager_dir = os.path.join(top, "manager")
    monkeypatch.setenv("SHMTENSOR_MANAGER_DIR", manager_dir)
    try:
        _refused(manager_dir)
    finally:
        shutil.rmtree(top, ignore_errors=True)


def _refused(manager_dir):
    name = _name("uid")
    q = Queue(name=name)  # noqa: F841 (the name lives while q does)
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:
        code = 1
        try:
            os.close(r)
            # Another uid that points at our manager (by default it asks its own, which
            # knows none of our names): the manager's directory refuses it, and behind it the
            # manager's SO_PEERCRED check (the C++ ManagerTest.PeerOfAnotherUidIsRefused).
            os.environ["SHMTENSOR_MANAGER_DIR"] = manager_dir
            os.setresuid(65534, 65534, 65534)
            try:
                Queue.open(name)
                msg = "opened"
            except FileNotFoundError as e:
                msg = "FileNotFoundError %s" % e
            except shmtensor.Error as e:
                msg = "%s %s" % (type(e).__name__, e)
            os.write(w, msg.encode())
            code = 0
        finally:
            os._exit(code)
    os.close(w)
    with os.fdopen(r, "rb") as f:
        msg = f.read().decode()
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0
    assert msg.startswith("Error "), msg
    assert "belongs to uid 0, not 65534; refusing to use it" in msg, msg
