"""A Ray job on a local cluster whose actors exchange torch tensors through shmtensor's named
channels (test_ray.py runs it; docs/python.md, "In a Ray job"). Ray starts every actor's
process; shmtensor starts none of them. Each actor runs shmtensor.torch.install() through
Ray's worker_process_setup_hook.

    python ray_job.py STRATEGY NAME   ->  one JSON line of what each actor saw
"""
import json
import sys

import ray
import torch


def setup():
    import shmtensor.torch  # noqa: PLC0415 (in each Ray worker process)
    shmtensor.torch.install()


@ray.remote
class Producer:
    """Creates the named queues; sends a tensor, then reads back what the consumer wrote."""

    def __init__(self, name, strategy):
        from shmtensor.multiprocessing import Queue  # noqa: PLC0415
        torch.multiprocessing.set_sharing_strategy(strategy)
        self.out = Queue(name=name + "_out")
        self.back = Queue(name=name + "_back")
        self.t = None

    def send(self):
        self.t = torch.arange(6, dtype=torch.float32)
        self.out.put({"step": 1, "x": self.t})
        return True

    def seen(self):
        assert self.back.get(timeout=60) == "doubled"
        return self.t.tolist()  # the consumer's write, seen here


@ray.remote
class Consumer:
    """Opens the producer's queues by name; doubles the tensor it gets in place."""

    def __init__(self, name, strategy):
        from shmtensor.multiprocessing import Queue  # noqa: PLC0415
        torch.multiprocessing.set_sharing_strategy(strategy)
        self.inq = Queue.open(name + "_out")
        self.back = Queue.open(name + "_back")

    def work(self):
        msg = self.inq.get(timeout=60)
        msg["x"].mul_(2)
        self.back.put("doubled")
        return msg["step"], msg["x"].tolist()


@ray.remote
class Writer:
    """Creates a named Broadcast for `readers` readers and puts `n` tensors into it."""

    def __init__(self, name, strategy, readers):
        from shmtensor.multiprocessing import Broadcast  # noqa: PLC0415
        torch.multiprocessing.set_sharing_strategy(strategy)
        self.b = Broadcast(readers=readers, name=name + "_bcast")
        self.sent = []

    def put(self, n):
        for i in range(n):
            t = torch.full((4,), float(i))
            self.sent.append(t)
            self.b.put((i, t), timeout=60)
        return True

    def last(self):
        return self.sent[-1].tolist()


@ray.remote
class Reader:
    """Opens the Broadcast by name as reader `index`; gets `n` messages."""

    def __init__(self, name, strategy, index):
        from shmtensor.multiprocessing import Broadcast  # noqa: PLC0415
        torch.multiprocessing.set_sharing_strategy(strategy)
        self.r = Broadcast.open(name + "_bcast").reader(index)
        self.index = index

    def take(self, n):
        self.got = [self.r.get(timeout=60) for _ in range(n)]
        return [(i, t.tolist()) for i, t in self.got]

    def bump_last(self):
        self.got[-1][1].add_(100)  # seen by the writer and by the other readers

    def last(self):
        return self.got[-1][1].tolist()


def main():
    strategy, name = sys.argv[1], sys.argv[2]
    ray.init(num_cpus=4, include_dashboard=False, log_to_driver=False,
             runtime_env={"worker_process_setup_hook": setup})
    try:
        producer = Producer.remote(name, strategy)
        ray.get(producer.send.remote())
        consumer = Consumer.remote(name, strategy)
        got = ray.get(consumer.work.remote())
        seen = ray.get(producer.seen.remote())

        writer = Writer.remote(name, strategy, 2)
        ray.get(writer.put.remote(0))  # created before the readers open it
        readers = [Reader.remote(name, strategy, i) for i in range(2)]
        taken = [r.take.remote(3) for r in readers]
        ray.get(writer.put.remote(3))
        taken = ray.get(taken)
        ray.get(readers[0].bump_last.remote())
        print(json.dumps({"consumer": got, "producer_sees": seen, "readers": taken,
                          "writer_sees": ray.get(writer.last.remote()),
                          "other_reader_sees": ray.get(readers[1].last.remote())}))
    finally:
        ray.shutdown()


if __name__ == "__main__":
    main()
