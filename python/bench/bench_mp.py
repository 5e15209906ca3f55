"""Benchmark: NumPy arrays between two processes (docs/python.md has the figures).

    PYTHONPATH=build/python /usr/bin/python3 python/bench/bench_mp.py [--quick] [--plot FILE]

One run, same machine, fork start method, a producer (this process) and a consumer child:

  mp.Queue             multiprocessing.Queue, plain pickling (shmtensor's reducers removed)
  mp.shared_memory     multiprocessing.shared_memory the documented way: the producer
                       creates a SharedMemory, copies the array in and sends (name, shape,
                       dtype) on a multiprocessing.Queue; the consumer attaches, makes an
                       ndarray over .buf, closes and replies; the producer unlinks after
                       the reply (in the stream, at most 32 messages in flight: each
                       SharedMemory keeps an fd open until then)
  shmtensor Queue      shmtensor.multiprocessing.Queue with ordinary arrays (copied once
                       into shared memory above the 64 KiB threshold)
  shmtensor Queue, shared  the same with arrays made by shmtensor.numpy.empty (no copy)
  mp.Queue + reducers  multiprocessing.Queue with shmtensor's ForkingPickler reducers
  mp.Pipe              multiprocessing.Pipe() (a socket pair), plain pickling, both ways on
                       one duplex pipe
  shmtensor Pipe       shmtensor.multiprocessing.Pipe() with ordinary arrays, the same way

Payloads: 1 KiB, 1 MiB and 64 MiB float32 arrays, and a dict of 64 arrays of 1 KiB.
Latency: median over repetitions of put -> consumer get -> small reply -> get, halved.
Throughput: a stream of messages, timed from the first put to the consumer's reply after
the last get; MB/s counts the payload bytes. Then: a consumer under ulimit -n 1024 keeps
1,000,000 received small shared arrays; its fds and mappings are counted.
"""
import argparse
import json
import multiprocessing
import multiprocessing.reduction
import os
import resource
import statistics
import time
from multiprocessing import shared_memory

import numpy as np

import shmtensor
import shmtensor.multiprocessing as smp
import shmtensor.numpy as snp

KIB, MIB = 1024, 1024 * 1024


def payload(kind, shared):
    make = snp.empty if shared else np.empty
    if kind == "dict of 64 x 1 KiB":
        out = {}
        for i in range(64):
            a = make(256, np.float32)
            a[...] = i
            out["k%d" % i] = a
        return out
    n = {"1 KiB": KIB, "1 MiB": MIB, "64 MiB": 64 * MIB}[kind] // 4
    a = make(n, np.float32)
    a[...] = 1.0
    return a


def nbytes(obj):
    if isinstance(obj, dict):
        return sum(a.nbytes for a in obj.values())
    return obj.nbytes


# ---- consumers -------------------------------------------------------------------------


def consume_plain(q, r):
    while True:
        msg = q.get()
        if msg is None:
            return
        if msg == "stream-end":
            r.put("done")
            continue
        if isinstance(msg, tuple) and msg[0] == "ping":
            r.put("pong")


def consume_shm(q, r):
    while True:
        msg = q.get()
        if msg is None:
            return
        op, items = msg
        for name, shape, dtype in items:
            shm = shared_memory.SharedMemory(name=name)
            a = np.ndarray(shape, dtype=dtype, buffer=shm.buf)
            del a
            shm.close()
        r.put("pong" if op == "ping" else ("done" if op == "end" else "ok"))


# ---- producers ---------------------------------------------------------------------------


def shm_send(q, obj):
    """Copies obj into new SharedMemory blocks; returns them (to unlink after the reply)."""
    arrays = obj.values() if isinstance(obj, dict) else [obj]
    blocks, items = [], []
    for a in arrays:
        shm = shared_memory.SharedMemory(create=True, size=a.nbytes)
        np.ndarray(a.shape, a.dtype, buffer=shm.buf)[...] = a
        blocks.append(shm)
        items.append((shm.name, a.shape, a.dtype.str))
    return blocks, items


def release(blocks):
    for shm in blocks:
        shm.close()
        shm.unlink()


class PipeSide:
    """One end of a duplex pipe with a queue's put/get, so both directions of a case run
    on it."""

    def __init__(self, conn):
        self.conn = conn

    def put(self, obj):
        self.conn.send(obj)

    def get(self):
        return self.conn.recv()


