"""shmtensor.torch: torch's own DataLoader and queues on shmtensor arenas, with real
processes (fork and spawn), both strategies, and the leak check after every test."""
import gc
import multiprocessing
import multiprocessing.spawn
import os
import resource
import signal
import sys

import pytest

torch = pytest.importorskip("torch", reason="python3-torch is not installed")
import torch.multiprocessing as tmp  # noqa: E402
from torch.utils.data import DataLoader, Dataset  # noqa: E402

import shmtensor.torch as st  # noqa: E402
from helpers import forget_inherited_forkserver, run_in_child, torch_strategy  # noqa: E402,F401

# The blog workload's samples, all kept: 20,000 (80,000 tensors, where stock torch's
# file_descriptor strategy dies at ~250 under ulimit -n 1024). Under the sanitizers, whose
# every worker is an interpreter importing torch with ASan's runtime preloaded, 2,000: still
# 8,000 tensors, 8 times the fd limit.
BLOG_KEPT = 2000 if os.environ.get("SHMTENSOR_TEST_SANITIZE") else 20000

needs_bridge = pytest.mark.skipif(not st.has_bridge(),
                                  reason="shmtensor._torch (the C++ bridge) is not built")


@pytest.fixture
def installed():
    st.install()
    yield
    st.uninstall()


class Blog(Dataset):
    """The blog workload: four 10-float tensors per sample (here with known values)."""

    def __init__(self, n):
        self.n = n

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        return [torch.full((10,), float(i + k)) for k in range(4)]


def fd_count():
    return len(os.listdir("/proc/self/fd"))


def mapping_count():
    with open("/proc/self/maps") as f:
        return sum(1 for _ in f)


def shared_mapping_count():
    """Mappings of shared memory: shmtensor's segments and torch's own."""
    with open("/proc/self/maps") as f:
        return sum(1 for line in f if "memfd:" in line or "/dev/shm/" in line)


def test_install_and_uninstall_restore_torch_exactly():
    from multiprocessing.reduction import ForkingPickler
    U = torch.UntypedStorage
    before = {n: U.__dict__.get(n) for n in ("share_memory_", "is_shared", "_new_shared")}
    reducer = ForkingPickler._extra_reducers[U]
    tensor_reducer = ForkingPickler._extra_reducers[torch.Tensor]
    torch_mp = {n: tmp.__dict__.get(n) for n in st._TORCH_MP}
    preparation = multiprocessing.spawn.get_preparation_data
    st.install()
    st.install()  # idempotent
    assert st.is_installed()
    assert ForkingPickler._extra_reducers[U] is st._reduce_storage
    expected = st._reduce_tensor if st.has_bridge() else tensor_reducer
    assert ForkingPickler._extra_reducers[torch.Tensor] is expected
    # A CUDA Parameter travels by fd with the bridge: Parameter gets a reducer of ours too.
    assert ForkingPickler._extra_reducers[torch.nn.Parameter] is (
        st._reduce_parameter if st.has_bridge() else tensor_reducer)
    assert U.__dict__["is_shared"] is st._is_shared
    assert {n: getattr(tmp, n) for n in torch_mp} == st._TORCH_MP
    assert multiprocessing.spawn.get_preparation_data is st._get_preparation_data
    assert DataLoader._get_iterator is st._get_iterator
    st.uninstall()
    assert not st.is_installed()
    assert ForkingPickler._extra_reducers[U] is reducer
    assert ForkingPickler._extra_reducers[torch.Tensor] is tensor_reducer
    assert ForkingPickler._extra_reducers[torch.nn.Parameter] is tensor_reducer
    assert {n: U.__dict__.get(n) for n in before} == before
    assert {n: tmp.__dict__.get(n) for n in torch_mp} == torch_mp
    assert multiprocessing.spawn.get_preparation_data is preparation
    # Torch's own again, unless a context() of this process still needs shmtensor's (which
    # passes every other loader to torch's).
    assert DataLoader._get_iterator is (st._get_iterator if st._contexts
                                        else st._torch_get_iterator)
    assert tmp.Queue is multiprocessing.Queue and tmp.get_context is multiprocessing.get_context
    st.uninstall()  # idempotent
    # What another library put in place after install() stays in place.
    st.install()

    def theirs(maxsize=0):
        return "theirs"
    tmp.Queue = theirs
    try:
        st.uninstall()
        assert tmp.Queue is theirs and tmp.Pipe is torch_mp["Pipe"]
    finally:
        tmp.Queue = torch_mp["Queue"]


