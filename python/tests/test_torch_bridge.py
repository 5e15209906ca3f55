"""shmtensor._torch, the native bridge shmtensor.torch builds on: torch.UntypedStorage over
shmtensor blocks and back without copies, lifetimes, moving a torch storage into shared
memory in place, and a torch tensor made from a block crossing to a forked child through
shmtensor.multiprocessing's native Queue. Skipped, with the reason, where _torch is not built.
"""
import gc

import numpy as np
import pytest

try:
    import torch
    from shmtensor import _torch
except ImportError as e:
    pytest.skip(f"shmtensor._torch is not built ({e}); it needs libtorch (SHMTENSOR_BUILD_TORCH)",
                allow_module_level=True)

import shmtensor
import shmtensor.multiprocessing as smp
from shmtensor import _C
from conftest import shmtensor_mappings
from helpers import run_in_child


def new_block(nbytes):
    return _C._empty((nbytes,), "uint8", True)


def address(block):
    return np.asarray(block).ctypes.data


def untyped(t):
    """The torch.UntypedStorage of a tensor (1.13: through its TypedStorage)."""
    return t.untyped_storage() if hasattr(t, "untyped_storage") else t.storage().untyped()


def tensor_on(storage, dtype, shape, offset=0, stride=None):
    t = torch.tensor([], dtype=dtype)
    if stride is None:
        stride = torch.empty(shape).stride()
    return t.set_(storage, offset, shape, stride)


def mappings_after_empty_cache():
    gc.collect()
    shmtensor.empty_cache()
    return len(shmtensor_mappings())


def test_storage_from_block_is_zero_copy_both_ways():
    block = new_block(48)
    np.asarray(block)[:] = np.arange(48, dtype=np.uint8)
    storage = _torch.storage_from_block(block)
    assert isinstance(storage, torch.UntypedStorage)
    assert storage.nbytes() == 48
    assert storage.data_ptr() == address(block)
    t = tensor_on(storage, torch.int32, (3, 4))
    assert t.tolist() == np.arange(48, dtype=np.uint8).view(np.int32).reshape(3, 4).tolist()
    t[1, 2] = -5
    assert np.asarray(block).view(np.int32)[6] == -5
    np.asarray(block).view(np.int32)[11] = 123456
    assert t[2, 3].item() == 123456


def test_one_torch_storage_per_block_while_it_lives():
    block = new_block(16)
    a = _torch.storage_from_block(block)
    b = _torch.storage_from_block(block)
    assert a.data_ptr() == b.data_ptr()
    ta, tb = tensor_on(a, torch.uint8, (16,)), tensor_on(b, torch.uint8, (16,))
    assert ta.is_set_to(tb)  # the same c10::StorageImpl, not just the same address


def test_block_of_storage_is_the_whole_block_or_none():
    block = new_block(32)
    storage = _torch.storage_from_block(block)
    back = _torch.block_of_storage(storage)
    assert isinstance(back, _C.Tensor)
    assert back.shape == (32,) and back.dtype == np.uint8
    assert address(back) == address(block)
    assert _torch.block_of_storage(untyped(torch.ones(4))) is None
    with pytest.raises(TypeError, match="UntypedStorage"):
        _torch.block_of_storage(torch.ones(4))


def test_storage_from_block_needs_a_shared_block():
    with pytest.raises(ValueError, match="not in shared memory"):
        _torch.storage_from_block(_C._empty((8,), "uint8", False))


def test_either_side_may_be_dropped_first():
    before = mappings_after_empty_cache()
    block = new_block(1 << 16)
    np.asarray(block)[:] = 7
    storage = _torch.storage_from_block(block)
    del block  # the torch storage alone keeps the bytes
    assert mappings_after_empty_cache() > before
    assert tensor_on(storage, torch.uint8, (1 << 16,)).sum().item() == 7 << 16
    del storage
    assert mappings_after_empty_cache() == before

    block = new_block(1 << 16)
    storage = _torch.storage_from_block(block)
    t = tensor_on(storage, torch.uint8, (1 << 16,))
    t.fill_(3)
    del storage, t  # the block alone keeps them
    assert mappings_after_empty_cache() > before
    assert int(np.asarray(block).sum()) == 3 << 16
    del block
    assert mappings_after_empty_cache() == before


