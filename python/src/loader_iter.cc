// One __next__ of shmtensor's DataLoader iterator (shmtensor/_loader.py) in the plain case, in
// one call: torch's _MultiProcessingDataLoaderIter._next_data for a map-style dataset or an
// IterableDataset (a worker's _IterableDatasetStopIteration included), in order or not
// (in_order=False: a batch returned as it comes), through shmtensor's native Queues. It reads
// and writes the attributes torch's _next_data, _process_data and _try_put_index keep
// (_rcvd_idx, _send_idx, _task_info, _tasks_outstanding, _workers_num_tasks on torch 2.x,
// _num_yielded) where torch keeps them, so they stay what torch's other code reads. A batch that
// arrives out of order is kept in _task_info as torch keeps it, and returned from there at its
// turn. Whatever else is not the plain case returns the handover object, having changed nothing
// since the last batch kept, and the caller runs torch's _next_data for the step: the end of the
// epoch, a worker no longer active, a closed queue. A failed get of the data queue (its wait
// reaching torch's MP_STATUS_CHECK_INTERVAL, an error, a signal handler's exception) goes to the
// iterator's _get_failed, which runs torch's _try_get_data on it (the dead-worker check and its
// RuntimeError). With the loader's `timeout`, one get waits that long, and a queue.Empty from it
// is torch's "DataLoader timed out after T seconds" once _try_get_data found every worker alive,
// as torch's _get_data does.
//
// The data queue's item is taken in C++ (native_queue_get) and a tensor message decoded from
// its storages (messages.cc), without Python objects for the blocks; the next task goes on
// its worker's index board ("Index boards" below).
// Raw CPython calls, not pybind11's, keep the path short; attribute names are interned once.
#include <Python.h>
#include <pybind11/pybind11.h>

#include <algorithm>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <exception>
#include <string>
#include <vector>

#include "bindings.h"
#include "shmtensor/error.h"
#include "shmtensor/internal/task_board.h"

namespace py = pybind11;

namespace shmtensor::python {
namespace {

// References kept for the life of the process (never released: the module is never unloaded,
// and releasing at exit would run Python code after the interpreter is gone).
struct Names {
  PyObject* rcvd_idx;
  PyObject* send_idx;
  PyObject* task_info;
  PyObject* workers_status;
  PyObject* shutdown;
  PyObject* tasks_outstanding;
  PyObject* data_queue;
  PyObject* native;  // a shmtensor Queue's native queue, None once closed
  PyObject* deferred;
  PyObject* dict;
  PyObject* prefetch_factor;
  PyObject* num_workers;
  PyObject* sampler_iter;
  PyObject* worker_cycle;
  PyObject* index_queues;
  PyObject* workers_num_tasks;
  PyObject* num_yielded;
  PyObject* get;
  PyObject* put;
  PyObject* try_put_index;
  PyObject* reraise;
  PyObject* get_failed;
  PyObject* loads;
  PyObject* board;  // a _BoardQueue's writer, and its shmtensor Queue
  PyObject* queue;
  PyObject* timeout;
  PyObject* iterable_step;  // set by _loader.py's _reset: an IterableDataset's loader
  PyObject* worker_id;
  PyObject* persistent_workers;
  PyObject* mark_unavailable;
  PyObject* in_order;
};

struct Setup {
  PyObject* handover = nullptr;           // what loader_next returns to hand a step over
  PyObject* exception_wrapper = nullptr;  // torch's ExceptionWrapper
  PyObject* empty = nullptr;              // queue.Empty
  PyObject* reductions = nullptr;         // shmtensor.multiprocessing.reductions
  PyObject* board_queue = nullptr;        // shmtensor._loader._BoardQueue, the type
  PyObject* iterable_stop = nullptr;      // torch's _IterableDatasetStopIteration
  double interval = 0;                    // torch's MP_STATUS_CHECK_INTERVAL, seconds
  bool ready = false;
  PyObject* rethrow = nullptr;  // _loader_rethrow: a C++ exception made the Python error
};

Names names;
Setup setup;
std::uint64_t batches_taken = 0;
std::exception_ptr pending;  // for _loader_rethrow

// The exception being handled as the Python error (pybind11's translators, through a call of
// _loader_rethrow); returns -1 for `return` chains.
int set_error_from_current() {
  pending = std::current_exception();
  PyObject* r = PyObject_CallNoArgs(setup.rethrow);
  Py_XDECREF(r);
  return -1;
}

// One native wait: a signal's Python handler runs between two (the wait sleeps in C++).
constexpr double kSliceSeconds = 0.1;

PyObject* intern(const char* s) {
  PyObject* o = PyUnicode_InternFromString(s);
  if (o == nullptr) throw py::error_already_set();
  return o;
}

// A new reference held for the scope.
class Ref {
 public:
  Ref() = default;
  explicit Ref(PyObject* o) : o_(o) {}
  Ref(const Ref&) = delete;
  Ref& operator=(const Ref&) = delete;
  Ref& operator=(PyObject* o) {
    Py_XDECREF(o_);
    o_ = o;
    return *this;
  }
  ~Ref() { Py_XDECREF(o_); }
  PyObject* get() const { return o_; }
  PyObject* release() {
    PyObject* o = o_;
    o_ = nullptr;
    return o;
  }
  explicit operator bool() const { return o_ != nullptr; }