def blog_child(n, num_workers, context, installed_method=None):
    """installed_method: with install(), the DataLoader's multiprocessing_context (None,
    or a start method given as a string)."""
    resource.setrlimit(resource.RLIMIT_NOFILE, (1024, 1024))
    forget_inherited_forkserver()
    maps_before = mapping_count()
    if context is None:
        st.install()
        if installed_method == "default forkserver":  # Python 3.14's default on Linux
            multiprocessing.set_start_method("forkserver", force=True)
            installed_method = None
        loader = DataLoader(Blog(n), num_workers=num_workers,
                            multiprocessing_context=installed_method)
        if installed_method is not None:  # torch's get_context: native queues
            assert isinstance(loader.multiprocessing_context, st._InstalledPolling)
    else:
        loader = DataLoader(Blog(n), num_workers=num_workers,
                            multiprocessing_context=st.context(context))
    it = iter(loader)
    if num_workers:  # install() and context(): the batches come through a native queue
        from shmtensor.multiprocessing.queues import Queue
        assert isinstance(it._worker_result_queue, Queue)
    kept = [batch for batch in it]  # every batch kept, as in the blog post
    assert len(kept) == n
    for i in (0, n // 2, n - 1):
        assert [float(t[0, 9]) for t in kept[i]] == [float(i + k) for k in range(4)]
    assert sum(float(b[3][0, 0]) for b in kept) == sum(range(3, n + 3))
    assert all(t.is_shared() for t in kept[-1]) == (context is None)
    # torch stock needs one fd (file_descriptor) or one mapping (file_system) per tensor
    # kept: 4 * n. Here they are arena segments.
    assert fd_count() < 100, fd_count()
    assert shared_mapping_count() < 100, shared_mapping_count()
    assert mapping_count() - maps_before < 300, (maps_before, mapping_count())


@pytest.mark.parametrize("num_workers", [1, 2])
def test_blog_workload_samples_kept_under_ulimit_1024(strategy, num_workers):
    assert run_in_child(lambda: blog_child(BLOG_KEPT, num_workers, None)) == 0


@pytest.mark.parametrize("method", ["spawn", "forkserver", "default forkserver"])
def test_blog_workload_with_spawn_and_forkserver_workers_all_kept(strategy, method):
    """install() alone reaches workers a new interpreter runs: stock torch in them dies
    after ~250 samples (file_descriptor) or ~16,000 (file_system) at this limit. "default
    forkserver": multiprocessing_context None with forkserver as the default start method,
    as Python 3.14 has it on Linux (the DataLoader then makes its queues with
    torch.multiprocessing.Queue: native ones, for forkserver)."""
    assert run_in_child(lambda: blog_child(BLOG_KEPT, 2, None, method)) == 0


@pytest.mark.parametrize("method", ["fork", "spawn"])
def test_scoped_context_changes_nothing_in_the_caller(method):
    assert run_in_child(lambda: blog_child(2000, 1, method)) == 0
    assert not st.is_installed()


def test_new_shared_storages_live_in_arenas(installed, strategy):
    s = torch.UntypedStorage._new_shared(40)
    assert s.is_shared() and s.nbytes() == 40
    typed = torch.FloatStorage._new_shared(10)  # the legacy typed classes go through it too
    assert typed.is_shared() and typed.size() == 10
    t = torch.tensor([], dtype=torch.float32).set_(typed)
    t.fill_(2.5)
    assert t.is_shared() and t.tolist() == [2.5] * 10
    del s, typed, t

    def empty():  # torch's own; with file_system it connects to torch_shm_manager for good
        e = torch.UntypedStorage._new_shared(0)
        assert e.nbytes() == 0 and st._block_of(e) is None
    assert run_in_child(empty) == 0


def put_and_exit(q):
    st.install()
    q.put(torch.arange(1000, dtype=torch.float64))
    # (No empty tensor here: with file_system torch's own reducer, which empties go to,
    # connects the receiver to torch_shm_manager for the rest of its life.)
    q.put([torch.full((5,), 7), torch.ones(3, dtype=torch.bool)])


# The queues install() makes (torch.multiprocessing's: shmtensor's native ones) and
# multiprocessing's own (a context the user made with the standard library).
QUEUE_KINDS = {"installed": lambda method: tmp.get_context(method),
               "stdlib": lambda method: multiprocessing.get_context(method)}


@needs_bridge
@pytest.mark.parametrize("kind", sorted(QUEUE_KINDS))
@pytest.mark.parametrize("method", ["fork", "spawn"])
def test_a_producer_may_exit_right_after_put(installed, strategy, method, kind):
    ctx = QUEUE_KINDS[kind](method)
    q = ctx.Queue()
    p = ctx.Process(target=put_and_exit, args=(q,))
    p.start()
    p.join(60)
    assert p.exitcode == 0
    a = q.get(timeout=30)
    assert a.dtype == torch.float64 and a.tolist() == [float(i) for i in range(1000)]
    assert a.is_shared()
    full, flags = q.get(timeout=30)
    assert full.tolist() == [7] * 5 and flags.tolist() == [True] * 3
    assert full.is_shared() and flags.is_shared()
    del a, full, flags


def write_and_send_back(q_in, q_out):
    assert st.is_installed()  # inherited (fork) or run before the arguments (spawn)
    t = q_in.get()
    t[1] = 42.0  # a view of the parent's tensor
    q_out.put(t)


@needs_bridge
@pytest.mark.parametrize("method", ["fork", "spawn"])
def test_in_place_move_writes_both_ways_and_identity(installed, strategy, method):
    base = torch.zeros(100)
    view = base[10:20]
    ctx = tmp.get_context(method)
    q_in, q_out = ctx.Queue(), ctx.Queue()
    p = ctx.Process(target=write_and_send_back, args=(q_in, q_out))
    p.start()
    q_in.put(view)
    back = q_out.get(timeout=60)
    p.join(60)
    assert p.exitcode == 0
    assert base.is_shared() and view.is_shared()  # moved in place: every view follows
    assert base[11].item() == 42.0  # the child's write
    # Sent back to its creator, it is the creator's storage.
    assert back.storage().data_ptr() == base.storage().data_ptr()
    assert back.storage_offset() == 10 and back.shape == (10,)
    del base, view, back


@needs_bridge
def test_share_memory_and_model_share_memory(installed, strategy):
    model = torch.nn.Linear(4, 3)
    before = [p.detach().clone() for p in model.parameters()]
    model.share_memory()
    assert all(p.is_shared() for p in model.parameters())
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters()))
    t = torch.arange(10.0)
    assert t.share_memory_() is t and t.is_shared()
    del model, before, t


