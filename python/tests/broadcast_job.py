"""A torchrun job for test_torch_distributed.py: docs/python.md's "In a torchrun job"
pattern. The ranks of the node share a named Broadcast: local rank 0 makes it (a name per
job, from TORCHELASTIC_RUN_ID), the others open it after a barrier and take their reader;
rank 0 puts a state dict of torch tensors (shmtensor.torch.install() in every rank: one
shared block for all readers), each reader checks it and writes its mark into it, and rank
0 sees both marks.

    torchrun --nproc_per_node 3 ... broadcast_job.py OUT_DIR

Each rank writes OUT_DIR/rank<R>.txt: what it saw.
"""
import os
import sys
import time

import torch
import torch.distributed as dist

import shmtensor.torch
from shmtensor.multiprocessing import Broadcast

shmtensor.torch.install()
dist.init_process_group("gloo")
rank, ranks = int(os.environ["LOCAL_RANK"]), int(os.environ["LOCAL_WORLD_SIZE"])
name = "weights_" + os.environ["TORCHELASTIC_RUN_ID"]
if rank == 0:
    weights = Broadcast(readers=ranks - 1, name=name)
dist.barrier()
if rank != 0:
    reader = Broadcast.open(name).reader(rank - 1)
dist.barrier()  # every reader has its handle: the name may go
if rank == 0:
    Broadcast.unlink(name)
    state = {"w": torch.arange(8, dtype=torch.float32), "step": 3}
    weights.put(state, timeout=60)
    dist.barrier()  # every reader has read it
    deadline = time.monotonic() + 60
    marks = list(range(1, ranks))
    while state["w"][marks].tolist() != [100.0 + r for r in marks] and time.monotonic() < deadline:
        time.sleep(0.01)
    seen = state["w"].tolist()
else:
    state = reader.get(timeout=60)
    seen = [state["step"], state["w"].tolist(), state["w"].is_shared()]
    dist.barrier()  # every reader has read it: now the marks
    state["w"][rank] = 100.0 + rank
dist.barrier()
with open(os.path.join(sys.argv[1], "rank%d.txt" % rank), "w") as f:
    f.write(repr(seen))
dist.destroy_process_group()
