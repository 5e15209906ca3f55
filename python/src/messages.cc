// Tensor messages: a message of the native transport whose value is a structure of plain
// values, NumPy arrays and torch tensors already in shared blocks, encoded in one call instead
// of a pickle and decoded in one call (docs/python.md, "Tensor messages"). torch tensors are
// described and made by shmtensor._torch's half (shmtensor/internal/message_torch.h), handed
// to this module when _torch is imported.
//
// The bytes, little-endian: kMagic, a flags byte (kHoldsTorch: a torch tensor is in it), then
// one value:
//   'N' None; 'T' True; 'F' False; 'i' an int64; 'f' a float64;
//   's' a str: u32 length, UTF-8; 'b' bytes: u32 length, the bytes;
//   'l' a list, 'u' a tuple: u32 count, the values; 'd' a dict: u32 count, key-value pairs;
//   'a' a NumPy array: u32 block index, u8 NumPy type number, u8 flags (1: read-only),
//       u8 dims, u64 byte offset, dims x i64 sizes, dims x i64 byte strides;
//   'x' a torch tensor: u32 block index, u8 dtype (c10::ScalarType), u8 dims, i64 offset,
//       dims x i64 sizes, then u8 0 (contiguous strides) or u8 1 and dims x i64 strides
//       (offset and strides in elements).
// The blocks travel beside the bytes, as a pickled message's do, each once.
#include <pybind11/numpy.h>
#include <pybind11/pybind11.h>

#include <algorithm>
#include <bit>
#include <cstdint>
#include <cstring>
#include <optional>
#include <string>
#include <unordered_set>
#include <vector>

#include "bindings.h"
#include "shmtensor/internal/message_torch.h"

namespace py = pybind11;

namespace shmtensor::python {

namespace {

using internal::kMessageMaxDims;
using internal::MessageTensor;
using internal::MessageTorch;

static_assert(std::endian::native == std::endian::little, "tensor messages are little-endian");

constexpr char kMagic[4] = {'S', 'T', 'M', '2'};  // a pickle starts with PROTO (0x80)
constexpr std::uint8_t kHoldsTorch = 1;
constexpr int kMaxDepth = 64;
constexpr std::size_t kMaxBlocks = 256;    // more: pickled (a linear search dedups blocks)
constexpr std::size_t kMaxObjects = 4096;  // containers, arrays and tensors, checked for repeats
constexpr std::size_t kMaxBytesWithoutTensor = 1024;  // then no second walk of a plain value

// shmtensor._torch's half, from its import on (its capsule is kept for the process's life).
const MessageTorch* g_torch = nullptr;

// The NumPy type numbers a message carries: the builtin numeric ones (bool to clongdouble,
// and half), numbered alike in NumPy 1 and 2.
bool numeric_type(int num) { return (num >= 0 && num <= 16) || num == 23; }

// The C-contiguous strides (in elements) of `sizes`, a size 0 counting as 1, as torch's;
// false when they overflow.
bool contiguous_strides(const std::int64_t* sizes, std::size_t dims, std::int64_t* strides) {
  std::int64_t stride = 1;
  for (std::size_t i = dims; i-- > 0;) {
    strides[i] = stride;
    if (__builtin_mul_overflow(stride, std::max<std::int64_t>(sizes[i], 1), &stride))
      return false;
  }
  return true;
}

// What is wrong with an array's view (byte offset, sizes, byte strides of any sign) of
// `itemsize`-byte elements on a block of `nbytes`, or nullptr when every element lies within.
const char* array_view_error(std::uint64_t offset, const std::vector<py::ssize_t>& sizes,
                             const std::vector<py::ssize_t>& strides, std::uint64_t itemsize,
                             std::uint64_t nbytes) {
  if (offset > nbytes) return "reaches past its block";
  bool empty = false;
  for (py::ssize_t size : sizes) {
    if (size < 0) return "has a negative size";
    empty = empty || size == 0;
  }
  if (empty) return nullptr;
  __int128 lo = offset, hi = offset;
  for (std::size_t i = 0; i < sizes.size(); ++i) {
    const __int128 span = static_cast<__int128>(sizes[i] - 1) * strides[i];
    if (span > INT64_MAX || span < INT64_MIN) return "overflows";
    (span < 0 ? lo : hi) += span;
  }
  hi += itemsize;
  if (lo < 0 || hi > static_cast<__int128>(nbytes)) return "reaches past its block";
  return nullptr;
}

class Encoder {
 public:
  // arrays: NumPy arrays travel as 'a' (the ndarray reducer is shmtensor's); torch: torch
  // tensors as 'x' (shmtensor.torch's tensor reducer is installed), where _torch is loaded.
  Encoder(bool arrays, bool torch)
      : torch_(torch ? g_torch : nullptr),
        array_type_(arrays ? py::detail::npy_api::get().PyArray_Type_ : nullptr) {}

