// Tensor: a typed, strided n-d view over a Storage.
//
// A Tensor is a small handle: a Storage (refcounted bytes), an offset into it in elements,
// sizes, strides (in elements, never negative) and a dtype. Copying a Tensor is cheap and the
// copy shares the bytes; views (view, select, slice, transpose, ...) share them too. Only
// clone(), contiguous() of a non-contiguous tensor, reshape() that cannot be a view, to() and
// the factories allocate.
//
// The data pointer is never cached: every access reads the storage's current data(), so a
// view made before share_memory_() sees the shared bytes afterwards.
//
// Thread safety: like std::shared_ptr. Distinct Tensor objects, even on the same storage,
// may be used from different threads; one Tensor object must not be assigned in one thread
// while used in another. The bytes themselves are unsynchronised: concurrent writes, or a
// write concurrent with a read, of the same elements are data races.
//
// A factory, view or copy has no effect but the tensor it returns, so each is [[nodiscard]]:
// `t.contiguous();` or `t.to(DType::kFloat64);` alone is a bug the compiler reports.
//
// Errors: violated preconditions (wrong shape, bad dimension, wrong dtype for data_ptr<T>,
// use of an undefined tensor) throw std::invalid_argument; indices out of range throw
// std::out_of_range. Allocation failures throw std::bad_alloc, or, for shared memory,
// SystemError / SharedMemoryFullError.
#pragma once

#include <complex>
#include <cstddef>
#include <cstdint>
#include <iosfwd>
#include <limits>
#include <stdexcept>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

#include "shmtensor/dims.h"
#include "shmtensor/dtype.h"
#include "shmtensor/export.h"
#include "shmtensor/storage.h"

namespace shmtensor {

namespace internal {
struct TensorAccess;  // internal/tensor_access.h
}  // namespace internal

class SHMTENSOR_API Tensor {
 public:
  // An undefined tensor: defined() is false; only defined(), to_string() and assignment are
  // meaningful, anything touching elements throws std::invalid_argument.
  Tensor() = default;

  // ---- factories (private heap memory unless the name says _shared) ------------------------
  // Sizes must be non-negative and numel * element_size must fit in int64, else
  // std::invalid_argument. empty() leaves the bytes uninitialised.
  [[nodiscard]] static Tensor empty(Dims sizes, DType dtype = DType::kFloat32);
  [[nodiscard]] static Tensor zeros(Dims sizes, DType dtype = DType::kFloat32);
  [[nodiscard]] static Tensor ones(Dims sizes, DType dtype = DType::kFloat32);
  // Every element is `value` converted to dtype (see fill_).
  [[nodiscard]] static Tensor full(Dims sizes, double value,
                                   DType dtype = DType::kFloat32);
  [[nodiscard]] static Tensor full(Dims sizes, std::complex<double> value,
                                   DType dtype = DType::kComplex64);
  // 1-d [0, 1, ..., n-1]; n >= 0.
  [[nodiscard]] static Tensor arange(std::int64_t n, DType dtype = DType::kInt64);
  // A copy of `values` with dtype dtype_of_v<T>. Empty `sizes` means 1-d of values.size();
  // otherwise the product of sizes must equal values.size(), else std::invalid_argument.
  template <class T>
  [[nodiscard]] static Tensor from_vector(std::vector<T> values,
                                          Dims sizes = {});
  // Allocated directly in shared memory of the current strategy (Storage::allocate_shared):
  // is_shared() is true from birth and the bytes are never copied by share_memory_().
  [[nodiscard]] static Tensor empty_shared(Dims sizes,
                                           DType dtype = DType::kFloat32);
  [[nodiscard]] static Tensor zeros_shared(Dims sizes,
                                           DType dtype = DType::kFloat32);
  // On `device`: for the CPU the same as the factories above; for a CUDA device, device
  // memory from this process's device arena (Storage::allocate(nbytes, device)), shared
  // from birth. Throws as Storage::allocate(nbytes, device).
  [[nodiscard]] static Tensor empty(Dims sizes, DType dtype, Device device);
  [[nodiscard]] static Tensor zeros(Dims sizes, DType dtype, Device device);
  // Same sizes, dtype and device as `other`, contiguous (private memory on the CPU).
  [[nodiscard]] static Tensor empty_like(const Tensor& other);
  [[nodiscard]] static Tensor zeros_like(const Tensor& other);