def test_share_storage_moves_in_place_and_views_follow():
    base = torch.arange(100, dtype=torch.float32)
    column = base.view(10, 10)[:, 3]
    storage = untyped(base)
    old = base.data_ptr()
    block = _torch.share_storage_(storage)
    assert isinstance(block, _C.Tensor) and block.shape == (400,)
    assert base.data_ptr() == address(block) != old
    assert column.data_ptr() == address(block) + 3 * 4
    assert torch.equal(base, torch.arange(100, dtype=torch.float32))
    assert column.tolist() == [float(3 + 10 * i) for i in range(10)]
    np.asarray(block).view(np.float32)[93] = -1.0
    assert column[9].item() == -1.0
    # Ours now: recognised and not moved again; not resizable any more.
    assert address(_torch.block_of_storage(storage)) == address(block)
    assert address(_torch.share_storage_(storage)) == address(block)
    assert base.data_ptr() == address(block)
    with pytest.raises(RuntimeError, match="not resizable"):
        base.resize_(1000)


@pytest.mark.parametrize("threads", [1, 2, 3])
def test_a_large_storage_moved_by_several_threads_keeps_every_byte(threads):
    """share_storage_ copies 8 MiB or more with as many threads as torch's intra-op setting
    allows (1, 2, 3: parts of a 41 MiB and an odd size, so the last part is short)."""
    old = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        n = (41 << 20) // 8 + 3
        base = torch.arange(n, dtype=torch.int64)
        block = _torch.share_storage_(untyped(base))
        assert base.data_ptr() == address(block)
        assert torch.equal(base, torch.arange(n, dtype=torch.int64))
    finally:
        torch.set_num_threads(old)


def test_share_storage_leaves_empty_and_foreign_devices_alone():
    empty = untyped(torch.empty(0))
    assert _torch.share_storage_(empty) is None
    with pytest.raises(ValueError, match="CPU"):
        _torch.share_storage_(untyped(torch.empty(4, device="meta")))
    with pytest.raises(TypeError, match="UntypedStorage"):
        _torch.share_storage_(np.zeros(4))


def test_share_storage_failures_are_shmtensor_errors_and_change_nothing(monkeypatch):
    t = torch.arange(8, dtype=torch.int64)
    storage = untyped(t)
    old = t.data_ptr()
    real_empty = _C._empty

    def full(shape, dtype, shared):
        raise shmtensor.SharedMemoryFullError("no room in /dev/shm (test)")

    monkeypatch.setattr(_C, "_empty", full)
    with pytest.raises(shmtensor.SharedMemoryFullError, match="no room"):
        _torch.share_storage_(storage)
    monkeypatch.setattr(_C, "_empty", lambda shape, dtype, shared: real_empty(
        (shape[0] - 1,), dtype, shared))
    with pytest.raises(ValueError, match="must return a shared Storage"):
        _torch.share_storage_(storage)
    assert t.data_ptr() == old
    assert _torch.block_of_storage(storage) is None
    assert torch.equal(t, torch.arange(8))


def test_a_tensor_from_a_block_crosses_to_a_forked_child_through_the_native_queue():
    block = new_block(12 * 4)
    t = tensor_on(_torch.storage_from_block(block), torch.int32, (3, 4))
    t.copy_(torch.arange(12, dtype=torch.int32).view(3, 4))
    q = smp.Queue()

    def child():
        got = q.get(timeout=60)
        mine = tensor_on(_torch.storage_from_block(got), torch.int32, (3, 4))
        assert mine.tolist() == torch.arange(12).view(3, 4).tolist()
        mine.mul_(10)

    q.put(block)
    assert run_in_child(child) == 0
    assert torch.equal(t, torch.arange(12, dtype=torch.int32).view(3, 4) * 10)
    q.close()


def mapping_of(addr):
    """What backs the mapping holding addr: "/dev/shm/" (a named segment) or "memfd:"."""
    with open("/proc/self/maps") as f:
        for line in f:
            lo, hi = (int(x, 16) for x in line.split()[0].split("-"))
            if lo <= addr < hi:
                return "/dev/shm/" if "/dev/shm/" in line else "memfd:" if "memfd:" in line else line
    return None


def test_new_shared_is_a_storage_over_a_new_block_of_the_strategy():
    for strategy in ("file_descriptor", "file_system"):
        shmtensor.set_sharing_strategy(strategy)
        s = _torch.new_shared(24)
        assert isinstance(s, torch.UntypedStorage) and s.nbytes() == 24
        block = _torch.block_of_storage(s)
        assert block is not None and block.shape == (24,) and block.is_shared()
        assert mapping_of(address(block)) == ("/dev/shm/" if strategy == "file_system" else "memfd:")
    shmtensor.set_sharing_strategy("file_descriptor")
    with pytest.raises(ValueError, match="0 bytes"):
        _torch.new_shared(0)


# ---- tensors: tensor_parts and tensor_from_block (shmtensor.torch's tensor reducer) ---------

