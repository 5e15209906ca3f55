"""Tensor messages of NumPy arrays (docs/python.md, "Tensor messages"): a native message that
is a structure of plain values and arrays in shared blocks is encoded and decoded by one call
of shmtensor._C instead of a pickle. Exact values, dtypes and views both ways, what stays a
pickle, hostile bytes, and real processes (fork, spawn) through the native Queue and a
Broadcast. (test_torch_messages.py: the same with torch tensors.)"""
import multiprocessing.reduction as mpreduction
import struct
import subprocess
import sys

import numpy as np
import pytest

import shmtensor.multiprocessing as smp
import shmtensor.numpy as snp
from shmtensor import _C
from shmtensor.multiprocessing import reductions
from helpers import assert_each_is_pickled, start_in_child, wait_child

NUMERIC = [np.bool_, np.int8, np.uint8, np.int16, np.uint16, np.int32, np.uint32, np.int64,
           np.uint64, np.float16, np.float32, np.float64, np.longdouble, np.complex64,
           np.complex128, np.clongdouble]


def encode(obj):
    return _C._encode_message(obj, True, False)


def test_a_structure_of_values_and_shared_arrays_round_trips_exactly():
    a = snp.empty((3, 4), np.float32)
    a[...] = np.arange(12).reshape(3, 4)
    b = snp.zeros(10, np.int64)
    b[:] = np.arange(10)
    frozen = snp.empty(2, np.uint8)
    frozen[:] = [7, 8]
    frozen.flags.writeable = False
    obj = {"step": 7, "views": [a, a[::2, ::-1], a.T, b[3:8], b[9:4:-2], a[1, 2, ...]],
           "frozen": frozen, "empty": b[5:5], "f": snp.empty((2, 3), np.int16, order="F"),
           "meta": ("é", 2.5, None, True, b"\x00\xff", -2**63)}
    obj["f"][...] = [[1, 2, 3], [4, 5, 6]]
    data, blocks = reductions.dumps(obj)
    assert data[:5] == b"STM2\x00"
    assert len(blocks) == 4  # a's, b's, frozen's and f's: each block once
    got = reductions.loads(data, blocks)
    assert type(got) is dict and list(got) == list(obj)
    assert got["step"] == 7 and got["meta"] == ("é", 2.5, None, True, b"\x00\xff", -2**63)
    views = got["views"]
    assert type(views) is list and len(views) == 6
    for sent, arrived in zip(obj["views"], views):
        assert type(arrived) is np.ndarray and arrived.dtype == sent.dtype
        assert arrived.shape == sent.shape and arrived.strides == sent.strides
        assert arrived.tolist() == sent.tolist()
        assert arrived.__array_interface__["data"][0] == sent.__array_interface__["data"][0]
    assert views[5].shape == () and views[5][()] == 6.0  # a 0-d array
    assert got["f"].flags.f_contiguous and got["f"].tolist() == [[1, 2, 3], [4, 5, 6]]
    assert got["empty"].shape == (0,) and got["empty"].dtype == np.int64
    assert not got["frozen"].flags.writeable and got["frozen"].tolist() == [7, 8]
    assert views[0].flags.writeable
    # The same bytes, not copies: writes are seen both ways, and each arrival is in its block.
    views[0][0, 0] = 100.0
    assert a[0, 0] == 100.0
    b[4] = -1
    assert views[3][1] == -1
    assert snp.is_shared(views[1]) and snp.is_shared(got["frozen"])


@pytest.mark.parametrize("dtype", NUMERIC, ids=lambda d: np.dtype(d).name)
def test_every_numeric_dtype_keeps_its_values(dtype):
    a = snp.empty(5, dtype)
    a[...] = np.array([0, 1, 2, 3, 1], dtype=dtype)
    data, blocks = encode([a])
    got = _C._decode_message(data, blocks)[0]
    assert got.dtype == np.dtype(dtype) and got.tobytes() == a.tobytes()


class Matrix(np.ndarray):
    pass


def test_what_is_not_a_tensor_message_stays_a_pickle():
    a = snp.zeros(4, np.int32)
    block = _C._empty((8,), "uint8", True)
    cases = {
        "no array": (1, [2, 3], {"a": "b"}),
        "an array not in shared memory": (np.ones(3),),
        "the same array twice": (a, a),
        "a byte-swapped dtype": (snp.zeros(2, ">i4"),),
        "a structured dtype": (snp.zeros(2, [("x", "<i4"), ("y", "<f8")]),),
        "datetime64": (snp.zeros(2, "datetime64[ms]"),),
        "a dtype with metadata": (snp.zeros(2, np.dtype(np.int32, metadata={"k": 1})),),
        "a subclass": (snp.zeros(2).view(Matrix),),
        "a shmtensor Tensor": (a, block),
        "a set": (a, {1}),
        "a NumPy scalar": (a, np.float32(1.0)),
    }
    assert_each_is_pickled(cases, encode)
    twice = reductions.loads(*reductions.dumps(cases["the same array twice"]))
    assert twice[0] is twice[1]  # the pickle keeps identity
    meta = reductions.loads(*reductions.dumps(cases["a dtype with metadata"]))[0]
    assert meta.dtype.metadata == {"k": 1}


