"""DLPack capsules made by hand with ctypes (dlpack.h's structs), as a producer other than
NumPy and torch would make them: over any address and device, 0.6 or 1.0, with flags, and a
deleter that counts its calls. What shmtensor.from_dlpack does with a foreign producer's
capsule, CUDA ones included, is tested with these on the fake driver."""
import ctypes

c_int32, c_uint8, c_uint16, c_uint32 = ctypes.c_int32, ctypes.c_uint8, ctypes.c_uint16, ctypes.c_uint32
c_int64, c_uint64, c_void_p = ctypes.c_int64, ctypes.c_uint64, ctypes.c_void_p


class DLDevice(ctypes.Structure):
    _fields_ = [("device_type", c_int32), ("device_id", c_int32)]


class DLDataType(ctypes.Structure):
    _fields_ = [("code", c_uint8), ("bits", c_uint8), ("lanes", c_uint16)]


class DLTensor(ctypes.Structure):
    _fields_ = [("data", c_void_p), ("device", DLDevice), ("ndim", c_int32),
                ("dtype", DLDataType), ("shape", ctypes.POINTER(c_int64)),
                ("strides", ctypes.POINTER(c_int64)), ("byte_offset", c_uint64)]


class DLManagedTensor(ctypes.Structure):
    _fields_ = [("dl_tensor", DLTensor), ("manager_ctx", c_void_p), ("deleter", c_void_p)]


class DLPackVersion(ctypes.Structure):
    _fields_ = [("major", c_uint32), ("minor", c_uint32)]


class DLManagedTensorVersioned(ctypes.Structure):
    _fields_ = [("version", DLPackVersion), ("manager_ctx", c_void_p), ("deleter", c_void_p),
                ("flags", c_uint64), ("dl_tensor", DLTensor)]


DELETER = ctypes.CFUNCTYPE(None, c_void_p)
READ_ONLY, IS_COPIED = 1, 2

_new = ctypes.pythonapi.PyCapsule_New
_new.restype = ctypes.py_object
_new.argtypes = [c_void_p, c_void_p, c_void_p]
_get_name = ctypes.pythonapi.PyCapsule_GetName
_get_name.restype = ctypes.c_char_p
_get_name.argtypes = [ctypes.py_object]
_get_pointer = ctypes.pythonapi.PyCapsule_GetPointer
_get_pointer.restype = c_void_p
_get_pointer.argtypes = [ctypes.py_object, ctypes.c_char_p]

# The capsule keeps the name's address: these live as long as the module.
_NAMES = {False: ctypes.create_string_buffer(b"dltensor"),
          True: ctypes.create_string_buffer(b"dltensor_versioned")}


def capsule_name(capsule):
    return _get_name(capsule).decode()


def versioned_flags(capsule):
    """The flags of a "dltensor_versioned" capsule."""
    p = _get_pointer(capsule, b"dltensor_versioned")
    return DLManagedTensorVersioned.from_address(p).flags


class Producer:
    """One hand-made capsule over `address` (kept alive by `keep`, e.g. the tensor owning
    the memory, until the deleter runs); `calls` counts the deleter's calls."""

    def __init__(self, address, shape, strides, code, bits, device=(1, 0), versioned=False,
                 flags=0, version=(1, 0), byte_offset=0, keep=None):
        self.calls = 0
        self.keep = keep
        n = len(shape)
        self.shape = (c_int64 * max(n, 1))(*shape)
        self.strides = None if strides is None else (c_int64 * max(n, 1))(*strides)
        self.callback = DELETER(self._deleter)
        self.versioned = versioned
        m = DLManagedTensorVersioned() if versioned else DLManagedTensor()
        if versioned:
            m.version = DLPackVersion(*version)
            m.flags = flags
        t = m.dl_tensor
        t.data = address
        t.device = DLDevice(*device)
        t.ndim = n
        t.dtype = DLDataType(code, bits, 1)
        t.shape = ctypes.cast(self.shape, ctypes.POINTER(c_int64))
        t.strides = (ctypes.cast(self.strides, ctypes.POINTER(c_int64))
                     if self.strides is not None else None)
        t.byte_offset = byte_offset
        m.deleter = ctypes.cast(self.callback, c_void_p)
        self.managed = m

    def _deleter(self, _):
        self.calls += 1
        self.keep = None

    def capsule(self):
        # No capsule destructor: a capsule a test leaves unconsumed is freed by hand.
        return _new(ctypes.addressof(self.managed), ctypes.addressof(_NAMES[self.versioned]),
                    None)
