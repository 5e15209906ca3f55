"""Pipe() and Connection on shmtensor's transport, and everything else of
multiprocessing.connection (Listener, Client, wait, ...), which is the standard library's.

Pipe() is a SOCK_SEQPACKET socket pair: each send() is one datagram, and the shared arrays
in it travel as descriptors (fds by SCM_RIGHTS, file_system names), not as bytes. As in
multiprocessing, fileno() is the socket: multiprocessing.connection.wait(), selectors and
multiprocessing.reduction.send_handle()/recv_handle() take it, and it is readable exactly
while a message or the peer's hang-up is there. The errors are multiprocessing's: EOFError
from recv() once the peer closed and nothing is left, BrokenPipeError from send() to a
closed peer, OSError on a closed handle or the wrong end of Pipe(duplex=False).
(shmtensor's C++ pipe(), with a ring of slots in shared memory each way, sends a small
message without a syscall; its readiness cannot be a socket that send_handle() writes to,
so Python's Pipe does not use it: docs/python.md.)
"""
from __future__ import annotations

import errno
import multiprocessing
import multiprocessing.connection as _mpconnection
from typing import TYPE_CHECKING

from shmtensor import _C
from shmtensor.multiprocessing import reductions
from shmtensor.multiprocessing._native_wait import untimed
from shmtensor.multiprocessing._reexport import reexport
from shmtensor.multiprocessing.frames import frame_reduce, fds_of

if TYPE_CHECKING:
    from collections.abc import Sequence
    from typing import Any

    from _typeshed import ReadableBuffer, WriteableBuffer
    from typing_extensions import Self

    from shmtensor._C import Tensor, _Connection, _Item
    from shmtensor.multiprocessing import keeper

__getattr__, __dir__ = reexport(globals(), _mpconnection)

if TYPE_CHECKING:
    # To type checkers, a multiprocessing Connection (it has that API, and code typed for
    # one takes it: multiprocessing.connection.wait() does); at run time, not a subclass.
    _ConnectionBase = _mpconnection.Connection
else:
    _ConnectionBase = object


class Connection(_ConnectionBase):
    def __init__(self, native: _Connection, readable: bool = True,
                 writable: bool = True) -> None:
        if not readable and not writable:
            raise ValueError("at least one of `readable` and `writable` must be True")
        self._c: _Connection | None = native
        self._readable = readable
        self._writable = writable

    def _check_closed(self) -> _Connection:
        if self._c is None:
            raise OSError("handle is closed")
        return self._c

    def _check_readable(self) -> _Connection:
        c = self._check_closed()
        if not self._readable:
            raise OSError("connection is write-only")
        return c

    def _check_writable(self) -> _Connection:
        c = self._check_closed()
        if not self._writable:
            raise OSError("connection is read-only")
        return c

    @property
    def closed(self) -> bool:
        return self._c is None

    @property
    def readable(self) -> bool:
        return self._readable

    @property
    def writable(self) -> bool:
        return self._writable

    def fileno(self) -> int:
        """The socket."""
        return self._check_closed().fileno()

    def close(self) -> None:
        if self._c is not None:
            self._c.close()
            self._c = None

    def _send(self, c: _Connection, data: bytes, blocks: Sequence[Tensor]) -> None:
        try:
            c.send(data, blocks)
        except EOFError:
            raise BrokenPipeError(errno.EPIPE, "Broken pipe: the peer closed the connection") from None

    def send(self, obj: Any) -> None:
        c = self._check_writable()
        data, blocks = reductions.dumps(obj)
        self._send(c, data, blocks)

    def _recv(self, c: _Connection) -> _Item:
        return untimed(c.recv)

    def recv(self) -> Any:
        data, blocks = self._recv(self._check_readable())
        return reductions.loads(data, blocks)

    def send_bytes(self, buf: ReadableBuffer, offset: int = 0,
                   size: int | None = None) -> None:
        c = self._check_writable()
        m = memoryview(buf).cast("B")
        n = m.nbytes
        if offset < 0:
            raise ValueError("offset is negative")
        if n < offset:
            raise ValueError("buffer length < offset")
        if size is None:
            size = n - offset
        elif size < 0:
            raise ValueError("size is negative")
        elif offset + size > n:
            raise ValueError("buffer length < offset + size")
        self._send(c, bytes(m[offset:offset + size]), [])

    def recv_bytes(self, maxlength: int | None = None) -> bytes:
        c = self._check_readable()
        if maxlength is not None and maxlength < 0:
            raise ValueError("negative maxlength")
        data, _ = self._recv(c)
        if maxlength is not None and len(data) > maxlength:
            # As multiprocessing: the message is lost, and this end reads no more.
            if self._writable:
                self._readable = False
            else:
                self.close()
            raise OSError("bad message length")
        return data

    def recv_bytes_into(self, buf: WriteableBuffer, offset: int = 0) -> int:
        c = self._check_readable()
        with memoryview(buf) as m:
            bytesize = m.itemsize * len(m)
            if offset < 0:
                raise ValueError("negative offset")
            if offset > bytesize:
                raise ValueError("offset too large")
            data, _ = self._recv(c)
            if bytesize < offset + len(data):
                raise multiprocessing.BufferTooShort(data)
            m.cast("B")[offset:offset + len(data)] = data
            return len(data)

    def poll(self, timeout: float | None = 0.0) -> bool:
        c = self._check_readable()
        if timeout is None:
            return untimed(c.poll)
        return c.poll(timeout)

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __reduce__(self) -> tuple[Any, ...]:
        return frame_reduce(_rebuild_connection, self._check_closed()._frame(),
                            (self._readable, self._writable))


def _rebuild_connection(data: bytes, fd_refs: list[keeper.FdRef], readable: bool,
                        writable: bool) -> Connection:
    return Connection(_C._connection_of_frame(data, fds_of(fd_refs)), readable, writable)


def Pipe(duplex: bool = True) -> tuple[Connection, Connection]:
    """Two connected ends. duplex=False returns (reader, writer) like multiprocessing."""
    a, b = _C._pipe(sockets_only=True)
    if duplex:
        return Connection(a), Connection(b)
    return Connection(a, True, False), Connection(b, False, True)
