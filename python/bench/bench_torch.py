"""Benchmark: torch stock against shmtensor.torch, in one run (docs/torch.md has the figures).

    PYTHONPATH=build/python /usr/bin/python3 python/bench/bench_torch.py [--quick] [--plot FILE]
                                                                          [--json FILE]

Each scenario runs in a fresh process (so install() and the strategy apply to it alone, and
stock torch's failures do not poison the next one), under ulimit -n 1024:

  blog      the blog workload: DataLoader(num_workers=W) over samples of four torch.randn(10),
            every batch kept in a list; samples/s, and the consumer's fds and shared-memory
            mappings at the end (or torch's error, if it fails first). Modes: stock,
            install (shmtensor.torch.install(): torch.multiprocessing's queues become
            shmtensor's native ones), context (multiprocessing_context=
            shmtensor.torch.context("fork")), and inline (the same loop with num_workers=0:
            no process, no shared memory; what workers must beat). --iterator compares
            install() with torch's DataLoader iterator (SHMTENSOR_DATALOADER_ITERATOR=torch)
            and with shmtensor's, busy polling off, with the consumer's CPU per batch. Workers are forked, or
            started by spawn or forkserver (multiprocessing_context="spawn", ... for stock
            and install; context("spawn"), ... for the context).
  queue     torch.multiprocessing.Queue, fork, one consumer: fresh 40 B tensors
            (torch.ones), fresh 64 MiB tensors (torch.ones), and one pre-shared 40 B tensor
            sent again and again; messages/s.
  pingpong  a fresh 40 B tensor through a torch.multiprocessing.Pipe, a small int back; the
            median round trip.
  workload  (--goals ROUNDS) the DataLoader goals' workloads, 2 workers, file_system: blog
            (batch 1, 4,000 samples), tokens (windows of 2,048 int64 tokens from an array
            in memory, batch 16, 64,000 samples) and images (3x224x224 uint8, batch 64, 6,400
            samples); stock, install()
            and num_workers=0, each batch dropped as it comes.
  dataset   (--dataset MIB) spawn and forkserver workers of a dataset holding MIB MiB in a
            tensor or a NumPy array: time to the first batch, each process's memory.
  ready     (--ready ROUNDS) the consumer's next() on blog batches already waiting (2
            workers, prefetch 64, file_system), stock and install(): µs per call (median)
            and the consumer's CPU per call (which counts waking a sleeping worker).
  steps     (--steps N) a blog batch's path under install(), step by step, in one process
            (no sleep, no wake-up, no other process): the index task put on a worker's
            board and taken (and, for comparison, the index message a queue carried before),
            the worker's fetch (its collate stacks into arena blocks, as in a worker
            process), the batch's tensor message encoded, put, taken and decoded, and the
            batch dropped; then the fetch of num_workers=0. Medians of 5 rounds of N
            batches, µs per batch.
"""
import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import time


def fds():
    return len(os.listdir("/proc/self/fd"))


def shared_mappings():
    with open("/proc/self/maps") as f:
        return sum(1 for line in f if "/dev/shm/" in line or "memfd:" in line)


def setup(mode, strategy):
    import torch.multiprocessing as tmp
    tmp.set_sharing_strategy(strategy)
    if mode in ("install", "torchiter", "consumer", "consumer-torchiter"):
        import shmtensor.torch
        if mode.endswith("torchiter"):  # install() with torch's own DataLoader iterator
            os.environ["SHMTENSOR_DATALOADER_ITERATOR"] = "torch"
        # consumer*: no busy polling, so that the consumer's CPU time is its work
        shmtensor.torch.install(busy_poll=0 if mode.startswith("consumer") else None)


class Blog:
    """The blog post's dataset: four torch.randn(10) per sample (a module-level class, so
    that spawned and forkserver workers can unpickle it)."""

    def __init__(self, n):
        self.n = n

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        import torch
        return [torch.randn(10) for _ in range(4)]


