"""shmtensor's DataLoader iterator (shmtensor/_loader.py): which loaders take it, and the
same batches, errors and ends as torch's own iterator on the same loader, with real worker
processes, both strategies, and the leak check after every test."""
import functools
import os
import random
import re
import signal
import threading
import time
import warnings

import pytest

torch = pytest.importorskip("torch", reason="python3-torch is not installed")
np = pytest.importorskip("numpy")
import torch.multiprocessing as tmp  # noqa: E402
from torch.utils.data import (BatchSampler, DataLoader, Dataset, IterableDataset,  # noqa: E402
                              RandomSampler, SequentialSampler, get_worker_info)
from torch.utils.data import dataloader as torch_dataloader  # noqa: E402

import shmtensor.multiprocessing as smp  # noqa: E402
import shmtensor.torch as st  # noqa: E402
from helpers import (forget_inherited_forkserver, run_in_child,  # noqa: E402,F401
                     torch_strategy)  # (fixture `strategy`)
from shmtensor import _C, _loader  # noqa: E402

TORCH_2 = int(torch.__version__.split(".")[0]) >= 2


class Noisy(Dataset):
    """Samples that depend on the worker's random state (random, torch and NumPy, which the
    workers seed) and on which worker loads them: equal across two iterators only if both
    seed the workers alike and give each worker the same batches in the same order."""

    def __init__(self, n=37):
        self.n = n

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        info = get_worker_info()
        return {"i": i, "worker": -1 if info is None else info.id,
                "torch": torch.rand(3), "random": random.random(),
                "numpy": float(np.random.rand())}


class Batched(Noisy):
    """A dataset that loads a batch at once (__getitems__, which torch's fetcher calls with
    the batch's indices)."""

    def __getitems__(self, indices):
        return [dict(self[i], batched=len(indices)) for i in indices]


def collect(loader, epochs=1):
    torch.manual_seed(1234)  # the loader's base seed comes from torch's global generator
    return [list(loader) for _ in range(epochs)]


