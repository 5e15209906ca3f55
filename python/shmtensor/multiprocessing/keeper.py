"""File descriptors inside plain pickles, kept by shmtensor-manager while they are in flight.

A plain pickle (multiprocessing.Queue, Pool) cannot carry an fd. multiprocessing's own
resource_sharer keeps the fd in the sending process, so the receiver fails if the sender
exited first (torch's file_descriptor strategy has that failure). shmtensor-manager, the
per-user daemon of the library (docs/manager.md, "Kept fds and tickets"), holds each fd
given to it under a random token until one receiver takes it.

FdRef(fd) pickles as:
  * while a child is being started (Process args with spawn/forkserver): multiprocessing's
    own DupFd, which hands the fd to the child at start; this process's duplicate is closed
    as soon as the child is launched (Popen._launch is wrapped for that);
  * otherwise: a token whose fd the manager keeps until the receiver takes it, so the
    sender may exit right after sending.
A file_system pickle carries no fd; it registers a ticket (register_ticket) that its load
claims (claim_ticket) before it adopts any count.
One FdRef per fd while pickles refer to it: the pickler's memo sends it once per pickle.

Failures are shmtensor's exceptions: a manager that cannot be reached or asked is
shmtensor.SystemCallError (an OSError), a pickle the manager holds nothing for (single-use)
shmtensor.Error (a RuntimeError).
"""
from __future__ import annotations

import multiprocessing.context as _mpcontext
import multiprocessing.popen_forkserver as _popen_forkserver
import multiprocessing.popen_spawn_posix as _popen_spawn_posix
import multiprocessing.reduction as _mpreduction
import os
import weakref
from typing import TYPE_CHECKING

from shmtensor import _C

if TYPE_CHECKING:
    from typing import Any

_refs = weakref.WeakValueDictionary()


class FdRef:
    """An owned duplicate of an fd that can travel in a pickle."""

    __slots__ = ("fd", "__weakref__")

    def __init__(self, fd: int) -> None:
        self.fd = fd

    @classmethod
    def of(cls, fd: int, key: int) -> FdRef:
        """One duplicate of fd per key while a pickle holds it (a segment's memfd, by the
        segment's uid); key 0 (an fd that is not a segment's memfd) gets its own each time."""
        if key == 0:
            return cls(os.dup(fd))
        ref = _refs.get(key)
        if ref is None:
            ref = _refs[key] = cls(os.dup(fd))
        return ref

    def take(self) -> int:
        """A new duplicate owned by the caller."""
        return os.dup(self.fd)

    def __del__(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1

    def __reduce__(self) -> tuple[Any, ...]:
        popen = _mpcontext.get_spawning_popen()
        if popen is not None:
            # The starting child receives the fd when it is launched, after pickling: a
            # duplicate stays open until then, and no longer (a Pipe end given to the child
            # must reach end-of-file when the child closes it).
            fd = os.dup(self.fd)
            _close_after_launch(popen, fd)
            return _from_dupfd, (_mpreduction.DupFd(fd),)
        return _KeptFd, (_register(self.fd),)


class _KeptFd:
    """An fd the keeper holds for a pickle, fetched only when the load needs it: a second
    load of the same pickle is refused by its nonce (reductions._load_block) before the
    keeper is asked, so it gets the single-use error and not a keeper error."""

    __slots__ = ("token", "_ref")

    def __init__(self, token):
        self.token = token
        self._ref = None

    def take(self):
        # Once from the keeper (it hands an fd out once); a pickle names it once per segment
        # however many of its blocks live there, and each of those takes a duplicate.
        if self._ref is None:
            self._ref = _from_keeper(self.token)
        return self._ref.take()


def _close_fds(fds):
    while fds:
        os.close(fds.pop())


def _close_after_launch(popen, fd):
    """Closes `fd` once `popen` has launched its child (spawn and forkserver hand the
    child its fds in Popen._launch, see _wrap_launch), or, for a Popen of another kind,
    once it is collected."""
    fds = popen.__dict__.get("_shmtensor_launch_fds")
    if fds is None:
        fds = popen.__dict__["_shmtensor_launch_fds"] = []
        weakref.finalize(popen, _close_fds, fds)
    fds.append(fd)


def _wrap_launch(cls):
    launch = cls._launch
    if getattr(launch, "_shmtensor_wrapped", False):
        return

    def _launch(self, process_obj):
        try:
            return launch(self, process_obj)
        finally:
            _close_fds(self.__dict__.get("_shmtensor_launch_fds", []))

    _launch._shmtensor_wrapped = True
    _launch.__wrapped__ = launch
    cls._launch = _launch


for _popen in (_popen_spawn_posix.Popen, _popen_forkserver.Popen):
    _wrap_launch(_popen)


def _from_dupfd(dupfd):
    return FdRef(dupfd.detach())


def _connection_fd():
    """The fd of this process's connection to the manager for kept fds, or None (the tests'
    leak check allows it, as it does multiprocessing's own long-lived fds)."""
    fd = _C._fd_keeper_connection()
    return fd if fd >= 0 else None


TOKEN_BYTES = 16


def _system_call_error(message, cause):
    """shmtensor.SystemCallError(message) with errno, strerror and syscall of `cause` when it
    is a SystemCallError, else None, None and ""."""
    e = _C.SystemCallError(message)
    e.errno = getattr(cause, "errno", None)
    e.strerror = os.strerror(e.errno) if e.errno is not None else None
    e.syscall = getattr(cause, "syscall", "")
    return e


def _register(fd, token=None):
    """Gives fd (or, with fd None, a ticket) to the manager under token (a new random one if
    None); starts the manager if none runs. Returns the token. One send, no answer."""
    if token is None:
        token = os.urandom(TOKEN_BYTES)
    try:
        _C._keep_fd(token, -1 if fd is None else fd)
    except _C.Error as e:
        raise _system_call_error("shmtensor: cannot reach shmtensor-manager, which keeps the "
                                 "shared memory in a pickle: %s" % e, e) from None
    return token


def register_ticket(token: bytes) -> None:
    """Registers a ticket: claim_ticket(token) succeeds once, in any process of this user."""
    _register(None, token)


def claim_ticket(token: bytes) -> None:
    """Claims a ticket registered by register_ticket; shmtensor.Error (a RuntimeError) if it
    was claimed already (or never registered, or its sender died longer than the grace period
    ago)."""
    kind, fd = _ask(token)
    if fd >= 0:
        os.close(fd)
    if kind != "ticket":
        raise _C.Error("shmtensor: the fd keeper holds no ticket for this pickle: a "
                       "pickle of shared memory is single-use (it was loaded already, "
                       "here or in another process), or it outlived the keeper's grace "
                       "period after its sender died")


def _ask(token):
    """What the manager held under token, taken: (kind, fd) with kind "fd", "ticket" or
    "unknown" (fd -1 unless "fd")."""
    try:
        return _C._take_kept_fd(token)
    except _C.Error as e:
        raise _system_call_error("shmtensor: cannot ask shmtensor-manager for this pickle's "
                                 "shared memory (%s)" % e, e) from None


def _from_keeper(token):
    kind, fd = _ask(token)
    if kind != "fd":
        if fd >= 0:
            os.close(fd)
        raise _C.Error("shmtensor: the fd keeper does not hold this pickle's shared memory: "
                       "a pickle of shared memory is single-use (it was loaded already), "
                       "or it outlived the keeper's grace period")
    return FdRef(fd)
