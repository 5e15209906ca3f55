"""shmtensor: tensors and NumPy arrays in shared memory, shared between processes."""
from shmtensor._C import Tensor, empty_cache

__all__ = ["Tensor", "empty_cache"]