 private:
  PyObject* o_ = nullptr;
};

// Py_NewRef (Python 3.10 and later; the package supports 3.9).
PyObject* new_ref(PyObject* o) {
  Py_INCREF(o);
  return o;
}

PyObject* handover() {
  Py_INCREF(setup.handover);
  return setup.handover;
}

// The iterator, and its instance dict: torch's attributes are plain instance attributes,
// read and written there (what getattr and setattr would find and do, without their lookups
// in the class).
struct Iter {
  PyObject* self;
  PyObject* dict;
};

// The iterator's attribute `name` (a new reference; nullptr with an error set).
PyObject* attr(const Iter& it, PyObject* name) {
  PyObject* v = PyDict_GetItemWithError(it.dict, name);
  if (v != nullptr) return new_ref(v);
  if (PyErr_Occurred()) return nullptr;
  return PyObject_GetAttr(it.self, name);
}

// The iterator's attribute `name` if it has one in its dict (a new reference), else nullptr
// (an error set only if the lookup failed).
PyObject* optional_attr(const Iter& it, PyObject* name) {
  PyObject* v = PyDict_GetItemWithError(it.dict, name);
  return v != nullptr ? new_ref(v) : nullptr;
}

// An attribute that is an exact int fitting in int64; false (no error set) when it is not.
bool int_attr(const Iter& it, PyObject* name, std::int64_t& out, bool& error) {
  Ref v(attr(it, name));
  if (!v) {
    error = true;
    return false;
  }
  if (!PyLong_CheckExact(v.get())) return false;
  int overflow = 0;
  out = PyLong_AsLongLongAndOverflow(v.get(), &overflow);
  return overflow == 0;
}

int set_int(const Iter& it, PyObject* name, std::int64_t v) {
  Ref n(PyLong_FromLongLong(v));
  if (!n) return -1;
  return PyDict_SetItem(it.dict, name, n.get());
}

// list[i] += delta for a list of exact ints (torch 2.x's _workers_num_tasks).
int add_to_item(PyObject* list, Py_ssize_t i, long delta) {
  Ref old(PySequence_GetItem(list, i));
  if (!old) return -1;
  Ref d(PyLong_FromLong(delta));
  if (!d) return -1;
  Ref sum(PyNumber_Add(old.get(), d.get()));
  if (!sum) return -1;
  return PySequence_SetItem(list, i, sum.get());
}

// ---- Index boards: torch's tasks on a worker's task board ---------------------------------

// A worker of shmtensor's iterator takes its tasks from a task board
// (shmtensor/internal/task_board.h) that the main process made for it, not as index
// messages: _BoardQueue (shmtensor/_loader.py) is the main process's side of a worker's index
// queue, and _BoardIndexQueue the worker's. A task (send_idx, index) whose index is an int
// (kEntryScalar) or a list of ints (what torch's samplers and BatchSampler yield) that fits
// an entry goes on the board, as does an IterableDataset's None or list of Nones
// (kEntryNone); anything else (a longer batch, another index, torch's None and
// _ResumeIteration) goes through the index queue as (entries posted before it, object), and
// the board counts it (announce_message), so the worker takes everything in the order sent.
// A worker asleep in its index queue's get is woken by kWake, a message of its own.

// What wakes a worker asleep in its index queue: not a pickle (which starts with PROTO) nor
// a tensor message ("STM2").
constexpr char kWake[] = "STWK";

// An exact int that fits in int64 (no error set when it is not).
bool exact_int(PyObject* o, std::int64_t& v) {
  if (!PyLong_CheckExact(o)) return false;
  int overflow = 0;
  v = PyLong_AsLongLongAndOverflow(o, &overflow);
  return overflow == 0 && !(v == -1 && PyErr_Occurred());
}

internal::TaskBoardShape board_shape(std::uint32_t slots, std::uint32_t index_words) {
  if (slots < 1 || index_words < 1 || index_words > internal::kMaxEntryIndices)
    throw py::value_error("an index board has 1 or more slots of 1 to " +
                          std::to_string(internal::kMaxEntryIndices) + " indices");
  return {slots, index_words};
}

// Worker `worker`'s board of the boards `memory` holds (_make_index_boards).
Tensor board_of(const Tensor& memory, std::int64_t worker, internal::TaskBoardShape shape) {
  const std::int64_t words = internal::task_board_words(shape);
  if (memory.dim() != 1 || worker < 0 || (worker + 1) * words > memory.numel())
    throw ProtocolError("the index boards hold no board for worker " + std::to_string(worker));
  return memory.narrow(0, worker * words, words);
}

class IndexBoardWriter {
 public:
  IndexBoardWriter(const Tensor& memory, std::int64_t worker, std::uint32_t slots,
                   std::uint32_t index_words)
      : IndexBoardWriter(memory, worker, board_shape(slots, index_words)) {}
  IndexBoardWriter(const Tensor& memory, std::int64_t worker, internal::TaskBoardShape shape)
      : w_(board_of(memory, worker, shape), shape) {}
  // The task on the board, the worker woken through `native` (its index queue's native
  // queue) if it sleeps; false when it does not fit or the board has no room (the caller
  // sends it as a message then).
  bool put(PyObject* task, PyObject* index, PyObject* native) {
    std::int64_t id = 0, v = 0;
    if (!exact_int(task, id) || id < 0 || !w_.has_room()) return false;
    indices_.clear();
    std::uint32_t flags = 0, nones = 0;
    if (index == Py_None) {
      flags = internal::kEntryScalar | internal::kEntryNone;
      nones = 1;
    } else if (exact_int(index, v)) {
      flags = internal::kEntryScalar;
      indices_.push_back(v);
    } else if (PyList_CheckExact(index)) {
      const Py_ssize_t n = PyList_GET_SIZE(index);
      if (n > static_cast<Py_ssize_t>(w_.index_words())) return false;
      // Ints, or (an IterableDataset's batch) Nones only.
      if (n > 0 && PyList_GET_ITEM(index, 0) == Py_None) {
        for (Py_ssize_t i = 0; i < n; ++i)
          if (PyList_GET_ITEM(index, i) != Py_None) return false;
        flags = internal::kEntryNone;
        nones = static_cast<std::uint32_t>(n);
      } else {
        for (Py_ssize_t i = 0; i < n; ++i) {
          if (!exact_int(PyList_GET_ITEM(index, i), v)) return false;
          indices_.push_back(v);
        }
      }
    } else {
      return false;
    }
    w_.post(static_cast<std::uint64_t>(id), false, indices_, flags, nones);
    if (w_.publish()) wake(native);
    return true;
  }
  // After a task was sent as a message: counted, the worker woken if it sleeps.
  void announce(PyObject* native) {
    if (w_.announce_message()) wake(native);
  }
  std::uint64_t posted() const { return w_.posted(); }
  std::uint64_t messages() const { return w_.messages(); }

