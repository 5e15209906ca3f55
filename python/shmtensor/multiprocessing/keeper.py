"""File descriptors inside plain pickles (the sending and receiving side of _fd_keeper.py).

FdRef(fd) pickles as:
  * while a child is being started (Process args with spawn/forkserver): multiprocessing's
    own DupFd, which hands the fd to the child at start;
  * otherwise: a token registered with the per-user fd keeper, which holds the fd until the
    receiver takes it, so the sender may exit right after sending.
One FdRef per fd while pickles refer to it: the pickler's memo sends it once per pickle.
"""
import multiprocessing.context as _mpcontext
import multiprocessing.reduction as _mpreduction
import os
import socket
import subprocess
import sys
import threading
import time
import weakref

from shmtensor.multiprocessing import _fd_keeper

_SCRIPT = _fd_keeper.__file__
_refs = weakref.WeakValueDictionary()
_start_lock = threading.Lock()


class FdRef:
    """An owned duplicate of an fd that can travel in a pickle."""

    __slots__ = ("fd", "__weakref__")

    def __init__(self, fd):
        self.fd = fd

    @classmethod
    def of(cls, fd, key):
        ref = _refs.get(key)
        if ref is None:
            ref = _refs[key] = cls(os.dup(fd))
        return ref

    def take(self):
        """A new duplicate owned by the caller."""
        return os.dup(self.fd)

    def __del__(self):
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1

    def __reduce__(self):
        popen = _mpcontext.get_spawning_popen()
        if popen is not None:
            # The starting child receives the fd when it is launched, after pickling: keep
            # a duplicate open for as long as the Popen lives.
            fd = os.dup(self.fd)
            weakref.finalize(popen, os.close, fd)
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


def _from_dupfd(dupfd):
    return FdRef(dupfd.detach())


def _connect():
    s = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET | socket.SOCK_CLOEXEC)
    try:
        s.settimeout(10.0)
        s.connect(_fd_keeper.address())
    except BaseException:
        s.close()
        raise
    return s


_started = []  # keepers this process started: reaped once they exit


def _start_keeper():
    with _start_lock:
        _started[:] = [p for p in _started if p.poll() is None]
        _started.append(subprocess.Popen(
            [sys.executable, "-I", "-S", _SCRIPT],
            stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
            close_fds=True, start_new_session=True))


def _register(fd):
    token = os.urandom(_fd_keeper.TOKEN_BYTES)
    deadline = time.monotonic() + 10.0
    started = False
    delay = 0.001
    while True:
        try:
            with _connect() as s:
                socket.send_fds(s, [b"R" + token], [fd])
                if s.recv(16) == b"K":
                    return token
        except (ConnectionRefusedError, FileNotFoundError):
            if not started:
                _start_keeper()
                started = True
        except OSError:
            pass  # a keeper that was exiting: try again (a new one starts if needed)
        if time.monotonic() > deadline:
            raise OSError("shmtensor: cannot reach the fd keeper (%s) to send a "
                          "file_descriptor segment in a pickle; set_sharing_strategy("
                          "'file_system') needs none" % _SCRIPT)
        time.sleep(delay)
        delay = min(delay * 2, 0.05)
        if delay >= 0.05:
            started = False


def _from_keeper(token):
    try:
        with _connect() as s:
            s.sendall(b"T" + token)
            msg, fds, _, _ = socket.recv_fds(s, 16, 1)
    except OSError as e:
        raise OSError("shmtensor: the fd keeper holding this pickle's shared memory is gone "
                      "(%s): the pickle was already loaded, or it waited longer than the "
                      "keeper's grace period after its sender died" % e) from None
    if msg != b"F" or len(fds) != 1:
        for fd in fds:
            os.close(fd)
        raise RuntimeError("shmtensor: the fd keeper does not hold this pickle's shared memory: "
                           "a pickle of shared memory is single-use (it was loaded already), "
                           "or it outlived the keeper's grace period")
    return FdRef(fds[0])