def same(a, b):
    """Exact equality of nested batches (tensors compared by value, dtype and shape)."""
    if isinstance(a, torch.Tensor):
        return (isinstance(b, torch.Tensor) and a.dtype == b.dtype and a.shape == b.shape
                and torch.equal(a, b))
    if isinstance(a, dict):
        return type(a) is type(b) and a.keys() == b.keys() and all(same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return (type(a) is type(b) and len(a) == len(b)
                and all(same(x, y) for x, y in zip(a, b)))
    return type(a) is type(b) and a == b


def stock_and_ours(make_loader, epochs=1, plain=True):
    """The batches of the loader that make_loader() returns, under torch's iterator
    (nothing installed) and under shmtensor's (install()), checking which iterator ran and
    whether it took its C++ path (plain: every batch came by _C._loader_next; else none).
    Called in a forked child (run_in_child): stock torch's file_system strategy keeps a
    connection to its torch_shm_manager for the rest of the process."""
    assert not st.is_installed()
    # Another loader for the check: a persistent_workers loader keeps its first iterator.
    assert type(iter(make_loader())) is torch_dataloader._MultiProcessingDataLoaderIter
    before = _C._loader_batches()
    stock = collect(make_loader(), epochs)
    assert _C._loader_batches() == before  # torch's iterator never calls it
    st.install()
    try:
        assert type(iter(make_loader())) is _loader.ShmtensorDataLoaderIter
        before = _C._loader_batches()
        ours = collect(make_loader(), epochs)
        taken = _C._loader_batches() - before
    finally:
        st.uninstall()
    if plain:
        assert taken == sum(len(epoch) for epoch in ours) > 0
    else:
        assert taken == 0
    return stock, ours


def double(batch):
    return [(2 * b["i"], b["random"]) for b in batch]


def _seeded(seed):
    return torch.Generator().manual_seed(seed)


# Each a function: a fresh sampler or generator for each loader made.
OPTIONS = {
    "default": lambda: dict(num_workers=2),
    "batch 4, shuffled with a generator": lambda: dict(
        num_workers=2, batch_size=4, shuffle=True, generator=_seeded(7)),
    "batch_size=None": lambda: dict(num_workers=3, batch_size=None),
    "drop_last": lambda: dict(num_workers=2, batch_size=5, drop_last=True),
    "collate_fn": lambda: dict(num_workers=2, batch_size=3, collate_fn=double),
    "sampler": lambda: dict(num_workers=2, batch_size=2,
                            sampler=RandomSampler(range(37), generator=_seeded(3))),
    "batch_sampler": lambda: dict(num_workers=2, batch_sampler=BatchSampler(
        SequentialSampler(range(37)), batch_size=6, drop_last=False)),
    "prefetch_factor=1": lambda: dict(num_workers=2, batch_size=2, prefetch_factor=1),
    "prefetch_factor=5, 3 workers": lambda: dict(num_workers=3, batch_size=2,
                                                 prefetch_factor=5),
    "one worker": lambda: dict(num_workers=1, batch_size=3, shuffle=True),
    "persistent_workers": lambda: dict(num_workers=2, batch_size=4, persistent_workers=True,
                                       shuffle=True),
    "persistent spawn workers": lambda: dict(num_workers=2, batch_size=4,
                                             persistent_workers=True,
                                             multiprocessing_context="spawn"),
    "__getitems__": lambda: dict(dataset=Batched(), num_workers=2, batch_size=5),
    "worker_init_fn": lambda: dict(num_workers=2, batch_size=3,
                                   worker_init_fn=lambda w: random.seed(100 + w)),
    # Without CUDA torch turns pin_memory off (the C++ step then takes every batch); with it,
    # torch's pin thread and _next_data take them.
    "pin_memory": lambda: dict(num_workers=2, batch_size=3, pin_memory=True),
}


@pytest.mark.parametrize("name", sorted(OPTIONS))
def test_the_same_batches_as_torchs_iterator(strategy, name):
    assert run_in_child(lambda: same_batches(name)) == 0


def same_batches(name):
    def make():
        options = OPTIONS[name]()
        return DataLoader(options.pop("dataset", Noisy()), **options)
    pinned = name == "pin_memory" and torch.cuda.is_available()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # torch's own, for pin_memory without CUDA
        stock, ours = stock_and_ours(make, epochs=2, plain=not pinned)
    assert len(stock[0]) == len(ours[0]) > 0
    assert same(stock, ours)
    # Both epochs of each differ (new seeds per epoch), and every worker loaded some.
    assert not same(stock[0], stock[1])
    first = stock[0][0]
    if isinstance(first, dict) and "worker" in first:
        workers = set(int(w) for b in stock[0]
                      for w in torch.as_tensor(b["worker"]).reshape(-1))
        assert workers == set(range(OPTIONS[name]()["num_workers"]))


@pytest.mark.skipif(not TORCH_2, reason="in_order is torch 2.6's (this torch has none)")
def test_not_in_order_gives_the_same_batches_in_some_order(strategy):
    assert run_in_child(same_batches_not_in_order) == 0


def same_batches_not_in_order():
    def make():
        return DataLoader(Noisy(), num_workers=2, batch_size=3, in_order=False)
    stock, ours = stock_and_ours(make)  # every batch by the C++ step
    # Which worker loads a batch depends on timing here (torch gives a task to a worker with
    # room), and so do its random values: the batches' samples are what must agree.
    expected = [list(range(k, min(k + 3, 37))) for k in range(0, 37, 3)]
    assert sorted(b["i"].tolist() for b in stock[0]) == expected
    assert sorted(b["i"].tolist() for b in ours[0]) == expected

    class SlowFirst(Dataset):  # batch 0 is late: the others are returned as they come
        def __len__(self):
            return 8

        def __getitem__(self, i):
            if i == 0:
                time.sleep(0.5)
            return i
    def late_first():
        return [b.tolist() for b in DataLoader(SlowFirst(), num_workers=2, in_order=False)]
    stock = late_first()
    st.install()
    try:
        before = _C._loader_batches()
        got = late_first()
        assert _C._loader_batches() - before == 8
    finally:
        st.uninstall()
    # Worker 0 has tasks 0 and 2 while it sleeps; worker 1 takes every later task.
    assert got == stock
    assert sorted(got) == [[i] for i in range(8)] and got[-2:] == [[0], [2]]


class Shards(IterableDataset):
    """An IterableDataset that shards itself with get_worker_info(), and claims a length."""

    def __init__(self, n, claimed):
        self.n, self.claimed = n, claimed

    def __len__(self):
        return self.claimed

    def __iter__(self):
        info = get_worker_info()
        return iter(range(info.id, self.n, info.num_workers))


def test_an_iterable_dataset_shards_and_warns_as_torch(strategy):
    assert run_in_child(iterable_as_torch) == 0


def iterable_as_torch():
    dataset = Shards(10, claimed=4)  # one object: torch's warning names it

    def run():
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            loader = DataLoader(dataset, num_workers=2, batch_size=2)
            assert len(loader) == 2  # ceil(4 / 2); torch warns after the 4th batch
            batches = [b.tolist() for b in loader]
        return batches, [str(w.message) for w in caught
                         if "Length of IterableDataset" in str(w.message)]
    stock = run()
    st.install()
    try:
        before = _C._loader_batches()
        ours = run()
        # Its length was asked for: torch's __next__, which warns past it.
        assert _C._loader_batches() == before
    finally:
        st.uninstall()
    assert stock == ours
    assert ours[0] == [[0, 2], [1, 3], [4, 6], [5, 7], [8], [9]]
    assert len(ours[1]) == 2  # after batches 5 and 6: more than the 4 samples claimed


_INIT_MARK = -1  # set in a worker by its worker_init_fn


def _mark_worker(worker_id):
    global _INIT_MARK
    _INIT_MARK = 100 + worker_id


class UnevenShards(IterableDataset):
    """Worker w yields 2 + 5 * w samples (w, i, its worker_init_fn's mark): its workers end
    at different times."""

    def __iter__(self):
        w = get_worker_info().id
        return iter(torch.tensor([w, i, _INIT_MARK]) for i in range(2 + 5 * w))


@pytest.mark.parametrize("batch_size,drop_last", [(None, False), (1, False), (7, False),
                                                  (7, True)])
def test_iterable_shards_of_other_lengths_give_torchs_batches(strategy, batch_size, drop_last):
    assert run_in_child(lambda: uneven_shards_as_torch(batch_size, drop_last)) == 0


def uneven_shards_as_torch(batch_size, drop_last):
    """Tasks None or lists of Nones on the boards: persistent workers over 3 epochs, the
    first broken off after one batch, and a non-persistent loader."""
    def epochs(persistent):
        loader = DataLoader(UnevenShards(), batch_size=batch_size, drop_last=drop_last,
                            num_workers=3, persistent_workers=persistent,
                            worker_init_fn=_mark_worker, timeout=60)
        torch.manual_seed(1234)
        out = []
        for e in range(3 if persistent else 1):
            got = []
            for batch in loader:
                got.append(batch)
                if persistent and e == 0 and len(got) == 1:
                    break
            out.append(got)
        return out

    def run():
        before = _C._loader_batches()
        return epochs(True), epochs(False), _C._loader_batches() - before
    stock, ours = stock_then_installed(run)
    assert stock[2] == 0
    taken = ours[2]
    stock, ours = stock[:2], ours[:2]
    assert same(stock, ours)
    # By the C++ step: every batch but those torch's _next_data took after a worker ran out
    # (the step hands over when the next task's worker is no longer active: at most one step
    # for each task a worker had when it ran out, prefetch 2, 3 workers in 4 epochs).
    total = sum(len(e) for e in ours[0] + ours[1])
    assert total - 2 * 3 * 4 <= taken <= total and taken > 0
    # 2 + 7 + 12 samples; by 7: 1 + 1 + 2 batches, or 0 + 1 + 1 dropping the last.
    batches = {None: 21, 1: 21}.get(batch_size, 2 if drop_last else 4)
    assert [len(e) for e in ours[0]] == [1, batches, batches]
    assert [len(e) for e in ours[1]] == [batches]
    marks = {int(m) for e in ours[0] + ours[1] for b in e for m in b.reshape(-1, 3)[:, 2]}
    assert marks == ({101, 102} if drop_last else {100, 101, 102})


class Fails(Dataset):
    def __len__(self):
        return 8

    def __getitem__(self, i):
        if i == 5:
            raise KeyError("no sample %d" % i)
        return i


def test_a_workers_exception_is_raised_as_torch_raises_it(strategy):
    st.install()
    try:
        loader = DataLoader(Fails(), num_workers=2, batch_size=2)
        it = iter(loader)
        assert type(it) is _loader.ShmtensorDataLoaderIter
        assert next(it).tolist() == [0, 1]
        assert next(it).tolist() == [2, 3]
        with pytest.raises(KeyError) as e:
            next(it)
        # torch's ExceptionWrapper: the worker (worker 0 loads batches 0 and 2), its traceback.
        assert "Caught KeyError in DataLoader worker process 0." in str(e.value)
        assert "no sample 5" in str(e.value)
        assert next(it).tolist() == [6, 7]  # the epoch goes on, as torch's does
        with pytest.raises(StopIteration):
            next(it)
    finally:
        st.uninstall()


def test_an_early_break_and_a_new_epoch_stop_the_workers(strategy):
    st.install()
    try:
        loader = DataLoader(Noisy(400), num_workers=2, batch_size=4, prefetch_factor=4)
        before = _C._loader_batches()
        for epoch in range(3):
            it = iter(loader)
            pids = [w.pid for w in it._workers]
            for k, batch in enumerate(it):
                assert batch["i"].tolist() == [4 * k + j for j in range(4)]
                if k == 10 + epoch:
                    break
            it._shutdown_workers()  # what dropping the iterator does (__del__)
            assert [w.is_alive() for w in it._workers] == [False, False]
            assert all(not os.path.exists("/proc/%d" % pid) for pid in pids)
            del it
        assert _C._loader_batches() - before == 11 + 12 + 13
    finally:
        st.uninstall()


class Slow(Dataset):
    def __len__(self):
        return 4

    def __getitem__(self, i):
        if i == 2:
            time.sleep(2)
        return i


@pytest.mark.parametrize("timeout", [0.5, 1])
def test_a_timeout_is_torchs_error(timeout):
    st.install()
    try:
        loader = DataLoader(Slow(), num_workers=1, timeout=timeout)
        it = iter(loader)
        assert type(it) is _loader.ShmtensorDataLoaderIter
        before = _C._loader_batches()
        assert [next(it).tolist(), next(it).tolist()] == [[0], [1]]

        def handed_over():
            raise AssertionError("the C++ step handed the timeout's step to torch's _next_data")
        it._next_data = handed_over  # what __next__ calls when the C++ step hands over
        with pytest.raises(RuntimeError, match=rf"^DataLoader timed out after {timeout} seconds$"):
            next(it)
        assert _C._loader_batches() - before == 2
        it._shutdown_workers()
    finally:
        st.uninstall()


def test_which_loaders_take_it(monkeypatch):
    plain = DataLoader(Noisy(), num_workers=1)
    assert type(iter(plain)) is torch_dataloader._MultiProcessingDataLoaderIter
    scoped = DataLoader(Noisy(), num_workers=1, multiprocessing_context=st.context("fork"))
    assert type(iter(scoped)) is _loader.ShmtensorDataLoaderIter
    assert type(iter(DataLoader(Noisy(), num_workers=0))) is \
        torch_dataloader._SingleProcessDataLoaderIter
    st.install()
    try:
        assert type(iter(plain)) is _loader.ShmtensorDataLoaderIter
        # Asked for torch's: torch's, saying why once.
        monkeypatch.setenv("SHMTENSOR_DATALOADER_ITERATOR", "torch")
        _loader._said.clear()
        with pytest.warns(RuntimeWarning, match="torch's own iterator: "
                          "SHMTENSOR_DATALOADER_ITERATOR=torch"):
            assert type(iter(plain)) is torch_dataloader._MultiProcessingDataLoaderIter
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            assert type(iter(plain)) is torch_dataloader._MultiProcessingDataLoaderIter
    finally:
        st.uninstall()
    assert type(iter(plain)) is torch_dataloader._MultiProcessingDataLoaderIter


_HOOKED = []  # in a worker: whether the worker loop a test put on torch's module ran there


class SaysHooked(Dataset):
    def __len__(self):
        return 6

    def __getitem__(self, i):
        return torch.tensor([i, len(_HOOKED)])


from torch.utils.data._utils import worker as _torch_worker_module  # noqa: E402

_TORCH_LOOP = _torch_worker_module._worker_loop  # torch's own, in this process


def _marking_loop(*args, **kwargs):
    """A worker loop put on torch's worker module: it marks the worker, then runs torch's
    (a module-level function: spawn and forkserver workers get it by name)."""
    _HOOKED.append(True)
    return _TORCH_LOOP(*args, **kwargs)


@pytest.mark.parametrize("method", ["fork", "spawn"])
def test_hooks_put_on_torch_after_import_run_as_under_torchs_iterator(strategy, method):
    assert run_in_child(lambda: hooks_run(method)) == 0


def hooks_run(method):
    """A worker loop put on torch's worker module and a _try_put_index put on torch's
    iterator class after shmtensor was imported: both run under shmtensor's iterator, the
    latter through torch's _next_data (no batch by the C++ step), saying so once."""
    it_class = torch_dataloader._MultiProcessingDataLoaderIter
    original_put = it_class._try_put_index
    puts = []

    def counting_put(self):
        puts.append(True)
        return original_put(self)

    def make():
        return DataLoader(SaysHooked(), num_workers=2, batch_size=2,
                          multiprocessing_context=method)

    _torch_worker_module._worker_loop = _marking_loop
    it_class._try_put_index = counting_put
    try:
        stock = [b.tolist() for b in make()]
        stock_puts = len(puts)
        assert stock == [[[0, 1], [1, 1]], [[2, 1], [3, 1]], [[4, 1], [5, 1]]]
        st.install()
        _loader._said.clear()
        del puts[:]
        before = _C._loader_batches()
        with pytest.warns(RuntimeWarning, match="torch's _try_put_index replaced on "
                          "_MultiProcessingDataLoaderIter: every batch takes torch's _next_data"):
            it = iter(make())
        assert type(it) is _loader.ShmtensorDataLoaderIter
        assert [b.tolist() for b in it] == stock
        assert len(puts) == stock_puts > 0
        assert _C._loader_batches() == before
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # said once
            assert [b.tolist() for b in make()] == stock
        # Both hooks gone: the C++ step again, and torch's worker loop.
        _torch_worker_module._worker_loop, it_class._try_put_index = _TORCH_LOOP, original_put
        assert [b.tolist() for b in make()] == [[[0, 0], [1, 0]], [[2, 0], [3, 0]],
                                                [[4, 0], [5, 0]]]
        assert _C._loader_batches() - before == 3
    finally:
        _torch_worker_module._worker_loop, it_class._try_put_index = _TORCH_LOOP, original_put
        st.uninstall()


class HoldsArrays(Dataset):
    """A dataset holding a 16 MiB NumPy array and a 4 MiB tensor: what each spawned worker
    unpickles."""

    def __init__(self):
        self.array = np.arange(4 << 20, dtype=np.float32)
        self.tensor = torch.arange(1 << 20, dtype=torch.float32)

    def __len__(self):
        return 4

    def __getitem__(self, i):
        import shmtensor.numpy as snp  # noqa: PLC0415 (in the worker)
        return torch.tensor([get_worker_info().id, snp.is_shared(self.array),
                             self.tensor.is_shared(), float(self.array[i << 20]),
                             float(self.tensor[i << 18])])


def rss_shmem_kib():
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("RssShmem:"))