 private:
  // Without waiting: a queue too full to take it holds items that keep the worker awake.
  // A wake-up that fails (a closed or broken queue) is dropped: the task is on the board,
  // and a worker not woken takes it when its get's timeout passes (torch's loop gets again).
  static void wake(PyObject* native) {
    try {
      native_queue_try_put(native, std::string(kWake, 4));
    } catch (...) {
    }
  }

  internal::TaskBoardWriter w_;
  std::vector<std::int64_t> indices_;
};

class IndexBoardReader {
 public:
  IndexBoardReader(const Tensor& memory, std::int64_t worker, std::uint32_t slots,
                   std::uint32_t index_words)
      : IndexBoardReader(memory, worker, board_shape(slots, index_words)) {}
  IndexBoardReader(const Tensor& memory, std::int64_t worker, internal::TaskBoardShape shape)
      : r_(board_of(memory, worker, shape), shape) {}
  // The next task, (id, index); `due` when a task sent as a message must be received first
  // (the main process counted more than this worker received); None when there is none.
  py::object take(py::handle due) {
    // `published` before `messages`: a message counted before an entry was published is
    // seen with the entry.
    const bool ready = r_.ready();
    if (r_.messages() > received_) return py::reinterpret_borrow<py::object>(due);
    if (!ready) return py::none();
    const internal::TaskBoardReader::Taken t = r_.take(indices_);
    if (t.reset || t.in_message)
      throw ProtocolError("an index board entry with flags the main process does not write");
    py::object index;
    if (t.none && t.scalar) {
      index = py::none();
    } else if (t.none) {
      py::list list(t.count);
      for (std::uint32_t i = 0; i < t.count; ++i) list[i] = py::none();
      index = std::move(list);
    } else if (t.scalar) {
      index = py::int_(indices_[0]);
    } else {
      py::list list(indices_.size());
      for (std::size_t i = 0; i < indices_.size(); ++i) list[i] = py::int_(indices_[i]);
      index = std::move(list);
    }
    return py::make_tuple(py::int_(t.id), std::move(index));
  }
  std::uint64_t taken() const { return r_.taken(); }
  void received() { ++received_; }
  bool about_to_sleep() { return r_.about_to_sleep(); }
  void woke() { r_.woke(); }

