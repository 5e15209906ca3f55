"""Native objects (Queue, Connection) inside plain pickles: a frame's bytes and its fds."""
from __future__ import annotations

import os
from typing import TYPE_CHECKING

from shmtensor.multiprocessing import keeper

if TYPE_CHECKING:
    from collections.abc import Callable, Iterable
    from typing import Any

    from shmtensor._C import _Frame


def frame_reduce(rebuild: Callable[..., Any], frame: _Frame,
                 extra: Iterable[Any] = ()) -> tuple[Any, ...]:
    """A reduce value that rebuilds with rebuild(data, fd_refs, *extra). The pickle takes
    over the counts the frame carries (it is single-use)."""
    fd_refs = [keeper.FdRef(os.dup(fd)) for fd in frame.fds]
    frame.mark_sent()
    return rebuild, (frame.data, fd_refs) + tuple(extra)


def fds_of(fd_refs: Iterable[keeper.FdRef]) -> list[int]:
    """Duplicates of the fds, owned by the caller (the native side takes them)."""
    return [ref.take() for ref in fd_refs]