def test_new_shared_on_a_full_dev_shm_is_shared_memory_full_error(installed):
    import shmtensor
    old = tmp.get_sharing_strategy()
    tmp.set_sharing_strategy("file_system")
    try:
        v = os.statvfs("/dev/shm")
        too_big = v.f_blocks * v.f_frsize + (1 << 30)
        with pytest.raises(shmtensor.SharedMemoryFullError, match="/dev/shm is too small"):
            torch.UntypedStorage._new_shared(too_big)
        s = torch.UntypedStorage._new_shared(64)  # nothing is left half made
        assert s.is_shared() and s.nbytes() == 64
    finally:
        tmp.set_sharing_strategy(old)


def test_strategy_is_torchs_own(installed, strategy):
    import shmtensor
    torch.UntypedStorage._new_shared(8)
    assert shmtensor.get_sharing_strategy() == strategy


def echo(q_in, q_out):
    st.install()  # a spawned child starts without it
    while True:
        item = q_in.get()
        if item is None:
            return
        q_out.put(item)


@needs_bridge
@pytest.mark.parametrize("native", [True, False], ids=["native queue", "torch queue"])
def test_plain_tensors_take_the_bridge_and_others_torchs_reducer(installed, strategy, native,
                                                                 capfd):
    """A plain CPU tensor is one call into the bridge each way; a Parameter, a tensor that
    requires grad and one with a lazy conjugate bit go through torch's reduce_tensor, and
    every one arrives as torch would deliver it (type, requires_grad, values, views)."""
    from multiprocessing.reduction import ForkingPickler
    from shmtensor.multiprocessing import reductions
    plain = torch.arange(12, dtype=torch.float32).view(3, 4)[:, 1:3]
    # (Each pickle made here is loaded here too: an unloaded one keeps its blocks' counts.)
    if native:
        data, blocks = reductions.dumps(plain)
        assert b"shmtensor.torch\x94\x8c\x16_rebuild_tensor_native" in data
        assert torch.equal(reductions.loads(data, blocks), plain)
    else:
        data = bytes(ForkingPickler.dumps(plain))  # its blocks in one frame, as a message's
        assert b"shmtensor.torch\x94\x8c\x16_rebuild_tensor_native" in data
        assert torch.equal(ForkingPickler.loads(data), plain)
    data = bytes(ForkingPickler.dumps(torch.nn.Parameter(torch.ones(2))))
    assert b"torch.multiprocessing.reductions\x94\x8c\x0erebuild_tensor" in data
    assert type(ForkingPickler.loads(data)) is torch.nn.Parameter
    del data
    ctx = st.context("fork") if native else tmp.get_context("fork")
    q_in, q_out = ctx.Queue(), ctx.Queue()
    p = ctx.Process(target=echo, args=(q_in, q_out))
    p.start()
    param = torch.nn.Parameter(torch.full((3,), 2.0))
    grad = torch.full((2,), 3.0, requires_grad=True)
    conj = torch.tensor([1 + 2j, 3 - 4j], dtype=torch.complex64).conj()
    q_in.put([plain, plain.T, param, grad, conj, 7])
    got = q_out.get(timeout=60)
    q_in.put(None)
    p.join(60)
    assert p.exitcode == 0
    back, back_t, back_param, back_grad, back_conj, seven = got
    assert type(back) is torch.Tensor and torch.equal(back, plain)
    assert back.stride() == (4, 1) and back.storage_offset() == 1
    assert torch.equal(back_t, plain.T)
    # Back in the process that made it: the very storage, both views on it.
    assert back.storage().data_ptr() == plain.storage().data_ptr() == back_t.storage().data_ptr()
    assert type(back_param) is torch.nn.Parameter and back_param.requires_grad
    assert torch.equal(back_param.detach(), param.detach())
    assert back_grad.requires_grad and torch.equal(back_grad.detach(), grad.detach())
    # torch 1.13's own reduce_tensor sends the bytes and drops the lazy conjugate bit (stock
    # torch delivers the same); a torch that keeps it delivers the conjugate.
    assert any(torch.equal(back_conj.resolve_conj(), c.resolve_conj()) for c in (conj, conj.conj()))
    assert seven == 7
    del plain, back, back_t, got, param, back_param, back_grad, conj, back_conj
    # Not a leaf: torch's own refusal, which put() reports on stderr and drops the item, as
    # multiprocessing's Queue does (its feeder thread pickles and prints).
    capfd.readouterr()
    q_in.put(grad * 2)
    if native:  # (multiprocessing's feeder prints it later, from its thread)
        assert "RuntimeError: Cowardly refusing" in capfd.readouterr().err
    q_in.put("after")
    assert q_in.get(timeout=60) == "after"
    del grad
    gc.collect()