def blog(mode, strategy, n, workers, method="fork"):
    from torch.utils.data import DataLoader
    setup(mode, strategy)

    kw = {}
    if mode == "context":
        import shmtensor.torch
        kw["multiprocessing_context"] = shmtensor.torch.context(method)
    elif mode == "inline":
        workers = 0
    elif method != "fork":
        kw["multiprocessing_context"] = method
    kept, error = [], None
    usage = resource.getrusage(resource.RUSAGE_SELF)
    start = time.perf_counter()
    steady = usage  # from the STEADY_FROM-th batch on: without the workers' start
    try:
        for batch in DataLoader(Blog(n), num_workers=workers, **kw):
            kept.append(batch)
            if len(kept) == STEADY_FROM:
                steady = resource.getrusage(resource.RUSAGE_SELF)
    except Exception as e:  # torch's own failure, reported as it is
        error = "%s: %s" % (type(e).__name__, str(e).splitlines()[0][:160])
    elapsed = time.perf_counter() - start
    end = resource.getrusage(resource.RUSAGE_SELF)

    def cpu_us(since, batches):
        cpu = end.ru_utime - since.ru_utime + end.ru_stime - since.ru_stime
        return cpu / max(batches, 1) * 1e6
    return {"samples": len(kept), "per_s": len(kept) / elapsed, "fds": fds(),
            "mappings": shared_mappings(), "error": error,
            "consumer_us": cpu_us(usage, len(kept)),
            "consumer_steady_us": cpu_us(steady, len(kept) - STEADY_FROM)}


STEADY_FROM = 200


def queue(mode, strategy, what, n):
    import torch
    import torch.multiprocessing as tmp
    setup(mode, strategy)
    ctx = tmp.get_context("fork")
    q, done = ctx.Queue(), ctx.Queue()

    def consume():
        for _ in range(n):
            t = q.get()
            del t
        done.put(0)

    p = ctx.Process(target=consume)
    p.start()
    pre = torch.ones(10)
    pre.share_memory_()
    start = time.perf_counter()
    for _ in range(n):
        if what == "fresh_40B":
            q.put(torch.ones(10))
        elif what == "fresh_64MiB":
            q.put(torch.ones(16 << 20))
        else:
            q.put(pre)
    done.get()
    elapsed = time.perf_counter() - start
    p.join()
    return {"per_s": n / elapsed}


def pingpong(mode, strategy, n):
    import torch
    import torch.multiprocessing as tmp
    setup(mode, strategy)
    ctx = tmp.get_context("fork")
    a, b = ctx.Pipe()

    def echo():  # a tensor one way, a small reply back (torch's fd strategy cannot send a
        for _ in range(n):  # received storage on again once its fd is closed)
            t = b.recv()
            b.send(int(t[0]))
            del t

    p = ctx.Process(target=echo)
    p.start()
    times = []
    for _ in range(n):
        t = torch.ones(10)
        start = time.perf_counter()
        a.send(t)
        a.recv()
        times.append(time.perf_counter() - start)
    p.join()
    return {"p50_us": statistics.median(times) * 1e6}


class Held:
    """A dataset holding `mib` MiB in one tensor or NumPy array: what a spawned or
    forkserver worker gets as a pickle."""

    def __init__(self, kind, mib):
        import numpy as np
        import torch
        n = mib << 18
        self.data = (torch.arange(n, dtype=torch.float32) if kind == "tensor"
                     else np.arange(n, dtype=np.float32))
        self.rows = n // 1024

    def __len__(self):
        return self.rows

    def __getitem__(self, i):
        import torch
        return torch.as_tensor(self.data[i * 1024:(i + 1) * 1024]).sum()


class Tokens:
    """LLM-style samples: windows of 2,048 int64 tokens sliced from a 16 Mi-token array in
    memory (batch 16: a 256 KiB batch)."""

    def __init__(self, n):
        import torch
        self.n = n
        self.tokens = torch.randint(0, 50000, (1 << 24,), generator=torch.Generator().manual_seed(0))

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        start = (i * 7919) % (len(self.tokens) - 2049)
        return self.tokens[start:start + 2048]


class Images:
    """Image-like samples: a 3x224x224 uint8 tensor (batch 64: a 9.6 MB batch)."""

    def __init__(self, n):
        self.n = n

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        import torch
        return torch.full((3, 224, 224), i % 256, dtype=torch.uint8)


WORKLOADS = {"blog": (Blog, 1, 4000), "tokens": (Tokens, 16, 64000), "images": (Images, 64, 6400)}