@pytest.mark.parametrize("method", ["spawn", "forkserver"])
def test_spawned_workers_share_one_copy_of_the_datasets_arrays(strategy, method):
    st.install()
    try:
        dataset = HoldsArrays()
        before = rss_shmem_kib()
        loader = DataLoader(dataset, num_workers=2, multiprocessing_context=method)
        batches = [b.tolist() for b in loader]
        # Each worker's dataset lies in shared memory, the array copied there, the tensor
        # moved there in place (as torch does).
        assert batches == [[[i % 2, 1.0, 1.0, float(i << 20), float(i << 18)]]
                           for i in range(4)]
        assert dataset.tensor.is_shared()
        # The parent made one 16 MiB copy of the array for both workers (20 MiB with the
        # tensor; one copy per worker would be 36).
        grown = (rss_shmem_kib() - before) >> 10
        assert 20 <= grown < 28, grown
    finally:
        st.uninstall()



# ---- The C++ path per batch (shmtensor._C._loader_next) ------------------------------------

def test_one_worker_takes_every_batch_by_the_cpp_path(strategy):
    assert run_in_child(one_worker_every_batch_in_cpp) == 0


def one_worker_every_batch_in_cpp():
    """One worker: every batch comes in order, so each __next__ but the epoch's end is one
    C++ call; the batches of a seeded RandomSampler are torch's, in torch's order."""
    def make():
        return DataLoader(Noisy(), num_workers=1, batch_size=3,
                          sampler=RandomSampler(range(37), generator=_seeded(11)))
    stock, ours = stock_and_ours(make, epochs=2)
    assert same(stock, ours)
    st.install()
    try:
        before = _C._loader_batches()
        assert len(list(make())) == 13
        assert _C._loader_batches() - before == 13
    finally:
        st.uninstall()


