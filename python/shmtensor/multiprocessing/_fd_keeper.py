"""shmtensor's fd keeper: holds file descriptors for pickles that are in flight.

A plain pickle (multiprocessing.Queue, Pool) cannot carry an fd. multiprocessing's own
resource_sharer keeps the fd in the sending process, so the receiver fails if the sender
exited first (torch's file_descriptor strategy has that failure). The keeper is one small
process per user, run as a script (standard library only, never imports shmtensor), that
holds each registered fd until one receiver takes it. It also holds tickets: a token with
no fd, which a file_system pickle (whose segments need no fd) registers so that only one
load, in any process, may adopt the counts it carries (reductions.py).

Protocol 2. It listens on the abstract unix address "\\0shmtensor-fd-keeper-2-<uid>"
(SOCK_SEQPACKET). A client process keeps one connection for its life and sends requests on
it, handled in order:
    b"H"                                       -> b"K"            hello: the first request
    b"R" + token(16) with one fd (SCM_RIGHTS)  -> (no answer)     register an fd
    b"R" + token(16) with no fd                -> (no answer)     register a ticket
    b"T" + token(16)                           -> b"F" + the fd   take an fd (once)
                                               -> b"C"            take a ticket (once)
                                               -> b"E"            unknown token
A register needs no answer: once the sender's send returned, its datagram is queued on a
connection the keeper has accepted (the hello's answer said so), and a connection is served
until it closes. A take of a token the keeper does not know yet is answered only after it
read every request already queued on every connection: a register sent before the pickle
that names it left its sender is among them, so the order of two processes' requests
cannot lose a token. Peers of another uid are refused (SO_PEERCRED).

A token whose sender has died is dropped after a grace period (SHMTENSOR_KEEPER_GRACE_S,
default 300 s); the keeper exits once it holds nothing, no client is connected and it was
idle for 2 s, and a client that finds no keeper starts one.
"""
import array
import os
import select
import socket
import struct
import sys
import time

TOKEN_BYTES = 16
IDLE_EXIT_S = 2.0
PROTOCOL = 2


def address():
    return "\0shmtensor-fd-keeper-%d-%d" % (PROTOCOL, os.getuid())


def _peer(conn):
    creds = conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
    pid, uid, _ = struct.unpack("3i", creds)
    return pid, uid


def _recv_nowait(conn):
    """One request without blocking: (bytes, fds); BlockingIOError when none is queued.
    (socket.recv_fds ignores its flags argument before Python 3.12, hence recvmsg.)"""
    msg, ancdata, _, _ = conn.recvmsg(1 + TOKEN_BYTES, socket.CMSG_LEN(4), socket.MSG_DONTWAIT)
    fds = array.array("i")
    for level, kind, data in ancdata:
        if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
            fds.frombytes(data[:len(data) - len(data) % fds.itemsize])
    return msg, list(fds)


def _alive(pid):
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


class Keeper:
    def __init__(self, grace):
        self.grace = grace
        # token -> [fd (-1 for a ticket), sender pid, time the sender was first seen dead or None]
        self.held = {}
        self.clients = {}  # socket -> pid of the connected process

    def close_client(self, conn):
        self.clients.pop(conn, None)
        conn.close()

    def read_pending(self, conn, takes):
        """Handles every request queued on conn; takes are appended to `takes` to be
        answered in order once every register before them was read."""
        while conn in self.clients:
            try:
                msg, fds = _recv_nowait(conn)
            except (BlockingIOError, InterruptedError):
                return
            except OSError:
                self.close_client(conn)
                return
            if not msg and not fds:
                self.close_client(conn)  # the client closed (or exited)
                return
            kind, token = msg[:1], msg[1:]
            if kind == b"H" and not fds:
                self.answer(conn, [b"K"])
                continue
            if len(token) != TOKEN_BYTES:
                for fd in fds:
                    os.close(fd)
                continue
            if kind == b"R" and len(fds) <= 1:
                old = self.held.pop(token, None)
                if old is not None and old[0] >= 0:
                    os.close(old[0])
                self.held[token] = [fds[0] if fds else -1, self.clients[conn], None]
                continue
            for fd in fds:
                os.close(fd)
            if kind == b"T":
                takes.append((conn, token))

    def answer(self, conn, msg, fds=()):
        try:
            socket.send_fds(conn, msg, list(fds))
        except OSError:
            self.close_client(conn)

    def serve_takes(self, takes):
        i = 0
        drained = False
        while i < len(takes):
            conn, token = takes[i]
            i += 1
            if token not in self.held and not drained:
                # Its register may still be queued on another connection: read them all.
                drained = True
                for other in list(self.clients):
                    self.read_pending(other, takes)
            entry = self.held.pop(token, None)
            if conn not in self.clients:
                if entry is not None and entry[0] >= 0:
                    os.close(entry[0])  # the taker is gone: the fd goes with it
                continue
            if entry is None:
                self.answer(conn, [b"E"])
            elif entry[0] < 0:
                self.answer(conn, [b"C"])
            else:
                try:
                    self.answer(conn, [b"F"], [entry[0]])
                finally:
                    os.close(entry[0])

    def sweep(self, now):
        alive = {}  # pid -> alive, one kill(2) per sender per sweep
        for token, entry in list(self.held.items()):
            fd, pid, dead_since = entry
            if dead_since is None:
                if pid not in alive:
                    alive[pid] = _alive(pid)
                if not alive[pid]:
                    entry[2] = now
            elif now - dead_since > self.grace:
                if fd >= 0:
                    os.close(fd)
                del self.held[token]


def serve():
    keeper = Keeper(float(os.environ.get("SHMTENSOR_KEEPER_GRACE_S", "300")))
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET | socket.SOCK_CLOEXEC)
    try:
        listener.bind(address())
    except OSError:
        return 0  # another keeper serves this user
    listener.listen(64)
    last_activity = last_sweep = time.monotonic()
    while True:
        ready, _, _ = select.select([listener, *keeper.clients], [], [], 1.0)
        now = time.monotonic()
        if ready:
            last_activity = now
        takes = []
        for conn in ready:
            if conn is listener:
                client, _ = listener.accept()
                pid, uid = _peer(client)
                if uid != os.getuid():
                    client.close()
                    continue
                keeper.clients[client] = pid
                keeper.read_pending(client, takes)
            elif conn in keeper.clients:
                keeper.read_pending(conn, takes)
        keeper.serve_takes(takes)
        # Senders' liveness is checked once a second, not per request: a request must not
        # cost a kill(2) per token held.
        if now - last_sweep >= 1.0:
            last_sweep = now
            keeper.sweep(now)
        if not keeper.held and not keeper.clients and now - last_activity > IDLE_EXIT_S:
            listener.close()
            return 0


if __name__ == "__main__":
    sys.exit(serve())
