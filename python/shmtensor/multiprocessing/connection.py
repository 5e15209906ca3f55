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
import errno
import multiprocessing
import multiprocessing.connection as _mpconnection

from shmtensor import _C
from shmtensor.multiprocessing import reductions
from shmtensor.multiprocessing._native_wait import untimed
from shmtensor.multiprocessing._reexport import reexport
from shmtensor.multiprocessing.frames import frame_reduce, fds_of

__getattr__, __dir__ = reexport(globals(), _mpconnection)


class Connection:
    def __init__(self, native, readable=True, writable=True):
        if not readable and not writable:
            raise ValueError("at least one of `readable` and `writable` must be True")
        self._c = native
        self._readable = readable
        self._writable = writable

    def _check_closed(self):
        if self._c is None:
            raise OSError("handle is closed")
        return self._c

    def _check_readable(self):
        c = self._check_closed()
        if not self._readable:
            raise OSError("connection is write-only")
        return c

    def _check_writable(self):
        c = self._check_closed()
        if not self._writable:
            raise OSError("connection is read-only")
        return c

    @property
    def closed(self):
        return self._c is None

    @property
    def readable(self):
        return self._readable

    @property
    def writable(self):
        return self._writable

    def fileno(self):
        """The socket."""
        return self._check_closed().fileno()

    def close(self):
        if self._c is not None:
            self._c.close()
            self._c = None

    def _send(self, c, data, blocks):
        try:
            c.send(data, blocks)
        except EOFError:
            raise BrokenPipeError(errno.EPIPE, "Broken pipe: the peer closed the connection") from None

    def send(self, obj):
        c = self._check_writable()
        data, blocks = reductions.dumps(obj)
        self._send(c, data, blocks)

    def _recv(self, c):
        return untimed(c.recv)

    def recv(self):
        data, blocks = self._recv(self._check_readable())
        return reductions.loads(data, blocks)

    def send_bytes(self, buf, offset=0, size=None):
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

    def recv_bytes(self, maxlength=None):
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

    def recv_bytes_into(self, buf, offset=0):
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

    def poll(self, timeout=0.0):
        c = self._check_readable()
        if timeout is None:
            return untimed(c.poll)
        return c.poll(timeout)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def __reduce__(self):
        return frame_reduce(_rebuild_connection, self._check_closed()._frame(),
                            (self._readable, self._writable))


def _rebuild_connection(data, fd_refs, readable, writable):
    return Connection(_C._connection_of_frame(data, fds_of(fd_refs)), readable, writable)


def Pipe(duplex=True):
    """Two connected ends. duplex=False returns (reader, writer) like multiprocessing."""
    a, b = _C._pipe(sockets_only=True)
    if duplex:
        return Connection(a), Connection(b)
    return Connection(a, True, False), Connection(b, False, True)
