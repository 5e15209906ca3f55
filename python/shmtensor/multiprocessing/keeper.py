"""File descriptors inside plain pickles (the sending and receiving side of _fd_keeper.py).

FdRef(fd) pickles as:
  * while a child is being started (Process args with spawn/forkserver): multiprocessing's
    own DupFd, which hands the fd to the child at start; this process's duplicate is closed
    as soon as the child is launched (Popen._launch is wrapped for that);
  * otherwise: a token registered with the per-user fd keeper, which holds the fd until the
    receiver takes it, so the sender may exit right after sending.
A file_system pickle carries no fd; it registers a ticket (register_ticket) that its load
claims (claim_ticket) before it adopts any count.
One FdRef per fd while pickles refer to it: the pickler's memo sends it once per pickle.

Failures are shmtensor's exceptions: a keeper that cannot be reached or asked is
shmtensor.SystemCallError (an OSError), a pickle the keeper holds nothing for (single-use)
shmtensor.Error (a RuntimeError).
"""
from __future__ import annotations

import multiprocessing.context as _mpcontext
import multiprocessing.popen_forkserver as _popen_forkserver
import multiprocessing.popen_spawn_posix as _popen_spawn_posix
import multiprocessing.reduction as _mpreduction
import os
import socket
import subprocess
import sys
import threading
import time
import weakref
from typing import TYPE_CHECKING

from shmtensor import _C
from shmtensor.multiprocessing import _fd_keeper

if TYPE_CHECKING:
    from typing import Any

_SCRIPT = _fd_keeper.__file__
_refs = weakref.WeakValueDictionary()
_start_lock = threading.Lock()


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


def _new_connection():
    s = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET | socket.SOCK_CLOEXEC)
    try:
        s.settimeout(10.0)
        s.connect(_fd_keeper.address())
        # The hello's answer says the keeper accepted this connection: from then on it reads
        # every request sent on it, so registers need no answer (_fd_keeper.py).
        s.sendall(b"H")
        if s.recv(16) != b"K":
            raise ConnectionResetError("the fd keeper did not answer the hello")
    except BaseException:
        s.close()
        raise
    return s


# This process's connection to the keeper, kept for its life; a forked child makes its own
# (requests of two processes on one connection would mix their answers).
_connection = None
_connection_lock = threading.Lock()


def _drop_inherited_connection():
    global _connection, _connection_lock
    _connection_lock = threading.Lock()  # another thread may have held it at fork
    if _connection is not None:
        _connection.close()  # the child's copy only: the parent's connection stays open
        _connection = None


os.register_at_fork(after_in_child=_drop_inherited_connection)


def _connection_fd():
    """The fd of this process's keeper connection, or None (the tests' leak check allows it,
    as it does multiprocessing's own long-lived fds)."""
    return _connection.fileno() if _connection is not None else None


_started = []  # keepers this process started: reaped once they exit


def _start_keeper():
    with _start_lock:
        _started[:] = [p for p in _started if p.poll() is None]
        _started.append(subprocess.Popen(
            [sys.executable, "-I", "-S", _SCRIPT],
            stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
            close_fds=True, start_new_session=True))


def _system_call_error(message, cause):
    """shmtensor.SystemCallError(message) with errno and strerror of the OSError `cause` (None
    when it had none), and syscall "connect" when cause came from connecting to the keeper,
    cause's own syscall when it is a SystemCallError, else "" (a send or receive on the
    keeper's socket, or the keeper closing it)."""
    e = _C.SystemCallError(message)
    e.errno = cause.errno if cause is not None else None
    e.strerror = os.strerror(e.errno) if e.errno is not None else None
    connecting = isinstance(cause, (ConnectionRefusedError, FileNotFoundError))
    e.syscall = "connect" if connecting else getattr(cause, "syscall", "")
    return e


_REQUEST_TIMEOUT = 10.0


def _request(send, expect_answer):
    """Sends a request on this process's keeper connection (connecting, and starting a keeper,
    if needed) and returns its answer (msg, fds), or None if it expects none. A connection
    that failed (the keeper exited or was killed) is replaced once per attempt."""
    global _connection
    deadline = time.monotonic() + _REQUEST_TIMEOUT
    started = False
    delay = 0.001
    last = None  # the last OSError, for the error raised at the deadline
    while True:
        with _connection_lock:
            try:
                if _connection is None:
                    _connection = _new_connection()
                send(_connection)
                if not expect_answer:
                    return None
                msg, fds, _, _ = socket.recv_fds(_connection, 16, 1)
                if msg:
                    return msg, fds
                raise ConnectionResetError("the fd keeper closed the connection")
            except (ConnectionRefusedError, FileNotFoundError) as e:
                last = e
                if not started:
                    _start_keeper()
                    started = True
            except OSError as e:
                last = e  # a keeper that was exiting or died: connect again (a new one starts)
            if _connection is not None:
                _connection.close()
                _connection = None
        if time.monotonic() > deadline:
            raise _system_call_error(
                "shmtensor: cannot reach the fd keeper (%s) for shared memory in a pickle "
                "within %g s; the last attempt failed with: %s" % (_SCRIPT, _REQUEST_TIMEOUT, last),
                last)
        time.sleep(delay)
        delay = min(delay * 2, 0.05)
        if delay >= 0.05:
            started = False


def _register(fd, token=None):
    """Registers fd (or, with fd None, a ticket) with the keeper under token (a new random
    one if None); starts the keeper if none runs. Returns the token. One send, no answer."""
    if token is None:
        token = os.urandom(_fd_keeper.TOKEN_BYTES)
    _request(lambda s: socket.send_fds(s, [b"R" + token], [] if fd is None else [fd]), False)
    return token


def register_ticket(token: bytes) -> None:
    """Registers a ticket: claim_ticket(token) succeeds once, in any process of this user."""
    _register(None, token)


def claim_ticket(token: bytes) -> None:
    """Claims a ticket registered by register_ticket; shmtensor.Error (a RuntimeError) if it
    was claimed already (or never registered, or its sender died longer than the grace period
    ago)."""
    msg, fds = _ask(token)
    for fd in fds:
        os.close(fd)
    if msg != b"C":
        raise _C.Error("shmtensor: the fd keeper holds no ticket for this pickle: a "
                       "pickle of shared memory is single-use (it was loaded already, "
                       "here or in another process), or it outlived the keeper's grace "
                       "period after its sender died")


def _ask(token):
    try:
        return _request(lambda s: s.sendall(b"T" + token), True)
    except OSError as e:
        raise _system_call_error("shmtensor: cannot ask the fd keeper for this pickle's shared "
                                 "memory (%s)" % e, e) from None


def _from_keeper(token):
    msg, fds = _ask(token)
    if msg != b"F" or len(fds) != 1:
        for fd in fds:
            os.close(fd)
        raise _C.Error("shmtensor: the fd keeper does not hold this pickle's shared memory: "
                       "a pickle of shared memory is single-use (it was loaded already), "
                       "or it outlived the keeper's grace period")
    return FdRef(fds[0])