def outcomes(loader):
    """Each next() of one epoch: ("batch", values) or (exception type, message)."""
    out = []
    it = iter(loader)
    while True:
        try:
            out.append(("batch", next(it).tolist()))
        except StopIteration:
            return out
        except Exception as e:  # noqa: BLE001 (what torch raises is the point)
            out.append((type(e).__name__, str(e)))


def test_a_workers_exception_in_the_cpp_path_is_torchs(strategy):
    assert run_in_child(exception_as_torch) == 0


def exception_as_torch():
    def make():
        return DataLoader(Fails(), num_workers=1, batch_size=2)
    stock = outcomes(make())
    st.install()
    try:
        before = _C._loader_batches()
        ours = outcomes(make())
        assert _C._loader_batches() - before == 3  # batches 0, 1 and 3; batch 2 raised there
    finally:
        st.uninstall()
    assert ours == stock
    assert [kind for kind, _ in ours] == ["batch", "batch", "KeyError", "batch"]
    assert ours[2][1].startswith('Caught KeyError in DataLoader worker process 0.\n'
                                 'Original Traceback (most recent call last):\n')
    assert ours[2][1].endswith("KeyError: 'no sample 5'\n")


class Stalls(Dataset):
    """Sample 0 at once, the others after a minute: the worker is killed meanwhile."""

    def __len__(self):
        return 4

    def __getitem__(self, i):
        if i > 0:
            time.sleep(60)
        return i


