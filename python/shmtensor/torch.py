"""shmtensor.torch: PyTorch's tensor sharing on shmtensor arenas (docs/torch.md, docs/cuda.md).

    import shmtensor.torch
    shmtensor.torch.install()   # here, and in every process started from here on

or, changing nothing globally, DataLoader(..., multiprocessing_context=
shmtensor.torch.context("fork")): only the loader's workers use the arenas.

What install() changes, and uninstall() restores exactly:
  * the ForkingPickler reducer of torch.UntypedStorage (which torch's reduce_tensor reaches
    for parameters and subclasses): a CPU storage travels as a shmtensor block, moved into
    an arena in place first when it is not in one (every view follows, as with torch's own
    share_memory_); with the bridge a CUDA storage moves into the device arena the same way
    (docs/cuda.md); meta and empty storages go to torch's own reducer;
  * with the bridge, the reducer of torch.Tensor itself: a plain CPU or CUDA tensor travels
    as its block and metadata, one C++ call each way (a CUDA tensor by fd); what the bridge
    does not take (requires_grad but for a CUDA leaf, named, conjugate/zero bits,
    quantized, nested, wrappers, other devices and layouts) goes to torch's reduce_tensor
    (a CUDA one with a RuntimeWarning once); with the bridge, a CUDA Parameter's data
    travels the same way (torch's reducer of Parameter for any other);
  * a storage already in torch's own shared memory stays there, with torch's reducer;
  * UntypedStorage.share_memory_, .is_shared and ._new_shared (what a DataLoader worker's
    default_collate allocates each batch with), shadowed by Python attributes;
  * with the bridge, default_collate_fn_map[torch.Tensor]: a worker's batch of plain CPU
    tensors is stacked into an arena block in one call;
  * torch.multiprocessing's Queue, SimpleQueue, JoinableQueue, Pipe, Pool and get_context:
    shmtensor's native transport (a DataLoader's queues among them);
  * multiprocessing.spawn.get_preparation_data: a spawn or forkserver child runs install()
    before it unpickles anything of its parent's (forked children inherit it);
  * DataLoader._get_iterator: a DataLoader with workers iterates with shmtensor's iterator
    (shmtensor/_loader.py), as does one whose multiprocessing_context is a context().
The sharing strategy is torch's own (torch.multiprocessing.set_sharing_strategy): each
allocation uses the one torch has at that moment; children started by spawn or forkserver
get this process's.

Moving an existing storage in place needs the C++ bridge shmtensor._torch (built when
libtorch is found). Without it, storages made by _new_shared (DataLoader batches) still live
in arenas, but share_memory_() and sending a tensor made elsewhere fall back to torch's own
shared memory (docs/torch.md).
"""
from __future__ import annotations

import multiprocessing
import multiprocessing.context as _mpcontext
import multiprocessing.spawn as _mpspawn
import os
import sys
import threading
import warnings
import weakref
from multiprocessing.reduction import ForkingPickler
from typing import TYPE_CHECKING

import torch
import torch.multiprocessing as _tmp
from torch.multiprocessing import reductions as _treductions
from torch.utils.data import get_worker_info as _get_worker_info
from torch.utils.data._utils import collate as _collate

import shmtensor.multiprocessing as _smp  # the NumPy reducers and one frame per pickle
from shmtensor import _C
from shmtensor.multiprocessing import context as _smpcontext
from shmtensor.multiprocessing import reductions as _red

from shmtensor import _bridge as _bridge_loader
from shmtensor import _loader

# The C++ bridge shmtensor._torch: the package's own (a CMake build), else compiled against
# this torch at first import and cached (a pip install; shmtensor/_bridge.py), else None and
# the reason, which install() says once.
_bridge, _no_bridge_reason = _bridge_loader.load()
# (Loading the bridge lets _C's tensor messages carry torch tensors: one from another process
# decodes here, installed or not.)
_said_no_bridge = False

if TYPE_CHECKING:
    from typing_extensions import TypeAlias

    # What context() returns (its classes below derive from these).
    _Context: TypeAlias = ("_smpcontext.ForkContext | _smpcontext.SpawnContext"
                           " | _smpcontext.ForkServerContext")

__all__ = ["install", "uninstall", "is_installed", "context", "has_bridge",
           "bridge_unavailable_reason"]

