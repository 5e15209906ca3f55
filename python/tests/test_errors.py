"""C++ failures as Python exceptions: the class hierarchy, the same messages, the
attributes, and real limits hit in this process or in a forked child (a /dev/shm too small
for the allocation, the open-file limit)."""
import errno
import os
import resource

import numpy as np
import pytest

import shmtensor
import shmtensor.numpy as snp
from helpers import run_in_child


@pytest.fixture(autouse=True)
def default_strategy():
    yield
    shmtensor.set_sharing_strategy("file_descriptor")


def test_class_hierarchy():
    assert issubclass(shmtensor.Error, RuntimeError)
    for cls, builtin in [(shmtensor.SharedMemoryFullError, MemoryError),
                         (shmtensor.SystemCallError, OSError),
                         (shmtensor.ProtocolError, ValueError),
                         (shmtensor.ConfigurationError, ValueError)]:
        assert issubclass(cls, shmtensor.Error) and issubclass(cls, builtin)
        assert cls.__module__ == "shmtensor"
    assert shmtensor.SystemCallError is not SystemError
    assert issubclass(shmtensor.OutOfMemoryError, shmtensor.SystemCallError)
    assert issubclass(shmtensor.OutOfMemoryError, MemoryError)


@pytest.mark.parametrize("strategy", ["file_descriptor", "file_system"])
def test_an_allocation_larger_than_the_address_space_is_memory_error(strategy):
    shmtensor.set_sharing_strategy(strategy)
    size = 1 << 60  # more than a 57-bit (5-level paging) user address space holds
    if strategy == "file_system":
        with pytest.raises(shmtensor.SharedMemoryFullError):  # /dev/shm is smaller
            snp.empty(size, np.uint8)
        return
    with pytest.raises(shmtensor.OutOfMemoryError) as info:
        snp.empty(size, np.uint8)
    e = info.value
    assert isinstance(e, MemoryError) and isinstance(e, OSError)
    assert e.errno == errno.ENOMEM and e.syscall == "mmap"
    assert str(e).startswith("mmap(memfd segment, size=")
    a = snp.zeros(1000)  # nothing is left half made, and the next allocation works
    assert snp.is_shared(a) and a[999] == 0


def dev_shm_too_small_size():
    v = os.statvfs("/dev/shm")
    return v.f_blocks * v.f_frsize + (1 << 30)


def test_dev_shm_too_small_is_shared_memory_full_error():
    shmtensor.set_sharing_strategy("file_system")
    size = dev_shm_too_small_size()
    with pytest.raises(shmtensor.SharedMemoryFullError) as info:
        snp.empty(size, np.uint8)
    e = info.value
    assert isinstance(e, MemoryError) and isinstance(e, shmtensor.Error)
    assert e.requested >= size
    assert 0 <= e.available < size
    text = str(e)
    assert text.startswith("/dev/shm is too small for a file_system segment: asked for ")
    assert f"({e.requested} bytes)" in text
    assert "--shm-size" in text and 'set_sharing_strategy("file_descriptor")' in text
    # The same through from_numpy, which allocates before it copies.
    with pytest.raises(MemoryError, match="/dev/shm is too small"):
        shmtensor.from_numpy(np.broadcast_to(np.zeros(1, np.uint8), (size,)))
    # Nothing is left, and the next allocation works.
    a = snp.zeros(1000)
    assert snp.is_shared(a)


@pytest.mark.skipif("undefined" in os.environ.get("SHMTENSOR_TEST_SANITIZE", ""),
                    reason="UBSan's vptr check needs free fds (as LimitsTest.OutOfFds... in C++)")
def test_out_of_fds_is_system_call_error_with_advice():
    def child():
        soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
        resource.setrlimit(resource.RLIMIT_NOFILE, (64, hard))
        filler = []
        while True:
            try:
                filler.append(os.open("/dev/null", os.O_RDONLY | os.O_CLOEXEC))
            except OSError as e:
                assert e.errno == errno.EMFILE
                break
            assert len(filler) < 100
        with pytest.raises(shmtensor.SystemCallError) as info:
            snp.empty(4096, np.uint8)
        e = info.value
        assert isinstance(e, OSError)
        assert e.errno == errno.EMFILE
        assert e.strerror == os.strerror(errno.EMFILE)
        assert e.syscall == "memfd_create"
        assert str(e).startswith("memfd_create(") and "ulimit -n" in str(e)
        private = shmtensor.full(1024, 5, "uint8")
        with pytest.raises(OSError, match="ulimit -n"):
            private.share_memory_()
        assert not private.is_shared()
        shmtensor.set_sharing_strategy("file_system")
        with pytest.raises(shmtensor.SystemCallError) as info:
            snp.empty(4096, np.uint8)
        assert info.value.errno == errno.EMFILE
        for fd in filler:
            os.close(fd)
        shmtensor.set_sharing_strategy("file_descriptor")
        private.share_memory_()
        assert private.is_shared() and np.asarray(private)[1023] == 5

    assert run_in_child(child) == 0