  // A view over an existing storage. Offset, sizes and strides are in elements. May be fed
  // values from an untrusted peer: it validates everything with checked arithmetic and throws
  // std::invalid_argument (undefined storage, negative size or stride, sizes/strides differing
  // in length, misaligned storage) or std::out_of_range (negative offset, any reachable
  // element - or, for an empty tensor, the offset - lying beyond storage.nbytes(), overflow).
  // A tensor it returns never reaches outside the storage.
  [[nodiscard]] static Tensor from_storage(Storage storage, std::int64_t storage_offset,
                                           Dims sizes, Dims strides, DType dtype);

  // ---- metadata ---------------------------------------------------------------------------
  bool defined() const noexcept { return storage_.defined(); }
  DType dtype() const noexcept { return dtype_; }
  std::int64_t dim() const noexcept { return static_cast<std::int64_t>(sizes_.size()); }
  // Read like a const std::vector<std::int64_t> (dims.h): indexable, iterable, equal to and
  // convertible to one.
  const Dims& sizes() const noexcept { return sizes_; }
  const Dims& strides() const noexcept { return strides_; }
  // Negative dims count from the end, as in torch; out of range throws std::out_of_range.
  std::int64_t size(std::int64_t dim) const;
  std::int64_t stride(std::int64_t dim) const;
  std::int64_t storage_offset() const noexcept { return storage_offset_; }
  std::int64_t numel() const noexcept;
  std::size_t element_size() const { return shmtensor::element_size(dtype_); }
  // numel() * element_size().
  std::size_t nbytes() const;
  // Row-major with no gaps (dims of size 1 may have any stride; numel 0 is contiguous).
  bool is_contiguous() const noexcept;
  // Where the elements live: the CPU, or a CUDA device (docs/cuda.md).
  Device device() const noexcept { return storage_.device(); }
  bool is_cuda() const noexcept { return device().is_cuda(); }

  // ---- data -------------------------------------------------------------------------------
  // Address of element 0: storage().data() + storage_offset() * element_size(), read afresh
  // on each call. For a CUDA tensor a device address (as torch's data_ptr): for kernels and
  // the CUDA API, never for the host to dereference. T must be the C++ type of dtype() (dtype_of_v<T>), else
  // std::invalid_argument. Valid while some handle keeps the storage alive and until
  // share_memory_() moves the bytes. As in libtorch, a const handle does not make the
  // bytes const: data_ptr() const returns T* too.
  template <class T>
  T* data_ptr();
  template <class T>
  T* data_ptr() const;
  void* raw_data();
  const void* raw_data() const;
  // The single element (numel() must be 1) converted to T, as torch's item<T>(): integral T
  // throws std::out_of_range when the value does not fit (or is NaN/inf); complex to real
  // takes the real part; to bool is value != 0.
  template <class T>
  T item() const;
  const Storage& storage() const noexcept { return storage_; }

  // ---- views (share the storage) ----------------------------------------------------------
  // At most one size may be -1 (inferred). Throws std::invalid_argument if numel differs or
  // the strides do not allow a view ("view size is not compatible ...": use reshape()).
  [[nodiscard]] Tensor view(Dims sizes) const;
  // view() when possible, else a contiguous private copy.
  [[nodiscard]] Tensor reshape(Dims sizes) const;
  // Removes dimension dim, taking index i (negative i counts from the end).
  [[nodiscard]] Tensor select(std::int64_t dim, std::int64_t index) const;
  [[nodiscard]] Tensor operator[](std::int64_t index) const { return select(0, index); }
  // Python slicing start:end:step along dim: negative start/end count from the end, both
  // clamp to [0, size]; step must be > 0. Use kSliceEnd for "to the end".
  static constexpr std::int64_t kSliceEnd = std::numeric_limits<std::int64_t>::max();
  [[nodiscard]] Tensor slice(std::int64_t dim, std::int64_t start, std::int64_t end = kSliceEnd,
                             std::int64_t step = 1) const;
  // Elements [start, start + length) along dim; start may be negative; no clamping. A
  // negative length is std::invalid_argument; a start or length past the end, std::out_of_range.
  [[nodiscard]] Tensor narrow(std::int64_t dim, std::int64_t start, std::int64_t length) const;
  [[nodiscard]] Tensor transpose(std::int64_t dim0, std::int64_t dim1) const;
  // dims must be a permutation of [0, dim()).
  [[nodiscard]] Tensor permute(Dims dims) const;
  // Inserts a size-1 dim at position dim in [-dim()-1, dim()].
  [[nodiscard]] Tensor unsqueeze(std::int64_t dim) const;
  // Removes every size-1 dim / dim `dim` if its size is 1 (else returns an equal view).
  [[nodiscard]] Tensor squeeze() const;
  [[nodiscard]] Tensor squeeze(std::int64_t dim) const;
  // Broadcast view: size-1 dims (and new leading dims) expand with stride 0; -1 keeps a size.
  [[nodiscard]] Tensor expand(Dims sizes) const;
  // 1-d reshape.
  [[nodiscard]] Tensor flatten() const { return reshape({-1}); }