  // (bytes, [block]) for obj, or None when obj is not what a tensor message holds: a value
  // of a type other than the exact types above, an int beyond int64, a str that is not
  // UTF-8, a container, array or tensor that occurs twice (a pickle keeps that identity),
  // an array of another dtype or not in a shared block, a tensor that shmtensor._torch
  // refuses, more than kMaxDepth levels, kMaxBlocks blocks or kMaxObjects objects, no array
  // or tensor in the first kMaxBytesWithoutTensor bytes, or none at all. (A str or bytes
  // object met twice is written twice; the pickle would name its first copy.)
  py::object encode(py::handle obj) {
    out_.append(kMagic, sizeof kMagic);
    out_ += '\0';  // the flags
    if (!value(obj.ptr(), 0) || storages_.empty()) return py::none();
    if (holds_torch_) out_[sizeof kMagic] = static_cast<char>(kHoldsTorch);
    return py::make_tuple(py::bytes(out_.data(), static_cast<py::ssize_t>(out_.size())),
                          blocks_);
  }

 private:
  template <class T>
  void put(T v) {
    char bytes[sizeof(T)];
    std::memcpy(bytes, &v, sizeof(T));
    out_.append(bytes, sizeof(T));
  }

  // False at the first repeat (the pickle keeps that identity) or past kMaxObjects.
  bool remember(PyObject* o) { return seen_.size() < kMaxObjects && seen_.insert(o).second; }

  // A message without an array or tensor in its first kMaxBytesWithoutTensor is pickled: no
  // second walk of a large plain value.
  bool still_worth_it() const {
    return !storages_.empty() || out_.size() <= kMaxBytesWithoutTensor;
  }

  bool count(char tag, Py_ssize_t n) {
    if (n < 0 || static_cast<std::uint64_t>(n) > UINT32_MAX) return false;
    out_ += tag;
    put(static_cast<std::uint32_t>(n));
    return true;
  }

  // The index of the block of `storage` in this message, added on first use.
  std::optional<std::uint32_t> block(const Storage& storage) {
    for (std::size_t i = 0; i < storages_.size(); ++i)
      if (storages_[i].is_same(storage)) return static_cast<std::uint32_t>(i);
    if (storages_.size() >= kMaxBlocks) return std::nullopt;
    blocks_.append(py::cast(whole_block(storage)));
    storages_.push_back(storage);  // held: its identity names it until the end
    return static_cast<std::uint32_t>(storages_.size() - 1);
  }

  // Each item is held by a reference of ours while it is encoded.
  bool sequence(PyObject* o, int depth) {
    const bool list = PyList_CheckExact(o);
    const Py_ssize_t n = list ? PyList_GET_SIZE(o) : PyTuple_GET_SIZE(o);
    if (!remember(o) || !count(list ? 'l' : 'u', n)) return false;
    for (Py_ssize_t i = 0; i < n; ++i) {
      if (list && PyList_GET_SIZE(o) != n) return false;  // changed meanwhile
      py::object item = py::reinterpret_borrow<py::object>(list ? PyList_GET_ITEM(o, i)
                                                                : PyTuple_GET_ITEM(o, i));
      if (!value(item.ptr(), depth + 1)) return false;
    }
    return !list || PyList_GET_SIZE(o) == n;
  }