def run_case(method, kind, reps, stream):
    shared = method == "shmtensor Queue, shared"
    ctx = smp.get_context("fork")
    plain = multiprocessing.get_context("fork")
    if method.endswith("Pipe"):
        a, b = (ctx if method.startswith("shmtensor") else plain).Pipe()
        q = r = PipeSide(a)
        child_args = (PipeSide(b), PipeSide(b))
    else:
        if method.startswith("shmtensor Queue"):
            q, r = ctx.Queue(), ctx.Queue()
        else:
            q, r = plain.Queue(), plain.Queue()
        child_args = (q, r)
    target = consume_shm if method == "mp.shared_memory" else consume_plain
    p = ctx.Process(target=target, args=child_args)
    p.start()
    lat = []
    for _ in range(reps):
        obj = payload(kind, shared)
        t0 = time.perf_counter()
        if method == "mp.shared_memory":
            blocks, items = shm_send(q, obj)
            q.put(("ping", items))
            r.get()
            release(blocks)
        else:
            q.put(("ping", obj))
            r.get()
        lat.append((time.perf_counter() - t0) / 2)
        del obj
    objs = [payload(kind, shared) for _ in range(stream)]
    t0 = time.perf_counter()
    if method == "mp.shared_memory":
        # At most 32 messages in flight: each SharedMemory holds an fd until unlinked.
        pending = []
        for obj in objs:
            blocks, items = shm_send(q, obj)
            pending.append(blocks)
            q.put(("data", items))
            if len(pending) == 32:
                r.get()
                release(pending.pop(0))
        for blocks in pending:
            r.get()
            release(blocks)
        q.put(("end", []))
        r.get()
    else:
        for obj in objs:
            q.put(("data", obj))
        q.put("stream-end")
        r.get()
    elapsed = time.perf_counter() - t0
    q.put(None)
    p.join()
    size = nbytes(objs[0])
    return {
        "method": method, "payload": kind, "latency_us": statistics.median(lat) * 1e6,
        "msgs_per_s": stream / elapsed, "MB_per_s": stream * size / elapsed / 1e6,
    }


# ---- 1,000,000 kept arrays ---------------------------------------------------------------


def keep_all(q, r, messages):
    resource.setrlimit(resource.RLIMIT_NOFILE, (1024, 1024))
    kept = []
    t0 = time.perf_counter()
    for _ in range(messages):
        kept.extend(q.get())
    elapsed = time.perf_counter() - t0
    with open("/proc/self/maps") as f:
        maps = sum(1 for line in f if "shmtensor" in line)
    r.put((len(kept), len(os.listdir("/proc/self/fd")), maps, elapsed,
           float(sum(float(a[0]) for a in kept[:: len(kept) // 1000]))))


def million(total, per_message):
    ctx = smp.get_context("fork")
    q, r = ctx.Queue(maxsize=64), ctx.Queue()
    p = ctx.Process(target=keep_all, args=(q, r, total // per_message))
    p.start()
    t0 = time.perf_counter()
    pool = snp.empty((total, 4), np.float32)  # one block; rows are views of it...
    for m in range(total // per_message):
        batch = [snp.full(4, float(m), np.float32) for _ in range(per_message)]
        q.put(batch)
    kept, fds, maps, consumer_s, _ = r.get()
    p.join()
    del pool
    return {"arrays": kept, "consumer_fds": fds, "consumer_shmtensor_mappings": maps,
            "seconds": time.perf_counter() - t0}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--plot", default=None)
    ap.add_argument("--json", default=None)
    ap.add_argument("--million", type=int, default=1_000_000)
    args = ap.parse_args()
    reps = {"1 KiB": 2000, "1 MiB": 200, "64 MiB": 10, "dict of 64 x 1 KiB": 500}
    stream = {"1 KiB": 5000, "1 MiB": 500, "64 MiB": 10, "dict of 64 x 1 KiB": 1000}
    if args.quick:
        reps = {k: max(3, v // 20) for k, v in reps.items()}
        stream = {k: max(3, v // 20) for k, v in stream.items()}
    methods = ["mp.Queue", "mp.shared_memory", "shmtensor Queue", "shmtensor Queue, shared",
               "mp.Queue + reducers", "mp.Pipe", "shmtensor Pipe"]
    ours = dict(multiprocessing.reduction.ForkingPickler._extra_reducers)
    results = []
    for kind in reps:
        for method in methods:
            fp = multiprocessing.reduction.ForkingPickler._extra_reducers
            if method in ("mp.Queue", "mp.shared_memory", "mp.Pipe"):
                fp.pop(np.ndarray, None)
                fp.pop(shmtensor.Tensor, None)
            else:
                fp.update(ours)
            res = run_case(method, kind, reps[kind], stream[kind])
            results.append(res)
            print("%-24s %-20s latency %10.1f us  %10.0f msg/s  %9.1f MB/s" % (
                method, kind, res["latency_us"], res["msgs_per_s"], res["MB_per_s"]), flush=True)
            shmtensor.empty_cache()
    multiprocessing.reduction.ForkingPickler._extra_reducers.update(ours)
    m = million(args.million, 1000)
    print("kept %(arrays)d arrays under ulimit -n 1024: %(consumer_fds)d fds, "
          "%(consumer_shmtensor_mappings)d shmtensor mappings, %(seconds).1f s" % m)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"results": results, "million": m}, f, indent=1)
    if args.plot:
        plot(results, methods, list(reps), args.plot)


def plot(results, methods, kinds, path):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, axes = plt.subplots(1, 2, figsize=(13, 4.6))
    width = 0.8 / len(methods)
    for ax, key, label in [(axes[0], "latency_us", "latency per message (µs, median, log)"),
                           (axes[1], "MB_per_s", "throughput (MB/s of payload, log)")]:
        for i, method in enumerate(methods):
            vals = [next(r[key] for r in results if r["method"] == method and r["payload"] == k)
                    for k in kinds]
            ax.bar([j + i * width for j in range(len(kinds))], vals, width, label=method)
        ax.set_xticks([j + 0.4 - width / 2 for j in range(len(kinds))])
        ax.set_xticklabels(kinds)
        ax.set_yscale("log")
        ax.set_title(label)
    axes[0].legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


if __name__ == "__main__":
    main()