def write_first(q_in, q_out):
    t = q_in.get()
    t[0] = 5.0
    q_out.put(1)


@needs_bridge
def test_a_tensor_torch_shared_already_stays_in_torchs_memory(strategy):
    """Shared by torch before install() (model.share_memory() of a Hogwild setup): sending
    it or share_memory_() after install() leaves it where it is, so that every process that
    mapped it keeps seeing its writes. (In a child: torch's own reducers leave a resource
    sharer's socket, or a torch_shm_manager connection, for the rest of the process.)"""
    def child():
        t = torch.zeros(10).share_memory_()
        before = t.data_ptr()
        st.install()
        assert t.is_shared() and st._block_of(st._untyped_of(t)) is None
        t.share_memory_()
        ctx = st.context("fork")
        q_in, q_out = ctx.Queue(), ctx.Queue()
        p = ctx.Process(target=write_first, args=(q_in, q_out))
        p.start()
        q_in.put(t)
        assert q_out.get(timeout=60) == 1
        p.join(60)
        assert p.exitcode == 0
        assert t.data_ptr() == before and t[0].item() == 5.0
        assert st._block_of(st._untyped_of(t)) is None
    assert run_in_child(child) == 0


def test_a_tensor_without_data_gets_torchs_own_error(installed):
    """A zero tensor's storage has a size and no data: torch 1.13's reducer refuses it with
    NotImplementedError, and so do we where torch's reducer reaches ours (torch 2.x; stock
    torch 2.13 dies of SIGSEGV there). The bridge once copied from the null pointer: a
    crash, hence the child."""
    from multiprocessing.reduction import ForkingPickler

    def child():
        with pytest.raises(NotImplementedError, match="nullptr storage|with no data"):
            ForkingPickler.dumps(torch._efficientzerotensor(3))
    assert run_in_child(child) == 0


