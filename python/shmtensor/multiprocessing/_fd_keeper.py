"""shmtensor's fd keeper: holds file descriptors for pickles that are in flight.

A plain pickle (multiprocessing.Queue, Pool) cannot carry an fd. multiprocessing's own
resource_sharer keeps the fd in the sending process, so the receiver fails if the sender
exited first (torch's file_descriptor strategy has that failure). The keeper is one small
process per user, run as a script (standard library only, never imports shmtensor), that
holds each registered fd until one receiver takes it:

  listen on the abstract unix address "\\0shmtensor-fd-keeper-<uid>" (SOCK_SEQPACKET);
  every connection sends one request and gets one answer:
    b"R" + token(16) with one fd (SCM_RIGHTS)  -> b"K"            register
    b"T" + token(16)                           -> b"F" + the fd   take (once)
                                               -> b"E"            unknown token
  peers of another uid are refused (SO_PEERCRED).

A token whose sender has died is dropped after a grace period (SHMTENSOR_KEEPER_GRACE_S,
default 300 s); the keeper exits once it holds nothing and was idle for 2 s, and a sender
that finds no keeper starts one.
"""
import os
import select
import socket
import struct
import sys
import time

TOKEN_BYTES = 16
IDLE_EXIT_S = 2.0


def address():
    return "\0shmtensor-fd-keeper-%d" % os.getuid()


def _peer_pid(conn):
    creds = conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
    pid, uid, _ = struct.unpack("3i", creds)
    return pid, uid


def _alive(pid):
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def serve():
    grace = float(os.environ.get("SHMTENSOR_KEEPER_GRACE_S", "300"))
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET | socket.SOCK_CLOEXEC)
    try:
        listener.bind(address())
    except OSError:
        return 0  # another keeper serves this user
    listener.listen(64)
    held = {}  # token -> [fd, sender pid, time the sender was first seen dead or None]
    last_activity = time.monotonic()
    while True:
        ready, _, _ = select.select([listener], [], [], 1.0)
        now = time.monotonic()
        if ready:
            last_activity = now
            conn, _ = listener.accept()
            with conn:
                conn.settimeout(2.0)
                try:
                    _handle(conn, held)
                except OSError:
                    pass
        for token, entry in list(held.items()):
            fd, pid, dead_since = entry
            if dead_since is None:
                if not _alive(pid):
                    entry[2] = now
            elif now - dead_since > grace:
                os.close(fd)
                del held[token]
        if not held and now - last_activity > IDLE_EXIT_S:
            listener.close()
            return 0


def _handle(conn, held):
    pid, uid = _peer_pid(conn)
    if uid != os.getuid():
        return
    msg, fds, _, _ = socket.recv_fds(conn, 1 + TOKEN_BYTES, 1)
    kind, token = msg[:1], msg[1:]
    if len(token) != TOKEN_BYTES:
        for fd in fds:
            os.close(fd)
        return
    if kind == b"R" and len(fds) == 1:
        old = held.pop(token, None)
        if old is not None:
            os.close(old[0])
        held[token] = [fds[0], pid, None]
        conn.sendall(b"K")
        return
    for fd in fds:
        os.close(fd)
    if kind == b"T":
        entry = held.pop(token, None)
        if entry is None:
            conn.sendall(b"E")
            return
        try:
            socket.send_fds(conn, [b"F"], [entry[0]])
        finally:
            os.close(entry[0])


if __name__ == "__main__":
    sys.exit(serve())