  bool dict(PyObject* o, int depth) {
    const Py_ssize_t n = PyDict_GET_SIZE(o);
    if (!remember(o) || !count('d', n)) return false;
    Py_ssize_t pos = 0, done = 0;
    PyObject* key = nullptr;
    PyObject* val = nullptr;
    while (PyDict_Next(o, &pos, &key, &val)) {
      py::object k = py::reinterpret_borrow<py::object>(key);
      py::object v = py::reinterpret_borrow<py::object>(val);
      if (++done > n || !value(k.ptr(), depth + 1) || !value(v.ptr(), depth + 1)) return false;
      if (PyDict_GET_SIZE(o) != n) return false;  // changed meanwhile
    }
    return done == n;
  }

  // An exact ndarray of a builtin numeric dtype (the builtin descriptor itself: not a
  // byte-swapped one or one with metadata) whose bytes lie in a shared CPU block.
  bool array(PyObject* o) {
    auto a = py::reinterpret_borrow<py::array>(o);
    const py::dtype dtype = a.dtype();
    const int num = dtype.num();
    if (!numeric_type(num) || a.ndim() > static_cast<py::ssize_t>(kMessageMaxDims)) return false;
    {
      py::dtype builtin(num);
      if (builtin.ptr() != dtype.ptr()) return false;
    }
    if (!remember(o)) return false;
    std::optional<ArrayStorage> found = array_storage(o);
    if (!found || !found->storage.is_shared() || found->storage.device().is_cuda()) return false;
    std::optional<std::uint32_t> index = block(found->storage);
    if (!index) return false;
    out_ += 'a';
    put(*index);
    put(static_cast<std::uint8_t>(num));
    put(static_cast<std::uint8_t>(a.writeable() ? 0 : 1));
    put(static_cast<std::uint8_t>(a.ndim()));
    put(static_cast<std::uint64_t>(found->offset));
    for (py::ssize_t d = 0; d < a.ndim(); ++d) put(static_cast<std::int64_t>(a.shape(d)));
    for (py::ssize_t d = 0; d < a.ndim(); ++d) put(static_cast<std::int64_t>(a.strides(d)));
    return true;
  }

  bool torch_tensor(PyObject* o) {
    if (!remember(o)) return false;
    MessageTensor t;
    const int described = torch_->describe(o, &t);
    if (described < 0) throw py::error_already_set();
    if (described == 0 || t.dims > kMessageMaxDims) return false;
    std::optional<std::uint32_t> index = block(t.storage);
    if (!index) return false;
    holds_torch_ = true;
    out_ += 'x';
    put(*index);
    put(t.dtype);
    put(t.dims);
    put(t.offset);
    for (std::size_t d = 0; d < t.dims; ++d) put(t.sizes[d]);
    put(static_cast<std::uint8_t>(t.contiguous ? 0 : 1));
    if (!t.contiguous)
      for (std::size_t d = 0; d < t.dims; ++d) put(t.strides[d]);
    return true;
  }

  bool value(PyObject* o, int depth) {
    if (depth > kMaxDepth || !still_worth_it()) return false;
    PyTypeObject* type = Py_TYPE(o);
    if (o == Py_None) {
      out_ += 'N';
    } else if (type == &PyBool_Type) {
      out_ += o == Py_True ? 'T' : 'F';
    } else if (type == &PyLong_Type) {
      int overflow = 0;
      const long long v = PyLong_AsLongLongAndOverflow(o, &overflow);
      if (overflow != 0) return false;
      out_ += 'i';
      put(static_cast<std::int64_t>(v));
    } else if (type == &PyFloat_Type) {
      out_ += 'f';
      put(PyFloat_AS_DOUBLE(o));
    } else if (type == &PyUnicode_Type) {
      Py_ssize_t n = 0;
      const char* utf8 = PyUnicode_AsUTF8AndSize(o, &n);
      if (utf8 == nullptr) {
        PyErr_Clear();  // a lone surrogate: the pickle takes it
        return false;
      }
      if (!count('s', n)) return false;
      out_.append(utf8, static_cast<std::size_t>(n));
    } else if (type == &PyBytes_Type) {
      if (!count('b', PyBytes_GET_SIZE(o))) return false;
      out_.append(PyBytes_AS_STRING(o), static_cast<std::size_t>(PyBytes_GET_SIZE(o)));
    } else if (type == &PyList_Type || type == &PyTuple_Type) {
      return sequence(o, depth);
    } else if (type == &PyDict_Type) {
      return dict(o, depth);
    } else if (type == array_type_) {
      return array(o);
    } else if (torch_ != nullptr && type == static_cast<PyTypeObject*>(torch_->tensor_type)) {
      return torch_tensor(o);
    } else {
      return false;
    }
    return true;
  }

