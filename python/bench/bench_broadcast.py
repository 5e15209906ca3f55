"""Benchmark: a 1 -> N broadcast on one machine (docs/benchmarks.md, "Broadcast").

    PYTHONPATH=build/python /usr/bin/python3 python/bench/bench_broadcast.py [--quick] [--json F]

One run, side by side, fork start method, one writer and N = 1, 2, 3 reader processes:

  shmtensor Broadcast   shmtensor.multiprocessing.Broadcast: a NumPy array made by
                        shmtensor.numpy.empty (a shared block: no copy), readers get()
  shm ring (vLLM)       a multiprocessing.shared_memory ring written for this benchmark with
                        vLLM's shm_broadcast protocol: 10 chunks, each a written flag and N
                        read flags; the writer pickles the message (protocol 5, buffers
                        inline) and copies it into a free chunk, each reader copies it out
                        and unpickles; readers poll with os.sched_yield() (no sleep)
  gloo broadcast        torch.distributed.broadcast_object_list over gloo on this node
                        (rank 0 the writer), a NumPy array in the object

Payloads: 4 KiB and 1 MiB arrays. Each message carries the writer's CLOCK_MONOTONIC time
taken just before the put; each reader takes its own after the get: delivery latency,
p50/p99 over the messages of all readers. Phases per run:
  latency   300 messages 1 ms apart (--quick: 100)
  idle      no message for 2 s: each reader's CPU time (user+sys) over that gap
  cadence   one message every 5 ms for 1 s: CPU per reader (its CPU time over the wall
            time) and p50 latency
"""
import argparse
import datetime
import json
import multiprocessing
import os
import pickle
import statistics
import struct
import sys
import time

import numpy as np

SIZES = {"4 KiB": 4096, "1 MiB": 1 << 20}
IDLE_S = 2.0
CADENCE_S = 0.005
CADENCE_N = 200


def now_ns():
    return time.clock_gettime_ns(time.CLOCK_MONOTONIC)


def cpu_s():
    t = os.times()
    return t.user + t.system


def schedule(n_latency):
    """(phase, gap before the message) for every message, then the end marker."""
    out = [("lat", 0.001)] * n_latency
    out.append(("idle_end", IDLE_S))
    out += [("cad", CADENCE_S)] * CADENCE_N
    return out


class Reader:
    """Collects one reader's figures from the messages it receives."""

    def __init__(self):
        self.lat, self.cad = [], []
        self.idle_cpu = None
        self.last_cpu = self.cad_cpu0 = self.cad_t0 = None

    def got(self, phase, t0):
        t = now_ns()
        c = cpu_s()
        if phase == "lat":
            self.lat.append(t - t0)
        elif phase == "idle_end":
            self.idle_cpu = c - self.last_cpu
            self.cad_cpu0, self.cad_t0 = c, t
        else:
            self.cad.append(t - t0)
        self.last_cpu = c

    def result(self):
        wall = (now_ns() - self.cad_t0) / 1e9
        return {"lat": self.lat, "cad": self.cad, "idle_cpu_s": self.idle_cpu,
                "cad_cpu": (cpu_s() - self.cad_cpu0) / wall}


def payload(nbytes, shared):
    if shared:
        import shmtensor.numpy as snp
        a = snp.empty(nbytes, dtype=np.uint8)
    else:
        a = np.empty(nbytes, dtype=np.uint8)
    a[:8] = 7
    return a


# ---- shmtensor ----

def st_reader(reader, n, out):
    r = Reader()
    for _ in range(n):
        phase, t0, a = reader.get()
        r.got(phase, t0)
        assert a[0] == 7
    out.put(r.result())


def run_shmtensor(readers, nbytes, plan, ctx, out):
    import shmtensor.multiprocessing as smp
    b = smp.Broadcast(readers=readers, depth=16)
    procs = [ctx.Process(target=st_reader, args=(b.reader(i), len(plan), out))
             for i in range(readers)]
    for p in procs:
        p.start()
    time.sleep(0.5)
    for phase, gap in plan:
        time.sleep(gap)
        a = payload(nbytes, True)
        b.put((phase, now_ns(), a))
    return procs


# ---- shared-memory ring with vLLM's protocol ----

CHUNKS = 10


class Ring:
    """chunk i: [written u8][read flags u8 * N][pad to 16][length u64][payload]."""

    def __init__(self, shm, readers, chunk_bytes):
        self.buf = shm.buf
        self.n = readers
        self.chunk = chunk_bytes + 32

    def meta(self, i):
        return i * self.chunk

    def write(self, i, data):
        base = self.meta(i)
        while True:  # wait until every reader has read the chunk (or it was never written)
            if self.buf[base] == 0 or all(self.buf[base + 1 + r] for r in range(self.n)):
                break
            os.sched_yield()
        struct.pack_into("Q", self.buf, base + 16, len(data))
        self.buf[base + 32:base + 32 + len(data)] = data
        for r in range(self.n):
            self.buf[base + 1 + r] = 0
        self.buf[base] = 1

    def read(self, i, r):
        base = self.meta(i)
        while not (self.buf[base] == 1 and self.buf[base + 1 + r] == 0):
            os.sched_yield()
        (n,) = struct.unpack_from("Q", self.buf, base + 16)
        data = bytes(self.buf[base + 32:base + 32 + n])
        self.buf[base + 1 + r] = 1
        return data


