// C++ exceptions become Python exceptions with the same message (str(e) == what()). The
// classes derive from shmtensor.Error (a RuntimeError) and from the built-in a Python user
// would catch for the same failure: MemoryError for a full /dev/shm, OSError (errno set)
// for a failed system call (and MemoryError too when it failed for want of memory, ENOMEM,
// as NumPy raises MemoryError for an array too large to allocate), ValueError for bad input
// from a peer or a bad configuration, EOFError for a connection whose peer closed,
// ValueError for a queue closed (as multiprocessing raises for a closed Queue). CUDA that
// cannot be used (no driver, a failed driver call, a forked child) is CudaError, an Error
// only, as torch raises RuntimeError for the same.
#include <cerrno>
#include <cstring>
#include <stdexcept>
#include <string>

#include "bindings.h"
#include "shmtensor/broadcast.h"
#include "shmtensor/connection.h"
#include "shmtensor/error.h"
#include "shmtensor/queue.h"

namespace py = pybind11;

namespace shmtensor::python {

namespace {

// Classes made with PyErr_NewException: multiple bases need a tuple, which
// py::exception<> cannot take. Owned by the module (kept alive by its attributes).
PyObject* g_error = nullptr;
PyObject* g_full = nullptr;
PyObject* g_system = nullptr;
PyObject* g_out_of_memory = nullptr;
PyObject* g_protocol = nullptr;
PyObject* g_configuration = nullptr;
PyObject* g_connection_closed = nullptr;
PyObject* g_queue_closed = nullptr;
PyObject* g_broadcast_timeout = nullptr;
PyObject* g_name_exists = nullptr;
PyObject* g_name_not_found = nullptr;
PyObject* g_cuda = nullptr;

PyObject* new_class(py::module_& m, const char* name, py::tuple bases, const char* doc) {
  std::string qualified = std::string("shmtensor.") + name;
  // str(e) is the C++ what() (args[0]), also for the OSError subclass, whose own __str__
  // would print "[Errno N] strerror" once errno is set.
  py::dict members;
  members["__str__"] = py::module_::import("builtins").attr("BaseException").attr("__str__");
  PyObject* cls =
      PyErr_NewExceptionWithDoc(qualified.c_str(), doc, bases.ptr(), members.ptr());
  if (cls == nullptr) throw py::error_already_set();
  m.add_object(name, py::handle(cls));  // steals nothing: add_object increfs
  return cls;
}

// Raises an instance of cls built from (what), then sets the given attributes on it.
void raise(PyObject* cls, const char* what, const py::dict& attrs = py::dict()) {
  py::object exc = py::reinterpret_steal<py::object>(PyObject_CallFunction(cls, "s", what));
  if (!exc) return;  // the constructor raised: that error stands
  for (auto item : attrs) {
    if (PyObject_SetAttr(exc.ptr(), item.first.ptr(), item.second.ptr()) != 0) return;
  }
  PyErr_SetObject(cls, exc.ptr());
}

}  // namespace

void bind_errors(py::module_& m) {
  py::object runtime = py::reinterpret_borrow<py::object>(PyExc_RuntimeError);
  g_error = new_class(m, "Error", py::make_tuple(runtime),
                      "Base of every exception shmtensor raises on purpose (C++ shmtensor::Error).");
  py::object error = py::reinterpret_borrow<py::object>(g_error);
  g_full = new_class(
      m, "SharedMemoryFullError",
      py::make_tuple(error, py::reinterpret_borrow<py::object>(PyExc_MemoryError)),
      "Not enough room in /dev/shm (file_system strategy) or in memory for a segment. "
      "Attributes: requested, available (bytes).");
  g_system = new_class(
      m, "SystemCallError",
      py::make_tuple(error, py::reinterpret_borrow<py::object>(PyExc_OSError)),
      "A system call failed (C++ shmtensor::SystemError; Python's own SystemError means an "
      "interpreter bug, hence the other name). errno and strerror as in OSError; syscall "
      "names the call.");
  g_out_of_memory = new_class(
      m, "OutOfMemoryError",
      py::make_tuple(py::reinterpret_borrow<py::object>(g_system),
                     py::reinterpret_borrow<py::object>(PyExc_MemoryError)),
      "A system call failed with ENOMEM (an mmap too large for the address space, "
      "vm.max_map_count reached, memory exhausted): a SystemCallError that is also a "
      "MemoryError.");
  g_protocol = new_class(
      m, "ProtocolError",
      py::make_tuple(error, py::reinterpret_borrow<py::object>(PyExc_ValueError)),
      "Bytes or descriptors from another process are malformed; nothing was kept.");
  g_configuration = new_class(
      m, "ConfigurationError",
      py::make_tuple(error, py::reinterpret_borrow<py::object>(PyExc_ValueError)),
      "The job's configuration (options, environment variables) is invalid.");
  g_connection_closed = new_class(
      m, "ConnectionClosed",
      py::make_tuple(error, py::reinterpret_borrow<py::object>(PyExc_EOFError)),
      "A connection's peer closed (or exited), and everything it sent was received; an "
      "EOFError, as multiprocessing's Connection raises.");
  g_queue_closed = new_class(
      m, "QueueClosed",
      py::make_tuple(error, py::reinterpret_borrow<py::object>(PyExc_ValueError)),
      "A put on a closed queue, or a get on one closed and drained; a ValueError, as "
      "multiprocessing raises for a closed Queue.");

  g_broadcast_timeout = new_class(
      m, "BroadcastTimeout",
      py::make_tuple(error, py::reinterpret_borrow<py::object>(PyExc_TimeoutError)),
      "Broadcast.put timed out waiting for a reader: `reader` (its index), `pid` (0: no "
      "process attached as it yet), `behind` (messages it has not taken) and `delivered` (the "
      "readers that got the message: empty unless a queue that had room took no copy). A "
      "TimeoutError.");
  g_name_exists = new_class(
      m, "NameExistsError",
      py::make_tuple(error, py::reinterpret_borrow<py::object>(PyExc_FileExistsError)),
      "A named Queue of this name exists already for this user (C++ shmtensor::NameExists); "
      "a FileExistsError.");
  g_name_not_found = new_class(
      m, "NameNotFoundError",
      py::make_tuple(error, py::reinterpret_borrow<py::object>(PyExc_FileNotFoundError)),
      "No named Queue of this name exists for this user (C++ shmtensor::NameNotFound); a "
      "FileNotFoundError.");

  g_cuda = new_class(
      m, "CudaError", py::make_tuple(error),
      "CUDA cannot be used for this: no driver, a driver call that failed (result is its "
      "CUresult, 0 when no call failed), a device this process does not see, or CUDA in a "
      "process forked after CUDA was used (start it with 'spawn' or 'forkserver').");

  // Translators run newest first; subclasses are caught before their bases within one.
  // A translator registered later (bind_transport's, for its own types) runs before this.
  py::register_exception_translator([](std::exception_ptr p) {
    try {
      if (p) std::rethrow_exception(p);
    } catch (const SharedMemoryFullError& e) {
      py::dict attrs;
      attrs["requested"] = py::int_(e.requested());
      attrs["available"] = py::int_(e.available());
      raise(g_full, e.what(), attrs);
    } catch (const SystemError& e) {
      py::dict attrs;
      attrs["errno"] = py::int_(e.error_code());
      attrs["strerror"] = py::str(std::strerror(e.error_code()));
      attrs["syscall"] = py::str(e.syscall());
      raise(e.error_code() == ENOMEM ? g_out_of_memory : g_system, e.what(), attrs);
    } catch (const ProtocolError& e) {
      raise(g_protocol, e.what());
    } catch (const ConfigurationError& e) {
      raise(g_configuration, e.what());
    } catch (const ConnectionClosed& e) {
      raise(g_connection_closed, e.what());
    } catch (const QueueClosed& e) {
      raise(g_queue_closed, e.what());
    } catch (const BroadcastTimeout& e) {
      py::dict attrs;
      attrs["reader"] = py::int_(e.reader());
      attrs["pid"] = py::int_(e.pid());
      attrs["behind"] = py::int_(e.behind());
      py::list delivered;
      for (int r : e.delivered()) delivered.append(py::int_(r));
      attrs["delivered"] = delivered;
      raise(g_broadcast_timeout, e.what(), attrs);
    } catch (const NameExists& e) {
      raise(g_name_exists, e.what());
    } catch (const NameNotFound& e) {
      raise(g_name_not_found, e.what());
    } catch (const CudaError& e) {
      py::dict attrs;
      attrs["result"] = py::int_(e.result());
      raise(g_cuda, e.what(), attrs);
    } catch (const Error& e) {
      raise(g_error, e.what());
    } catch (const std::out_of_range& e) {
      PyErr_SetString(PyExc_IndexError, e.what());
    } catch (const std::invalid_argument& e) {
      PyErr_SetString(PyExc_ValueError, e.what());
    }
  });
}

}  // namespace shmtensor::python