def test_a_plain_value_of_more_than_1_kib_before_any_array_is_pickled_after_a_short_walk():
    a = snp.zeros(2, np.int16)
    ints = list(range(200))  # 1,805 bytes as a tensor message
    assert encode((ints, a)) is None
    assert reductions.dumps((ints, a))[0][:1] == b"\x80"
    data, blocks = encode((a, ints))  # the array came first
    got = _C._decode_message(data, blocks)
    assert got[1] == ints and got[0].tolist() == [0, 0]


def test_another_reducer_for_ndarray_takes_them_as_pickles():
    a = snp.zeros(3, np.int32)
    seen = []

    def reduce(arr):
        seen.append(arr)
        return np.array, (arr.tolist(),)

    mpreduction.ForkingPickler.register(np.ndarray, reduce)
    try:
        data, blocks = reductions.dumps({"a": a})
        assert data[:1] == b"\x80" and blocks == [] and len(seen) == 1
    finally:
        mpreduction.ForkingPickler.register(np.ndarray, reductions._reduce_ndarray)
    assert reductions.dumps({"a": a})[0][:5] == b"STM2\x00"


def array_entry(index=0, num=7, flags=0, sizes=(4,), offset=0, strides=None):
    strides = (8,) if strides is None else strides
    out = b"a" + struct.pack("<IBBBQ", index, num, flags, len(sizes), offset)
    out += b"".join(struct.pack("<q", s) for s in sizes)
    return out + b"".join(struct.pack("<q", s) for s in strides)


@pytest.mark.parametrize("data, message", [
    (b"STM", "does not start with its magic"),
    (b"STM2", "is truncated"),
    (b"STM2\x04N", "has unknown flags"),
    (b"STM2\x00i\x01\x02", "is truncated"),
    (b"STM2\x00?", "has an unknown value tag"),
    (b"STM2\x00NN", "has bytes after its value"),
    (b"STM2\x00l" + struct.pack("<I", 1000), "has a count past its end"),
    (b"STM2\x00" + array_entry(index=1), "names a block it does not carry"),
    (b"STM2\x00" + array_entry(num=20), "has an array of no NumPy dtype"),
    (b"STM2\x00" + array_entry(num=200), "has an array of no NumPy dtype"),
    (b"STM2\x00" + array_entry(flags=2), "has an array with unknown flags"),
    (b"STM2\x00" + array_entry(sizes=(1,) * 65, strides=(8,) * 65), "too many dimensions"),
    (b"STM2\x00" + array_entry(sizes=(5,)), "reaches past its block"),
    (b"STM2\x00" + array_entry(sizes=(2,), offset=24), "reaches past its block"),
    (b"STM2\x00" + array_entry(sizes=(0,), offset=33), "reaches past its block"),
    (b"STM2\x00" + array_entry(sizes=(2,), strides=(-8,)), "reaches past its block"),
    (b"STM2\x00" + array_entry(sizes=(-1,)), "has a negative size"),
    (b"STM2\x00" + array_entry(sizes=(2**62, 2), strides=(2**62, 8)), "overflows"),
    (b"STM2\x00" + array_entry()[:-1], "is truncated"),
])
def test_hostile_bytes_are_a_value_error_naming_what_is_wrong(data, message):
    _, blocks = encode([snp.zeros(4, np.int64)])  # one block of 32 bytes
    with pytest.raises(ValueError, match=message):
        _C._decode_message(data, blocks)
    if data[:4] == b"STM2":
        with pytest.raises(ValueError, match=message):
            reductions.loads(data, blocks)


def test_the_exact_bytes_decode_and_a_well_formed_message_fits_its_block():
    a = snp.zeros(4, np.int64)
    a[:] = [1, 2, 3, 4]
    data, blocks = encode([a])
    assert data == b"STM2\x00l" + struct.pack("<I", 1) + array_entry()
    assert _C._decode_message(data, blocks)[0].tolist() == [1, 2, 3, 4]
    back = array_entry(sizes=(4,), offset=24, strides=(-8,))  # the last element first
    assert _C._decode_message(b"STM2\x00" + back, blocks).tolist() == [4, 3, 2, 1]


