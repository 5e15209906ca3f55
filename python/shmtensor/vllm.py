"""A stand-in for vLLM's shared-memory MessageQueue
(vllm/distributed/device_communicators/shm_broadcast.py) on shmtensor's Broadcast, with its
method names, so that an engine swaps it in with one import:

    from shmtensor.vllm import MessageQueue

docs/python.md, "vLLM's MessageQueue", gives the mapping. What differs: tensors and arrays in
a message are not copied into a ring (one shared block that every reader maps); readers
sleep in the kernel after a short adaptive poll rather than spinning for a second; a put
that waits too long raises shmtensor.BroadcastTimeout naming the reader it waited for; all
readers are on this machine (n_local_reader == n_reader; no ZeroMQ socket for remote ones).
"""
from __future__ import annotations

import time
import uuid
from dataclasses import dataclass, field
from typing import Any

from shmtensor.multiprocessing.broadcast import Broadcast, BroadcastReader

__all__ = ["Handle", "MessageQueue"]


@dataclass
class Handle:
    """What export_handle() returns and create_from_handle() takes: picklable (its
    Broadcast pickles by fds), to be sent to the readers' processes."""
    local_reader_ranks: list[int] = field(default_factory=list)
    broadcast: Broadcast | None = None


class MessageQueue:
    """The writer's side when made; a reader's from create_from_handle()."""

    def __init__(self, n_reader: int, n_local_reader: int | None = None,
                 local_reader_ranks: list[int] | None = None,
                 max_chunk_bytes: int = 1 << 24, max_chunks: int = 10,
                 connect_ip: str | None = None, *, name: str | None = None) -> None:
        """vLLM's arguments; `name` (shmtensor's): the Broadcast is published under it
        (Broadcast.open(name) in any process of the user)."""
        if n_local_reader is not None and n_local_reader != n_reader:
            raise ValueError("shmtensor.vllm.MessageQueue: every reader must be local "
                             "(n_local_reader == n_reader)")
        if local_reader_ranks is None:
            local_reader_ranks = list(range(n_reader))
        if len(local_reader_ranks) != n_reader:
            raise ValueError("local_reader_ranks must name n_reader ranks")
        # max_chunk_bytes has no meaning here (a message is not copied into a chunk).
        self.n_reader = n_reader
        self.n_local_reader = n_reader
        self._broadcast: Broadcast | None = Broadcast(readers=n_reader, name=name,
                                                      depth=max_chunks)
        self._handle = Handle(list(local_reader_ranks), self._broadcast)
        self._reader: BroadcastReader | None = None
        self._is_writer = True
        self.name = name  # published under it while it is (create_from_process_group: made)

    def export_handle(self) -> Handle:
        return self._handle

    @staticmethod
    def create_from_handle(handle: Handle, rank: int) -> MessageQueue:
        if handle.broadcast is None:
            raise ValueError("the handle carries no Broadcast")
        mq = MessageQueue.__new__(MessageQueue)
        mq.n_reader = handle.broadcast.readers
        mq.n_local_reader = mq.n_reader
        mq._broadcast = None
        mq._handle = handle
        mq._reader = handle.broadcast.reader(handle.local_reader_ranks.index(rank))
        mq._is_writer = False
        mq.name = None
        return mq

    @staticmethod
    def create_from_process_group(pg: Any, max_chunk_bytes: int = 1 << 24, max_chunks: int = 10,
                                  writer_rank: int = 0, extra_writer_handler: Any = None,
                                  blocking: bool = True) -> MessageQueue:
        """vLLM's way to make one for a torch.distributed group `pg`, called by every rank of
        it: group rank `writer_rank` makes the writer's under a fresh name, which it sends to
        the others over `pg` (broadcast_object_list); each other rank opens it by name as a
        reader (its rank among the others, in group order); once all have, the name goes.
        Every rank must be on the writer's machine (checked: ValueError on every rank).
        vLLM's other options (extra_writer_handler, blocking) are accepted and ignored."""
        import torch.distributed as dist  # noqa: PLC0415 (only this method needs torch)
        rank, world = dist.get_rank(pg), dist.get_world_size(pg)
        if not 0 <= writer_rank < world:
            raise ValueError(f"writer_rank {writer_rank} is not a rank of a group of {world}")
        src = (writer_rank if pg is None or pg is dist.group.WORLD
               else dist.get_global_rank(pg, writer_rank))
        machines = [None] * world
        dist.all_gather_object(machines, _this_machine(), group=pg)
        if any(m != machines[writer_rank] for m in machines):
            raise ValueError("shmtensor.vllm.MessageQueue: every rank of the group must be on "
                             "the writer's machine (ranks %s are not)" % [
                                 r for r, m in enumerate(machines) if m != machines[writer_rank]])
        readers = [r for r in range(world) if r != writer_rank]
        name = [f"vllm_mq_{uuid.uuid4().hex}" if rank == writer_rank else None]
        if rank == writer_rank:
            mq = MessageQueue(n_reader=len(readers), local_reader_ranks=readers,
                              max_chunk_bytes=max_chunk_bytes, max_chunks=max_chunks,
                              name=name[0])
            dist.broadcast_object_list(name, src=src, group=pg)
        else:
            dist.broadcast_object_list(name, src=src, group=pg)
            mq = MessageQueue.create_from_handle(
                Handle(readers, Broadcast.open(name[0])), rank)
        dist.barrier(group=pg)  # every reader has opened it: the name may go
        if rank == writer_rank:
            Broadcast.unlink(name[0])
        mq.name = name[0]
        return mq

    def wait_until_ready(self) -> None:
        """Nothing to wait for: readers attach on their first dequeue()."""

    def enqueue(self, obj: Any, timeout: float | None = None) -> None:
        if self._broadcast is None:
            raise RuntimeError("enqueue() on a reader's MessageQueue")
        self._broadcast.put(obj, timeout=timeout)

    def dequeue(self, timeout: float | None = None, cancel: Any = None,
                indefinite: bool = False) -> Any:
        """The next object. `cancel` (a threading.Event) is looked at between waits of at
        most 0.1 s; `indefinite` is accepted for vLLM's signature (a None timeout waits)."""
        if self._reader is None:
            raise RuntimeError("dequeue() on the writer's MessageQueue")
        if cancel is None:
            return self._reader.get(timeout=timeout)
        end = None if timeout is None else time.monotonic() + timeout
        while True:
            if cancel.is_set():
                raise RuntimeError("cancelled")
            slice_s = 0.1 if end is None else max(0.0, min(0.1, end - time.monotonic()))
            try:
                return self._reader.get(timeout=slice_s)
            except TimeoutError:
                if end is not None and time.monotonic() >= end:
                    raise

    def broadcast_object(self, obj: Any = None) -> Any:
        if self._is_writer:
            self.enqueue(obj)
            return obj
        return self.dequeue()


def _this_machine() -> tuple[str, str]:
    """What two processes on one machine (one kernel) have alike: the boot id and the
    hostname."""
    import socket  # noqa: PLC0415
    with open("/proc/sys/kernel/random/boot_id") as f:
        return f.read().strip(), socket.gethostname()