def test_context_queues_poll_in_the_process_that_made_them():
    q = st.context("fork").Queue()
    assert q._q.busy_poll == pytest.approx(50e-6)

    def child():  # a forked child (a DataLoader worker) follows its own process's setting
        assert q._q.busy_poll is None
    assert run_in_child(child) == 0
    assert st.context("fork") is st.context("fork")
    off = st.context("spawn", busy_poll=0)
    assert off is not st.context("spawn") and off.Queue()._q.busy_poll == 0
    assert st.context("forkserver", busy_poll=1e-3).Queue()._q.busy_poll == pytest.approx(1e-3)
    with pytest.raises(ValueError, match="busy_poll"):
        st.context("fork", busy_poll=2)
    with pytest.raises(ValueError, match="busy_poll"):
        st.context("fork", busy_poll=-1e-6)
    with pytest.raises(ValueError, match="cannot find context"):
        st.context("thread")


class InstalledWhenUnpickled:
    """Records, as it is unpickled, whether install() is active in that process."""

    def __reduce__(self):
        return _installed_probe, ()


def _installed_probe():
    probe = InstalledWhenUnpickled()
    mod = sys.modules.get("shmtensor.torch")
    probe.installed = mod is not None and mod.is_installed()
    probe.strategy = tmp.get_sharing_strategy()
    return probe


def report_probe(probe, q):
    q.put((probe.installed, probe.strategy, st.is_installed()))


@pytest.mark.parametrize("method", ["spawn", "forkserver"])
def test_a_child_has_install_before_it_unpickles_its_arguments(strategy, method):
    """spawn and forkserver children of an installed process run install() (with the
    parent's strategy) before they unpickle the Process object; after uninstall() they are
    stock, as are the children of a process that never installed."""
    ctx = multiprocessing.get_context(method)  # the standard library's own context
    for active in (True, False, True):
        if active:
            st.install()
        try:
            q = ctx.SimpleQueue()
            p = ctx.Process(target=report_probe, args=(InstalledWhenUnpickled(), q))
            p.start()
            got = q.get()
            p.join(60)
        finally:
            st.uninstall()
        assert p.exitcode == 0
        if active:
            assert got == (True, strategy, True)
        else:
            assert got[0] is False and got[2] is False
        q.close()


def spawned_fn(i, q, t):
    q.put((i, st.is_installed(), t * (i + 1)))


@needs_bridge  # without it, the children's fresh tensors go by torch's resource_sharer,
# which needs each child alive until the parent has unpickled (torch's own limit)
def test_torch_spawn_and_start_processes_reach_their_children(installed, strategy):
    for start in (lambda *a, **k: tmp.spawn(*a, **k),
                  lambda *a, **k: tmp.start_processes(*a, start_method="forkserver", **k)):
        q = tmp.get_context("spawn").SimpleQueue()
        start(spawned_fn, args=(q, torch.arange(4.0)), nprocs=2)
        got = sorted((q.get() for _ in range(2)), key=lambda r: r[0])
        assert [(i, inst, t.tolist()) for i, inst, t in got] == [
            (0, True, [0.0, 1.0, 2.0, 3.0]), (1, True, [0.0, 2.0, 4.0, 6.0])]
        assert all(t.is_shared() for _, _, t in got)
        del got
        q.close()


