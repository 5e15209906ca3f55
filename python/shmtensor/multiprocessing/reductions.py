"""How NumPy arrays and shmtensor Tensors travel between processes.

Two paths share the same reducers (registered with multiprocessing.reduction.ForkingPickler):

* Native messages (shmtensor.multiprocessing.Queue / Pipe / SimpleQueue): `dumps` pickles
  with protocol 5 while a message is open; each shared block an array lives in is added to
  the message's block list and travels beside the pickle as a descriptor (its fds once per
  segment per message, by SCM_RIGHTS). Any other out-of-band buffer (PEP 574) above the
  share threshold is copied once into a block; smaller ones stay in the pickle.

* Plain pickles (multiprocessing.Queue, Pipe, Pool, a spawned child's arguments): the
  blocks travel as a frame (a few hundred bytes naming the segments and blocks) plus, for
  the file_descriptor strategy, each segment's fd, sent once per segment per pickle through
  shmtensor's fd keeper (keeper.py), so the receiver gets it even if the sender has exited.
  ForkingPickler.dumps (what multiprocessing's queues and connections call) is replaced by
  _plain_dumps, which gathers every block of the object into one frame in front of the
  pickle; any other pickler (a child's arguments) gives each block a frame of its own.

Either way the message carries a count on each block it names (the C++ in-flight count), so
the sender may drop its arrays at once. A plain pickle is therefore single-use, as in torch:
its first load adopts those counts, and a second load raises shmtensor.Error (a RuntimeError)
and takes nothing from other messages: in the same process by the pickle's nonce, in another
one by the fd keeper, which hands each fd (file_descriptor) or ticket (file_system) out once.
"""
from __future__ import annotations

import contextlib
import io
import multiprocessing.context as _mpcontext
import multiprocessing.reduction as _mpreduction
import os
import pickle
import struct
import threading
import weakref
from typing import TYPE_CHECKING

import numpy as np

from shmtensor import _C

if TYPE_CHECKING:
    from collections.abc import Callable, Sequence
    from typing import Any

    from shmtensor._C import Tensor

_DEFAULT_SHARE_THRESHOLD = 64 * 1024
_share_threshold = _DEFAULT_SHARE_THRESHOLD


def set_share_threshold(nbytes: int) -> None:
    """Arrays (and out-of-band pickle buffers) of at least `nbytes` that are not in shared
    memory yet are copied once into a shared block when sent; smaller ones are pickled in
    the message. Default 64 KiB. 0 shares everything that has at least one byte."""
    global _share_threshold
    nbytes = int(nbytes)
    if nbytes < 0:
        # A bad argument, as set_sharing_strategy's: a plain ValueError (python.md's table).
        raise ValueError("set_share_threshold(%d): the share threshold is a number of bytes "
                         ">= 0" % nbytes)
    _share_threshold = nbytes


def get_share_threshold() -> int:
    return _share_threshold


# ---- finding the block an array lives in -----------------------------------------------


def _new_block(nbytes: int) -> Tensor:
    """A new shared block: a 1-d uint8 Tensor of nbytes (> 0), uninitialised."""
    return _C._empty((nbytes,), "uint8", True)


def _copy_to_block(a):
    """A C-contiguous copy of `a` in a new block, and the block."""
    block = _new_block(a.nbytes)
    copy = np.ndarray(a.shape, dtype=a.dtype, buffer=block)
    copy[...] = a
    return block, copy


def _array_from_block(block, offset, dtype, shape, strides, readonly):
    a = np.ndarray(shape, dtype=dtype, buffer=block, offset=offset, strides=strides)
    if readonly:
        a.flags.writeable = False
    return a


# ---- messages (native transport) --------------------------------------------------------

_local = threading.local()
_TRAILER = struct.Struct("<QQ")
_MAGIC = 0x5354504B4C4D5347  # marks a message with out-of-band buffers


class _Message:
    """The blocks of one native message being pickled."""

    def __init__(self):
        self.blocks = []
        self.index = {}

    def add(self, block):
        key = _C._block_address(block)
        i = self.index.get(key)
        if i is None:
            i = self.index[key] = len(self.blocks)
            self.blocks.append(block)
        return i


