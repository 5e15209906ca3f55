// Exceptions thrown by shmtensor.
//
// catch (const shmtensor::Error&) catches every failure the library reports about its own
// operations: a system call that failed (SystemError: errno, the call, what we were
// doing), shared memory that ran out (SharedMemoryFullError), bytes or descriptors from
// another process that do not hold together (ProtocolError), a peer that is gone
// (ConnectionClosed, QueueClosed), CUDA that cannot be used (CudaError), a child or worker
// that failed (ProcessException,
// TaskError, DataLoaderError and their subclasses), and misused process control
// (Process::start() twice, Process::join() before start(), spawn() with nprocs < 1, a Pool
// of -1 processes, Pool::join() before close(), a task submitted after close()).
//
// Two kinds of exception are not Error, as in the standard library and libtorch:
//  - A violated precondition of a call, a programmer error, is std::invalid_argument or
//    std::out_of_range. No class is both (one deriving from std::invalid_argument and Error
//    would have two std::exception bases, and catch (const std::exception&) would miss it).
//    These are exactly:
//      Tensor (tensor.h): a negative size or sizes whose bytes overflow int64, a shape that
//        does not fit (view, reshape, expand, copy_, from_vector, stack, stack_into), a
//        wrong dtype for data_ptr<T>, a non-integral add_ to an integer tensor, item() of
//        a tensor with numel() != 1, an undefined tensor where elements are needed, a
//        negative or repeated dim, a slice step <= 0, a negative narrow() length,
//        from_storage() arguments that do not describe a view inside the storage:
//        std::invalid_argument. A dim or index out of
//        range, an item<T>() value that T cannot hold, stride or offset arithmetic that
//        overflows: std::out_of_range.
//      DType (dtype.h): a value outside the enum, an unknown name: std::invalid_argument.
//      set_sharing_strategy (sharing_strategy.h): a value outside the enum, an unknown
//        name: std::invalid_argument.
//      DefaultCollate (collate.h): samples that do not collate (an empty batch, an
//        undefined tensor, different dtypes, sizes, lengths or keys): std::invalid_argument.
//      DataLoader (data_loader.h): invalid options (the constructor): std::invalid_argument;
//        a Sampler or BatchSampler index outside the dataset (begin()): std::out_of_range.
//      random_permutation (sampler.h): n < 0: std::invalid_argument.
//      Pool (pool.h): chunksize 0: std::invalid_argument.
//      Queue (queue.h): a maxsize above 2^31 - 1: std::invalid_argument.
//      The libtorch bridge (torch.h, optional): an undefined Tensor or Storage for
//        to_torch, a torch tensor or storage shmtensor cannot hold (not on the CPU, not
//        strided, a dtype shmtensor lacks), an allocate function of share_memory_ that
//        returns no shared Storage of the size asked: std::invalid_argument.
//  - Memory that cannot be allocated in this process is std::bad_alloc.
//
// What user code throws when the library calls it passes through unchanged in the calling
// process (a dataset's get() with num_workers = 0, a collate_fn); in a worker or child it is
// reported as text in an Error (DataLoaderWorkerError, TaskError, ProcessRaisedException),
// whatever its type, a programmer error included.
#pragma once

#include <stdexcept>
#include <string>

#include "shmtensor/export.h"

namespace shmtensor {

// Base of every failure the library reports about its own operations (see above).
class SHMTENSOR_API Error : public std::runtime_error {
 public:
  explicit Error(const std::string& what) : std::runtime_error(what) {}
};

// A system call failed. what() reads "<syscall>(<context>): <strerror> — <advice>".
class SHMTENSOR_API SystemError : public Error {
 public:
  SystemError(int err, std::string syscall, const std::string& context,
              const std::string& advice = {});
  int error_code() const noexcept { return errno_; }
  const std::string& syscall() const noexcept { return syscall_; }

 private:
  int errno_;
  std::string syscall_;
};

// Not enough room in /dev/shm (file_system strategy) or in memory for a segment.
// what() names the requested size, the free space and the fix.
class SHMTENSOR_API SharedMemoryFullError : public Error {
 public:
  SharedMemoryFullError(const std::string& what, std::size_t requested, std::size_t available)
      : Error(what), requested_(requested), available_(available) {}
  std::size_t requested() const noexcept { return requested_; }
  std::size_t available() const noexcept { return available_; }

 private:
  std::size_t requested_;
  std::size_t available_;
};

// Bytes or descriptors that came from another process (a segment header, a message, a
// cmsg) are malformed or inconsistent. The data is rejected; nothing was mapped or kept.
class SHMTENSOR_API ProtocolError : public Error {
 public:
  explicit ProtocolError(const std::string& what) : Error(what) {}
};

// The CUDA driver is missing, refused a call, or cannot be used in this process (a child
// forked after its parent used CUDA). what() names the driver call and the driver's error,
// and says what to do; result() is the driver's CUresult (0 when no call failed).
class SHMTENSOR_API CudaError : public Error {
 public:
  CudaError(const std::string& what, int result = 0) : Error(what), result_(result) {}
  int result() const noexcept { return result_; }

 private:
  int result_;
};

// The job's configuration, given in options or in environment variables, is invalid or
// incomplete. what() names the option or variable, its value and what to set.
class SHMTENSOR_API ConfigurationError : public Error {
 public:
  explicit ConfigurationError(const std::string& what) : Error(what) {}
};

// A named channel (Queue<T>::create) of this name exists already for this user (Python:
// also a FileExistsError).
class SHMTENSOR_API NameExists : public Error {
 public:
  explicit NameExists(const std::string& what) : Error(what) {}
};

// No named channel of this name exists for this user (Queue<T>::open; Python: also a
// FileNotFoundError).
class SHMTENSOR_API NameNotFound : public Error {
 public:
  explicit NameNotFound(const std::string& what) : Error(what) {}
};

}  // namespace shmtensor