def fill_and_report(t):
    t.fill_(float(t.numel()))
    return st.is_installed(), t.sum().item()


@needs_bridge
@pytest.mark.parametrize("method", [None, "spawn"])
def test_torch_pool_is_native_and_writes_reach_the_parent(installed, strategy, method):
    tensors = [torch.zeros(n) for n in (1, 5, 10)]
    pool = tmp.Pool(2) if method is None else tmp.get_context(method).Pool(2)
    with pool:
        from shmtensor.multiprocessing.queues import SimpleQueue
        assert isinstance(pool._inqueue, SimpleQueue)
        assert pool.map(fill_and_report, tensors) == [(True, 1.0), (True, 25.0), (True, 100.0)]
    pool.join()
    assert [t.tolist() for t in tensors] == [[1.0], [5.0] * 5, [10.0] * 10]


KEEPER_CALLS = []  # calls to the fd keeper in this process (test_no_message_...)


def pipe_peer(conn):
    t = conn.recv()
    t += 1
    conn.send(t[:2])
    conn.send(list(KEEPER_CALLS))
    conn.close()


def keeper_calls(t):
    t.fill_(float(t.numel()))
    return list(KEEPER_CALLS)


@needs_bridge
def test_no_message_makes_a_round_trip_to_the_fd_keeper(installed, strategy, monkeypatch):
    """torch.multiprocessing's Queue, Pipe and Pool carry blocks and fds in the message
    itself once installed: nothing registers with or asks shmtensor's fd keeper, here or in
    the (forked) children, which report their own calls."""
    from shmtensor.multiprocessing import keeper
    KEEPER_CALLS.clear()
    for name in ("_register", "register_ticket", "claim_ticket", "_ask"):
        real = getattr(keeper, name)
        monkeypatch.setattr(keeper, name, lambda *a, _real=real, _name=name:
                            KEEPER_CALLS.append(_name) or _real(*a))
    q = tmp.Queue()
    a, b = tmp.Pipe()
    p = tmp.get_context("fork").Process(target=pipe_peer, args=(b,))
    p.start()
    t = torch.zeros(4)
    a.send(t)
    back = a.recv()
    in_child = a.recv()
    p.join(60)
    assert p.exitcode == 0 and back.tolist() == [1.0, 1.0] and t.tolist() == [1.0] * 4
    q.put(torch.ones(3))
    assert q.get(timeout=30).tolist() == [1.0] * 3
    with tmp.get_context("fork").Pool(1) as pool:
        x = torch.zeros(2)
        in_worker = pool.map(keeper_calls, [x])
    pool.join()
    assert x.tolist() == [2.0, 2.0]
    assert KEEPER_CALLS == [] and in_child == [] and in_worker == [[]]
    a.close()
    b.close()
    del back, t, x
    # And the check can fail: a plain pickle of a tensor (not a native message) asks it.
    from multiprocessing.reduction import ForkingPickler
    ForkingPickler.loads(ForkingPickler.dumps(torch.ones(2)))
    assert KEEPER_CALLS
    KEEPER_CALLS.clear()


class Mixed(Dataset):
    """Samples of several dtypes, shapes and layouts, with their values known."""

    def __len__(self):
        return 24

    def __getitem__(self, i):
        base = torch.arange(12, dtype=torch.float64).reshape(3, 4) + i
        return {"f": base, "col": base[:, 1], "t": base.t(), "i": torch.tensor(i),
                "b": torch.tensor([i % 2 == 0, True]), "u8": torch.full((2, 2), i % 256,
                                                                        dtype=torch.uint8),
                "n": i, "s": "x%d" % i}