  // ---- copies -----------------------------------------------------------------------------
  // *this if contiguous, else clone().
  [[nodiscard]] Tensor contiguous() const;
  // A contiguous copy in private (non-shared) memory: how data leaves shared memory.
  [[nodiscard]] Tensor clone() const;
  // A contiguous private copy converted to dtype, or *this if dtype() == dtype.
  [[nodiscard]] Tensor to(DType dtype) const;
  // A contiguous copy on `device` (CPU: private memory; CUDA: the device arena), or *this
  // if it is there already. Copies between host and device are synchronous.
  [[nodiscard]] Tensor to(Device device) const;
  [[nodiscard]] Tensor cpu() const { return to(Device::cpu()); }
  [[nodiscard]] Tensor cuda(int index = 0) const { return to(Device::cuda(index)); }

  // ---- in-place (write the bytes; return *this) --------------------------------------------
  // src must broadcast to sizes() (see expand); its values are converted to dtype(). src may
  // overlap *this. Throws std::invalid_argument on shape mismatch. Either may be on a CUDA
  // device: the copy then goes through the driver (synchronous), staged through host
  // memory where it cannot be one contiguous copy; writing a non-contiguous CUDA tensor
  // rewrites every byte its elements span.
  Tensor& copy_(const Tensor& src);
  // value converted to dtype(): to bool is value != 0; to an integer truncates toward zero
  // and saturates (NaN gives 0); to complex has imaginary part 0.
  Tensor& fill_(double value);
  Tensor& fill_(std::complex<double> value);
  // Adds value to every element. Integer dtypes need an integral value (else
  // std::invalid_argument) and wrap around on overflow; bool computes x || value != 0.
  Tensor& add_(double value);
  // The same through a const handle (they write the bytes, not the handle), as libtorch's
  // in-place methods are const.
  const Tensor& copy_(const Tensor& src) const { return const_cast<Tensor*>(this)->copy_(src); }
  const Tensor& fill_(double value) const { return const_cast<Tensor*>(this)->fill_(value); }
  const Tensor& fill_(std::complex<double> value) const {
    return const_cast<Tensor*>(this)->fill_(value);
  }
  const Tensor& add_(double value) const { return const_cast<Tensor*>(this)->add_(value); }

  // fill_, add_, equal, item and to_string work on CUDA tensors through host copies
  // (shmtensor has no device kernels): correct, not fast.

  // ---- comparison and printing -------------------------------------------------------------
  // Same sizes, dtype, device and values (NaN differs from everything). Two undefined
  // tensors are equal; an undefined one equals no defined one.
  bool equal(const Tensor& other) const;
  // Like torch's repr: "tensor([[1., 2.],\n        [3., 4.]], dtype=float32)". Tensors with
  // more than 1000 elements are summarised with "..." (3 items at each edge).
  std::string to_string() const;

  // ---- sharing ----------------------------------------------------------------------------
  bool is_shared() const noexcept { return storage_.is_shared(); }
  // Moves the storage into shared memory in place (Storage::share_memory_): values are kept,
  // every tensor on the storage sees the new pointer. Throws as Storage::share_memory_.
  Tensor& share_memory_();
  const Tensor& share_memory_() const { return const_cast<Tensor*>(this)->share_memory_(); }

