# The extension module shmtensor._torch (python/src/torch_module.cc), the bridge between
# torch storages and shmtensor blocks that shmtensor.torch uses; built only with libtorch
# (docs/torch.md). A block is a 1-d uint8 shmtensor._C.Tensor over a whole shared storage.
# python/tests/test_typing.py checks this file against the module where it is built.
import torch

from shmtensor._C import Tensor

torch_version: str

def storage_from_block(block: Tensor) -> torch.UntypedStorage: ...
def block_of_storage(storage: torch.UntypedStorage) -> Tensor | None: ...
def share_storage_(storage: torch.UntypedStorage) -> Tensor | None: ...
def new_shared(nbytes: int) -> torch.UntypedStorage: ...
def has_no_data(storage: torch.UntypedStorage) -> bool: ...

# None when the batch is not a non-empty list or tuple of plain CPU tensors of one dtype and
# shape.
def stack_shared(batch: object) -> torch.Tensor | None: ...

# (block, dtype code, storage offset, sizes, strides: None when contiguous), or None for a
# tensor shmtensor.torch leaves to torch's reducer; block None (with 0, 0, (), ()) for a
# storage not in shared memory yet when `move` is false.
def tensor_parts(
    tensor: object, move: bool
) -> tuple[Tensor | None, int, int, tuple[int, ...], tuple[int, ...] | None] | None: ...
def tensor_from_block(
    block: Tensor,
    dtype: int,
    offset: int,
    sizes: tuple[int, ...],
    strides: tuple[int, ...] | None,
) -> torch.Tensor: ...

