"""Native objects (Queue, Connection) inside plain pickles: a frame's bytes and its fds."""
import os

from shmtensor.multiprocessing import keeper


def frame_reduce(rebuild, frame, extra=()):
    """A reduce value that rebuilds with rebuild(data, fd_refs, *extra). The pickle takes
    over the counts the frame carries (it is single-use)."""
    fd_refs = [keeper.FdRef(os.dup(fd)) for fd in frame.fds]
    frame.mark_sent()
    return rebuild, (frame.data, fd_refs) + tuple(extra)


def fds_of(fd_refs):
    """Duplicates of the fds, owned by the caller (the native side takes them)."""
    return [ref.take() for ref in fd_refs]