def ring_reader(name, readers, chunk_bytes, index, n, out):
    from multiprocessing import shared_memory
    shm = shared_memory.SharedMemory(name=name)
    ring = Ring(shm, readers, chunk_bytes)
    r = Reader()
    for k in range(n):
        phase, t0, a = pickle.loads(ring.read(k % CHUNKS, index))
        r.got(phase, t0)
        assert a[0] == 7
    out.put(r.result())
    del ring
    shm.close()


def run_ring(readers, nbytes, plan, ctx, out):
    from multiprocessing import shared_memory
    chunk_bytes = nbytes + 4096
    shm = shared_memory.SharedMemory(create=True, size=CHUNKS * (chunk_bytes + 32))
    shm.buf[:] = bytes(len(shm.buf))
    procs = [ctx.Process(target=ring_reader, args=(shm.name, readers, chunk_bytes, i,
                                                   len(plan), out))
             for i in range(readers)]
    for p in procs:
        p.start()
    ring = Ring(shm, readers, chunk_bytes)
    time.sleep(0.5)
    for k, (phase, gap) in enumerate(plan):
        time.sleep(gap)
        a = payload(nbytes, False)
        t0 = now_ns()
        ring.write(k % CHUNKS, pickle.dumps((phase, t0, a), protocol=5))
    return procs, shm, ring


# ---- gloo ----

def gloo_rank(rank, world, port, nbytes, plan, out):
    import torch.distributed as dist
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=world)
    r = Reader()
    time.sleep(0.5)
    for phase, gap in plan:
        if rank == 0:
            time.sleep(gap)
            a = payload(nbytes, False)
            objs = [(phase, now_ns(), a)]
        else:
            objs = [None]
        dist.broadcast_object_list(objs, src=0)
        if rank != 0:
            p, t0, a = objs[0]
            r.got(p, t0)
            assert a[0] == 7
    if rank != 0:
        out.put(r.result())
    dist.barrier()
    dist.destroy_process_group()


def run_gloo(readers, nbytes, plan, ctx, out, port):
    return [ctx.Process(target=gloo_rank, args=(rank, readers + 1, port, nbytes, plan, out))
            for rank in range(readers + 1)]


def summarize(results):
    lat = sorted(x for r in results for x in r["lat"])
    cad = sorted(x for r in results for x in r["cad"])

    def pct(v, q):
        return v[min(len(v) - 1, int(q * len(v)))] / 1e3

    return {"p50_us": pct(lat, 0.5), "p99_us": pct(lat, 0.99),
            "idle_cpu_pct": max(r["idle_cpu_s"] for r in results) / IDLE_S * 100,
            "cad_cpu_pct": max(r["cad_cpu"] for r in results) * 100,
            "cad_p50_us": pct(cad, 0.5)}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--json")
    ap.add_argument("--systems", default="shmtensor,ring,gloo")
    args = ap.parse_args()
    ctx = multiprocessing.get_context("fork")
    plan = schedule(100 if args.quick else 300)
    rows = []
    port = 29500 + os.getpid() % 1000
    for size_name, nbytes in SIZES.items():
        for readers in (1, 2, 3):
            for system in args.systems.split(","):
                out = ctx.Queue()
                extra = None
                if system == "shmtensor":
                    procs = run_shmtensor(readers, nbytes, plan, ctx, out)
                elif system == "ring":
                    procs, shm, extra = run_ring(readers, nbytes, plan, ctx, out)
                else:
                    port += 1
                    procs = run_gloo(readers, nbytes, plan, ctx, out, port)
                    for p in procs:
                        p.start()
                results = [out.get(timeout=300) for _ in range(readers)]
                for p in procs:
                    p.join(60)
                if system == "ring":
                    del extra
                    shm.close()
                    shm.unlink()
                s = summarize(results)
                row = {"system": system, "payload": size_name, "readers": readers, **s}
                rows.append(row)
                print(f"{system:10s} {size_name:6s} readers={readers}  p50 {s['p50_us']:8.1f} us"
                      f"  p99 {s['p99_us']:9.1f} us  idle CPU {s['idle_cpu_pct']:5.1f} %"
                      f"  5 ms cadence: CPU {s['cad_cpu_pct']:5.1f} %, p50 "
                      f"{s['cad_p50_us']:8.1f} us", flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"date": datetime.datetime.utcnow().isoformat(), "nproc": os.cpu_count(),
                       "load": os.getloadavg(), "rows": rows}, f, indent=1)


if __name__ == "__main__":
    sys.exit(main())
