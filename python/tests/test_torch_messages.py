"""Tensor messages of torch tensors (docs/python.md, "Tensor messages"): while shmtensor.torch
is installed, a message that is a structure of plain values and tensors already in arenas is
encoded and decoded by one call of shmtensor._C (the bridge describing and making the tensors)
instead of a pickle. Exact values and types both ways,
what stays a pickle, hostile bytes, and real processes (fork, spawn) through the native
Queue. Skipped, with the reason, where shmtensor._torch is not built."""
import struct

import numpy as np
import pytest

try:
    import torch
    from shmtensor import _torch
except ImportError as e:
    pytest.skip(f"shmtensor._torch is not built ({e}); it needs libtorch (SHMTENSOR_BUILD_TORCH)",
                allow_module_level=True)

import shmtensor.multiprocessing as smp
import shmtensor.numpy as snp
import shmtensor.torch as st
from shmtensor import _C
from shmtensor.multiprocessing import reductions
from helpers import assert_each_is_pickled, run_in_child, start_in_child, wait_child
from helpers import torch_strategy  # noqa: F401 (fixture `strategy`)


@pytest.fixture(name="installed")
def fixture_installed(strategy):
    st.install()
    yield strategy
    st.uninstall()


def encode(obj):
    """What reductions.dumps sends for obj while installed, or None (a pickle)."""
    return _C._encode_message(obj, True, True)


def shared(values, dtype=torch.float32):
    """A tensor of `values` on a new arena block (as a DataLoader worker's collate makes)."""
    return _torch.stack_shared([torch.tensor(values, dtype=dtype)])[0]


def test_a_structure_of_values_and_arena_tensors_round_trips_exactly(installed):
    a = shared([1.0, 2.0, 3.0, 4.0])
    b = _torch.stack_shared([torch.arange(6, dtype=torch.int64).view(2, 3)] * 2)
    view = b[1].t()  # strided, offset into b's block
    obj = (7, [a, view], {"name": "é", 3: 2.5, (1, None): b"\x00\xff", "flags": [True, False]},
           None, -2**63, 2**63 - 1)
    data, blocks = reductions.dumps(obj)
    assert data[:4] == b"STM2"
    assert len(blocks) == 2  # a's block, and b's once for b and its view
    got = reductions.loads(data, blocks)
    assert type(got) is tuple and type(got[1]) is list and type(got[2]) is dict
    assert got[0] == 7 and got[3] is None and got[4] == -2**63 and got[5] == 2**63 - 1
    assert got[2] == {"name": "é", 3: 2.5, (1, None): b"\x00\xff", "flags": [True, False]}
    assert type(got[2]["flags"][0]) is bool
    ga, gview = got[1]
    assert ga.dtype == torch.float32 and ga.tolist() == [1.0, 2.0, 3.0, 4.0]
    assert gview.shape == (3, 2) and gview.stride() == view.stride()
    assert gview.storage_offset() == view.storage_offset()
    assert gview.tolist() == [[0, 3], [1, 4], [2, 5]]
    # The same storages, not copies: writes are seen both ways.
    assert ga.data_ptr() == a.data_ptr() and gview.data_ptr() == view.data_ptr()
    ga[0] = 10.0
    assert a[0].item() == 10.0
    b[1, 0, 1] = 42
    assert gview[1, 0].item() == 42


@pytest.mark.parametrize("dtype", [torch.uint8, torch.int8, torch.int16, torch.int32,
                                   torch.int64, torch.float16, torch.bfloat16, torch.float32,
                                   torch.float64, torch.bool, torch.complex64], ids=str)
def test_every_dtype_keeps_its_values(installed, dtype):
    t = _torch.stack_shared([torch.tensor([0, 1, 1, 0, 1], dtype=torch.int64).to(dtype)])
    data, blocks = reductions.dumps({"x": t})
    assert data[:4] == b"STM2"
    got = reductions.loads(data, blocks)["x"]
    assert got.dtype == dtype and torch.equal(got, t)


class Point(tuple):
    pass


def nested(levels):
    out = []
    for _ in range(levels - 1):
        out = [out]
    return out