 private:
  internal::TaskBoardReader r_;
  std::vector<std::int64_t> indices_;
  std::uint64_t received_ = 0;
};

// index_queue.put((task, index)): on the worker's board when the queue is a _BoardQueue
// and the task fits an entry (the worker woken if it sleeps), else the queue's own put.
int put_task(PyObject* index_queue, std::int64_t task, PyObject* index) {
  Ref t(PyLong_FromLongLong(task));
  if (!t) return -1;
  if (Py_TYPE(index_queue) == reinterpret_cast<PyTypeObject*>(setup.board_queue)) {
    Ref board(PyObject_GetAttr(index_queue, names.board));
    if (!board) return -1;
    Ref queue(PyObject_GetAttr(index_queue, names.queue));
    if (!queue) return -1;
    Ref native(PyObject_GetAttr(queue.get(), names.native));
    if (!native) return -1;
    if (native.get() != Py_None) {
      try {
        if (py::cast<IndexBoardWriter&>(py::handle(board.get())).put(t.get(), index, native.get()))
          return 0;
      } catch (...) {
        return set_error_from_current();
      }
    }
  }
  Ref message(PyTuple_Pack(2, t.get(), index));
  if (!message) return -1;
  Ref r(PyObject_CallMethodOneArg(index_queue, names.put, message.get()));
  return r ? 0 : -1;
}

// torch's _try_put_index (in order: the next active worker of torch's cycle, every worker's
// status read as torch reads it; in_order=False: torch's method itself). -1 with an error set.
int try_put_index(const Iter& it, bool num_tasks) {
  {
    // in_order=False (torch 2.6's): torch's own, which gives the task to a worker with room
    // (fewer tasks than its share) rather than to the next in the cycle.
    Ref in_order(optional_attr(it, names.in_order));
    if (!in_order && PyErr_Occurred()) return -1;
    if (in_order.get() == Py_False) {
      Ref r(PyObject_CallMethodNoArgs(it.self, names.try_put_index));
      return r ? 0 : -1;
    }
  }
  bool error = false;
  std::int64_t outstanding = 0, prefetch = 0, workers = 0, send = 0;
  if (!int_attr(it, names.tasks_outstanding, outstanding, error) ||
      !int_attr(it, names.prefetch_factor, prefetch, error) ||
      !int_attr(it, names.num_workers, workers, error) ||
      !int_attr(it, names.send_idx, send, error) || outstanding >= prefetch * workers) {
    if (error) return -1;
    Ref r(PyObject_CallMethodNoArgs(it.self, names.try_put_index));  // torch's, and its assertion
    return r ? 0 : -1;
  }
  Ref sampler(attr(it, names.sampler_iter));
  if (!sampler) return -1;
  Ref index(PyIter_Next(sampler.get()));
  if (!index) return PyErr_Occurred() ? -1 : 0;  // the sampler's end: nothing to send
  Ref cycle(attr(it, names.worker_cycle));
  if (!cycle) return -1;
  Ref status(attr(it, names.workers_status));
  if (!status) return -1;
  Ref worker;
  bool found = false;
  for (std::int64_t i = 0; i < workers && !found; ++i) {
    worker = PyIter_Next(cycle.get());
    if (!worker) return PyErr_Occurred() ? -1 : 0;
    Ref active(PyObject_GetItem(status.get(), worker.get()));
    if (!active) return -1;
    const int truth = PyObject_IsTrue(active.get());
    if (truth < 0) return -1;
    found = truth == 1;
  }
  if (!found) return 0;
  Ref queues(attr(it, names.index_queues));
  if (!queues) return -1;
  Ref queue(PyObject_GetItem(queues.get(), worker.get()));
  if (!queue) return -1;
  if (put_task(queue.get(), send, index.get()) != 0) return -1;
  Ref info(PyTuple_Pack(1, worker.get()));
  if (!info) return -1;
  Ref task(PyLong_FromLongLong(send));
  if (!task) return -1;
  Ref task_info(attr(it, names.task_info));
  if (!task_info) return -1;
  if (PyObject_SetItem(task_info.get(), task.get(), info.get()) != 0) return -1;
  if (num_tasks) {
    Ref counts(attr(it, names.workers_num_tasks));
    if (!counts) return -1;
    const Py_ssize_t w = PyLong_AsSsize_t(worker.get());
    if (w == -1 && PyErr_Occurred()) return -1;
    if (add_to_item(counts.get(), w, 1) != 0) return -1;
  }
  if (set_int(it, names.tasks_outstanding, outstanding + 1) != 0) return -1;
  return set_int(it, names.send_idx, send + 1);
}

// ---- The data queue ------------------------------------------------------------------------

// The error now set, as an exception instance (its traceback attached); the error is cleared.
PyObject* take_error() {
#if PY_VERSION_HEX >= 0x030C0000
  return PyErr_GetRaisedException();
#else
  PyObject *type = nullptr, *value = nullptr, *tb = nullptr;
  PyErr_Fetch(&type, &value, &tb);
  PyErr_NormalizeException(&type, &value, &tb);
  if (tb != nullptr && value != nullptr) PyException_SetTraceback(value, tb);
  Py_XDECREF(type);
  Py_XDECREF(tb);
  return value;
#endif
}

// What the data queue's get(timeout=seconds) returns, decoded as the shmtensor Queue's get
// decodes it; nullptr with an error set when the get failed (queue.Empty once `seconds`
// passed).
PyObject* get_once(PyObject* native, double seconds) {
  const auto deadline = std::chrono::steady_clock::now() +
                        std::chrono::duration<double>(seconds);
  std::string data;
  std::vector<Storage> storages;
  for (bool first = true;; first = false) {
    const double left =
        std::chrono::duration<double>(deadline - std::chrono::steady_clock::now()).count();
    if (left <= 0 && !first) {  // (an item already there is taken however short the wait)
      PyErr_SetNone(setup.empty);
      return nullptr;
    }
    try {
      if (native_queue_get(native, std::clamp(left, 0.0, kSliceSeconds), data, storages)) break;
    } catch (...) {
      set_error_from_current();
      return nullptr;
    }
    if (PyErr_CheckSignals() != 0) return nullptr;
  }
  if (message_decodable_here(data.data(), data.size()))
    return decode_message_of_storages(data.data(), data.size(), storages.data(), storages.size());
  py::tuple item;
  try {
    item = native_item_to_python(std::move(data), std::move(storages));
  } catch (...) {
    set_error_from_current();
    return nullptr;
  }
  PyObject* bytes = PyTuple_GET_ITEM(item.ptr(), 0);
  PyObject* blocks = PyTuple_GET_ITEM(item.ptr(), 1);
  Ref loads(PyObject_GetAttr(setup.reductions, names.loads));
  if (!loads) return nullptr;
  return PyObject_CallFunctionObjArgs(loads.get(), bytes, blocks, nullptr);
}

// torch's _get_data without a pin_memory thread: the data queue's get, a failed one handed
// to _get_failed (torch's _try_get_data: a dead worker's RuntimeError, the error itself, or
// (False, None) for queue.Empty), repeated until it gives; with the loader's timeout, one get
// of that long, then torch's RuntimeError.
PyObject* get_data(const Iter& it, PyObject* native) {
  Ref timeout(attr(it, names.timeout));
  if (!timeout) return nullptr;
  const double limit = PyFloat_AsDouble(timeout.get());
  if (limit == -1.0 && PyErr_Occurred()) return nullptr;
  while (true) {
    PyObject* got = get_once(native, limit > 0 ? limit : setup.interval);
    if (got != nullptr) return got;
    if (!PyErr_ExceptionMatches(PyExc_Exception)) return nullptr;  // torch lets these through
    Ref error(take_error());
    Ref r(PyObject_CallMethodOneArg(it.self, names.get_failed, error.get()));
    if (!r) return nullptr;
    if (limit > 0) {
      Ref shown(PyObject_Str(timeout.get()));
      if (!shown) return nullptr;
      PyErr_Format(PyExc_RuntimeError, "DataLoader timed out after %U seconds", shown.get());
      return nullptr;
    }
  }
}

// ---- One __next__ --------------------------------------------------------------------------

// The end of a step with a batch for task `task` (its _task_info entry taken out): torch's
// _process_data (torch 2.x: the worker's count of tasks, from `info`), then __next__'s count;
// the batch of _rcvd_idx unless `advance` is false (in_order=False: a later one, returned as
// it came).
PyObject* process_data(const Iter& it, std::int64_t rcvd, PyObject* info, PyObject* data,
                       bool advance = true) {
  if (advance && set_int(it, names.rcvd_idx, rcvd + 1) != 0) return nullptr;
  Ref counts(optional_attr(it, names.workers_num_tasks));  // torch 2.x's
  const bool num_tasks = static_cast<bool>(counts);
  if (!num_tasks) {
    if (PyErr_Occurred()) return nullptr;
  } else {
    if (!PyTuple_Check(info) || PyTuple_GET_SIZE(info) < 1) {
      PyErr_SetString(PyExc_TypeError, "DataLoader iterator: a _task_info entry is not a tuple");
      return nullptr;
    }
    const Py_ssize_t w = PyLong_AsSsize_t(PyTuple_GET_ITEM(info, 0));
    if (w == -1 && PyErr_Occurred()) return nullptr;
    if (add_to_item(counts.get(), w, -1) != 0) return nullptr;
  }
  if (try_put_index(it, num_tasks) != 0) return nullptr;
  const int wrapped = PyObject_IsInstance(data, setup.exception_wrapper);
  if (wrapped < 0) return nullptr;
  if (wrapped == 1) {
    Ref r(PyObject_CallMethodNoArgs(data, names.reraise));
    if (!r) return nullptr;
  }
  bool error = false;
  std::int64_t yielded = 0;
  if (!int_attr(it, names.num_yielded, yielded, error)) {
    if (error) return nullptr;
    PyErr_SetString(PyExc_TypeError, "DataLoader iterator: _num_yielded is not an int");
    return nullptr;
  }
  if (set_int(it, names.num_yielded, yielded + 1) != 0) return nullptr;
  ++batches_taken;
  Py_INCREF(data);
  return data;
}

// An IterableDataset's worker that ran out (its _IterableDatasetStopIteration `stop` taken
// from the data queue), as torch's _next_data takes it: a persistent worker marked inactive
// for the epoch, any other shut down (_mark_worker_as_unavailable); then the next task.
int worker_stopped(const Iter& it, PyObject* stop) {
  Ref worker(PyObject_GetAttr(stop, names.worker_id));
  if (!worker) return -1;
  Ref persistent(attr(it, names.persistent_workers));
  if (!persistent) return -1;
  const int keep = PyObject_IsTrue(persistent.get());
  if (keep < 0) return -1;
  if (keep == 1) {
    Ref status(attr(it, names.workers_status));
    if (!status || PyObject_SetItem(status.get(), worker.get(), Py_False) != 0) return -1;
  } else {
    Ref r(PyObject_CallMethodOneArg(it.self, names.mark_unavailable, worker.get()));
    if (!r) return -1;
  }
  Ref counts(optional_attr(it, names.workers_num_tasks));  // torch 2.x's
  if (!counts && PyErr_Occurred()) return -1;
  return try_put_index(it, static_cast<bool>(counts));
}

// torch's _next_data for a map-style dataset or an IterableDataset (its workers' ends
// included), in order or not, while every step is the plain one.
PyObject* loader_next(PyObject*, PyObject* self) {
  if (!setup.ready) {
    PyErr_SetString(PyExc_RuntimeError, "shmtensor: _loader_setup was not called");
    return nullptr;
  }
  Ref dict(PyObject_GenericGetDict(self, nullptr));
  if (!dict) return nullptr;
  if (!PyDict_CheckExact(dict.get())) return handover();
  const Iter it{self, dict.get()};
  Ref task_info(attr(it, names.task_info));
  if (!task_info) return nullptr;
  if (!PyDict_CheckExact(task_info.get())) return handover();
  Ref iterable_step(optional_attr(it, names.iterable_step));
  if (!iterable_step && PyErr_Occurred()) return nullptr;
  const bool iterable = iterable_step.get() == Py_True;
  Ref in_order_attr(optional_attr(it, names.in_order));  // torch 2.6's; in order before
  if (!in_order_attr && PyErr_Occurred()) return nullptr;
  const bool in_order = in_order_attr.get() != Py_False;
  while (true) {
    bool error = false;
    std::int64_t rcvd = 0, send = 0, outstanding = 0;
    if (!int_attr(it, names.rcvd_idx, rcvd, error) ||
        !int_attr(it, names.send_idx, send, error) || rcvd >= send)
      return error ? nullptr : handover();  // the end of the epoch: torch's
    Ref rcvd_key(PyLong_FromLongLong(rcvd));
    if (!rcvd_key) return nullptr;
    PyObject* info = PyDict_GetItemWithError(task_info.get(), rcvd_key.get());  // borrowed
    if (info == nullptr && !in_order && !PyErr_Occurred()) {
      // Its batch was returned as it came (in_order=False): torch's loop steps past it.
      if (set_int(it, names.rcvd_idx, rcvd + 1) != 0) return nullptr;
      continue;
    }
    if (info == nullptr) return PyErr_Occurred() ? nullptr : handover();
    if (!PyTuple_CheckExact(info)) return handover();
    if (PyTuple_GET_SIZE(info) == 2) {  // came out of order before: (worker, data)
      Ref task(new_ref(info));
      if (PyDict_DelItem(task_info.get(), rcvd_key.get()) != 0) return nullptr;
      return process_data(it, rcvd, task.get(), PyTuple_GET_ITEM(task.get(), 1));
    }
    if (PyTuple_GET_SIZE(info) != 1) return handover();
    {
      Ref status(attr(it, names.workers_status));
      if (!status) return nullptr;
      Ref active(PyObject_GetItem(status.get(), PyTuple_GET_ITEM(info, 0)));
      if (!active) return nullptr;
      if (active.get() != Py_True) return handover();  // torch skips the task
    }
    {
      Ref shutdown(attr(it, names.shutdown));
      if (!shutdown) return nullptr;
      if (shutdown.get() != Py_False) return handover();
    }
    if (!int_attr(it, names.tasks_outstanding, outstanding, error) || outstanding <= 0)
      return error ? nullptr : handover();
    Ref queue(attr(it, names.data_queue));
    if (!queue) return nullptr;
    Ref native(PyObject_GetAttr(queue.get(), names.native));
    if (!native) return nullptr;
    if (native.get() == Py_None) return handover();  // closed: torch's code raises
    {
      Ref queue_dict(PyObject_GetAttr(queue.get(), names.dict));
      if (!queue_dict) return nullptr;
      if (!PyDict_Check(queue_dict.get())) return handover();
      PyObject* deferred = PyDict_GetItemWithError(queue_dict.get(), names.deferred);
      if (deferred == nullptr && PyErr_Occurred()) return nullptr;
      if (deferred != nullptr) return handover();  // errors a get_many kept for get()
    }

    Ref got(get_data(it, native.get()));
    if (!got) return nullptr;
    // torch unpacks the result (idx, data), then counts the task received.
    if (!PyTuple_CheckExact(got.get()) || PyTuple_GET_SIZE(got.get()) != 2) {
      PyErr_SetString(PyExc_ValueError, "DataLoader worker result is not (index, data)");
      return nullptr;
    }
    if (!int_attr(it, names.tasks_outstanding, outstanding, error)) {
      if (error) return nullptr;
      PyErr_SetString(PyExc_TypeError, "DataLoader iterator: _tasks_outstanding is not an int");
      return nullptr;
    }
    if (set_int(it, names.tasks_outstanding, outstanding - 1) != 0) return nullptr;
    PyObject* idx = PyTuple_GET_ITEM(got.get(), 0);
    PyObject* data = PyTuple_GET_ITEM(got.get(), 1);
    if (iterable) {
      const int stop = PyObject_IsInstance(data, setup.iterable_stop);
      if (stop < 0) return nullptr;
      if (stop == 1 && worker_stopped(it, data) != 0) return nullptr;
      if (stop == 1) continue;
    }
    const int same = PyObject_RichCompareBool(idx, rcvd_key.get(), Py_EQ);
    if (same < 0) return nullptr;
    if (same == 0 && !in_order) {
      // in_order=False: returned as it came, its entry taken out (torch 2.6's _next_data).
      Ref task(PyObject_GetItem(task_info.get(), idx));  // a KeyError, as torch's pop, if none
      if (!task) return nullptr;
      if (PyDict_DelItem(task_info.get(), idx) != 0) return nullptr;
      return process_data(it, rcvd, task.get(), data, /*advance=*/false);
    }
    if (same == 0) {
      // Out of order: kept beside its worker id, as torch keeps it, until its turn.
      Ref kept(PyObject_GetItem(task_info.get(), idx));
      if (!kept) return nullptr;
      Ref one(PyTuple_Pack(1, data));
      if (!one) return nullptr;
      Ref both(PySequence_Concat(kept.get(), one.get()));
      if (!both) return nullptr;
      if (PyObject_SetItem(task_info.get(), idx, both.get()) != 0) return nullptr;
      continue;
    }
    Ref task(PyObject_CallMethodOneArg(task_info.get(), names.get, idx));  // (worker,)
    if (!task) return nullptr;
    if (PyDict_DelItem(task_info.get(), idx) != 0) return nullptr;
    return process_data(it, rcvd, task.get(), data);
  }
}

// The docstring opens with CPython's text signature, which inspect.signature() reads (`$module`:
// the module the function is bound to, which it leaves out), then the signature in pybind11's
// form, as the module's other functions have it.
PyMethodDef loader_next_def = {
    "_loader_next", loader_next, METH_O,
    "_loader_next($module, iterator, /)\n--\n\n"
    "_loader_next(arg0: object) -> object\n\nOne __next__ of shmtensor's DataLoader iterator in the "
    "common case (shmtensor/_loader.py), or the handover object given to _loader_setup when "
    "torch's _next_data must take this step."};

}  // namespace

void bind_loader_iter(py::module_& m) {
  names = Names{intern("_rcvd_idx"),          intern("_send_idx"),
                intern("_task_info"),         intern("_workers_status"),
                intern("_shutdown"),          intern("_tasks_outstanding"),
                intern("_data_queue"),        intern("_q"),
                intern("_deferred"),          intern("__dict__"),
                intern("_prefetch_factor"),
                intern("_num_workers"),       intern("_sampler_iter"),
                intern("_worker_queue_idx_cycle"), intern("_index_queues"),
                intern("_workers_num_tasks"), intern("_num_yielded"),
                intern("get"),                intern("put"),
                intern("_try_put_index"),
                intern("reraise"),            intern("_get_failed"),
                intern("loads"),              intern("_board"),
                intern("_queue"),             intern("_timeout"),
                intern("_iterable_step"),     intern("worker_id"),
                intern("_persistent_workers"), intern("_mark_worker_as_unavailable"),
                intern("_in_order")};
  // Bound to the module, with the module's name as __module__, as CPython binds a module's
  // own functions: a function with no __self__ shows its self as a parameter to signature().
  py::object module_name = m.attr("__name__");
  PyObject* f = PyCFunction_NewEx(&loader_next_def, m.ptr(), module_name.ptr());
  if (f == nullptr) throw py::error_already_set();
  m.add_object("_loader_next", py::reinterpret_steal<py::object>(f));
  m.def(
      "_loader_setup",
      [](py::object handover, py::object exception_wrapper, py::object empty, double interval,
         py::object reductions, py::object board_queue, py::object iterable_stop) {
        const auto keep = [](py::object o) { return o.release().ptr(); };
        setup.handover = keep(std::move(handover));
        setup.exception_wrapper = keep(std::move(exception_wrapper));
        setup.empty = keep(std::move(empty));
        setup.reductions = keep(std::move(reductions));
        setup.board_queue = keep(std::move(board_queue));
        setup.iterable_stop = keep(std::move(iterable_stop));
        setup.interval = interval;
        setup.ready = true;
      },
      py::arg("handover"), py::arg("exception_wrapper"), py::arg("empty"), py::arg("interval"),
      py::arg("reductions"), py::arg("board_queue"), py::arg("iterable_stop"),
      "Gives _loader_next torch's ExceptionWrapper, queue.Empty, torch's "
      "MP_STATUS_CHECK_INTERVAL, shmtensor's reductions module and _loader._BoardQueue, "
      "torch's _IterableDatasetStopIteration, and its handover object.");
  m.def(
      "_make_index_boards",
      [](std::size_t workers, std::uint32_t slots, std::uint32_t index_words) {
        return internal::make_task_boards(board_shape(slots, index_words), workers);
      },
      py::arg("workers"), py::arg("slots"), py::arg("index_words"),
      "The task boards of a DataLoader's workers (shmtensor/internal/task_board.h), one after "
      "the other: an int64 Tensor in shared memory, file_descriptor whatever the strategy.");
  py::class_<IndexBoardWriter>(m, "_IndexBoardWriter",
                               "The main process's side of a worker's index board.")
      .def(py::init<const Tensor&, std::int64_t, std::uint32_t, std::uint32_t>(),
           py::arg("memory"), py::arg("worker"), py::arg("slots"), py::arg("index_words"))
      .def(
          "put",
          [](IndexBoardWriter& w, py::handle task, py::handle index, py::handle native) {
            return w.put(task.ptr(), index.ptr(), native.ptr());
          },
          py::arg("task"), py::arg("index"), py::arg("native"),
          "Puts the task (send_idx, index) on the board, waking the worker through `native` "
          "(its index queue's _Queue) if it sleeps; False when it must go as a message.")
      .def(
          "announce", [](IndexBoardWriter& w, py::handle native) { w.announce(native.ptr()); },
          py::arg("native"), "Counts a task sent as a message; wakes the worker if it sleeps.")
      .def_property_readonly("posted", &IndexBoardWriter::posted,
                             "Entries posted so far (a message names it: what comes before it).")
      .def_property_readonly("messages", &IndexBoardWriter::messages,
                             "Tasks sent through the index queue so far (announced).");
  py::class_<IndexBoardReader>(m, "_IndexBoardReader", "A worker's side of its index board.")
      .def(py::init<const Tensor&, std::int64_t, std::uint32_t, std::uint32_t>(),
           py::arg("memory"), py::arg("worker"), py::arg("slots"), py::arg("index_words"))
      .def("take", &IndexBoardReader::take, py::arg("due"),
           "The next task (send_idx, index), `due` when a message must be received first, or "
           "None.")
      .def_property_readonly("taken", &IndexBoardReader::taken, "Entries taken so far.")
      .def("received", &IndexBoardReader::received, "Counts a task message received.")
      .def("about_to_sleep", &IndexBoardReader::about_to_sleep,
           "Before a sleep: True when a task came meanwhile (do not sleep then).")
      .def("woke", &IndexBoardReader::woke, "After a sleep.");
  m.attr("_INDEX_BOARD_WAKE") = py::bytes(kWake, 4);
  py::cpp_function rethrow(
      [] {
        std::exception_ptr p = pending;
        pending = nullptr;
        if (p) std::rethrow_exception(p);
      },
      py::name("_loader_rethrow"));
  setup.rethrow = rethrow.release().ptr();
  m.def(
      "_loader_batches", [] { return batches_taken; },
      "How many batches _loader_next has returned in this process (for the tests).");
}

}  // namespace shmtensor::python
