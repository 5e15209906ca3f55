// One __next__ of shmtensor's DataLoader iterator (shmtensor/_loader.py) in the common case,
// in one call: the next batch in order, from a live worker, through shmtensor's native
// Queues. It reads and writes the attributes of torch's _MultiProcessingDataLoaderIter that
// torch's _next_data, _process_data and _try_put_index keep (_rcvd_idx, _send_idx,
// _task_info, _tasks_outstanding, _workers_num_tasks on torch 2.x, _num_yielded), so they
// stay what torch's code reads. Whatever is not that case returns the handover object
// without having changed anything, and the caller runs torch's _next_data for the step:
// a buffered batch, the end of the epoch, a worker no longer active, a closed queue.
// A failed get of the data queue (its wait reaching torch's MP_STATUS_CHECK_INTERVAL, an
// error, a signal handler's exception) goes to the iterator's _get_failed, which runs
// torch's _try_get_data on it (the dead-worker check and its RuntimeError); a batch that
// arrives out of order is kept in _task_info as torch keeps it, then the handover.
//
// Raw CPython calls, not pybind11's, keep the path short; attribute names are interned once.
#include <Python.h>
#include <pybind11/pybind11.h>

#include <chrono>
#include <cstdint>
#include <cstring>
#include <string>

#include "bindings.h"

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
  PyObject* feeder;
  PyObject* put_here;
  PyObject* put_unbounded;
  PyObject* try_put_index;
  PyObject* reraise;
  PyObject* get_failed;
  PyObject* tensor_message_decoder;
  PyObject* loads;
};

struct Setup {
  PyObject* handover = nullptr;           // what loader_next returns to hand a step over
  PyObject* exception_wrapper = nullptr;  // torch's ExceptionWrapper
  PyObject* empty = nullptr;              // queue.Empty
  PyObject* reductions = nullptr;         // shmtensor.multiprocessing.reductions
  PyObject* no_blocks = nullptr;          // () : an index message carries no block
  PyObject* slice = nullptr;              // the wait of one native get, seconds (a float)
  double interval = 0;                    // torch's MP_STATUS_CHECK_INTERVAL, seconds
  bool ready = false;
};

Names names;
Setup setup;
std::uint64_t batches_taken = 0;

// The first bytes of a tensor message (torch_module.cc writes them; reductions.loads tells
// it from a pickle so).
constexpr char kTensorMessageMagic[4] = {'S', 'T', 'M', '1'};
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

PyObject* handover() {
  Py_INCREF(setup.handover);
  return setup.handover;
}

// An attribute that is an exact int fitting in int64; false (no error set) when it is not.
bool int_attr(PyObject* o, PyObject* name, std::int64_t& out, bool& error) {
  Ref v(PyObject_GetAttr(o, name));
  if (!v) {
    error = true;
    return false;
  }
  if (!PyLong_CheckExact(v.get())) return false;
  int overflow = 0;
  out = PyLong_AsLongLongAndOverflow(v.get(), &overflow);
  return overflow == 0;
}

