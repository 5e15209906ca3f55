"""Pipe() and Connection on shmtensor's native transport (include/shmtensor/connection.h):
one SOCK_SEQPACKET socket pair; each send() is one message whose shared arrays travel as
descriptors. The API is multiprocessing.connection.Connection's; a closed peer is EOFError.
"""
from shmtensor import _C
from shmtensor.multiprocessing import reductions
from shmtensor.multiprocessing.frames import frame_reduce, fds_of


class Connection:
    def __init__(self, native, readable=True, writable=True):
        self._c = native
        self._readable = readable
        self._writable = writable

    def _check(self):
        if self._c is None:
            raise OSError("handle is closed")
        return self._c

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
        return self._check().fileno()

    def close(self):
        if self._c is not None:
            self._c.close()
            self._c = None

    def send(self, obj):
        c = self._check()
        if not self._writable:
            raise OSError("connection is read-only")
        data, blocks = reductions.dumps(obj)
        c.send(data, blocks)

    def recv(self):
        c = self._check()
        if not self._readable:
            raise OSError("connection is write-only")
        data, blocks = c.recv(None)
        return reductions.loads(data, blocks)

    def send_bytes(self, buf, offset=0, size=None):
        c = self._check()
        m = memoryview(buf).cast("B")
        if offset < 0 or offset > len(m):
            raise ValueError("offset is negative or too large")
        if size is None:
            size = len(m) - offset
        if size < 0 or offset + size > len(m):
            raise ValueError("size is negative or too large")
        c.send(bytes(m[offset:offset + size]), [])

    def recv_bytes(self, maxlength=None):
        data, _ = self._check().recv(None)
        if maxlength is not None and len(data) > maxlength:
            raise OSError("bad message length")
        return data

    def recv_bytes_into(self, buf, offset=0):
        data, _ = self._check().recv(None)
        m = memoryview(buf).cast("B")
        if offset < 0 or offset > len(m):
            raise ValueError("negative offset or offset too large")
        if len(data) > len(m) - offset:
            import multiprocessing
            raise multiprocessing.BufferTooShort(data)
        m[offset:offset + len(data)] = data
        return len(data)

    def poll(self, timeout=0.0):
        return self._check().poll(timeout)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def __reduce__(self):
        return frame_reduce(_rebuild_connection, self._check()._frame(),
                            (self._readable, self._writable))


def _rebuild_connection(data, fd_refs, readable, writable):
    return Connection(_C._connection_of_frame(data, fds_of(fd_refs)), readable, writable)


def Pipe(duplex=True):
    """Two connected ends. duplex=False returns (reader, writer) like multiprocessing."""
    a, b = _C._pipe()
    if duplex:
        return Connection(a), Connection(b)
    return Connection(a, True, False), Connection(b, False, True)