def test_configuration_problems_are_errors():
    def child():
        os.environ["SHMTENSOR_MANAGER_GROUP"] = "../escape"
        shmtensor.set_sharing_strategy("file_system")
        with pytest.raises(shmtensor.ConfigurationError) as info:
            snp.empty(16)
        assert isinstance(info.value, ValueError)
        assert str(info.value) == (
            'invalid shmtensor-manager group "../escape" (SHMTENSOR_MANAGER_GROUP): use 1 to '
            '64 characters of A-Z a-z 0-9 _ . -, other than "." and ".."')

    assert run_in_child(child) == 0


def test_invalid_argument_is_value_error_and_out_of_range_is_index_error():
    with pytest.raises(ValueError) as info:
        shmtensor.set_sharing_strategy("shared")
    assert str(info.value) == (
        'invalid sharing strategy "shared": valid values are "file_descriptor" and "file_system"')
    t = shmtensor.zeros((2, 3))
    with pytest.raises(IndexError):
        t.size(2)
    with pytest.raises(IndexError):
        t.stride(-3)
    with pytest.raises(IndexError):
        t.select(0, 5)
    with pytest.raises(IndexError, match=r"start \(1\) \+ length \(3\) exceeds dimension size"):
        t.narrow(1, 1, 3)
    with pytest.raises(ValueError) as info:  # a negative length is a bad argument, not a range
        t.narrow(1, 1, -1)
    assert type(info.value) is ValueError
    assert str(info.value) == (
        "narrow(): length -1 is negative; from start 1 in dimension 1 of size 3 a length is 0 to 2")
    with pytest.raises(ValueError, match="view size is not compatible"):
        t.transpose(0, 1).view((6,))
    with pytest.raises(ValueError):
        t.view((4, 2))
    with pytest.raises(ValueError):
        shmtensor.empty((2, -1))
    with pytest.raises(TypeError, match="no dtype for NumPy's uint16"):
        shmtensor.empty(3, np.uint16)


def test_an_fd_keeper_that_cannot_be_reached_is_system_call_error():
    # A forked child (no keeper connection of its parent's: it makes its own) whose manager
    # cannot be started: the sender's register and the receiver's ask.
    from shmtensor.multiprocessing import keeper

    def child():
        missing = "/nonexistent/shmtensor-manager-%d" % os.getpid()
        os.environ["SHMTENSOR_MANAGER"] = missing
        os.environ["SHMTENSOR_MANAGER_GROUP"] = "no-keeper-%d" % os.getpid()
        with pytest.raises(shmtensor.SystemCallError) as info:
            keeper.register_ticket(os.urandom(16))
        e = info.value
        assert isinstance(e, OSError) and isinstance(e, shmtensor.Error)
        assert e.errno is None and e.strerror is None and e.syscall == ""
        reach = ("shmtensor: cannot reach shmtensor-manager, which keeps the shared memory in "
                 "a pickle: cannot start shmtensor-manager")
        assert str(e).startswith(reach), str(e)
        assert "%s (does not exist)" % missing in str(e)
        with pytest.raises(shmtensor.SystemCallError) as info:
            keeper.claim_ticket(os.urandom(16))
        assert str(info.value).startswith(
            "shmtensor: cannot ask shmtensor-manager for this pickle's shared memory "
            "(cannot start shmtensor-manager"), str(info.value)

    assert run_in_child(child) == 0


@pytest.mark.parametrize("strategy", ["file_descriptor", "file_system"])
def test_a_pickle_the_fd_keeper_holds_nothing_for_is_error(strategy):
    # A token or ticket the keeper never had: what a replay of a pickle in another process
    # meets (test_mp_lifetime.py replays one for real).
    from shmtensor.multiprocessing import keeper

    if strategy == "file_descriptor":
        with pytest.raises(shmtensor.Error) as info:
            keeper._KeptFd(os.urandom(16)).take()
        expected = ("shmtensor: the fd keeper does not hold this pickle's shared memory: a "
                    "pickle of shared memory is single-use (it was loaded already), or it "
                    "outlived the keeper's grace period")
    else:
        with pytest.raises(shmtensor.Error) as info:
            keeper.claim_ticket(os.urandom(16))
        expected = ("shmtensor: the fd keeper holds no ticket for this pickle: a pickle of "
                    "shared memory is single-use (it was loaded already, here or in another "
                    "process), or it outlived the keeper's grace period after its sender died")
    assert type(info.value) is shmtensor.Error and isinstance(info.value, RuntimeError)
    assert str(info.value) == expected