def test_what_is_not_a_tensor_message_stays_a_pickle(installed):
    a = shared([1.0])
    private = torch.ones(3)  # not in an arena: the reducer moves it, as before
    grad = shared([1.0]).requires_grad_()
    lst = [a]
    cases = {
        "no tensor": (1, [2, 3], {"a": "b"}),
        "a tensor not in an arena": (0, private),
        "the same tensor twice": (a, a),
        "the same list twice": (lst, lst),
        "a tuple subclass": Point((a,)),
        "an int beyond int64": (a, 2**63),
        "a lone surrogate": (a, "\ud800"),
        "a set": (a, {1}),
        "requires_grad": (a, grad),
        "65 levels": (a, nested(65)),
    }
    assert_each_is_pickled(cases, encode)
    got = reductions.loads(*reductions.dumps(cases["the same tensor twice"]))
    assert got[0] is got[1]  # the pickle keeps identity
    assert private.is_shared()  # moved by the reducer when it was sent


def test_a_large_plain_value_before_any_tensor_is_pickled_without_a_second_walk(installed):
    t = shared([1.0])
    ints = list(range(20000))  # 180,000 bytes as a tensor message
    assert encode((ints, t)) is None
    data, blocks = encode((t, ints))  # the tensor came first
    got = _C._decode_message(data, blocks)
    assert got[1] == ints and got[0].data_ptr() == t.data_ptr()


def test_decode_takes_contiguous_bytes_and_a_list_or_tuple_of_blocks(installed):
    data, blocks = encode([shared([1.0])])
    with pytest.raises(TypeError, match="contiguous bytes"):
        _C._decode_message(memoryview(data + data)[::2], blocks)
    with pytest.raises(TypeError, match="a list or a tuple"):
        _C._decode_message(data, iter(blocks))
    assert _C._decode_message(data, tuple(blocks))[0].tolist() == [1.0]


def test_uninstalled_sends_pickles_and_still_decodes_tensor_messages(strategy):
    st.install()
    a = shared([5.0, 6.0])
    message = reductions.dumps((1, a))
    st.uninstall()
    assert reductions.torch_reducer is None  # dumps pickles (torch's reducer then)
    got = reductions.loads(*message)
    assert got[0] == 1 and got[1].tolist() == [5.0, 6.0] and got[1].data_ptr() == a.data_ptr()


def message_bytes(*parts):
    return b"STM2\x01" + b"".join(parts)


def tensor_entry(index=0, dtype=6, sizes=(4,), offset=0, strides=None):
    out = b"x" + struct.pack("<IBBq", index, dtype, len(sizes), offset)
    out += b"".join(struct.pack("<q", s) for s in sizes)
    if strides is None:
        return out + b"\x00"
    return out + b"\x01" + b"".join(struct.pack("<q", s) for s in strides)


@pytest.mark.parametrize("data, message", [
    (b"STM", "does not start with its magic"),
    (message_bytes(b"i\x01\x02"), "is truncated"),
    (message_bytes(b"?"), "has an unknown value tag"),
    (message_bytes(b"N", b"N"), "has bytes after its value"),
    (message_bytes(b"l" + struct.pack("<I", 1000)), "has a count past its end"),
    (message_bytes(b"s" + struct.pack("<I", 2) + b"\xff\xfe"), "has a str that is not UTF-8"),
    (message_bytes(b"s" + struct.pack("<I", 9) + b"abc"), "is truncated"),
    (message_bytes(b"d" + struct.pack("<I", 1) + b"l" + struct.pack("<I", 0) + b"N"),
     "has a dict key that cannot be hashed"),
    (message_bytes(b"l" + struct.pack("<I", 1)) * 1 + b"l\x01\x00\x00\x00" * 70 + b"N",
     "nests too deep"),
    (message_bytes(tensor_entry(index=1)), "names a block it does not carry"),
    (message_bytes(tensor_entry(dtype=200)), "has no dtype"),
    (message_bytes(tensor_entry(sizes=(5,))), "reaches past its block"),
    (message_bytes(tensor_entry(sizes=(2,), offset=-1)), "has a negative offset"),
    (message_bytes(tensor_entry(sizes=(2,), strides=(-1,))), "out of range"),
    (message_bytes(tensor_entry()[:-1] + b"\x02"), "a bad strides flag"),
    (message_bytes(tensor_entry(sizes=(1,) * 65)), "has too many dimensions"),
    (b"STM2\x00" + tensor_entry(), "has a torch tensor its flags do not announce"),
    (b"STM2\x03" + tensor_entry(), "has unknown flags"),
])
def test_hostile_bytes_are_a_value_error_naming_what_is_wrong(installed, data, message):
    _, blocks = encode([shared([1.0, 2.0, 3.0, 4.0])])
    with pytest.raises(ValueError, match=message):
        _C._decode_message(data, blocks)