def count_stacks(counter, worker_id):
    """worker_init_fn: counts the worker's calls of the bridge's stack_shared in counter."""
    real = st._bridge.stack_shared

    def counted(batch):
        out = real(batch)
        if out is not None:
            with counter.get_lock():
                counter.value += 1
        return out
    st._bridge.stack_shared = counted


def collate_child(method):
    import functools
    from torch.utils.data._utils.collate import default_collate
    forget_inherited_forkserver()
    st.install()
    expect = [default_collate([Mixed()[j] for j in range(k, k + 4)]) for k in range(0, 24, 4)]
    stacks = multiprocessing.get_context(method or "fork").Value("i", 0)
    got = list(DataLoader(Mixed(), batch_size=4, num_workers=2, multiprocessing_context=method,
                          worker_init_fn=functools.partial(count_stacks, stacks)))
    assert stacks.value == 6 * 6  # six tensors a batch, six batches: all by the bridge
    assert len(got) == len(expect)
    for g, e in zip(got, expect):
        assert g.keys() == e.keys()
        for key in g:
            if isinstance(e[key], torch.Tensor):
                assert g[key].dtype == e[key].dtype and g[key].shape == e[key].shape, key
                assert g[key].stride() == e[key].stride() and torch.equal(g[key], e[key]), key
                assert g[key].is_shared(), key
            else:
                assert g[key] == e[key], key


class Ragged(Dataset):
    def __len__(self):
        return 4

    def __getitem__(self, i):
        return torch.ones(i + 1)


def ragged_child():
    st.install()
    with pytest.raises(RuntimeError, match="stack expects each tensor to be equal size"):
        list(DataLoader(Ragged(), batch_size=2, num_workers=1))


@needs_bridge
@pytest.mark.parametrize("method", [None, "spawn"])
def test_collate_in_workers_gives_torchs_batches(strategy, method):
    """install() stacks a worker's batch of plain tensors into an arena block in one call
    (default_collate_fn_map[torch.Tensor]); the batches equal torch's default_collate's, and
    what the bridge does not take (ragged shapes) gets torch's own error."""
    from torch.utils.data._utils.collate import default_collate_fn_map
    own = default_collate_fn_map[torch.Tensor]
    assert run_in_child(lambda: collate_child(method)) == 0
    assert run_in_child(ragged_child) == 0
    st.install()
    assert default_collate_fn_map[torch.Tensor] is st._collate_tensor
    st.uninstall()
    assert default_collate_fn_map[torch.Tensor] is own

    def mine(batch, *, collate_fn_map=None):  # a user's own entry stays theirs
        return "mine"
    default_collate_fn_map[torch.Tensor] = mine
    try:
        st.install()
        assert default_collate_fn_map[torch.Tensor] is mine
        st.uninstall()
        assert default_collate_fn_map[torch.Tensor] is mine
    finally:
        default_collate_fn_map[torch.Tensor] = own


class KillsItsWorker(Dataset):
    """Sample 40 SIGKILLs the worker that loads it."""

    def __len__(self):
        return 200

    def __getitem__(self, i):
        if i == 40:
            os.kill(os.getpid(), signal.SIGKILL)
        return torch.full((10,), float(i))


@pytest.mark.parametrize("method", [None, "spawn"])
def test_a_worker_sigkilled_mid_epoch_is_torchs_error_and_nothing_leaks(installed, strategy,
                                                                       method):
    """A worker killed while batches are in flight on the native queues: the DataLoader
    raises torch's own error, and no fd, mapping or /dev/shm name is left (the leak check)."""
    loader = DataLoader(KillsItsWorker(), num_workers=2, multiprocessing_context=method)
    got, batch = [], None
    with pytest.raises(RuntimeError, match="DataLoader worker .*(killed by signal|exited "
                                           "unexpectedly)"):
        for batch in loader:
            got.append(int(batch[0, 0]))
    assert len(got) < 200 and got == list(range(len(got)))
    del loader, got, batch


# ---- the bridge loader (shmtensor/_bridge.py) -------------------------------------------------

