"""A torchrun job for test_torch_distributed.py: DDP (gloo) over a small model, each rank's
DataLoader (2 workers, the start method in SHMTENSOR_JOB_METHOD) fed by torch's
DistributedSampler, with shmtensor.torch.install() when SHMTENSOR_JOB_INSTALL=1.

    torchrun --nnodes 2 --nproc_per_node 1 --node_rank R --rdzv_backend c10d \
        --rdzv_endpoint 127.0.0.1:PORT --rdzv_id ID ddp_job.py OUT_DIR

Each rank writes OUT_DIR/rank<R>.pt: the sample indices it saw (epoch by epoch), whether
install() was active in its workers, and the trained parameters.
"""
import os
import sys

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader, Dataset, DistributedSampler, get_worker_info

SAMPLES = 96
EPOCHS = 2


class Regression(Dataset):
    """Sample i: (i, x_i, y_i) with x_i and y_i fixed by i alone."""

    def __len__(self):
        return SAMPLES

    def __getitem__(self, i):
        g = torch.Generator().manual_seed(i)
        x = torch.randn(8, generator=g)
        y = x.sum(0, keepdim=True) * 0.5 + 1.0
        installed = False
        if get_worker_info() is not None and "shmtensor.torch" in sys.modules:
            installed = sys.modules["shmtensor.torch"].is_installed()
        return torch.tensor(i), x, y, torch.tensor(installed)


def main():
    out_dir = sys.argv[1]
    if os.environ.get("SHMTENSOR_JOB_INSTALL") == "1":
        import shmtensor.torch
        shmtensor.torch.install()
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    model = DistributedDataParallel(torch.nn.Linear(8, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    sampler = DistributedSampler(Regression(), num_replicas=world, rank=rank, shuffle=True,
                                 seed=7)
    loader = DataLoader(Regression(), batch_size=4, sampler=sampler, num_workers=2,
                        multiprocessing_context=os.environ.get("SHMTENSOR_JOB_METHOD") or None)
    seen, installed = [], []
    for epoch in range(EPOCHS):
        sampler.set_epoch(epoch)
        indices = []
        for index, x, y, inst in loader:
            indices += index.tolist()
            installed += inst.tolist()
            opt.zero_grad()
            torch.nn.functional.mse_loss(model(x), y).backward()
            opt.step()
        seen.append(indices)
    torch.save({"rank": rank, "world": world, "seen": seen, "installed": installed,
                "params": [p.detach().clone() for p in model.parameters()]},
               os.path.join(out_dir, "rank%d.pt" % rank))
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