def test_the_exact_bytes_decode_and_a_well_formed_message_fits_its_block(installed):
    t = shared([1.0, 2.0, 3.0, 4.0])
    data, blocks = encode([t])
    assert data == message_bytes(b"l" + struct.pack("<I", 1), tensor_entry(dtype=6, sizes=(4,)))
    assert _C._decode_message(data, blocks)[0].tolist() == [1.0, 2.0, 3.0, 4.0]


def test_a_forked_worker_sends_batches_as_tensor_messages_both_ways(installed):
    q = smp.Queue()
    back = smp.Queue()

    def worker():
        for i in range(3):
            batch = _torch.stack_shared([torch.full((2, 3), float(i)), torch.ones(2, 3)])
            assert reductions.dumps((i, batch))[0][:4] == b"STM2"
            q.put((i, [batch, {"label": i}]))
        got = back.get(timeout=60)  # the parent's writes, seen here
        assert got.tolist() == [[[-1.0] * 3] * 2, [[1.0] * 3] * 2]

    pid = start_in_child(worker)
    batches = [q.get(timeout=60) for _ in range(3)]
    assert [i for i, _ in batches] == [0, 1, 2]
    for i, (batch, meta) in batches:
        assert meta == {"label": i} and batch.shape == (2, 2, 3)
        assert batch[0].eq(float(i)).all() and batch[1].eq(1.0).all()
    batches[0][1][0][0].fill_(-1.0)
    back.put(batches[0][1][0])
    assert wait_child(pid) == 0
    q.close()
    back.close()


def _spawned_receiver(q, out):
    # No install() here: the message decodes through shmtensor.torch, imported on demand.
    i, t = q.get(timeout=60)
    out.put((i, t.tolist(), t.dtype == torch.int32))


def test_a_spawned_process_that_never_installed_decodes_them(installed):
    ctx = smp.get_context("spawn")
    q, out = ctx.Queue(), ctx.Queue()
    p = ctx.Process(target=_spawned_receiver, args=(q, out))
    p.start()
    t = _torch.stack_shared([torch.arange(4, dtype=torch.int32)])
    q.put((9, t))
    assert out.get(timeout=120) == (9, [[0, 1, 2, 3]], True)
    p.join(60)
    assert p.exitcode == 0
    q.close()
    out.close()


class SharedArrays(torch.utils.data.Dataset):
    """Samples of NumPy arrays, each on a block of its own (two in a message), and a tensor in an arena."""

    def __len__(self):
        return 4

    def __getitem__(self, i):
        return {"arrays": [snp.full((2, 3), 10 * i + k, np.int32) for k in range(2)],
                "t": shared([float(i)])}


def _first(batch):
    return batch[0]


def loader_decodes_arrays_on_their_blocks():
    st.install()
    try:
        before = _C._loader_batches()
        loader = torch.utils.data.DataLoader(SharedArrays(), batch_size=1, num_workers=2,
                                             collate_fn=_first)
        got = list(loader)
        assert _C._loader_batches() - before == 4  # each batch decoded by _loader_next
    finally:
        st.uninstall()
    for i, sample in enumerate(got):
        assert sample["t"].tolist() == [float(i)]
        for k, a in enumerate(sample["arrays"]):
            assert type(a) is np.ndarray and a.dtype == np.int32
            assert a.tolist() == [[10 * i + k] * 3] * 2
            # A view of the block that came with the message, which the array keeps alive.
            assert type(a.base) is _C.Tensor and snp.is_shared(a)
            assert a.__array_interface__["data"][0] == _C._block_address(a.base)


def test_the_loader_decodes_arrays_on_their_blocks_not_copies(strategy):
    assert run_in_child(loader_decodes_arrays_on_their_blocks) == 0