_Untyped = torch.UntypedStorage
_lock = threading.RLock()
_saved = None  # what install() replaced, for uninstall()
_MISSING = object()


def has_bridge() -> bool:
    """Whether the C++ bridge (shmtensor._torch) is loaded: without it, existing storages
    cannot be moved into arenas in place."""
    return _bridge is not None


def bridge_unavailable_reason() -> str | None:
    """Why the C++ bridge is not loaded, or None when it is."""
    return _no_bridge_reason


# ---- storages and blocks ------------------------------------------------------------------

# Without the bridge: data_ptr -> (StorageWeakRef, weakref to the block) of the arena
# storages made here. The storage holds the block (torch.frombuffer keeps its exporter), so
# both references die with the storage.
_fallback = {}
_fallback_limit = [128]


def _sync_strategy():
    strategy = _tmp.get_sharing_strategy()
    if strategy != _C.get_sharing_strategy():
        _C.set_sharing_strategy(strategy)


def _cache_key(block):
    return ("shmtensor", _C._block_address(block))


def _wrap(block):
    """A new torch storage over the whole block, keeping it alive. With the bridge, one
    torch storage per block in this process while it lives (its C++ cache): the same one
    comes back however the block arrives. Without it, torch's shared_cache keeps that
    identity for blocks received (_storage_of_block)."""
    if _bridge is not None:
        return _bridge.storage_from_block(block)
    storage = _untyped_of(torch.frombuffer(block, dtype=torch.uint8))
    with _lock:
        _fallback[storage.data_ptr()] = (_treductions.StorageWeakRef(storage),
                                         weakref.ref(block))
        if len(_fallback) > _fallback_limit[0]:
            for key, (ref, _) in list(_fallback.items()):
                if ref.expired():
                    del _fallback[key]
            _fallback_limit[0] = max(128, 2 * len(_fallback))
    _treductions.shared_cache[_cache_key(block)] = _treductions.StorageWeakRef(storage)
    return storage


def _storage_of_block(block):
    """The torch storage over block: the one this process has already, if any (identity)."""
    if _bridge is not None:
        return _bridge.storage_from_block(block)
    storage = _treductions.storage_from_cache(_Untyped, _cache_key(block))
    return storage if storage is not None else _wrap(block)


def _block_of(storage):
    """The shmtensor block holding a CPU storage's bytes, or None."""
    if _bridge is not None:
        return _bridge.block_of_storage(storage)
    with _lock:
        entry = _fallback.get(storage.data_ptr())
    block = None if entry is None or entry[0].expired() else entry[1]()
    if block is None or block.nbytes != storage.nbytes():
        return None
    return block


def _in_arena(storage):
    """The block of storage, moved into an arena first if the bridge can; None if it stays
    with torch (neither CPU nor CUDA, empty, a CPU storage in torch's own shared memory
    already, or no bridge). A CUDA storage moves into this process's device arena (one
    device-to-device copy: docs/cuda.md, "torch's CUDA tensors").
    NotImplementedError for a CPU storage with a size and no data (a zero tensor's, a
    wrapper subclass's), as torch 1.13's reducer says (torch 2.13's crashes with SIGSEGV in
    _share_fd_cpu_)."""
    kind = storage.device.type
    if kind not in ("cpu", "cuda") or storage.nbytes() == 0:
        return None
    if kind == "cuda":
        if _bridge is None:
            return None
        block = _bridge.block_of_storage(storage)
        if block is not None:
            return block
        try:
            return _bridge.share_storage_(storage)
        except _C.CudaError:  # no device arena here (no POSIX-fd export, ...): torch's path
            return None
    block = _block_of(storage)
    if block is None and _bridge is not None:
        if _bridge.has_no_data(storage):
            raise NotImplementedError(
                "shmtensor.torch: a storage of %d bytes with no data (a zero tensor's, or a "
                "wrapper subclass's) cannot be shared" % storage.nbytes())
        if not _saved_is_shared(storage):
            _sync_strategy()
            block = _bridge.share_storage_(storage)
    return block


def _saved_is_shared(storage):
    """Whether torch's own shared memory holds storage already (shared before install(), or
    received from a process without it): it stays there, with torch's reducer, so that
    processes that mapped it keep seeing its writes (Hogwild-style sharing)."""
    saved = _saved
    return (saved["is_shared"] if saved else _Untyped.is_shared)(storage)