DTYPES = [torch.bool, torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64,
          torch.float16, torch.bfloat16, torch.float32, torch.float64, torch.complex64,
          torch.complex128]


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_tensor_parts_and_back_keep_values_view_and_storage(dtype):
    base = torch.arange(60).to(dtype).view(5, 12)
    view = base[1:4, 2:11:3]  # offset, strides, not contiguous
    assert _torch.tensor_parts(view, False)[0] is None  # not in an arena yet
    block, code, offset, size, stride = _torch.tensor_parts(view, True)
    assert isinstance(block, _C.Tensor) and block.shape == (60 * base.element_size(),)
    assert untyped(base).data_ptr() == address(block)  # moved in place: base follows
    assert (offset, size, stride) == (14, (3, 3), (12, 3))
    back = _torch.tensor_from_block(block, code, offset, size, stride)
    assert type(back) is torch.Tensor and back.dtype == dtype
    assert back.shape == (3, 3) and back.stride() == (12, 3) and back.storage_offset() == 14
    assert torch.equal(back, view)
    assert back.storage().data_ptr() == base.storage().data_ptr()
    # One c10::StorageImpl per block: a tensor over storage_from_block shares it.
    same = tensor_on(_torch.storage_from_block(block), dtype, (60,))
    assert tensor_on(untyped(back), dtype, (60,)).is_set_to(same)
    back[0, 0] = base[4, 11]
    assert torch.equal(base[1, 2], base[4, 11])  # a write through `back` is base's


@pytest.mark.filterwarnings("ignore:Named tensors")
@pytest.mark.filterwarnings("ignore:The PyTorch API of nested tensors")
def test_tensor_parts_leaves_what_torch_must_reduce_to_torch():
    plain = torch.ones(4)
    assert _torch.tensor_parts(plain, True) is not None
    leave = {
        "a subclass": torch.nn.Parameter(torch.ones(4)),
        "requires_grad": torch.ones(4, requires_grad=True),
        "conjugate bit": torch.ones(3, dtype=torch.complex64).conj(),
        "negative bit": torch.ones(3, dtype=torch.complex64).conj().imag,
        "quantized": torch.quantize_per_tensor(torch.ones(3), 0.1, 0, torch.qint8),
        "meta": torch.ones(3, device="meta"),
        "sparse": torch.ones(2, 2).to_sparse(),
        "empty storage": torch.empty(0),
        "zero tensor (no data)": torch._efficientzerotensor(3),
        "nested": torch.nested.nested_tensor([torch.ones(2), torch.ones(3)]),
    }
    if hasattr(torch.Tensor, "names"):  # named tensors are gone from torch 2.13
        leave["named"] = torch.ones(2, 2, names=("a", "b"))
    for what, t in leave.items():
        before = t.data_ptr() if t.layout == torch.strided and not t.is_meta else None
        assert _torch.tensor_parts(t, True) is None, what
        if before is not None:
            assert t.data_ptr() == before, what + " was moved"
    assert _torch.tensor_parts(np.ones(3), True) is None
    assert _torch.tensor_parts(untyped(plain), True) is None
    import functorch
    inside = []

    def record(x):  # a functional wrapper: torch's reducer refuses it ("nullptr storage")
        inside.append(_torch.tensor_parts(x, True))
        return x + 1
    functorch.functionalize(record)(torch.ones(3))
    assert inside == [None]


# The dtype codes are c10::ScalarType's: 6 is Float.
@pytest.mark.parametrize("bad, message", [
    ((-1, 0, (4,), (1,)), "dtype code out of range"),
    ((2 ** 70, 0, (4,), (1,)), "dtype code out of range"),
    ((6.0, 0, (4,), (1,)), "dtype code that are not ints"),
    ((10_000, 0, (4,), (1,)), "has no dtype"),
    ((12, 0, (4,), (1,)), "has no dtype"),  # c10::ScalarType::QInt8
    ((6, -1, (4,), (1,)), "offset out of range"),
    ((6, 2 ** 64, (4,), (1,)), "offset out of range"),
    ((6, None, (4,), (1,)), "offset that are not ints"),
    ((6, 0, (4,), (1, 1)), "different number of strides and sizes"),
    ((6, 0, [4], (1,)), "not a tuple"),
    ((6, 0, (4.0,), (1,)), "not ints"),
    ((6, 0, (-4,), (1,)), "out of range"),
    ((6, 0, (4,), (-1,)), "out of range"),
    ((6, 0, (2 ** 63,), (1,)), "out of range"),
    ((6, 0, (5,), (1,)), "reaches past its block"),  # 5 floats in 16 bytes
    ((6, 1, (4,), (1,)), "reaches past its block"),
    ((6, 0, (2, 2), (3, 1)), "reaches past its block"),
    ((6, 2 ** 63 - 1, (3,), (2 ** 62,)), "overflows"),  # the last index is 2^64 - 1
    ((7, 0, (2 ** 32, 2 ** 32), (0, 0)), "overflows"),  # the element count (torch refuses it)
    ((6, 0, (2 ** 62, 2 ** 62, 0), (0, 0, 0)), "overflows"),  # counted in order, as torch does
    ((6, 0, (2 ** 40, 2 ** 40), (2 ** 40, 2 ** 40)), "overflows"),
    ((6, 0, (2 ** 40, 2 ** 40, 2 ** 40), None), "overflows"),  # its contiguous strides
    ((6, 0, (5,), None), "reaches past its block"),
])
def test_tensor_from_block_refuses_metadata_that_does_not_fit(bad, message):
    block = new_block(16)
    with pytest.raises(ValueError, match=message):
        _torch.tensor_from_block(block, *bad)