def workload(mode, strategy, name, workers):
    """One run of a workload of WORKLOADS, every batch dropped at once: samples/s."""
    from torch.utils.data import DataLoader
    setup(mode, strategy)
    cls, batch_size, n = WORKLOADS[name]
    loader = DataLoader(cls(n), batch_size=batch_size,
                        num_workers=0 if mode == "inline" else workers)
    count, error = 0, None
    start = time.perf_counter()
    try:
        for batch in loader:
            count += len(batch[0]) if isinstance(batch, list) else len(batch)
            del batch
    except Exception as e:  # torch's own failure, reported as it is
        error = "%s: %s" % (type(e).__name__, str(e).splitlines()[0][:160])
    return {"per_s": count / (time.perf_counter() - start), "samples": count, "error": error}


def ready(mode, strategy):
    """The consumer's next() on blog batches that are already waiting (2 workers, prefetch
    64: the workers fill what may be out, then each next() takes one): µs per call (the
    median) and the consumer's CPU per call (thread time, which also counts waking a worker
    that sleeps for its next task)."""
    from torch.utils.data import DataLoader
    setup(mode, strategy)
    prefetch, workers = 64, 2
    it = iter(DataLoader(Blog(1 << 20), num_workers=workers, prefetch_factor=prefetch))
    next(it)
    time.sleep(1.5)  # the workers fill what may be out
    calls = prefetch * workers - 8
    times = []
    ns = time.perf_counter_ns
    cpu = time.thread_time_ns()
    for _ in range(calls):
        t0 = ns()
        batch = next(it)
        times.append(ns() - t0)
        del batch
    cpu = time.thread_time_ns() - cpu
    return {"median_us": statistics.median(times) / 1e3, "cpu_us": cpu / calls / 1e3}


def rss_mib(pid):
    out = {}
    with open("/proc/%d/status" % pid) as f:
        for line in f:
            if line.startswith(("RssAnon", "RssShmem", "RssFile", "VmRSS")):
                key, value = line.split(":")
                out[key] = int(value.split()[0]) >> 10
    return out


def dataset(mode, kind, method, mib):
    """Time to the first batch of a DataLoader (2 workers started by `method`) over Held,
    and each process's memory once 21 batches came."""
    from torch.utils.data import DataLoader
    setup(mode, "file_descriptor")
    loader = DataLoader(Held(kind, mib), num_workers=2, batch_size=64,
                        multiprocessing_context=method)
    start = time.perf_counter()
    it = iter(loader)
    next(it)
    first = time.perf_counter() - start
    for _ in range(20):
        next(it)
    return {"first_batch_s": first, "workers": [rss_mib(w.pid) for w in it._workers],
            "main": rss_mib(os.getpid())}


def child_main(args):
    resource.setrlimit(resource.RLIMIT_NOFILE, (1024, 1024))
    kind = args[0]
    if kind == "dataset":
        out = dataset(args[1], args[2], args[3], int(args[4]))
    elif kind == "ready":
        out = ready(args[1], args[2])
    elif kind == "workload":
        out = workload(args[1], args[2], args[3], int(args[4]))
    elif kind == "blog":
        out = blog(args[1], args[2], int(args[3]), int(args[4]), *args[5:6])
    elif kind == "queue":
        out = queue(args[1], args[2], args[3], int(args[4]))
    else:
        out = pingpong(args[1], args[2], int(args[3]))
    print(json.dumps(out))


def run(*args, timeout=900):
    r = subprocess.run([sys.executable, __file__, "--child", *map(str, args)],
                       capture_output=True, text=True, timeout=timeout)
    if args[:2] in (("blog", "stock"), ("queue", "stock")):
        # Stock torch's file_system segments (one per tensor) and its torch_shm_manager are
        # torn down after the child exits: let that pass before the next scenario runs, or it
        # takes CPU from it (docs/torch.md: install(), which ran right after stock, measured
        # below the context without this pause and level with it with the pause).
        time.sleep(2)
    lines = [line for line in r.stdout.splitlines() if line.startswith("{")]
    if r.returncode != 0 or not lines:
        tail = (r.stderr.strip().splitlines() or ["?"])[-1]
        return {"error": "exit %d: %s" % (r.returncode, tail[:160])}
    return json.loads(lines[-1])