BRIDGE_CHECK = r"""
import json, os, sys, warnings
import torch
import shmtensor.torch as st
out = {"has_bridge": st.has_bridge(), "reason": st.bridge_unavailable_reason()}
with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    st.install()
    st.install()
    st.uninstall()
    st.install()
    st.context("fork")
out["warnings"] = [(w.category.__name__, str(w.message)) for w in caught]
# Without the bridge, a DataLoader's batches still travel (worker-made storages in arenas).
data = torch.arange(24.0).reshape(6, 4)
loader = torch.utils.data.DataLoader(data, batch_size=2, num_workers=2,
                                     multiprocessing_context="fork")
assert torch.equal(torch.cat(list(loader)), data)
st.uninstall()
module = sys.modules.get("shmtensor._torch")
out["loaded"] = module.__file__ if module else None
print(json.dumps(out))
"""


def run_bridge_check(tmp_path, **env):
    import json  # noqa: PLC0415
    import subprocess  # noqa: PLC0415
    full = dict(os.environ, SHMTENSOR_CACHE_DIR=str(tmp_path / "cache"), **env)
    r = subprocess.run([sys.executable, "-c", BRIDGE_CHECK], env=full, capture_output=True,
                       text=True, timeout=240)
    assert r.returncode == 0, r.stdout + r.stderr
    return json.loads(r.stdout.splitlines()[-1])


@pytest.mark.parametrize("env, why", [
    ({"SHMTENSOR_TORCH_BRIDGE": "off"}, "SHMTENSOR_TORCH_BRIDGE=off"),
    ({"SHMTENSOR_TORCH_BRIDGE": "compile", "CXX": "/bin/false"}, "compiling it failed"),
    ({"SHMTENSOR_TORCH_BRIDGE": "compile", "CXX": "/nonexistent/c++"}, "no C++ compiler"),
    ({"SHMTENSOR_TORCH_BRIDGE": "sometimes"}, "SHMTENSOR_TORCH_BRIDGE is 'sometimes'"),
])
def test_without_the_bridge_install_works_and_says_why_once(tmp_path, env, why):
    out = run_bridge_check(tmp_path, **env)
    assert out["has_bridge"] is False
    assert why in out["reason"], out["reason"]
    warned = out["warnings"]
    assert len(warned) == 1, warned
    assert warned[0][0] == "RuntimeWarning"
    assert "works without its C++ bridge" in warned[0][1] and why in warned[0][1]
    assert out["loaded"] is None
    if "compiling" in why:  # the compiler's log is kept, and named
        logs = list((tmp_path / "cache" / "torch-bridge").glob("*/build.log"))
        assert len(logs) == 1 and str(logs[0]) in out["reason"]
        assert not list((tmp_path / "cache" / "torch-bridge").glob("*/*.so"))


def test_a_failed_compile_is_not_tried_again_by_the_next_process(tmp_path):
    calls = tmp_path / "compiles"
    cxx = tmp_path / "failing-c++"
    cxx.write_text('#!/bin/sh\ncase " $* " in *" -c "*) echo x >> %s; exit 1;; esac\n'
                   'echo "failing-c++ 1.0"\n' % calls)
    cxx.chmod(0o755)
    env = {"SHMTENSOR_TORCH_BRIDGE": "compile", "CXX": str(cxx)}
    first = run_bridge_check(tmp_path, **env)
    assert "compiling it failed" in first["reason"], first["reason"]
    assert calls.read_text().count("x") == 3  # one per source, once
    second = run_bridge_check(tmp_path, **env)
    assert second["has_bridge"] is False
    assert second["reason"].startswith(first["reason"])
    assert "kept from an earlier try" in second["reason"]
    assert calls.read_text().count("x") == 3  # not compiled again
    for failed in (tmp_path / "cache" / "torch-bridge").glob("*/failed"):
        failed.unlink()
    run_bridge_check(tmp_path, **env)
    assert calls.read_text().count("x") == 6  # compiled again once the record is gone


@needs_bridge
def test_the_packages_own_bridge_loads_without_a_warning(tmp_path):
    out = run_bridge_check(tmp_path)
    assert out["has_bridge"] is True and out["reason"] is None
    assert out["warnings"] == []
    assert out["loaded"] == st._bridge.__file__
    assert not (tmp_path / "cache").exists()  # nothing compiled