def test_a_killed_worker_is_torchs_error(strategy):
    assert run_in_child(killed_worker_as_torch) == 0


def killed_worker_error():
    """Whether the C++ path may take the iterator's steps, and the error of next() while
    the only worker is SIGKILLed, pids made N."""
    it = iter(DataLoader(Stalls(), num_workers=1))
    plain = getattr(it, "_plain", None)
    assert next(it).tolist() == [0]
    # Killed once next() waits for the data queue (a SIGCHLD at another point reaches the
    # interpreter outside torch's get, with torch's iterator too).
    killer = threading.Timer(1.0, os.kill, (it._workers[0].pid, signal.SIGKILL))
    killer.start()
    try:
        with pytest.raises(RuntimeError) as e:
            next(it)
    finally:
        killer.join()
        it._shutdown_workers()
    def n(error):
        return type(error).__name__, re.sub(r"\d+", "N", str(error))
    return plain, n(e.value), n(e.value.__cause__)


def stock_then_installed(fn):
    """(fn() under torch's iterator, fn() under install())."""
    stock = fn()
    st.install()
    try:
        return stock, fn()
    finally:
        st.uninstall()


def killed_worker_as_torch():
    stock, ours = stock_then_installed(killed_worker_error)
    assert stock[0] is None and ours[0] is True
    assert ours[1:] == stock[1:]
    assert ours[1:] == (("RuntimeError", "DataLoader worker (pid(s) N) exited unexpectedly"),
                    ("RuntimeError", "DataLoader worker (pid N) is killed by signal: Killed. "))


class _FailedGet:
    """Just what _get_failed uses of the iterator: a data queue and torch's _try_get_data."""
    _get_failed = _loader.ShmtensorDataLoaderIter._get_failed

    def __init__(self):
        self._data_queue = "the native queue"

    def _try_get_data(self):
        return self._data_queue.get(timeout=5.0)


def test_a_failed_get_leaves_no_cycle_that_keeps_the_iterator():
    # An iterator dropped after a failed get (the 5 s status check, a worker's death) goes
    # at once, with its workers, not at the garbage collector's next run.
    import gc
    import weakref
    it = _FailedGet()
    ref = weakref.ref(it)
    enabled = gc.isenabled()
    gc.disable()
    try:
        with pytest.raises(OSError, match="^the get's error$"):
            it._get_failed(OSError("the get's error"))
        assert it._data_queue == "the native queue"
        del it
        assert ref() is None
    finally:
        if enabled:
            gc.enable()


# ---- Index tasks on the workers' boards (python/src/loader_iter.cc, "Index boards") -------

def test_index_tasks_go_on_the_workers_boards(strategy):
    assert run_in_child(tasks_on_the_boards) == 0