def steps(n):
    """--steps: a blog batch's path under install(), step by step, in one process."""
    import torch  # noqa: F401
    import shmtensor.torch
    shmtensor.torch.install()
    import torch.multiprocessing as tmp
    from torch.utils.data._utils import worker as torch_worker
    from torch.utils.data._utils.collate import default_collate
    from torch.utils.data._utils.fetch import _MapDatasetFetcher
    from shmtensor.multiprocessing import reductions
    # torch's collate stacks into shared memory only in a worker: this process says it is one.
    torch_worker._worker_info = torch_worker.WorkerInfo(id=0, num_workers=1, seed=0,
                                                        dataset=None)
    fetcher = _MapDatasetFetcher(Blog(1 << 40), True, default_collate, False)
    from shmtensor import _C, _loader
    index_q, data_q = tmp.Queue(), tmp.Queue()
    native = data_q._q
    # A worker's index board as shmtensor's iterator makes it (batch_size 1, prefetch 2): the
    # main process's put (what _C._loader_next calls) and the worker's get.
    shape = (4, 16)
    memory = _C._make_index_boards(1, *shape)
    board = _C._IndexBoardWriter(memory, 0, *shape)
    worker_q = _loader._BoardIndexQueue(index_q, _C._IndexBoardReader(memory, 0, *shape))
    index_native = index_q._q
    names = ("index task put", "index task taken", "fetch", "encode", "put", "take", "decode",
             "drop")
    rounds = {k: [] for k in names + ("index message (queue)", "fetch, num_workers=0")}
    ns = time.perf_counter_ns
    for _ in range(5):
        acc = dict.fromkeys(names, 0)
        for i in range(n):
            tp = ns()
            board.put(i, [i], index_native)
            t0 = ns()
            idx, index = worker_q.get(timeout=5.0)
            t1 = ns()
            batch = fetcher.fetch(index)
            t2 = ns()
            data, blocks = reductions.dumps((idx, batch))
            t3 = ns()
            native.put(data, blocks, 0.0)
            t4 = ns()
            item = native.get(5.0)
            t5 = ns()
            got = reductions.loads(*item)
            t6 = ns()
            del got, item, batch, data, blocks
            t7 = ns()
            for k, a, b in zip(names, (tp, t0, t1, t2, t3, t4, t5, t6),
                               (t0, t1, t2, t3, t4, t5, t6, t7)):
                acc[k] += b - a
        for k in names:
            rounds[k].append(acc[k] / n / 1e3)
        t0 = ns()
        for i in range(n):  # what the index queue carried before the board
            index_q.put((i, [i]))
            index_q.get(timeout=5.0)
        rounds["index message (queue)"].append((ns() - t0) / n / 1e3)
    shmtensor.torch.uninstall()
    torch_worker._worker_info = None
    for _ in range(5):
        t0 = ns()
        for i in range(n):
            fetcher.fetch([i])
        rounds["fetch, num_workers=0"].append((ns() - t0) / n / 1e3)
    for k, v in rounds.items():
        print("%-22s %6.2f us  (rounds: %s)" % (k, statistics.median(v),
                                              " ".join("%.2f" % x for x in v)))
    return 0