class _Reducers(dict):
    """ForkingPickler's reducers as a pickler's dispatch_table, read live: empty itself, so
    every lookup is a miss that asks ForkingPickler's tables (its registered reducers first,
    then copyreg's, the order ForkingPickler's own copy has). A reducer registered or
    replaced at any time is the one used, and no message copies the ~90 entries."""

    __slots__ = ()

    def __missing__(self, cls):
        reduce = _mpreduction.ForkingPickler._extra_reducers.get(cls)
        if reduce is None:
            reduce = _mpreduction.ForkingPickler._copyreg_dispatch_table.get(cls)
            if reduce is None:
                raise KeyError(cls)
        return reduce


_REDUCERS = _Reducers()


class _MessagePickler(pickle.Pickler):
    """Protocol 5 with ForkingPickler's reducers (ForkingPickler itself takes no
    buffer_callback)."""

    def __init__(self, file, buffer_callback):
        super().__init__(file, 5, buffer_callback=buffer_callback)
        self.dispatch_table = _REDUCERS


class _Sender:
    """A thread's pickler for native messages, kept from one message to the next (making
    one costs more than pickling a small message). One message at a time: dumps makes a
    fresh one for a message pickled while this one is (a reducer that sends something)."""

    def __init__(self):
        self.out = io.BytesIO()
        self.pickler = _MessagePickler(self.out, self._buffer)
        self.message = None
        self.oob = None

    def _buffer(self, buf):
        raw = buf.raw()
        if raw.nbytes == 0 or raw.nbytes < _share_threshold:
            return True
        block = _new_block(raw.nbytes)
        memoryview(block)[:] = raw
        self.oob.append((self.message.add(block), raw.readonly))
        return False

    def dumps(self, obj):
        message = self.message = _Message()
        oob = self.oob = []
        out = self.out
        stack = _local.__dict__.setdefault("sending", [])
        stack.append(message)
        try:
            self.pickler.dump(obj)
            if oob:  # (a pickle ends with STOP, never with the magic: no trailer, no oob)
                meta = pickle.dumps(oob, 5)
                out.write(meta)
                out.write(_TRAILER.pack(len(meta), _MAGIC))
            return out.getvalue(), message.blocks
        finally:
            stack.pop()
            # Nothing of this message stays referenced by the kept pickler.
            self.pickler.clear_memo()
            out.seek(0)
            out.truncate()
            self.message = self.oob = None


# A kept pickler's memo table keeps the size its largest message gave it, and clear_memo()
# clears all of it: after a message of this many pickled bytes (or a failed one) the thread
# makes a new pickler.
_KEEP_PICKLER_UP_TO = 1 << 20


# A message that is a structure of plain values, NumPy arrays and tensors already in shared
# blocks (a DataLoader worker's (index, batch), a Broadcast's step) goes as a tensor message:
# encoded and decoded by one call of shmtensor._C instead of a pickle (docs/python.md, "Tensor
# messages"). Arrays go so while _reduce_ndarray is ForkingPickler's reducer for them; torch
# tensors while shmtensor.torch's reducer is installed: shmtensor.torch sets torch_reducer to
# (torch.Tensor, its reducer) then, and back to None.
_TENSOR_MESSAGE = b"STM2"  # a pickle starts with PROTO (0x80)
torch_reducer: tuple[type, Callable[[Any], Any]] | None = None
_extra_reducers = _mpreduction.ForkingPickler._extra_reducers


def dumps(obj: object) -> tuple[bytes, list[Tensor]]:
    """obj as a native message, (bytes, [Block]): a tensor message where it can be one, else
    a pickle."""
    arrays = _extra_reducers.get(np.ndarray) is _reduce_ndarray
    reducer = torch_reducer
    torch = reducer is not None and _extra_reducers.get(reducer[0]) is reducer[1]
    if arrays or torch:
        message = _C._encode_message(obj, arrays, torch)
        if message is not None:
            return message
    sender = _local.__dict__.get("sender")
    if sender is None:
        sender = _local.sender = _Sender()
    elif sender.message is not None:  # this thread is pickling a message already
        return _Sender().dumps(obj)
    try:
        data, blocks = sender.dumps(obj)
    except BaseException:
        _local.sender = None
        raise
    if len(data) > _KEEP_PICKLER_UP_TO:
        _local.sender = None
    return data, blocks


