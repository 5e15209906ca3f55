"""The DataLoader consumer's instructions per batch (docs/torch.md, "shmtensor's DataLoader
iterator"): the main process of the blog workload (2 forked workers, file_system,
install(busy_poll=0)) under callgrind, counted around K next() calls alone, with K + 10
batches queued ahead and each next() sending the next index.

    PYTHONPATH=build/python /usr/bin/python3 python/bench/bench_loader_ir.py [K]

Runs, one after the other, shmtensor's iterator and torch's (SHMTENSOR_DATALOADER_ITERATOR
=torch) and prints each one's instructions per batch; the callgrind files stay in a
temporary directory it names (callgrind_annotate --inclusive=yes FILE gives the parts).
Needs valgrind (callgrind_control). Each run takes ~20 s.
"""
import gc
import os
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_torch import Blog  # noqa: E402  (the blog workload's dataset)


def wait_for(path):
    while not os.path.exists(path):
        time.sleep(0.01)


def child(mode, k, d):
    """Under callgrind, instrumentation off until the parent turns it on at `go`."""
    import torch.multiprocessing as tmp
    from torch.utils.data import DataLoader

    import shmtensor.torch
    tmp.set_sharing_strategy("file_system")
    if mode == "torch":
        os.environ["SHMTENSOR_DATALOADER_ITERATOR"] = "torch"
    shmtensor.torch.install(busy_poll=0)
    it = iter(DataLoader(Blog(3 * k), num_workers=2, prefetch_factor=(k + 10) // 2 + 1))
    while it._data_queue.qsize() < k + 10:
        time.sleep(0.05)
    next(it)
    gc.disable()
    kept = []
    open(os.path.join(d, "ready"), "w").close()
    wait_for(os.path.join(d, "go"))
    for _ in range(k):
        kept.append(next(it))
    open(os.path.join(d, "done"), "w").close()
    wait_for(os.path.join(d, "stopped"))
    gc.enable()
    it._shutdown_workers()


def measure(mode, k, top):
    d = os.path.join(top, mode)
    os.makedirs(d)
    out = os.path.join(d, "callgrind.%p.out")
    p = subprocess.Popen(["valgrind", "--tool=callgrind", "--instr-atstart=no",
                          "--callgrind-out-file=" + out, sys.executable, __file__,
                          "--child", mode, str(k), d],
                         stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    wait_for(os.path.join(d, "ready"))
    subprocess.run(["callgrind_control", "-i", "on", str(p.pid)], check=True,
                   stdout=subprocess.DEVNULL)
    open(os.path.join(d, "go"), "w").close()
    wait_for(os.path.join(d, "done"))
    subprocess.run(["callgrind_control", "-i", "off", str(p.pid)], check=True,
                   stdout=subprocess.DEVNULL)
    open(os.path.join(d, "stopped"), "w").close()
    p.wait()
    path = out.replace("%p", str(p.pid))
    with open(path) as f:
        total = next(int(line.split()[1]) for line in f if line.startswith("totals:"))
    print("%-10s %8d instructions per batch   (%s)" % (mode, total // k, path), flush=True)


def main():
    if sys.argv[1:2] == ["--child"]:
        return child(sys.argv[2], int(sys.argv[3]), sys.argv[4])
    k = int(sys.argv[1]) if len(sys.argv) > 1 else 1000
    import torch
    top = tempfile.mkdtemp(prefix="shmtensor-loader-ir-")
    print("torch %s, blog workload, 2 workers, %d next() with batches queued ahead: the main "
          "process's instructions per batch (callgrind)" % (torch.__version__, k))
    for mode in ("shmtensor", "torch"):
        measure(mode, k, top)
    return 0


if __name__ == "__main__":
    sys.exit(main())