def test_tensor_from_block_takes_what_fits_exactly():
    block = new_block(16)  # 4 float32 (dtype code 6)
    assert _torch.tensor_from_block(block, 6, 0, (4,), (1,)).shape == (4,)
    assert _torch.tensor_from_block(block, 6, 3, (1,), (1,)).storage_offset() == 3
    assert _torch.tensor_from_block(block, 6, 0, (2, 2), (2, 1)).shape == (2, 2)
    assert _torch.tensor_from_block(block, 6, 4, (0,), (1,)).numel() == 0
    # A view with no elements reads nothing: any offset, sizes and strides (torch allows
    # them, and tensor_parts sends them).
    assert _torch.tensor_from_block(block, 6, 100, (0,), (1,)).storage_offset() == 100
    assert _torch.tensor_from_block(block, 6, 0, (0, 2 ** 62), (1, 2 ** 62)).numel() == 0
    assert _torch.tensor_from_block(block, 6, 0, (), ()).shape == ()
    assert _torch.tensor_from_block(block, 6, 0, (4, 3), (1, 0)).shape == (4, 3)  # expanded
    assert _torch.tensor_from_block(block, 6, 0, (2, 2), None).stride() == (2, 1)


def test_contiguous_strides_travel_as_none_and_others_exactly():
    t = torch.arange(24, dtype=torch.float32).view(2, 3, 4)
    cases = {
        "contiguous": (t, None),
        "a size-1 dim with another stride": (t[:, :1, :], (12, 4, 1)),
        "transposed": (t.transpose(1, 2), (12, 1, 4)),
        "a zero-size dim, strides of its base": (t[:, :0, :], (12, 4, 1)),
        "a zero-size dim, contiguous": (t.as_strided((2, 0, 4), (4, 4, 1)), None),
        "a scalar": (t[1, 2, 3], None),
        "empty, offset past the end": (t.as_strided((0,), (1,), 100), None),
    }
    for what, (view, strides) in cases.items():
        block, code, offset, size, stride = _torch.tensor_parts(view, True)
        assert stride == strides, what
        back = _torch.tensor_from_block(block, code, offset, size, stride)
        assert back.stride() == view.stride() and back.shape == view.shape, what
        assert torch.equal(back, view), what


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_stack_shared_is_torch_stack_into_a_new_shared_block(dtype):
    base = (torch.arange(24) % 7).to(dtype).reshape(4, 6)
    for batch in ([base[0], base[1], base[3]],  # rows
                  (base[:, 1], base[:, 4]),  # strided columns, in a tuple
                  [base.t()[:3], base.t()[2:5]],  # transposed views
                  [torch.tensor(5).to(dtype)]):  # 0-d
        out = _torch.stack_shared(batch)
        expect = torch.stack(list(batch), 0)
        assert out.dtype == dtype and out.shape == expect.shape
        assert out.is_contiguous() and torch.equal(out, expect)
        assert _torch.block_of_storage(untyped(out)) is not None  # in an arena
        assert untyped(out).nbytes() == expect.numel() * expect.element_size()
        del out


def test_stack_shared_leaves_to_torch_what_torch_must_stack_or_refuse():
    plain = torch.ones(3)
    for batch in ([], (), [plain, torch.ones(4)], [plain, torch.ones(3, dtype=torch.int64)],
                  [plain, torch.ones(3, requires_grad=True)], [torch.nn.Parameter(plain)],
                  [torch.ones(3, device="meta")], [torch.ones(0)], [plain, "not a tensor"],
                  [torch.ones(3, dtype=torch.complex64).conj()], [torch._efficientzerotensor(3)],
                  [torch.ones(2, 2).to_sparse()], plain, "abc"):
        assert _torch.stack_shared(batch) is None, batch