 private:
  friend struct internal::TensorAccess;
  Tensor(Storage&& storage, std::int64_t storage_offset, Dims&& sizes, Dims&& strides,
         DType dtype) noexcept
      : storage_(std::move(storage)),
        storage_offset_(storage_offset),
        sizes_(std::move(sizes)),
        strides_(std::move(strides)),
        dtype_(dtype) {}
  // A view on this tensor's storage. The caller guarantees that every element it reaches is
  // reachable from *this; an empty result keeps this tensor's offset, so that the offset of an
  // empty tensor always lies within the storage too.
  Tensor make_view(std::int64_t storage_offset, Dims sizes, Dims strides) const;
  void check_defined(const char* op) const;
  void check_dtype(DType requested, const char* op) const;
  // copy_ when either tensor is on a CUDA device (tensor_device.cc), of a source already
  // broadcast to sizes() and not sharing our storage; numel() > 0.
  Tensor& copy_across_devices(const Tensor& source);
  // The single element (numel must be 1) in the widest type of its kind.
  bool item_bool() const;
  std::int64_t item_int64(std::int64_t min, std::uint64_t max) const;
  double item_double() const;
  std::complex<double> item_complex() const;

  Storage storage_;
  std::int64_t storage_offset_ = 0;
  Dims sizes_;
  Dims strides_;
  DType dtype_ = DType::kFloat32;
};

// Stacks equally-sized tensors of one dtype along a new dimension dim (in [-d-1, d]) into a
// new contiguous private tensor. Throws std::invalid_argument for an empty list or a
// mismatch of sizes or dtypes.
[[nodiscard]] SHMTENSOR_API Tensor stack(const std::vector<Tensor>& tensors, std::int64_t dim = 0);
// The same into `out`, which must already have the stacked sizes (any dtype: values are
// converted; any memory, e.g. empty_shared). Returns out.
SHMTENSOR_API Tensor& stack_into(const std::vector<Tensor>& tensors, Tensor& out,
                                 std::int64_t dim = 0);

SHMTENSOR_API std::ostream& operator<<(std::ostream& os, const Tensor& tensor);

// ---- template definitions -------------------------------------------------------------------

template <class T>
Tensor Tensor::from_vector(std::vector<T> values, Dims sizes) {
  if (sizes.empty()) sizes.push_back(static_cast<std::int64_t>(values.size()));
  Tensor t = empty(std::move(sizes), dtype_of_v<T>);
  if (static_cast<std::size_t>(t.numel()) != values.size()) {
    throw std::invalid_argument("Tensor::from_vector: " + std::to_string(values.size()) +
                                " values do not fill sizes of numel " + std::to_string(t.numel()));
  }
  T* out = t.data_ptr<T>();
  // Element by element: std::vector<bool> has no data().
  for (std::size_t i = 0; i < values.size(); ++i) out[i] = values[i];
  return t;
}

template <class T>
T* Tensor::data_ptr() {
  check_dtype(dtype_of_v<std::remove_cv_t<T>>, "data_ptr");
  return static_cast<T*>(raw_data());
}

template <class T>
T* Tensor::data_ptr() const {
  check_dtype(dtype_of_v<std::remove_cv_t<T>>, "data_ptr");
  return static_cast<T*>(const_cast<void*>(raw_data()));
}

template <class T>
T Tensor::item() const {
  if constexpr (std::is_same_v<T, bool>) {
    return item_bool();
  } else if constexpr (std::is_integral_v<T>) {
    return static_cast<T>(item_int64(static_cast<std::int64_t>(std::numeric_limits<T>::min()),
                                     static_cast<std::uint64_t>(std::numeric_limits<T>::max())));
  } else if constexpr (std::is_same_v<T, Half> || std::is_same_v<T, BFloat16>) {
    return T(static_cast<float>(item_double()));
  } else if constexpr (std::is_floating_point_v<T>) {
    return static_cast<T>(item_double());
  } else {
    static_assert(std::is_same_v<T, std::complex<float>> || std::is_same_v<T, std::complex<double>>,
                  "item<T>: T must be an element type");
    return T(item_complex());
  }
}

}  // namespace shmtensor