def _untyped_of(tensor):
    get = getattr(tensor, "untyped_storage", None)  # torch 2.x
    return get() if get is not None else tensor._storage()


def _rebuild_storage(block):
    return _storage_of_block(block)


def _rebuild_native(index):
    """The storage of block `index` of the message being unpickled."""
    return _storage_of_block(_red._native_block(index))


def _rebuild_tensor(block, dtype, offset, size, stride):
    return _bridge.tensor_from_block(block, dtype, offset, size, stride)


def _rebuild_tensor_grad(native, ref, dtype, offset, size, stride):
    """A CUDA leaf tensor that required grad in its sender: requires grad here too."""
    block = _red._native_block(ref) if native else ref
    return _bridge.tensor_from_block(block, dtype, offset, size, stride).requires_grad_(True)


def _rebuild_tensor_native(index, dtype, offset, size, stride):
    """A tensor on block `index` of the message being unpickled."""
    return _bridge.tensor_from_block(_red._native_block(index), dtype, offset, size, stride)


# ---- what install() puts in place -----------------------------------------------------------


def _reduce_storage(storage):
    block = _in_arena(storage)
    if block is None:
        return _treductions.reduce_storage(storage)
    message = _red._sending_message()
    if message is not None:
        # The block travels once beside the pickle (queues, pipes, ForkingPickler.dumps):
        # its index is enough. Identity holds on the way back through _storage_of_block.
        return _rebuild_native, (message.add(block),)
    return _rebuild_storage, (_red._ref(block),)


def _reduce_tensor(tensor):
    """An exact torch.Tensor (with the bridge): one C++ call for its block and metadata, in
    place of torch's reduce_tensor, TypedStorage and storage reducer; anything the bridge
    does not take (tensor_parts) goes to torch's reduce_tensor."""
    grad = tensor.requires_grad and tensor.is_cuda and tensor.is_leaf
    parts = _bridge.tensor_parts(tensor.detach() if grad else tensor, False)
    if parts is not None and parts[0] is None:  # not in an arena yet
        if not tensor.is_cuda and _saved_is_shared(_untyped_of(tensor)):
            parts = None  # in torch's shared memory: it stays there (_saved_is_shared)
        else:  # moved into an arena, with torch's strategy
            _sync_strategy()
            try:
                parts = _bridge.tensor_parts(tensor.detach() if grad else tensor, True)
            except _C.CudaError:  # no device arena here (unchanged): torch's CUDA IPC
                parts = None
    if parts is None:
        if tensor.is_cuda:
            _say_cuda_to_torch(tensor)
        saved = _saved  # None once uninstalled (a pickler may still hold this reducer)
        return (saved["tensor_reducer"] if saved else _treductions.reduce_tensor)(tensor)
    block, dtype, offset, size, stride = parts
    message = _red._sending_message()
    if grad:  # a CUDA leaf that requires grad: its detached view travels, the flag beside
        ref = message.add(block) if message is not None else _red._ref(block)
        native = message is not None
        return _rebuild_tensor_grad, (native, ref, dtype, offset, size, stride)
    if message is not None:
        return _rebuild_tensor_native, (message.add(block), dtype, offset, size, stride)
    return _rebuild_tensor, (_red._ref(block), dtype, offset, size, stride)


_Parameter = torch.nn.Parameter


def _reduce_parameter(param):
    """A CUDA Parameter (torch registers its reduce_tensor for Parameter itself, which would
    send it through torch's CUDA IPC): its data as _reduce_tensor sends a tensor, by fd, and
    a Parameter with its requires_grad on arrival. Anything else: the reducer install()
    found (torch's)."""
    if type(param) is _Parameter and param.is_cuda:
        rebuild, args = _reduce_tensor(param.detach())
        return _rebuild_parameter, (rebuild, args, param.requires_grad)
    saved = _saved
    reducer = saved["parameter"] if saved else _MISSING
    return (_treductions.reduce_tensor if reducer is _MISSING else reducer)(param)


def _rebuild_parameter(rebuild, args, requires_grad):
    return _Parameter(rebuild(*args), requires_grad=requires_grad)


_cuda_to_torch_said = [False]