  const MessageTorch* const torch_;
  PyTypeObject* const array_type_;
  bool holds_torch_ = false;
  std::string out_;
  std::unordered_set<PyObject*> seen_;
  std::vector<Storage> storages_;  // of the blocks, in their order
  py::list blocks_;
};

class Decoder {
 public:
  // The blocks as Python objects (shmtensor Tensors, each standing for its whole storage).
  Decoder(const char* data, std::size_t size, py::tuple blocks)
      : p_(data), end_(data + size), blocks_(std::move(blocks)) {
    const auto n = static_cast<std::size_t>(PyTuple_GET_SIZE(blocks_.ptr()));
    storages_.resize(n);
    objects_.resize(n);
  }
  // The blocks' storages themselves (a queue's item, taken in C++).
  Decoder(const char* data, std::size_t size, const Storage* storages, std::size_t count)
      : p_(data), end_(data + size), storages_(storages, storages + count), objects_(count) {}

  py::object decode() {
    if (static_cast<std::size_t>(end_ - p_) < sizeof kMagic ||
        std::memcmp(p_, kMagic, sizeof kMagic) != 0)
      fail("does not start with its magic");
    p_ += sizeof kMagic;
    const auto flags = take<std::uint8_t>();
    if ((flags & ~kHoldsTorch) != 0) fail("has unknown flags");
    holds_torch_ = (flags & kHoldsTorch) != 0;
    if (holds_torch_ && g_torch == nullptr)
      throw py::value_error(
          "shmtensor: a received tensor message holds torch tensors, and shmtensor.torch's "
          "C++ bridge is not loaded in this process");
    py::object out = value(0);
    if (p_ != end_) fail("has bytes after its value");
    return out;
  }

 private:
  [[noreturn]] static void fail(const std::string& what) {
    throw py::value_error("shmtensor: a received tensor message " + what +
                          " (a corrupt or hostile message)");
  }

  template <class T>
  T take() {
    if (static_cast<std::size_t>(end_ - p_) < sizeof(T)) fail("is truncated");
    T v;
    std::memcpy(&v, p_, sizeof(T));
    p_ += sizeof(T);
    return v;
  }

  // A count of things of at least one byte each: no more than the bytes left.
  std::size_t count() {
    const std::uint32_t n = take<std::uint32_t>();
    if (n > static_cast<std::size_t>(end_ - p_)) fail("has a count past its end");
    return n;
  }

  const char* bytes(std::size_t n) {
    if (n > static_cast<std::size_t>(end_ - p_)) fail("is truncated");
    const char* at = p_;
    p_ += n;
    return at;
  }

  static py::object steal(PyObject* o) {
    if (o == nullptr) throw py::error_already_set();
    return py::reinterpret_steal<py::object>(o);
  }

  std::uint32_t block_index() {
    const auto index = take<std::uint32_t>();
    if (index >= storages_.size()) fail("names a block it does not carry");
    return index;
  }

  const Storage& storage(std::uint32_t index) {
    std::optional<Storage>& s = storages_[index];
    if (!s) {
      py::handle block = PyTuple_GET_ITEM(blocks_.ptr(), index);
      if (!py::isinstance<Tensor>(block))
        throw py::type_error("shmtensor: a tensor message's blocks must be shmtensor Tensors");
      s = block.cast<const Tensor&>().storage();
    }
    if (!s->is_shared() || s->device().is_cuda() || s->data() == nullptr)
      fail("names a block that is not in shared memory");
    return *s;
  }

  // The Python object that keeps a block alive under the arrays made on it.
  py::handle block_object(std::uint32_t index) {
    py::object& o = objects_[index];
    if (!o) {
      o = blocks_ ? py::reinterpret_borrow<py::object>(PyTuple_GET_ITEM(blocks_.ptr(), index))
                  : py::cast(whole_block(*storages_[index]));
    }
    return o;
  }