def test_blocks_must_be_shared_tensors_given_as_a_list_or_a_tuple():
    data, blocks = encode([snp.zeros(4, np.int64)])
    with pytest.raises(TypeError, match="contiguous bytes"):
        _C._decode_message(memoryview(data + data)[::2], blocks)
    with pytest.raises(TypeError, match="a list or a tuple"):
        _C._decode_message(data, iter(blocks))
    with pytest.raises(TypeError, match="must be shmtensor Tensors"):
        _C._decode_message(data, [bytearray(32)])
    with pytest.raises(ValueError, match="not in shared memory"):
        _C._decode_message(data, [_C._empty((32,), "uint8", False)])
    assert _C._decode_message(data, tuple(blocks))[0].tolist() == [0, 0, 0, 0]


def test_a_forked_process_sends_arrays_as_tensor_messages_both_ways():
    q = smp.Queue()
    back = smp.Queue()

    def worker():
        for i in range(3):
            a = snp.full((2, 3), i, np.float32)
            assert reductions.dumps((i, a))[0][:5] == b"STM2\x00"
            q.put((i, {"x": a, "y": a[:, 1]}))
        got = back.get(timeout=60)  # the parent's write, seen here
        assert got.tolist() == [[-1.0, 0.0, 0.0], [0.0, 0.0, 0.0]]

    pid = start_in_child(worker)
    got = [q.get(timeout=60) for _ in range(3)]
    assert [i for i, _ in got] == [0, 1, 2]
    for i, d in got:
        assert d["x"].tolist() == [[float(i)] * 3] * 2 and d["y"].tolist() == [float(i)] * 2
    got[0][1]["x"][0, 0] = -1.0
    back.put(got[0][1]["x"])
    assert wait_child(pid) == 0
    q.close()
    back.close()


def _spawned_reader(reader, out):
    step, a = reader.get(timeout=60)
    out.put((step, a.tolist(), str(a.dtype), "torch" in sys.modules))
    a[0] = 99  # seen by the writer


def test_a_spawned_broadcast_reader_decodes_them_without_torch():
    ctx = smp.get_context("spawn")
    b = smp.Broadcast(readers=1)
    out = ctx.Queue()
    p = ctx.Process(target=_spawned_reader, args=(b.reader(0), out))
    p.start()
    a = snp.empty(3, np.uint16)
    a[:] = [1, 2, 3]
    b.put((5, a))
    assert out.get(timeout=120) == (5, [1, 2, 3], "uint16", False)
    p.join(60)
    assert p.exitcode == 0
    assert a.tolist() == [99, 2, 3]
    b.close()
    out.close()


# A fresh interpreter where torch cannot be imported: a message's flags byte decides whether
# loads imports shmtensor.torch, and a process without torch gets a clear error for one that
# holds torch tensors, a ValueError for unknown flags.
WITHOUT_TORCH = r"""
import pickle, sys
sys.modules["torch"] = None
import numpy as np
import shmtensor.numpy as snp
from shmtensor.multiprocessing import reductions
a = snp.zeros(4, np.int64)
a[:] = [1, 2, 3, 4]
data, blocks = reductions.dumps([a])
assert data[:5] == b"STM2\x00"
assert reductions.loads(data, blocks)[0].tolist() == [1, 2, 3, 4]
for flags, error in [(b"\x04", ValueError), (b"\x81", ValueError),
                     (b"\x01", pickle.UnpicklingError)]:
    try:
        reductions.loads(data[:4] + flags + data[5:], blocks)
    except error as e:
        print(flags.hex(), type(e).__name__, e)
    print("shmtensor.torch" in sys.modules)
"""


def test_a_process_without_torch_refuses_flags_it_cannot_decode_with_clear_errors():
    r = subprocess.run([sys.executable, "-c", WITHOUT_TORCH], capture_output=True, text=True,
                       timeout=120)
    assert r.returncode == 0, r.stdout + r.stderr
    lines = r.stdout.splitlines()
    assert lines[0] == ("04 ValueError shmtensor: a received tensor message has unknown flags "
                        "(a corrupt or hostile message)")
    assert lines[2].startswith("81 ValueError shmtensor: a received tensor message has unknown")
    assert lines[4] == ("01 UnpicklingError a shmtensor tensor message of torch tensors needs "
                        "torch and shmtensor.torch, which cannot be imported here: import of "
                        "torch halted; None in sys.modules")
    assert lines[1::2] == ["False", "False", "False"]