def _say_cuda_to_torch(tensor):
    """Once per process: a CUDA tensor that shmtensor's path does not take goes to torch's
    own CUDA IPC (cudaIpcGetMemHandle), with torch's lifetimes."""
    if _cuda_to_torch_said[0]:
        return
    _cuda_to_torch_said[0] = True
    warnings.warn(
        "shmtensor.torch: a CUDA tensor that shmtensor does not send by fd (a subclass, a "
        "non-strided layout, a conjugate, negative or zero bit, named dimensions, quantized, "
        "a non-leaf that requires grad, a storage torch's CUDA IPC shares already, or no "
        "device arena here) goes to torch's own CUDA IPC, whose producer must outlive its "
        "consumers; said once per process",
        RuntimeWarning, stacklevel=3)


def _share_memory_(self):
    # A CUDA storage's share_memory_() is a no-op, as torch's: it moves when it is sent.
    if self.device.type != "cpu" or _in_arena(self) is None:
        return _saved["share_memory_"](self)
    return self


def _is_shared(self):
    if self.device.type == "cpu" and _block_of(self) is not None:
        return True
    return _saved["is_shared"](self)


_CPU = torch.device("cpu")
# A torch function mode active (torch.stack would go through it; the bridge's stack would not).
_torch_function_mode = getattr(torch._C, "_is_torch_function_mode_enabled", lambda: False)


def _in_thread_worker():
    """Whether this thread is a DataLoader worker thread (torch's worker_method="thread"):
    its batches never leave the process, so they need no shared memory."""
    if threading.current_thread() is threading.main_thread():
        return False
    info = _get_worker_info()
    return info is not None and getattr(info, "worker_method", "process") == "thread"


def _new_shared(cls, size, *, device="cpu"):
    if size == 0 or not (device == _CPU or torch.device(device).type == "cpu"):
        return _saved["_new_shared"](size, device=device)  # bound to UntypedStorage
    if _in_thread_worker():
        return _Untyped(size)
    _sync_strategy()
    if _bridge is not None:
        return _bridge.new_shared(size)
    return _wrap(_C._empty((size,), "uint8", True))


_SHADOWED = {"share_memory_": _share_memory_, "is_shared": _is_shared,
             "_new_shared": classmethod(_new_shared)}


def _collate_tensor(batch, *, collate_fn_map=None):
    """torch's collate_tensor_fn (default_collate_fn_map[torch.Tensor]) while installed: in a
    DataLoader worker process, a batch of plain CPU tensors of one dtype and shape is
    stacked into a new arena block by one call into the bridge (what torch does through
    TypedStorage._new_shared, Tensor.new, resize_ and torch.stack(out=), ~20 us of Python
    a batch). Anything else, outside a worker process or with a torch function mode active,
    is torch's own function's."""
    saved = _saved
    if (saved is not None and _get_worker_info() is not None and not _in_thread_worker()
            and not _torch_function_mode()):
        _sync_strategy()
        out = _bridge.stack_shared(batch)
        if out is not None:
            return out
    own = saved["collate_tensor"] if saved else _collate.collate_tensor_fn
    return own(batch, collate_fn_map=collate_fn_map)

def _package_parent():
    """The directory a child must have on sys.path to import this shmtensor package."""
    import shmtensor
    return os.path.dirname(os.path.dirname(os.path.abspath(shmtensor.__file__)))


class _ChildInstall:
    """An entry of a spawn or forkserver child's preparation data: unpickling it in the
    child (multiprocessing.spawn._main loads that data before prepare() and before the
    Process object, its target and its arguments) imports shmtensor.torch and runs
    install() with the parent's sharing strategy and busy poll. The callable is the
    builtin exec, so that the child needs nothing on sys.path to find it; the code it runs
    first sets sys.path to the parent's (what prepare() does next anyway), with this
    package's directory added if the parent lacks it, so that torch and shmtensor are found
    where the parent found them."""

    def __reduce__(self):
        path = list(sys.path)
        parent = _package_parent()
        if parent not in path:
            path.append(parent)
        code = ("import sys\n"
                "sys.path[:] = {path!r}\n"
                "import shmtensor.torch\n"
                "shmtensor.torch._install_in_child({strategy!r}, {busy_poll!r})\n").format(
                    path=path, strategy=_tmp.get_sharing_strategy(),
                    busy_poll=_installed_busy_poll[0])
        return exec, (code,)


_PREPARATION_KEY = "shmtensor.torch.install"
_stdlib_preparation_data = _mpspawn.get_preparation_data