  py::object array() {
    const std::uint32_t index = block_index();
    const Storage& block = storage(index);
    const int num = take<std::uint8_t>();
    if (!numeric_type(num)) fail("has an array of no NumPy dtype");
    const auto flags = take<std::uint8_t>();
    if (flags > 1) fail("has an array with unknown flags");
    const std::size_t dims = take<std::uint8_t>();
    if (dims > kMessageMaxDims) fail("has too many dimensions");
    const auto offset = take<std::uint64_t>();
    std::vector<py::ssize_t> sizes(dims), strides(dims);
    for (py::ssize_t& size : sizes) size = take<std::int64_t>();
    for (py::ssize_t& stride : strides) stride = take<std::int64_t>();
    py::dtype dtype(num);
    if (const char* error = array_view_error(offset, sizes, strides,
                                             static_cast<std::uint64_t>(dtype.itemsize()),
                                             block.nbytes()))
      fail(std::string("has an array that ") + error);
    py::array a(dtype, std::move(sizes), std::move(strides),
                static_cast<const char*>(block.data()) + offset, block_object(index));
    if (flags & 1) py::detail::array_proxy(a.ptr())->flags &= ~py::detail::npy_api::NPY_ARRAY_WRITEABLE_;
    return a;
  }

  py::object torch_tensor() {
    if (!holds_torch_) fail("has a torch tensor its flags do not announce");
    MessageTensor t;
    const std::uint32_t index = block_index();
    t.storage = storage(index);
    t.dtype = take<std::uint8_t>();
    t.dims = take<std::uint8_t>();
    if (t.dims > kMessageMaxDims) fail("has too many dimensions");
    t.offset = take<std::int64_t>();
    for (std::size_t d = 0; d < t.dims; ++d) t.sizes[d] = take<std::int64_t>();
    const auto strided = take<std::uint8_t>();
    if (strided == 0) {
      if (!contiguous_strides(t.sizes, t.dims, t.strides)) fail("has a tensor that overflows");
      t.contiguous = true;
    } else if (strided == 1) {
      for (std::size_t d = 0; d < t.dims; ++d) t.strides[d] = take<std::int64_t>();
    } else {
      fail("has a tensor with a bad strides flag");
    }
    return steal(static_cast<PyObject*>(g_torch->make(&t)));
  }

  py::object value(int depth) {
    if (depth > kMaxDepth) fail("nests too deep");
    switch (take<char>()) {
      case 'N': return py::none();
      case 'T': return py::bool_(true);
      case 'F': return py::bool_(false);
      case 'i': return steal(PyLong_FromLongLong(take<std::int64_t>()));
      case 'f': return steal(PyFloat_FromDouble(take<double>()));
      case 's': {
        const std::size_t n = take<std::uint32_t>();
        const char* at = bytes(n);
        PyObject* s = PyUnicode_DecodeUTF8(at, static_cast<Py_ssize_t>(n), "strict");
        if (s == nullptr) {
          PyErr_Clear();
          fail("has a str that is not UTF-8");
        }
        return steal(s);
      }
      case 'b': {
        const std::size_t n = take<std::uint32_t>();
        const char* at = bytes(n);
        return steal(PyBytes_FromStringAndSize(at, static_cast<Py_ssize_t>(n)));
      }
      case 'l':
      case 'u': {
        const bool list = p_[-1] == 'l';
        const std::size_t n = count();
        py::object seq = steal(list ? PyList_New(static_cast<Py_ssize_t>(n))
                                    : PyTuple_New(static_cast<Py_ssize_t>(n)));
        for (std::size_t i = 0; i < n; ++i) {
          PyObject* item = value(depth + 1).release().ptr();
          if (list)
            PyList_SET_ITEM(seq.ptr(), static_cast<Py_ssize_t>(i), item);
          else
            PyTuple_SET_ITEM(seq.ptr(), static_cast<Py_ssize_t>(i), item);
        }
        return seq;
      }
      case 'd': {
        const std::size_t n = count();
        py::object d = steal(PyDict_New());
        for (std::size_t i = 0; i < n; ++i) {
          py::object key = value(depth + 1);
          py::object val = value(depth + 1);
          if (PyDict_SetItem(d.ptr(), key.ptr(), val.ptr()) != 0) {
            PyErr_Clear();
            fail("has a dict key that cannot be hashed");
          }
        }
        return d;
      }
      case 'a': return array();
      case 'x': return torch_tensor();
      default: fail("has an unknown value tag");
    }
  }