def readies(n):
    """--ready: the consumer's next() on waiting batches, stock and install() in turn."""
    got = {"stock": [], "install": []}
    for _ in range(n):
        for mode in got:
            r = run("ready", mode, "file_system")
            got[mode].append(r)
            print("%-8s next() %7.2f us  CPU %7.2f us per call" % (
                mode, r.get("median_us", 0), r.get("cpu_us", 0)), flush=True)
    for mode, rs in got.items():
        print("%-8s medians of %d: next() %.2f us, CPU %.2f us per call" % (
            mode, n, statistics.median(r.get("median_us", 0) for r in rs),
            statistics.median(r.get("cpu_us", 0) for r in rs)))
    return 0


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--plot", default=None)
    ap.add_argument("--json", default=None)
    ap.add_argument("--demo", action="store_true",
                    help="the flagship demo of `make run`: the blog workload, stock and installed")
    ap.add_argument("--rounds", type=int, default=0,
                    help="only the blog workload side by side (file_system, 4,000 samples, "
                         "1 and 2 workers): this many rounds of stock, install, context and "
                         "inline in turn; each run's samples/s, the medians and their ratios")
    ap.add_argument("--iterator", type=int, default=0, metavar="ROUNDS",
                    help="only install() with torch's DataLoader iterator against "
                         "shmtensor's (blog workload, file_system, 8,000 samples, busy "
                         "polling off): samples/s and the consumer's CPU per batch")
    ap.add_argument("--goals", type=int, default=0, metavar="ROUNDS",
                    help="only the DataLoader goals' workloads side by side (blog, tokens, "
                         "images; file_system, 2 workers): stock, install() and "
                         "num_workers=0 in turn, ROUNDS times; samples/s and the ratios")
    ap.add_argument("--dataset", type=int, default=0, metavar="MIB",
                    help="only spawn and forkserver workers of a dataset holding MIB MiB "
                         "(a tensor, then a NumPy array), stock and install(): time to the "
                         "first batch, and each process's anonymous and shared memory")
    ap.add_argument("--steps", type=int, default=0, metavar="N",
                    help="only a blog batch's path under install(), step by step in one "
                         "process: µs per batch, medians of 5 rounds of N batches")
    ap.add_argument("--ready", type=int, default=0, metavar="ROUNDS",
                    help="only the consumer's next() on blog batches already waiting (2 "
                         "workers, prefetch 64, file_system), stock and install() in turn: "
                         "µs per call and the consumer's CPU per call, medians of ROUNDS")
    ap.add_argument("--child", nargs=argparse.REMAINDER)
    a = ap.parse_args()
    if a.child:
        return child_main(a.child)
    if a.ready:
        return readies(a.ready)
    if a.steps:
        return steps(a.steps)
    if a.dataset:
        return datasets(a.dataset)
    if a.iterator:
        return iterators(a.iterator)
    if a.goals:
        return goals(a.goals)
    if a.demo:
        return demo()
    if a.rounds:
        return rounds(a.rounds)
    results = {"blog": [], "queue": [], "pingpong": []}

    def blog_row(mode, strategy, n, workers, method="fork"):
        r = run("blog", mode, strategy, n, workers, method)
        r.update(mode=mode, strategy=strategy, n=n, workers=0 if mode == "inline" else workers,
                 method=method)
        results["blog"].append(r)
        print("blog %-8s %-15s n=%-6d W=%d %-10s %8.0f samples/s  fds %5s  maps %5s  %s"
              % (mode, strategy, n, r["workers"], method, r.get("per_s", 0), r.get("fds"),
                 r.get("mappings"), r.get("error") or ""), flush=True)

    sizes = [4000] if a.quick else [4000, 20000]
    for strategy in ("file_descriptor", "file_system"):
        for n in sizes:
            blog_row("inline", strategy, n, 0)
            for workers in (1, 2):
                for mode in ("stock", "install", "context"):
                    blog_row(mode, strategy, n, workers)
        for method in ("spawn", "forkserver"):
            for mode in ("stock", "install", "context"):
                blog_row(mode, strategy, sizes[0], 2, method)
    for strategy in ("file_descriptor", "file_system"):
        for what, n in (("fresh_40B", 2000), ("fresh_64MiB", 20), ("preshared_40B", 5000)):
            for mode in ("stock", "install"):
                r = run("queue", mode, strategy, what, n // 4 if a.quick else n)
                r.update(mode=mode, strategy=strategy, what=what)
                results["queue"].append(r)
                print("queue %-8s %-15s %-14s %10.0f msg/s %s"
                      % (mode, strategy, what, r.get("per_s", 0), r.get("error") or ""),
                      flush=True)
        for mode in ("stock", "install"):
            r = run("pingpong", mode, strategy, 500 if a.quick else 2000)
            r.update(mode=mode, strategy=strategy)
            results["pingpong"].append(r)
            print("pingpong %-8s %-15s p50 %8.1f us %s"
                  % (mode, strategy, r.get("p50_us", 0), r.get("error") or ""), flush=True)
    if a.json:
        with open(a.json, "w") as f:
            json.dump(results, f, indent=1)
    if a.plot:
        plot(results, a.plot)


def rounds(count, n=4000, strategy="file_system"):
    import torch
    print("torch %s, blog workload, %s, %d samples, %d alternating rounds (samples/s)"
          % (torch.__version__, strategy, n, count))
    modes = ("stock", "install", "context", "inline")
    for workers in (1, 2):
        rates = {m: [] for m in modes}
        for _ in range(count):
            for mode in modes:
                r = run("blog", mode, strategy, n, workers)
                rates[mode].append(r.get("per_s", 0) if not r.get("error") else 0)
        med = {m: statistics.median(v) for m, v in rates.items()}
        for mode in modes:
            print("  W=%d %-8s %s  median %6.0f" % (
                0 if mode == "inline" else workers, mode,
                " ".join("%6.0f" % v for v in rates[mode]), med[mode]))
        if med["stock"]:
            print("  W=%d install/stock %.1fx  context/stock %.1fx  install/inline %.2fx"
                  % (workers, med["install"] / med["stock"], med["context"] / med["stock"],
                     med["install"] / med["inline"]), flush=True)


def goals(count, workers=2, strategy="file_system"):
    import torch
    print("torch %s, %s, %d workers, %d alternating rounds of stock, install() and "
          "num_workers=0 (samples/s; batches dropped as they come)"
          % (torch.__version__, strategy, workers, count))
    modes = ("stock", "install", "inline")
    for name, (cls, batch_size, n) in WORKLOADS.items():
        rates = {m: [] for m in modes}
        for _ in range(count):
            for mode in modes:
                r = run("workload", mode, strategy, name, workers)
                rates[mode].append(0 if r.get("error") else r["per_s"])
        med = {m: statistics.median(v) for m, v in rates.items()}
        for mode in modes:
            print("  %-6s (batch %2d, %d samples) %-7s %s  median %7.0f" % (
                name, batch_size, n, mode, " ".join("%7.0f" % v for v in rates[mode]),
                med[mode]))
        print("  %-6s install/stock %.2fx  install/num_workers=0 %.2fx" % (
            name, med["install"] / max(med["stock"], 1), med["install"] / max(med["inline"], 1)),
            flush=True)


def iterators(count, n=8000, strategy="file_system"):
    import torch
    print("torch %s, blog workload, %s, %d samples, install(busy_poll=0), %d alternating "
          "rounds: samples/s, and the consumer's CPU (user + system) per batch"
          % (torch.__version__, strategy, n, count))
    modes = (("consumer-torchiter", "torch's iterator"), ("consumer", "shmtensor's"))
    for workers in (1, 2):
        rates = {m: [] for m, _ in modes}
        cpu = {m: [] for m, _ in modes}
        steady = {m: [] for m, _ in modes}
        for _ in range(count):
            for mode, _ in modes:
                r = run("blog", mode, strategy, n, workers)
                rates[mode].append(0 if r.get("error") else r["per_s"])
                cpu[mode].append(0 if r.get("error") else r["consumer_us"])
                steady[mode].append(0 if r.get("error") else r["consumer_steady_us"])
        for mode, label in modes:
            print("  W=%d %-17s samples/s %s  median %6.0f   consumer us/batch %s  median %5.1f"
                  "   from batch %d on: median %5.1f"
                  % (workers, label, " ".join("%6.0f" % v for v in rates[mode]),
                     statistics.median(rates[mode]),
                     " ".join("%5.1f" % v for v in cpu[mode]), statistics.median(cpu[mode]),
                     STEADY_FROM, statistics.median(steady[mode])),
                  flush=True)


def datasets(mib):
    import torch
    print("torch %s, a dataset of %d MiB, 2 workers, file_descriptor (MiB: each worker's "
          "VmRSS = RssAnon + RssShmem + RssFile; the main process's RssAnon/RssShmem)"
          % (torch.__version__, mib))
    for kind in ("tensor", "numpy"):
        for method in ("spawn", "forkserver"):
            for mode in ("stock", "install"):
                r = run("dataset", mode, kind, method, mib)
                if r.get("error"):
                    print("  %-6s %-10s %-7s %s" % (kind, method, mode, r["error"]))
                    continue
                workers = "  ".join("%d = %d+%d+%d" % (w["VmRSS"], w["RssAnon"], w["RssShmem"],
                                                        w["RssFile"])
                                    for w in r["workers"])
                print("  %-6s %-10s %-7s first batch %5.2f s  workers %s  main %d/%d" % (
                    kind, method, mode, r["first_batch_s"], workers, r["main"]["RssAnon"],
                    r["main"]["RssShmem"]), flush=True)


def demo(n=20000):
    import torch
    print("torch %s's own DataLoader, the blog workload: %d samples of four torch.randn(10), "
          "every batch kept, file_descriptor strategy, ulimit -n 1024" % (torch.__version__, n))
    rows = (("stock", 1, "1 worker, torch as it is"),
            ("install", 1, "1 worker, shmtensor.torch.install()"),
            ("install", 2, "2 workers, shmtensor.torch.install()"),
            ("inline", 0, "num_workers=0 (no worker process)"))
    rates, until_failed = {}, {}
    for mode, workers, label in rows:
        r = run("blog", mode, "file_descriptor", n, workers)
        rates[mode, workers] = r.get("per_s", 0) if not r.get("error") else None
        until_failed[mode, workers] = r.get("per_s", 0)
        print("  %-38s %6d samples kept  %7.0f samples/s  fds %5s  shared mappings %5s"
              % (label, r.get("samples", 0), r.get("per_s", 0), r.get("fds", "?"),
                 r.get("mappings", "?")))
        if r.get("error"):
            print("  %-38s %s" % ("", r["error"]))
    stock, ours = rates["stock", 1], rates["install", 1]
    if stock and ours:
        print("  install() with 1 worker: %.1fx stock torch's rate (this run)" % (ours / stock))
    elif ours:
        print("  stock torch failed; install() kept all %d samples, at %.0fx the rate stock "
              "torch had until it failed (this run)" % (n, ours / max(until_failed["stock", 1], 1)))
    docker_demo()


def docker_demo():
    """Docker's 64 MiB /dev/shm, side by side (dev_shm_demo.py's 16 MiB cases: a loop that
    drops each batch and one that keeps the previous one), where this machine allows a
    private mount namespace (root)."""
    import dev_shm_demo as d
    print()
    why = d.skip_reason()
    if why:
        print("Docker's 64 MiB /dev/shm: skipped (%s)" % why)
        return
    print("Docker's 64 MiB /dev/shm (a private mount namespace): torch's DataLoader, %d "
          "workers, %d batches of 16 MiB" % (d.WORKERS, d.BATCHES))
    try:
        out = d.run_in_namespace(16)
    except RuntimeError as e:
        print("  %s" % str(e).strip().splitlines()[-1])
        return
    for o in out:
        label = "%s, %s, %s" % ("torch as it is" if o["mode"] == "stock"
                                else "shmtensor.torch.install()", o["strategy"],
                                "keeping the last batch" if o["keep"] else "dropping each")
        print("  %-68s %2d of %d batches  %s"
              % (label, o["batches"], d.BATCHES, o["error"] or "completed"))


COLORS = {"stock": "tab:red", "install": "tab:green", "context": "tab:olive",
          "inline": "tab:gray"}


def plot(results, path):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4))
    rows = [r for r in results["blog"]
            if r.get("method", "fork") == "fork" and (r["workers"] == 1 or r["mode"] == "inline")]
    labels = ["%s\n%s n=%d" % (r["mode"], r["strategy"][5:] if r["strategy"] == "file_system"
                                else "fd", r["n"]) for r in rows]
    x = range(len(rows))
    left.bar(x, [r.get("per_s", 0) if not r.get("error") else 0 for r in rows],
             color=[COLORS[r["mode"]] for r in rows])
    left.set_xticks(list(x), labels, fontsize=6, rotation=90)
    left.set_ylabel("samples/s (0: failed)")
    left.set_title("blog workload, 1 worker (inline: num_workers=0)")
    right.bar(x, [r.get("fds") or 0 for r in rows], color=[COLORS[r["mode"]] for r in rows])
    right.set_yscale("log")
    right.set_xticks(list(x), labels, fontsize=6, rotation=90)
    right.set_ylabel("consumer's open fds at the end")
    right.set_title("fds kept")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


if __name__ == "__main__":
    main()