def _get_preparation_data(name):
    """multiprocessing.spawn.get_preparation_data while installed: what spawn and
    forkserver send a new child first, with _ChildInstall in it."""
    saved = _saved
    data = (saved["get_preparation_data"] if saved else _stdlib_preparation_data)(name)
    if saved is not None:
        data[_PREPARATION_KEY] = _ChildInstall()
    return data


def _install_in_child(strategy, busy_poll=None):
    """Run in a spawn or forkserver child of an installed process, before it unpickles
    anything else: the parent's strategy, then install() with the parent's busy poll. The
    parent has said already why there is no bridge, if there is none."""
    global _said_no_bridge
    _said_no_bridge = True
    _tmp.set_sharing_strategy(strategy)
    install(busy_poll=busy_poll)


def _say_no_bridge() -> None:
    """Once per process tree: a RuntimeWarning saying why there is no bridge."""
    global _said_no_bridge
    if _bridge is None and not _said_no_bridge:
        _said_no_bridge = True
        warnings.warn("shmtensor.torch works without its C++ bridge, slower and without "
                      f"moving existing storages in place: {_no_bridge_reason}",
                      RuntimeWarning, stacklevel=3)


# ---- the DataLoader's iterator ------------------------------------------------------------

_DataLoader = torch.utils.data.DataLoader
_torch_get_iterator = _DataLoader._get_iterator


def _takes(loader) -> bool:
    """Whether a DataLoader with workers iterates with shmtensor's iterator: while install()
    is active, or when its multiprocessing_context is a shmtensor.torch.context()."""
    return _saved is not None or isinstance(loader.multiprocessing_context, _PollingQueues)


# The standard library's contexts, whose queues pickle every batch (through the fd keeper).
_STDLIB_CONTEXTS = (_mpcontext.ForkContext, _mpcontext.SpawnContext, _mpcontext.ForkServerContext)


def _installed_counterpart(loader):
    """While install() is active, for a loader whose multiprocessing_context is one of the
    standard library's (a context object given, or a start method named before install()):
    the installed context of that start method, which carries the batches natively and
    lets the workers take their tasks from boards. None otherwise."""
    ctx = loader.multiprocessing_context
    if _saved is None or type(ctx) not in _STDLIB_CONTEXTS:
        return None
    return _get_context(ctx.get_start_method())


def _get_iterator(self):
    """DataLoader._get_iterator once install() or context() has run: shmtensor's iterator
    (shmtensor/_loader.py) for a loader with workers that _takes; torch's otherwise, or
    when this torch lacks what shmtensor's needs (saying why, once)."""
    if self.num_workers > 0 and _takes(self):
        reason = _loader.unavailable_reason()
        if reason is None:
            self.check_worker_number_rationality()
            return _loader.ShmtensorDataLoaderIter(self, _installed_counterpart(self))
        _loader.say_torch_iterator(reason)
    return _torch_get_iterator(self)


def _hook_loader() -> None:
    """Puts _get_iterator on DataLoader (once; it passes every loader it does not take to
    torch's method, so it stays after uninstall() when a context() exists)."""
    if _DataLoader.__dict__.get("_get_iterator") is _torch_get_iterator:
        _DataLoader._get_iterator = _get_iterator


