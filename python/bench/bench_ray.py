"""Tensors between Ray actors on one node: shmtensor's named Queue and named Broadcast against
Ray's object store, on the same tensors in the same run (docs/benchmarks.md, "Ray").

    PYTHONPATH=build-torch2/python build-torch2/venv/bin/python python/bench/bench_ray.py [--rounds 3]

Ray's ways: the consumer actor calls the producer actor, whose method returns the tensor (Ray
serializes it into its object store and the consumer's ray.get maps it); and ray.put of the
tensor in the producer, ray.get of the refs in the consumer (the two times added). shmtensor's way: the
producer puts the tensor into a named Queue (an arena tensor: no copy) and the consumer, which
opened the queue by name, gets it. Both consumers read one element of each tensor. Then one
to two consumers: ray.put in the producer and ray.get of the refs in both consumers at once
(the put's time plus the slower consumer's), against a named Broadcast of two readers (the
producer puts, each consumer gets from its reader; the slower consumer's time). Printed: per
tensor, microseconds (median of the rounds) and Ray's ÷ shmtensor's.
"""
import argparse
import os
import statistics
import time

import ray
import torch


def setup():
    import shmtensor.torch  # noqa: PLC0415 (in each Ray worker process)
    shmtensor.torch.install()


@ray.remote
class Producer:
    def __init__(self, name):
        from shmtensor.multiprocessing import Broadcast, Queue  # noqa: PLC0415
        torch.multiprocessing.set_sharing_strategy("file_descriptor")
        self.q = Queue(4, name=name)
        self.b = Broadcast(readers=2, name=name + "_b", depth=4)
        self.t = {}

    def tensor(self, nbytes):
        t = self.t.get(nbytes)
        if t is None:
            t = self.t[nbytes] = torch.ones(nbytes // 4, dtype=torch.float32).share_memory_()
        return t

    def put_refs(self, n, nbytes):
        t = self.tensor(nbytes)
        start = time.perf_counter()
        refs = [ray.put(t) for _ in range(n)]
        return (time.perf_counter() - start) / n, refs

    def push(self, n, nbytes):
        t = self.tensor(nbytes)
        for _ in range(n):
            self.q.put(t)
        return True

    def broadcast(self, n, nbytes):
        t = self.tensor(nbytes)
        for _ in range(n):
            self.b.put(t, timeout=60)
        return True


@ray.remote
class Consumer:
    def __init__(self, name, index=0):
        from shmtensor.multiprocessing import Broadcast, Queue  # noqa: PLC0415
        torch.multiprocessing.set_sharing_strategy("file_descriptor")
        self.q = Queue.open(name)
        self.reader = Broadcast.open(name + "_b").reader(index)

    def pull_ray(self, producer, n, nbytes):
        start = time.perf_counter()
        for _ in range(n):
            t = ray.get(producer.tensor.remote(nbytes))
            assert t[0].item() == 1.0
        return (time.perf_counter() - start) / n

    def get_refs(self, refs):
        start = time.perf_counter()
        for ref in refs:
            t = ray.get(ref)
            assert t[0].item() == 1.0
        return (time.perf_counter() - start) / len(refs)

    def pull_shm(self, n):
        start = time.perf_counter()
        for _ in range(n):
            t = self.q.get(timeout=60)
            assert t[0].item() == 1.0
        return (time.perf_counter() - start) / n

    def pull_broadcast(self, n):
        start = time.perf_counter()
        for _ in range(n):
            t = self.reader.get(timeout=60)
            assert t[0].item() == 1.0
        return (time.perf_counter() - start) / n


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=3)
    a = ap.parse_args()
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False,
             runtime_env={"worker_process_setup_hook": setup})
    name = "bench_ray_%d" % os.getpid()
    producer = Producer.remote(name)
    ray.get(producer.tensor.remote(4))
    consumer = Consumer.remote(name)
    other = Consumer.remote(name, 1)
    print("ray %s, torch %s, actors on one node (a cluster of 2 CPUs); per tensor, median of "
          "%d rounds" % (ray.__version__, torch.__version__, a.rounds))
    for label, nbytes, n in (("4 KiB", 4096, 2000), ("1 MiB", 1 << 20, 500),
                             ("64 MiB", 64 << 20, 20)):
        call_s, store_s, shm_s = [], [], []
        for _ in range(a.rounds):
            call_s.append(ray.get(consumer.pull_ray.remote(producer, n, nbytes)))
            put_s, refs = ray.get(producer.put_refs.remote(n, nbytes))
            store_s.append(put_s + ray.get(consumer.get_refs.remote(refs)))
            del refs
            pushed = producer.push.remote(n, nbytes)
            shm_s.append(ray.get(consumer.pull_shm.remote(n)))
            ray.get(pushed)
        c, r, s = (statistics.median(v) * 1e6 for v in (call_s, store_s, shm_s))
        print("  %-6s actor call returning it %10.1f us   ray.put + ray.get %10.1f us   "
              "named Queue %7.1f us   (%.0fx, %.0fx)" % (label, c, r, s, c / s, r / s),
              flush=True)
    for label, nbytes, n in (("4 KiB", 4096, 2000), ("1 MiB", 1 << 20, 500),
                             ("64 MiB", 64 << 20, 20)):
        store_s, shm_s = [], []
        for _ in range(a.rounds):
            put_s, refs = ray.get(producer.put_refs.remote(n, nbytes))
            gets = [c.get_refs.remote(refs) for c in (consumer, other)]
            store_s.append(put_s + max(ray.get(gets)))
            del refs
            pushed = producer.broadcast.remote(n, nbytes)
            shm_s.append(max(ray.get([c.pull_broadcast.remote(n) for c in (consumer, other)])))
            ray.get(pushed)
        r, s = (statistics.median(v) * 1e6 for v in (store_s, shm_s))
        print("  %-6s to 2 consumers: ray.put + 2 ray.get %10.1f us   named Broadcast %7.1f us"
              "   (%.0fx)" % (label, r, s, r / s), flush=True)
    ray.shutdown()


if __name__ == "__main__":
    main()