def tasks_on_the_boards():
    """Each task of a map-style loader is an entry of its worker's board: the boards'
    posted entries are the epoch's batches, each worker's half, and the one message each
    worker got is torch's None at the shutdown. An IterableDataset's tasks (None, or a list
    of Nones) are entries too: each worker's batches, the task its end answered, and maybe
    more that it ignores after its end (torch sends them before it learns of the end); its
    one message is the None that marks it done."""
    st.install()
    try:
        for options, batches in ((dict(batch_size=4), 10), (dict(batch_size=None), 37)):
            it = iter(DataLoader(Noisy(), num_workers=2, **options))
            assert [type(q) for q in it._index_queues] == [_loader._BoardQueue] * 2
            assert sum(1 for _ in it) == batches
            assert [q._board.posted for q in it._index_queues] == [
                (batches + 1) // 2, batches // 2]
            assert [q._board.messages for q in it._index_queues] == [1, 1]
        for batch_size, batches in ((4, [3, 3]), (None, [10, 9])):
            it = iter(DataLoader(Shards(19, 19), num_workers=2, batch_size=batch_size))
            assert [type(q) for q in it._index_queues] == [_loader._BoardQueue] * 2
            got = list(it)
            expected = [list(range(w, 19, 2)) for w in (0, 1)]
            if batch_size is None:
                assert sorted(int(b) for b in got) == list(range(19))
            else:
                assert sorted(b.tolist() for b in got) == sorted(
                    e[k:k + 4] for e in expected for k in range(0, len(e), 4))
            for q, n in zip(it._index_queues, batches):
                # At most prefetch_factor x workers tasks out at once, all of them to one
                # worker once the other ended.
                assert n + 1 <= q._board.posted <= n + 4
                assert q._board.messages == 1
    finally:
        st.uninstall()


class Typed(Noisy):
    """Samples that say which type of index the worker was given."""

    def __getitem__(self, i):
        return dict(super().__getitem__(int(i)), index_type=type(i).__name__)


class Mixed:
    """A batch sampler whose batches take the board and the index queue by turns: lists of
    ints (the board), a list longer than an entry (512 indices), a tuple and NumPy ints
    (messages, which must reach the worker as they were: a pickle keeps their types)."""

    def __iter__(self):
        yield [0, 1, 2]
        yield list(range(3, 603))
        yield (603, 604)
        yield [np.int64(605), np.int64(606)]
        yield [607]
        yield [608, 609]
        yield list(range(610, 1200))
        yield [1200]
        yield [True, 1201]  # a bool is an int, but not one of an entry

    def __len__(self):
        return 9


def test_tasks_that_are_not_an_entry_come_in_order_with_those_that_are(strategy):
    assert run_in_child(tasks_in_order) == 0


def tasks_in_order():
    def make():
        return DataLoader(Typed(1202), num_workers=2, batch_sampler=Mixed(),
                          persistent_workers=True)
    stock, ours = stock_and_ours(make, epochs=2)
    assert same(stock, ours)
    types = [sorted(set(b["index_type"])) for b in ours[0]]
    assert types == [["int"], ["int"], ["int"], ["int64"], ["int"], ["int"], ["int"], ["int"],
                     ["bool", "int"]]
    assert [len(b["i"]) for b in ours[0]] == [3, 600, 2, 2, 1, 2, 590, 1, 2]
    st.install()
    try:
        it = iter(make())
        assert sum(1 for _ in it) == 9
        # Worker 0 had batches 0, 2, 4, 6, 8: two on its board ([0, 1, 2] and [607]); worker 1
        # had 1, 3, 5, 7: two ([608, 609] and [1200]).
        assert [q._board.posted for q in it._index_queues] == [2, 2]
    finally:
        st.uninstall()


def test_an_index_board_in_one_process():
    shape = (4, 16)
    memory = _C._make_index_boards(3, *shape)  # worker 1's board, between two others
    board = _C._IndexBoardWriter(memory, 1, *shape)
    reader = _C._IndexBoardReader(memory, 1, *shape)
    others = [_C._IndexBoardReader(memory, w, *shape) for w in (0, 2)]
    q = smp.Queue()
    try:
        native = q._q
        due = object()
        assert reader.take(due) is None
        # What fits an entry: an int (a scalar index) or a list of up to 16 ints.
        assert board.put(0, 7, native) and board.put(1, [], native)
        assert board.put(2, list(range(16)), native) and board.put(3, [-1, 2**63 - 1], native)
        # The ring is full (4 slots, none taken): the next goes as a message.
        assert not board.put(4, [5], native)
        assert reader.take(due) == (0, 7)
        assert board.put(4, [5], native)
        for bad in (list(range(17)), (1, 2), [1.0], [True], np.int64(3), [2**63], "1",
                    [None, 1], [1, None], [None] * 17):
            assert not board.put(5, bad, native), bad
        assert not board.put(-1, [1], native) and not board.put(2**64, [1], native)
        assert board.posted == 5
        assert reader.take(due) == (1, [])
        assert reader.take(due) == (2, list(range(16)))
        board.announce(native)  # a message was sent after 5 entries
        assert reader.take(due) is due  # received before anything else
        reader.received()
        assert reader.take(due) == (3, [-1, 2**63 - 1]) and reader.taken == 4
        assert reader.take(due) == (4, [5])
        assert reader.take(due) is None
        # Nobody slept: no wake-up was sent.
        assert q._q.get(0.0) is None
        assert not reader.about_to_sleep()
        assert board.put(5, [9], native)  # the reader said it sleeps: woken
        assert q._q.get(0.0) == (_C._INDEX_BOARD_WAKE, [])
        reader.woke()
        assert reader.about_to_sleep()  # a task is there: no sleep
        assert reader.take(due) == (5, [9])
        # An IterableDataset's indices: None, or a list of Nones.
        assert board.put(6, None, native) and board.put(7, [None] * 16, native)
        assert reader.take(due) == (6, None)
        assert reader.take(due) == (7, [None] * 16)
        assert [r.take(due) for r in others] == [None, None]  # their boards are their own
    finally:
        q.close()
        q.join_thread()


def test_an_index_board_of_another_shape_is_refused():
    memory = _C._make_index_boards(2, 4, 16)
    for shape in ((3, 16), (4, 8)):  # no larger than the board: its header tells
        with pytest.raises(_C.ProtocolError, match="header is not that of a board of"):
            _C._IndexBoardReader(memory, 1, *shape)
    with pytest.raises(_C.ProtocolError, match="hold no board for worker 2"):
        _C._IndexBoardReader(memory, 2, 4, 16)
    with pytest.raises(_C.ProtocolError, match="hold no board for worker -1"):
        _C._IndexBoardWriter(memory, -1, 4, 16)
    with pytest.raises(ValueError, match="1 or more slots of 1 to 512 indices"):
        _C._make_index_boards(1, 4, 513)
    # An entry the main process does not write (flags, or more indices than an entry holds)
    # is the reader's ProtocolError.
    board = _C._IndexBoardWriter(memory, 0, 4, 16)
    reader = _C._IndexBoardReader(memory, 0, 4, 16)
    words = np.frombuffer(memory, dtype=np.int64)
    q = smp.Queue()
    try:
        assert board.put(0, [1, 2], q._q)
        words[8 + 1] = 99 << 32  # entry 0's count (the high half of its second word)
        with pytest.raises(_C.ProtocolError, match="a task board entry of 99 indices"):
            reader.take(None)
        assert board.put(1, [3], q._q)
        words[8 + 18 + 1] = (1 << 32) | 16  # entry 1: one index, an unknown flag
        with pytest.raises(_C.ProtocolError, match="a task board entry of 1 indices, flags 16"):
            reader.take(None)
    finally:
        q.close()
        q.join_thread()


class Stream(IterableDataset):
    def __iter__(self):
        return iter(range(6))


class StartsAnother(Dataset):
    """A map-style dataset whose pickle (made as a spawn worker starts, inside torch's
    __init__) lets another thread make and run a loader of an iterable dataset meanwhile."""

    others: list = []

    def __len__(self):
        return 4

    def __getitem__(self, i):
        return i

    def __reduce__(self):
        if not StartsAnother.others:
            def other():
                loader = DataLoader(Stream(), num_workers=1, batch_size=2,
                                    multiprocessing_context="fork")
                try:
                    StartsAnother.others.append([b.tolist() for b in loader])
                except Exception as e:  # noqa: BLE001 (the test compares it)
                    StartsAnother.others.append(e)
            t = threading.Thread(target=other)
            t.start()
            t.join()
        return (StartsAnother, ())


class StartsOneInside(StartsAnother):
    """A map-style dataset whose first pickle (as the first of its spawn workers starts)
    makes and runs a map-style loader on the same thread, inside torch's __init__."""

    inner: list = []

    def __len__(self):
        return 8

    def __reduce__(self):
        if not StartsOneInside.inner:
            StartsOneInside.inner.append(None)
            loader = DataLoader(Noisy(6), num_workers=1, batch_size=4,
                                multiprocessing_context="fork", timeout=60)
            StartsOneInside.inner[0] = [b["i"].tolist() for b in loader]
        return (StartsOneInside, ())


def test_a_loader_made_while_another_starts_its_workers_on_the_same_thread(strategy):
    assert run_in_child(one_inside_another) == 0


def one_inside_another():
    """Both loaders' workers take their tasks from their own boards: the outer one's second
    worker, started after the inner loader is done, too."""
    st.install()
    try:
        # (A worker reading its index queue without its board would time out.)
        batches = [b.tolist() for b in DataLoader(StartsOneInside(), num_workers=2,
                                                    batch_size=2, timeout=60,
                                                    multiprocessing_context="spawn")]
        assert batches == [[0, 1], [2, 3], [4, 5], [6, 7]]
        assert StartsOneInside.inner == [[[0, 1, 2, 3], [4, 5]]]
    finally:
        st.uninstall()


def test_a_loader_started_on_another_thread_meanwhile_runs_torchs_worker_loop(strategy):
    assert run_in_child(another_thread_meanwhile) == 0


def another_thread_meanwhile():
    """The board's worker target is the starting thread's only: a loader another thread
    starts while a map-style loader's workers start gets torch's worker loop (no board)."""
    st.install()
    try:
        batches = [b.tolist() for b in DataLoader(StartsAnother(), num_workers=1, batch_size=2,
                                                    multiprocessing_context="spawn")]
        assert batches == [[0, 1], [2, 3]]
        assert StartsAnother.others == [[[0, 1], [2, 3], [4, 5]]]
        from torch.utils.data._utils import worker
        assert worker._worker_loop is _loader._torch_worker_loop
    finally:
        st.uninstall()


@pytest.mark.parametrize("method", ["fork", "spawn", "forkserver"])
def test_a_standard_library_context_takes_the_native_path(strategy, method):
    assert run_in_child(functools.partial(standard_library_context, method)) == 0


def standard_library_context(method):
    """A DataLoader given a context of the standard library's (an object, or a start method
    named before install(), which torch resolved then): under install() its workers start by
    that method and the batches come natively, every one by the C++ path, the same as
    torch's; the loader keeps its context."""
    import multiprocessing
    forget_inherited_forkserver()
    given = multiprocessing.get_context(method)

    def make():
        return DataLoader(Noisy(), num_workers=2, batch_size=3, multiprocessing_context=given,
                          sampler=RandomSampler(range(37), generator=_seeded(5)))
    stock, ours = stock_and_ours(make)
    assert same(stock, ours)
    named_before = DataLoader(Noisy(), num_workers=2, batch_size=3,
                              multiprocessing_context=method)
    assert type(named_before.multiprocessing_context) is type(given)
    st.install()
    try:
        for loader in (make(), named_before):
            before = _C._loader_batches()
            it = iter(loader)
            assert _loader._native(it._worker_result_queue, False)
            assert all(type(q) is _loader._BoardQueue for q in it._index_queues)
            assert [w._start_method for w in it._workers] == [method, method]
            assert sum(len(b["i"]) for b in it) == 37
            assert _C._loader_batches() - before == 13
            assert loader.multiprocessing_context is (given if loader is not named_before
                                                      else named_before.multiprocessing_context)
            assert type(loader.multiprocessing_context) is type(given)
    finally:
        st.uninstall()


def test_the_batches_get_polls_only_with_a_cpu_to_spare():
    assert run_in_child(polls_only_with_a_cpu_to_spare) == 0


def polls_only_with_a_cpu_to_spare():
    """The data queue's get polls (install()'s 50 us) while the workers leave a CPU of the
    process's affinity mask to it; with as many workers as CPUs it sleeps at once, and the
    batches are the same."""
    st.install()
    try:
        def data_queue_poll(workers):
            it = iter(DataLoader(Noisy(8), num_workers=workers, batch_size=2))
            batches = [b["i"].tolist() for b in it]
            assert batches == [[0, 1], [2, 3], [4, 5], [6, 7]]
            return it._worker_result_queue._q.busy_poll
        allowed = sorted(os.sched_getaffinity(0))
        os.sched_setaffinity(0, {allowed[0]})  # one CPU
        assert data_queue_poll(1) == 0
        assert data_queue_poll(2) == 0
        if len(allowed) >= 2:
            os.sched_setaffinity(0, set(allowed[:2]))  # two CPUs
            assert data_queue_poll(1) == pytest.approx(50e-6)
            assert data_queue_poll(2) == 0
    finally:
        st.uninstall()


def test_a_board_has_twice_prefetch_factor_slots_up_to_256():
    def shape(**options):
        return _loader._board_shape(DataLoader(Noisy(), num_workers=2, **options))
    assert shape() == (4, 16)
    assert shape(batch_size=None, prefetch_factor=1) == (4, 16)
    assert shape(batch_size=600, prefetch_factor=5) == (10, 512)
    assert shape(batch_size=20, prefetch_factor=128) == (256, 20)
    assert shape(batch_size=3, prefetch_factor=10**6) == (256, 16)  # not 2e6 slots (288 MB)


def test_more_tasks_out_than_a_boards_slots(strategy):
    assert run_in_child(more_tasks_than_slots) == 0


def more_tasks_than_slots():
    """prefetch_factor 300: 300 tasks out per worker, a board of 256 slots; the tasks that
    find it full go as messages, in order."""
    def make(**options):
        return DataLoader(Noisy(900), num_workers=2, batch_size=1, prefetch_factor=300,
                          **options)
    stock, ours = stock_and_ours(make)
    assert same(stock, ours)
    st.install()
    try:
        # The workers take nothing before the check (their worker_init_fn waits).
        go = tmp.get_context("fork").Event()
        it = iter(make(worker_init_fn=functools.partial(wait_for, go)))
        # Each worker was given 300 tasks at once: 256 on its board, 44 as messages.
        assert [q._board.posted for q in it._index_queues] == [256, 256]
        go.set()
        assert [b["i"].item() for b in it] == list(range(900))
    finally:
        st.uninstall()


def wait_for(event, worker_id):
    event.wait()


# An entry's second word: flags (low half) and count (high half).
CORRUPT_ENTRIES = {
    "more indices than an entry holds": 99 << 32,
    "None itself (scalar, none) with a count of 2": (2 << 32) | 4 | 8,
    "Nones in a message": (2 << 32) | 2 | 8,
    "Nones and reset": (2 << 32) | 1 | 8,
    "a flag of no meaning": (2 << 32) | 16,
}


@pytest.mark.parametrize("corrupt", sorted(CORRUPT_ENTRIES))
def test_a_worker_that_reads_a_corrupt_board_entry_is_a_dead_worker(strategy, corrupt):
    assert run_in_child(lambda: corrupt_entry(CORRUPT_ENTRIES[corrupt])) == 0


def corrupt_entry(word):
    """An entry the main process does not write (its second word `word`): the worker's
    ProtocolError ends it, and next() raises torch's error for a dead worker."""
    boards = []
    make_boards = _C._make_index_boards

    def recorded(*shape):
        boards.append(make_boards(*shape))
        return boards[-1]
    _C._make_index_boards = recorded
    st.install()
    try:
        go = tmp.get_context("fork").Event()
        it = iter(DataLoader(Noisy(), num_workers=1, batch_size=2,
                             worker_init_fn=functools.partial(wait_for, go)))
        words = np.frombuffer(boards[0], dtype=np.int64)  # worker 0's board first
        assert words[8:11].tolist() == [0, 2 << 32, 0]  # entry 0: id 0, 2 indices: 0, 1
        words[9] = word
        go.set()
        with pytest.raises(RuntimeError, match=r"DataLoader worker \(pid\(s\) \d+\) exited "
                                               r"unexpectedly$"):
            next(it)
        del it
    finally:
        st.uninstall()
        _C._make_index_boards = make_boards


class Unpicklable:
    """A batch sampler whose second batch cannot be pickled."""

    def __iter__(self):
        yield [0, 1]
        yield [2, threading.Lock()]
        yield [4, 5]

    def __len__(self):
        return 3


def test_an_index_that_cannot_be_pickled_is_lost_as_with_torch(strategy):
    assert run_in_child(unpicklable_index) == 0


def unpicklable_index():
    """The task that cannot be sent is reported and lost, as by torch's queue: the batches
    before it come, then torch's timeout (the worker does not wait for it before taking the
    tasks on its board)."""
    def outcome():
        got = []
        try:
            for batch in DataLoader(Noisy(6), num_workers=1, batch_sampler=Unpicklable(),
                                    timeout=2):
                got.append(batch["i"].tolist())
        except RuntimeError as e:
            got.append(str(e))
        return got
    stock, ours = stock_then_installed(outcome)
    assert stock == ours == [[0, 1], "DataLoader timed out after 2 seconds"]