  const char* p_;
  const char* end_;
  // The blocks' tuple (a copy: Python code may run while the message is decoded), or null
  // where the blocks are given as storages.
  py::object blocks_;
  std::vector<std::optional<Storage>> storages_;
  std::vector<py::object> objects_;  // of the blocks, made on first use
  bool holds_torch_ = false;
};

bool is_message(const char* data, std::size_t size) {
  return size >= sizeof kMagic && std::memcmp(data, kMagic, sizeof kMagic) == 0;
}

}  // namespace

bool message_decodable_here(const char* data, std::size_t size) {
  return is_message(data, size) &&
         (size == sizeof kMagic || (static_cast<std::uint8_t>(data[sizeof kMagic]) &
                                    kHoldsTorch) == 0 || g_torch != nullptr);
}

PyObject* decode_message_of_storages(const char* data, std::size_t size,
                                     const Storage* storages, std::size_t count) {
  try {
    return Decoder(data, size, storages, count).decode().release().ptr();
  } catch (py::error_already_set& e) {
    e.restore();
  } catch (const py::builtin_exception& e) {
    e.set_error();
  } catch (const std::exception& e) {
    PyErr_SetString(PyExc_RuntimeError, e.what());
  }
  return nullptr;
}

void bind_messages(py::module_& m) {
  m.def(
      "_encode_message",
      [](py::handle obj, bool arrays, bool torch) { return Encoder(arrays, torch).encode(obj); },
      py::arg("obj"), py::arg("arrays"), py::arg("torch"),
      "(bytes, [block]) of a message that is a structure of None, bool, int (int64), float, "
      "str, bytes, list, tuple and dict (exact types, no object twice) holding at least one "
      "NumPy array (if `arrays`) or torch.Tensor (if `torch` and shmtensor._torch is loaded) "
      "in a shared block: one call in place of a pickle; None for anything else (the caller "
      "pickles it).");
  m.def(
      "_decode_message",
      [](const py::buffer& data, py::handle blocks) {
        py::buffer_info info = data.request();
        if (info.ndim != 1 || info.itemsize != 1 || (info.size > 1 && info.strides[0] != 1))
          throw py::type_error("_decode_message: data must be contiguous bytes");
        if (!PyList_CheckExact(blocks.ptr()) && !PyTuple_CheckExact(blocks.ptr()))
          throw py::type_error("_decode_message: blocks must be a list or a tuple");
        auto copy = py::reinterpret_steal<py::tuple>(PySequence_Tuple(blocks.ptr()));
        if (!copy) throw py::error_already_set();
        return Decoder(static_cast<const char*>(info.ptr), static_cast<std::size_t>(info.size),
                       std::move(copy))
            .decode();
      },
      py::arg("data"), py::arg("blocks"),
      "The value of _encode_message's (bytes, blocks): its arrays and tensors on the blocks. "
      "ValueError for bytes that are not such a message or do not fit the blocks.");
  m.def(
      "_set_message_torch",
      [](const py::capsule& capsule) {
        auto* torch = static_cast<const MessageTorch*>(
            PyCapsule_GetPointer(capsule.ptr(), internal::kMessageTorchCapsule));
        if (torch == nullptr) throw py::error_already_set();
        capsule.inc_ref();  // kept for the process's life, as the module it points into
        g_torch = torch;
      },
      py::arg("capsule"),
      "Called by shmtensor._torch at import: its half of tensor messages (torch tensors).");
  m.def(
      "_message_torch_ready", [] { return g_torch != nullptr; },
      "Whether tensor messages holding torch tensors are encoded and decoded here.");
}

}  // namespace shmtensor::python