def install(*, busy_poll: float | None = None) -> None:
    """Puts torch's sharing of CPU storages on shmtensor arenas in this process and in every
    process it starts afterwards, by any start method: forked children inherit it, and
    spawn and forkserver children run it (with this process's sharing strategy) before
    they unpickle anything of the parent's. torch.multiprocessing's Queue, SimpleQueue,
    Pipe, Pool and get_context become shmtensor's native transport, so a DataLoader's
    queues are native ones. A get() on a Queue made through torch.multiprocessing in this
    process polls for up to `busy_poll` seconds (default 50 us, 0: never) before it sleeps
    (context()), except the batches' queue of a DataLoader with at least as many workers as
    the CPUs of this process's affinity mask, which never polls (a poll would keep a CPU
    from the workers). Idempotent; busy_poll given again changes the setting. Without the C++
    bridge it works, and warns once why (RuntimeWarning; bridge_unavailable_reason())."""
    global _saved
    with _lock:
        _say_no_bridge()
        if busy_poll is not None:
            _installed_busy_poll[0] = _check_busy_poll(busy_poll)
        if _saved is not None:
            return
        saved = {"reducer": ForkingPickler._extra_reducers.get(_Untyped, _MISSING),
                 "tensor": ForkingPickler._extra_reducers.get(torch.Tensor, _MISSING),
                 "tensor_reducer": ForkingPickler._extra_reducers.get(
                     torch.Tensor, _treductions.reduce_tensor),
                 "parameter": ForkingPickler._extra_reducers.get(_Parameter, _MISSING),
                 "own": {name: _Untyped.__dict__.get(name, _MISSING) for name in _SHADOWED},
                 "torch_mp": {name: _tmp.__dict__.get(name, _MISSING)
                              for name in _TORCH_MP},
                 "get_preparation_data": _mpspawn.get_preparation_data,
                 "collate_tensor": _collate.default_collate_fn_map.get(torch.Tensor, _MISSING)}
        for name in _SHADOWED:
            saved[name] = getattr(_Untyped, name)
        _saved = saved
        for name, value in _SHADOWED.items():
            setattr(_Untyped, name, value)
        ForkingPickler.register(_Untyped, _reduce_storage)
        if _bridge is not None:
            ForkingPickler.register(torch.Tensor, _reduce_tensor)
            ForkingPickler.register(_Parameter, _reduce_parameter)
            _red.torch_reducer = (torch.Tensor, _reduce_tensor)
        for name, value in _TORCH_MP.items():
            setattr(_tmp, name, value)
        _mpspawn.get_preparation_data = _get_preparation_data
        _hook_loader()
        # Only torch's own entry: a function the user registered stays theirs.
        if _bridge is not None and saved["collate_tensor"] is _collate.collate_tensor_fn:
            _collate.default_collate_fn_map[torch.Tensor] = _collate_tensor


def uninstall() -> None:
    """Restores torch and multiprocessing exactly as install() found them; children started
    afterwards are stock. Storages already in arenas stay valid; torch's own reducer moves
    them into its shared memory if they are sent again. Queues and pipes made while
    installed stay native ones."""
    global _saved
    with _lock:
        if _saved is None:
            return
        saved, _saved = _saved, None
        _red.torch_reducer = None
        for name, own in saved["own"].items():
            if own is _MISSING:
                delattr(_Untyped, name)
            else:
                setattr(_Untyped, name, own)
        for cls, reducer in ((_Untyped, saved["reducer"]), (torch.Tensor, saved["tensor"]),
                             (_Parameter, saved["parameter"])):
            if reducer is _MISSING:
                ForkingPickler._extra_reducers.pop(cls, None)
            else:
                ForkingPickler._extra_reducers[cls] = reducer
        # What install() put there, unless something has replaced it since (that stays).
        for name, own in saved["torch_mp"].items():
            if _tmp.__dict__.get(name) is not _TORCH_MP[name]:
                continue
            if own is _MISSING:
                delattr(_tmp, name)
            else:
                setattr(_tmp, name, own)
        if _mpspawn.get_preparation_data is _get_preparation_data:
            _mpspawn.get_preparation_data = saved["get_preparation_data"]
        if _collate.default_collate_fn_map.get(torch.Tensor) is _collate_tensor:
            _collate.default_collate_fn_map[torch.Tensor] = saved["collate_tensor"]
        if not _contexts and _DataLoader.__dict__.get("_get_iterator") is _get_iterator:
            _DataLoader._get_iterator = _torch_get_iterator


def is_installed() -> bool:
    return _saved is not None


# ---- the scoped alternative ------------------------------------------------------------------


class _InstallFirst:
    """A Process whose child runs install() before its target."""

    def run(self):
        global _said_no_bridge
        _said_no_bridge = True  # context() said it in the parent
        install()
        super().run()


class ForkProcess(_InstallFirst, _mpcontext.ForkProcess):
    pass


class SpawnProcess(_InstallFirst, _mpcontext.SpawnProcess):
    pass


class ForkServerProcess(_InstallFirst, _mpcontext.ForkServerProcess):
    pass


# How long the DataLoader's consumer polls its result queue before it sleeps (context(),
# and install()'s torch.multiprocessing queues).
_DEFAULT_BUSY_POLL = 50e-6
_installed_busy_poll = [_DEFAULT_BUSY_POLL]