int set_int(PyObject* o, PyObject* name, std::int64_t v) {
  Ref n(PyLong_FromLongLong(v));
  if (!n) return -1;
  return PyObject_SetAttr(o, name, n.get());
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

// ---- The index message: (send_idx, index) as the pickle a shmtensor Queue carries ---------

void pickle_int(std::string& out, std::int64_t v) {
  if (v >= 0 && v < 256) {
    out += 'K';  // BININT1
    out += static_cast<char>(v);
  } else if (v >= INT32_MIN && v <= INT32_MAX) {
    out += 'J';  // BININT, little-endian
    const auto u = static_cast<std::uint32_t>(static_cast<std::int32_t>(v));
    for (int i = 0; i < 4; ++i) out += static_cast<char>((u >> (8 * i)) & 0xff);
  } else {
    out += '\x8a';  // LONG1: 8 bytes of two's complement, little-endian
    out += '\x08';
    const auto u = static_cast<std::uint64_t>(v);
    for (int i = 0; i < 8; ++i) out += static_cast<char>((u >> (8 * i)) & 0xff);
  }
}

bool exact_int(PyObject* o, std::int64_t& v) {
  if (!PyLong_CheckExact(o)) return false;
  int overflow = 0;
  v = PyLong_AsLongLongAndOverflow(o, &overflow);
  return overflow == 0 && !(v == -1 && PyErr_Occurred());
}

// The pickle (protocol 2) of (task, index) where index is an int or a list of ints (what
// torch's samplers and BatchSampler yield); false for any other index.
bool pickle_task(std::string& out, std::int64_t task, PyObject* index) {
  out.assign("\x80\x02", 2);  // PROTO 2
  pickle_int(out, task);
  std::int64_t v = 0;
  if (exact_int(index, v)) {
    pickle_int(out, v);
  } else if (PyList_CheckExact(index)) {
    out += ']';  // EMPTY_LIST
    const Py_ssize_t n = PyList_GET_SIZE(index);
    if (n > 0) {
      out += '(';  // MARK
      for (Py_ssize_t i = 0; i < n; ++i) {
        if (!exact_int(PyList_GET_ITEM(index, i), v)) return false;
        pickle_int(out, v);
      }
      out += 'e';  // APPENDS
    }
  } else {
    return false;
  }
  out += '\x86';  // TUPLE2
  out += '.';     // STOP
  return true;
}

// index_queue.put((task, index)) as a shmtensor Queue's put does it (torch's index queues are
// unbounded): straight to the native queue when it has room and nothing of this handle's is
// waiting in its feeder thread; otherwise the handle's own code.
int put_task(PyObject* index_queue, std::int64_t task, PyObject* index) {
  std::string pickle;
  Ref native(PyObject_GetAttr(index_queue, names.native));
  if (!native) return -1;
  Ref feeder(PyObject_GetAttr(index_queue, names.feeder));
  if (!feeder) return -1;
  if (native.get() == Py_None || feeder.get() != Py_None || !pickle_task(pickle, task, index)) {
    if (PyErr_Occurred()) return -1;
    Ref t(PyLong_FromLongLong(task));
    if (!t) return -1;
    Ref message(PyTuple_Pack(2, t.get(), index));
    if (!message) return -1;
    Ref r(PyObject_CallMethodOneArg(index_queue, names.put, message.get()));
    return r ? 0 : -1;
  }
  if (PyObject_SetAttr(index_queue, names.put_here, Py_True) != 0) return -1;
  Ref data(PyBytes_FromStringAndSize(pickle.data(), static_cast<Py_ssize_t>(pickle.size())));
  if (!data) return -1;
  Ref no_wait(PyFloat_FromDouble(0.0));
  if (!no_wait) return -1;
  PyObject* args[] = {native.get(), data.get(), setup.no_blocks, no_wait.get()};
  Ref put(PyObject_VectorcallMethod(names.put, args, 4 | PY_VECTORCALL_ARGUMENTS_OFFSET, nullptr));
  if (!put) return -1;
  if (put.get() == Py_True) return 0;
  PyObject* args2[] = {index_queue, native.get(), data.get(), setup.no_blocks};
  Ref r(PyObject_VectorcallMethod(names.put_unbounded, args2,
                                  4 | PY_VECTORCALL_ARGUMENTS_OFFSET, nullptr));
  return r ? 0 : -1;
}

// torch's _try_put_index for the plain case (in order, every worker's status read as torch
// reads it). -1 with an error set.
int try_put_index(PyObject* it, bool num_tasks) {
  bool error = false;
  std::int64_t outstanding = 0, prefetch = 0, workers = 0, send = 0;
  if (!int_attr(it, names.tasks_outstanding, outstanding, error) ||
      !int_attr(it, names.prefetch_factor, prefetch, error) ||
      !int_attr(it, names.num_workers, workers, error) ||
      !int_attr(it, names.send_idx, send, error) || outstanding >= prefetch * workers) {
    if (error) return -1;
    Ref r(PyObject_CallMethodNoArgs(it, names.try_put_index));  // torch's, and its assertion
    return r ? 0 : -1;
  }
  Ref sampler(PyObject_GetAttr(it, names.sampler_iter));
  if (!sampler) return -1;
  Ref index(PyIter_Next(sampler.get()));
  if (!index) return PyErr_Occurred() ? -1 : 0;  // the sampler's end: nothing to send
  Ref cycle(PyObject_GetAttr(it, names.worker_cycle));
  if (!cycle) return -1;
  Ref status(PyObject_GetAttr(it, names.workers_status));
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
  Ref queues(PyObject_GetAttr(it, names.index_queues));
  if (!queues) return -1;
  Ref queue(PyObject_GetItem(queues.get(), worker.get()));
  if (!queue) return -1;
  if (put_task(queue.get(), send, index.get()) != 0) return -1;
  Ref info(PyTuple_Pack(1, worker.get()));
  if (!info) return -1;
  Ref task(PyLong_FromLongLong(send));
  if (!task) return -1;
  Ref task_info(PyObject_GetAttr(it, names.task_info));
  if (!task_info) return -1;
  if (PyObject_SetItem(task_info.get(), task.get(), info.get()) != 0) return -1;
  if (num_tasks) {
    Ref counts(PyObject_GetAttr(it, names.workers_num_tasks));
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
  PyObject *type = nullptr, *value = nullptr, *tb = nullptr;
  PyErr_Fetch(&type, &value, &tb);
  PyErr_NormalizeException(&type, &value, &tb);
  if (tb != nullptr && value != nullptr) PyException_SetTraceback(value, tb);
  Py_XDECREF(type);
  Py_XDECREF(tb);
  return value;
}

// What the data queue's get(timeout=MP_STATUS_CHECK_INTERVAL) returns, decoded as the
// shmtensor Queue's get decodes it; nullptr with an error set when the get failed (queue.Empty
// once the interval passed).
PyObject* get_once(PyObject* native) {
  const auto deadline = std::chrono::steady_clock::now() +
                        std::chrono::duration<double>(setup.interval);
  Ref item;
  while (true) {
    const double left =
        std::chrono::duration<double>(deadline - std::chrono::steady_clock::now()).count();
    if (left <= 0) {
      PyErr_SetNone(setup.empty);
      return nullptr;
    }
    if (left < kSliceSeconds) {
      Ref wait(PyFloat_FromDouble(left));
      if (!wait) return nullptr;
      item = PyObject_CallMethodOneArg(native, names.get, wait.get());
    } else {
      item = PyObject_CallMethodOneArg(native, names.get, setup.slice);
    }
    if (!item) return nullptr;
    if (item.get() != Py_None) break;
    if (PyErr_CheckSignals() != 0) return nullptr;
  }
  if (!PyTuple_CheckExact(item.get()) || PyTuple_GET_SIZE(item.get()) != 2) {
    PyErr_SetString(PyExc_TypeError, "shmtensor: a native queue item is not (data, blocks)");
    return nullptr;
  }
  PyObject* data = PyTuple_GET_ITEM(item.get(), 0);
  PyObject* blocks = PyTuple_GET_ITEM(item.get(), 1);
  if (PyBytes_Check(data) && PyBytes_GET_SIZE(data) >= 4 &&
      std::memcmp(PyBytes_AS_STRING(data), kTensorMessageMagic, 4) == 0) {
    Ref decode(PyObject_GetAttr(setup.reductions, names.tensor_message_decoder));
    if (!decode) return nullptr;
    if (decode.get() != Py_None) return PyObject_CallFunctionObjArgs(decode.get(), data, blocks, nullptr);
  }
  Ref loads(PyObject_GetAttr(setup.reductions, names.loads));
  if (!loads) return nullptr;
  return PyObject_CallFunctionObjArgs(loads.get(), data, blocks, nullptr);
}

// torch's _get_data for the plain case (no timeout, no pin_memory thread): the data queue's
// get, a failed one handed to _get_failed (torch's _try_get_data), repeated until it gives.
PyObject* get_data(PyObject* it, PyObject* native) {
  while (true) {
    PyObject* got = get_once(native);
    if (got != nullptr) return got;
    if (!PyErr_ExceptionMatches(PyExc_Exception)) return nullptr;  // torch lets these through
    Ref error(take_error());
    Ref r(PyObject_CallMethodOneArg(it, names.get_failed, error.get()));
    if (!r) return nullptr;
  }
}

// ---- One __next__ --------------------------------------------------------------------------

PyObject* loader_next(PyObject*, PyObject* it) {
  if (!setup.ready) {
    PyErr_SetString(PyExc_RuntimeError, "shmtensor: _loader_setup was not called");
    return nullptr;
  }
  bool error = false;
  std::int64_t rcvd = 0, send = 0, outstanding = 0;
  if (!int_attr(it, names.rcvd_idx, rcvd, error) || !int_attr(it, names.send_idx, send, error) ||
      rcvd >= send)
    return error ? nullptr : handover();
  Ref task_info(PyObject_GetAttr(it, names.task_info));
  if (!task_info) return nullptr;
  if (!PyDict_CheckExact(task_info.get())) return handover();
  Ref rcvd_key(PyLong_FromLongLong(rcvd));
  if (!rcvd_key) return nullptr;
  PyObject* info = PyDict_GetItemWithError(task_info.get(), rcvd_key.get());  // borrowed
  if (info == nullptr) return PyErr_Occurred() ? nullptr : handover();
  if (!PyTuple_CheckExact(info) || PyTuple_GET_SIZE(info) != 1) return handover();  // has data
  {
    Ref status(PyObject_GetAttr(it, names.workers_status));
    if (!status) return nullptr;
    Ref active(PyObject_GetItem(status.get(), PyTuple_GET_ITEM(info, 0)));
    if (!active) return nullptr;
    if (active.get() != Py_True) return handover();
  }
  {
    Ref shutdown(PyObject_GetAttr(it, names.shutdown));
    if (!shutdown) return nullptr;
    if (shutdown.get() != Py_False) return handover();
  }
  if (!int_attr(it, names.tasks_outstanding, outstanding, error) || outstanding <= 0)
    return error ? nullptr : handover();
  Ref queue(PyObject_GetAttr(it, names.data_queue));
  if (!queue) return nullptr;
  Ref native(PyObject_GetAttr(queue.get(), names.native));
  if (!native) return nullptr;
  if (native.get() == Py_None) return handover();  // closed: torch's code raises
  {
    Ref dict(PyObject_GetAttr(queue.get(), names.dict));
    if (!dict) return nullptr;
    if (!PyDict_Check(dict.get())) return handover();
    PyObject* deferred = PyDict_GetItemWithError(dict.get(), names.deferred);  // borrowed
    if (deferred == nullptr && PyErr_Occurred()) return nullptr;
    if (deferred != nullptr) return handover();  // errors a get_many kept for get()
  }

  Ref got(get_data(it, native.get()));
  if (!got) return nullptr;
  // torch counts the task received before it looks at the result.
  if (!int_attr(it, names.tasks_outstanding, outstanding, error)) {
    if (error) return nullptr;
    PyErr_SetString(PyExc_TypeError, "DataLoader iterator: _tasks_outstanding is not an int");
    return nullptr;
  }
  if (set_int(it, names.tasks_outstanding, outstanding - 1) != 0) return nullptr;
  if (!PyTuple_CheckExact(got.get()) || PyTuple_GET_SIZE(got.get()) != 2) {
    PyErr_SetString(PyExc_ValueError, "DataLoader worker result is not (index, data)");
    return nullptr;
  }
  PyObject* idx = PyTuple_GET_ITEM(got.get(), 0);
  PyObject* data = PyTuple_GET_ITEM(got.get(), 1);
  const int same = PyObject_RichCompareBool(idx, rcvd_key.get(), Py_EQ);
  if (same < 0) return nullptr;
  if (same == 0) {
    // Out of order: kept beside its worker id, as torch keeps it, for torch's step.
    Ref kept(PyObject_GetItem(task_info.get(), idx));
    if (!kept) return nullptr;
    Ref one(PyTuple_Pack(1, data));
    if (!one) return nullptr;
    Ref both(PySequence_Concat(kept.get(), one.get()));
    if (!both) return nullptr;
    if (PyObject_SetItem(task_info.get(), idx, both.get()) != 0) return nullptr;
    return handover();
  }
  Ref task(PyObject_CallMethodOneArg(task_info.get(), names.get, idx));  // ours: (worker,)
  if (!task) return nullptr;
  if (PyDict_DelItem(task_info.get(), idx) != 0) return nullptr;
  if (set_int(it, names.rcvd_idx, rcvd + 1) != 0) return nullptr;
  Ref counts(PyObject_GetAttr(it, names.workers_num_tasks));
  const bool num_tasks = static_cast<bool>(counts);
  if (!num_tasks) {
    if (!PyErr_ExceptionMatches(PyExc_AttributeError)) return nullptr;
    PyErr_Clear();  // torch 1.x: no count per worker
  } else {
    if (!PyTuple_Check(task.get()) || PyTuple_GET_SIZE(task.get()) < 1) {
      PyErr_SetString(PyExc_TypeError, "DataLoader iterator: a _task_info entry is not a tuple");
      return nullptr;
    }
    const Py_ssize_t w = PyLong_AsSsize_t(PyTuple_GET_ITEM(task.get(), 0));
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

PyMethodDef loader_next_def = {
    "_loader_next", loader_next, METH_O,
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
                intern("_feeder"),            intern("_put_here"),
                intern("_put_unbounded"),     intern("_try_put_index"),
                intern("reraise"),            intern("_get_failed"),
                intern("tensor_message_decoder"), intern("loads")};
  PyObject* f = PyCFunction_NewEx(&loader_next_def, nullptr, m.ptr());
  if (f == nullptr) throw py::error_already_set();
  m.add_object("_loader_next", py::reinterpret_steal<py::object>(f));
  m.def(
      "_loader_setup",
      [](py::object handover, py::object exception_wrapper, py::object empty, double interval,
         py::object reductions) {
        const auto keep = [](py::object o) { return o.release().ptr(); };
        setup.handover = keep(std::move(handover));
        setup.exception_wrapper = keep(std::move(exception_wrapper));
        setup.empty = keep(std::move(empty));
        setup.reductions = keep(std::move(reductions));
        setup.no_blocks = keep(py::tuple());
        setup.slice = keep(py::float_(kSliceSeconds));
        setup.interval = interval;
        setup.ready = true;
      },
      py::arg("handover"), py::arg("exception_wrapper"), py::arg("empty"), py::arg("interval"),
      py::arg("reductions"),
      "Gives _loader_next torch's ExceptionWrapper, queue.Empty, torch's "
      "MP_STATUS_CHECK_INTERVAL and shmtensor's reductions module, and its handover object.");
  m.def(
      "_loader_batches", [] { return batches_taken; },
      "How many batches _loader_next has returned in this process (for the tests).");
}

}  // namespace shmtensor::python