def loads(data: bytes, blocks: Sequence[Tensor]) -> Any:
    """The inverse of dumps, in the receiving process."""
    if data[:4] == _TENSOR_MESSAGE:
        return _decode_tensor_message(data, blocks)
    oob = []
    end = len(data)
    if end >= _TRAILER.size:
        meta_len, magic = _TRAILER.unpack_from(data, end - _TRAILER.size)
        if magic == _MAGIC:
            end -= _TRAILER.size + meta_len
            if end < 0:
                raise pickle.UnpicklingError("truncated shmtensor message")
            oob = pickle.loads(data[end:end + meta_len])
    buffers = []
    for index, readonly in oob:
        view = memoryview(blocks[index])
        buffers.append(view.toreadonly() if readonly else view)
    stack = _local.__dict__.setdefault("receiving", [])
    stack.append(blocks)
    try:
        return pickle.loads(memoryview(data)[:end], buffers=buffers)
    finally:
        stack.pop()


def _decode_tensor_message(data: bytes, blocks: Sequence[Tensor]) -> Any:
    # Flags 1: it holds torch tensors, and shmtensor.torch loads the bridge where it can. Any
    # other flags byte is _C's to refuse (a ValueError), with nothing imported for it.
    if data[4:5] == b"\x01" and not _C._message_torch_ready():
        try:
            import shmtensor.torch  # noqa: PLC0415
        except ImportError as e:
            raise pickle.UnpicklingError(
                "a shmtensor tensor message of torch tensors needs torch and shmtensor.torch, "
                "which cannot be imported here: %s" % e) from e
        if not _C._message_torch_ready():
            raise pickle.UnpicklingError(
                "a shmtensor tensor message of torch tensors needs shmtensor.torch's C++ "
                "bridge, which is not loaded here: "
                + str(shmtensor.torch.bridge_unavailable_reason()))
    return _C._decode_message(data, blocks)


def _sending_message():
    """The message being pickled on this thread (a native message, or a ForkingPickler.dumps
    that gathers its blocks in one frame), or None: a reducer may then name a block by its
    index in the message (message.add) and rebuild it with _native_block."""
    stack = getattr(_local, "sending", None)
    return stack[-1] if stack else None


def _native_block(index):
    stack = getattr(_local, "receiving", None)
    if not stack:
        raise pickle.UnpicklingError(
            "a shmtensor native block reference outside a shmtensor message")
    blocks = stack[-1]
    if not 0 <= index < len(blocks):
        raise pickle.UnpicklingError("shmtensor block index %d out of range" % index)
    return blocks[index]


# ---- block references in plain pickles ----------------------------------------------------

_loaded_nonces = set()
_nonce_lock = threading.Lock()
_refs = weakref.WeakValueDictionary()


class _BlockRef:
    """A block named in a pickle. One object per block while pickles refer to it, so that
    the pickler's memo sends it once per pickle."""

    __slots__ = ("block", "__weakref__")

    def __init__(self, block):
        self.block = block

    def __reduce__(self):
        sending = getattr(_local, "sending", None)
        if sending:
            # In a native message or a ForkingPickler.dumps (_plain_dumps): an index into
            # the message's block list, which travels once beside the pickle.
            return _native_block, (sending[-1].add(self.block),)
        # Any other pickle (a child's arguments, pickle.dumps with ForkingPickler's
        # dispatch table): a frame of its own.
        return _load_block, _frame_args([self.block])


def _ref(block):
    key = _C._block_address(block)
    ref = _refs.get(key)
    if ref is None:
        ref = _refs[key] = _BlockRef(block)
    return ref


def _frame_args(blocks):
    """What a plain pickle carries for blocks: (frame bytes, fd refs, nonce, ticket). The
    counts on the blocks go with it: the pickle is single-use."""
    from shmtensor.multiprocessing import keeper

    frame = _C._frame_of_blocks(blocks)
    fd_refs = [keeper.FdRef.of(fd, uid) for fd, uid in zip(frame.fds, frame.fd_uids)]
    nonce = os.urandom(16)
    # A frame without fds (file_system) gets a ticket: its load claims it before it adopts
    # the frame's counts, so a replay in another process takes nothing from another message
    # naming the same block. The keeper hands each fd out once, so a frame with fds needs
    # none. Arguments of a child being started are read once, by the child, and need none.
    ticket = not fd_refs and _mpcontext.get_spawning_popen() is None
    if ticket:
        keeper.register_ticket(nonce)
    frame.mark_sent()
    return frame.data, fd_refs, nonce, ticket


def _adopt_frame(data, fd_refs, nonce, ticket):
    """The blocks of a plain pickle's frame, adopted once (the inverse of _frame_args)."""
    with _nonce_lock:
        if nonce in _loaded_nonces:
            raise _C.Error(
                "shmtensor: this pickle was already loaded in this process (or in the one it "
                "was forked from); a pickle of "
                "shared memory is single-use (its first load took the counts it carried): "
                "send the object again instead of keeping its pickle")
        _loaded_nonces.add(nonce)
    if ticket:
        from shmtensor.multiprocessing import keeper

        keeper.claim_ticket(nonce)
    return _C._blocks_of_frame(data, [ref.take() for ref in fd_refs])