def _check_busy_poll(busy_poll):
    busy_poll = float(busy_poll)
    if not 0 <= busy_poll <= 1:
        raise ValueError("busy_poll is from 0 to 1 second, not %r" % busy_poll)
    return busy_poll


class _PollingQueues:
    """Queues made by this context poll in the process that made them (the DataLoader's
    main process gets every batch from one), for up to `_busy_poll` seconds per get."""

    _busy_poll = _DEFAULT_BUSY_POLL

    def Queue(self, maxsize=0):
        q = super().Queue(maxsize)
        q.set_busy_poll(self._busy_poll)
        return q


class _ForkContext(_PollingQueues, _smpcontext.ForkContext):
    Process = ForkProcess


class _SpawnContext(_PollingQueues, _smpcontext.SpawnContext):
    Process = SpawnProcess


class _ForkServerContext(_PollingQueues, _smpcontext.ForkServerContext):
    Process = ForkServerProcess


class _InstalledPolling(_PollingQueues):
    @property
    def _busy_poll(self):
        return _installed_busy_poll[0]

    def get_context(self, method=None):
        return self if method is None else _get_context(method)


# install()'s contexts: multiprocessing's processes (install() reaches their children by
# itself), shmtensor's queues and pipes.
class _InstalledFork(_InstalledPolling, _smpcontext.ForkContext):
    pass


class _InstalledSpawn(_InstalledPolling, _smpcontext.SpawnContext):
    pass


class _InstalledForkServer(_InstalledPolling, _smpcontext.ForkServerContext):
    pass


_context_classes = {"fork": _ForkContext, "spawn": _SpawnContext,
                    "forkserver": _ForkServerContext}
_contexts = {}
_installed_contexts = {"fork": _InstalledFork(), "spawn": _InstalledSpawn(),
                       "forkserver": _InstalledForkServer()}


def _get_context(method=None):
    """torch.multiprocessing.get_context while installed: the start method's context with
    shmtensor's Queue, SimpleQueue and Pipe (None: the current default start method)."""
    if method is None:
        method = multiprocessing.get_start_method()
    ctx = _installed_contexts.get(method)
    if ctx is None:
        raise ValueError("cannot find context for %r" % method)
    ctx._check_available()  # the standard library's check (forkserver needs fd passing)
    return ctx


def _Queue(maxsize=0):
    return _get_context().Queue(maxsize)


def _SimpleQueue():
    return _get_context().SimpleQueue()


def _JoinableQueue(maxsize=0):
    return _get_context().JoinableQueue(maxsize)


def _Pipe(duplex=True):
    return _get_context().Pipe(duplex)


def _Pool(processes=None, initializer=None, initargs=(), maxtasksperchild=None):
    return _get_context().Pool(processes, initializer, initargs, maxtasksperchild)


# What install() puts in torch.multiprocessing: its Queue, SimpleQueue, JoinableQueue,
# Pipe, Pool and get_context become those of shmtensor's native transport.
_TORCH_MP = {"Queue": _Queue, "SimpleQueue": _SimpleQueue, "JoinableQueue": _JoinableQueue,
             "Pipe": _Pipe, "Pool": _Pool, "get_context": _get_context}


def context(method: str = "fork", *, busy_poll: float = _DEFAULT_BUSY_POLL) -> _Context:
    """A multiprocessing context for DataLoader(multiprocessing_context=...) and the like:
    its processes run install() first, and its Queue, SimpleQueue and Pipe are shmtensor's
    native transport. Nothing changes in the calling process, except that a get() on a
    Queue made by this context polls for up to `busy_poll` seconds (adapting; 50 us by
    default, 0: never) before it sleeps: the DataLoader's main process then takes each
    batch as it comes instead of being woken for it (Queue.set_busy_poll). A DataLoader with
    at least as many workers as the CPUs of this process's affinity mask never polls for its
    batches (a poll would keep a CPU from the workers)."""
    cls = _context_classes.get(method)
    if cls is None:
        raise ValueError("cannot find context for %r" % method)
    busy_poll = _check_busy_poll(busy_poll)
    key = (method, busy_poll)
    with _lock:
        _say_no_bridge()
        ctx = _contexts.get(key)
        if ctx is None:
            ctx = _contexts[key] = cls()
            ctx._busy_poll = busy_poll
        _hook_loader()
    return ctx