def _load_block(data, fd_refs, nonce, ticket=False):
    blocks = _adopt_frame(data, fd_refs, nonce, ticket)
    if len(blocks) != 1:
        raise pickle.UnpicklingError("a shmtensor block reference names %d blocks" % len(blocks))
    return blocks[0]


class _PlainMessage:
    """A ForkingPickler.dumps pickle that names shared blocks: the inner pickle refers to
    them by index, and one frame carries them all (one fd per segment, one ticket)."""

    __slots__ = ("blocks", "inner")

    def __init__(self, blocks, inner):
        self.blocks = blocks
        self.inner = inner

    def __reduce__(self):
        return _load_plain, _frame_args(self.blocks) + (self.inner,)


def _load_plain(data, fd_refs, nonce, ticket, inner):
    blocks = _adopt_frame(data, fd_refs, nonce, ticket)
    stack = _local.__dict__.setdefault("receiving", [])
    stack.append(blocks)
    try:
        return pickle.loads(inner)
    finally:
        stack.pop()


_stdlib_dumps = _mpreduction.ForkingPickler.__dict__["dumps"]


def _plain_dumps(cls, obj, protocol=None):
    """ForkingPickler.dumps (what multiprocessing's Queue, SimpleQueue, Pipe and Pool send)
    with every shared block of obj in one frame: a pickle that names no block is the
    standard library's, byte for byte."""
    message = _Message()
    stack = _local.__dict__.setdefault("sending", [])
    stack.append(message)
    try:
        inner = _stdlib_dumps.__func__(cls, obj, protocol)
    finally:
        stack.pop()
    if not message.blocks:
        return inner
    return _stdlib_dumps.__func__(cls, _PlainMessage(message.blocks, bytes(inner)), protocol)


# ---- reducers ------------------------------------------------------------------------------


@contextlib.contextmanager
def one_copy_per_array():
    """While active on this thread, an array that is not in shared memory and is pickled
    more than once is copied into a block only the first time; later picklings send that
    block (the array as it was then). A DataLoader's iterator starts its spawn and
    forkserver workers in this scope: each worker's pickle of the dataset carries the same
    blocks, one copy of each array in all (shmtensor/_loader.py)."""
    if _local.__dict__.get("copies") is not None:  # nested: the outer scope's copies
        yield
        return
    _local.copies = {}
    try:
        yield
    finally:
        _local.copies = None  # and the arrays it kept alive (their ids stay unique meanwhile)


def _copied(a):
    """The block holding a copy of `a` and the copy: a new one, or, in one_copy_per_array,
    the one made the first time `a` was pickled in the scope."""
    copies = _local.__dict__.get("copies")
    if copies is None:
        return _copy_to_block(a)
    kept = copies.get(id(a))
    if kept is None or kept[0] is not a:
        kept = copies[id(a)] = (a,) + _copy_to_block(a)
    return kept[1], kept[2]


def _reduce_ndarray(a):
    if a.dtype.hasobject:
        return a.__reduce_ex__(4)
    readonly = not a.flags.writeable
    found = _C._block_of(a)
    if found is None:
        if a.nbytes == 0 or a.nbytes < _share_threshold:
            return a.__reduce_ex__(4)
        block, a = _copied(a)
        offset = 0
    else:
        block, offset = found
    return _array_from_block, (_ref(block), offset, a.dtype, a.shape, a.strides, readonly)


def _reduce_tensor(t):
    if t.numel() > 0:
        t.share_memory_()  # in place, as torch's reducer does
    parts = _C._tensor_parts(t)
    block, rest = parts[0], parts[1:]
    return _rebuild_tensor, (None if block is None else _ref(block),) + tuple(rest)


def _rebuild_tensor(block, offset, sizes, strides, dtype, device=None):
    return _C._tensor_from_parts(block, offset, sizes, strides, dtype, device)


def init_reductions() -> None:
    _mpreduction.ForkingPickler.dumps = classmethod(_plain_dumps)
    _mpreduction.ForkingPickler.register(np.ndarray, _reduce_ndarray)
    _mpreduction.ForkingPickler.register(_C.Tensor, _reduce_tensor)
