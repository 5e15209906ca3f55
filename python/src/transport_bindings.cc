// The native transport for shmtensor.multiprocessing: Connection and Queue carrying
// (pickle bytes, blocks), where a block is a 1-d uint8 Tensor over a whole shared storage;
// and frames: a message turned into bytes plus fds, so that a block reference, a Queue or a
// Connection can ride inside an ordinary pickle (multiprocessing's own Queue, Pool, a
// spawned child's arguments), made and parsed by the library (shmtensor/internal/frame.h).
//
// Every call that can block releases the GIL. The GIL is held while Python objects are
// touched; pybind11 casts happen before the release.
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <optional>
#include <span>
#include <string>
#include <utility>
#include <vector>

#include "bindings.h"
#include "devices.h"
#include "shmtensor/broadcast.h"
#include "shmtensor/connection.h"
#include "shmtensor/internal/connection_access.h"
#include "shmtensor/internal/fd_keeper.h"
#include "shmtensor/internal/frame.h"
#include "shmtensor/queue.h"
#include "shmtensor/storage.h"
#include "shmtensor/tensor.h"

namespace py = pybind11;

namespace shmtensor::python {
namespace {

// A message item: the pickle and its out-of-band blocks' storages. The pickle describes each
// array's view of its block; the message carries the storages alone (Codec<Storage>).
using Item = std::pair<std::string, std::vector<Storage>>;

// The blocks travel as whole storages; what a block tensor views does not matter.
std::vector<Storage> block_storages(const std::vector<Tensor>& blocks) {
  std::vector<Storage> out;
  out.reserve(blocks.size());
  for (const auto& t : blocks) {
    if (!t.defined() || !t.is_shared())
      throw py::value_error("shmtensor message blocks must be shared tensors");
    out.push_back(t.storage());
  }
  return out;
}

std::vector<Tensor> blocks_of_storages(const std::vector<Storage>& storages) {
  std::vector<Tensor> out;
  out.reserve(storages.size());
  for (const auto& s : storages) out.push_back(whole_block(s));
  return out;
}

Item make_item(py::bytes data, const std::vector<Tensor>& blocks) {
  return Item{std::string(data), block_storages(blocks)};
}

py::tuple item_to_python(Item&& item) {
  return py::make_tuple(py::bytes(item.first), py::cast(blocks_of_storages(item.second)));
}

// The one conversion of a Python timeout (seconds, a float; None: no limit), for every
// call of this module: a negative one is 0 (a single try, as multiprocessing's), a fraction
// of a nanosecond is rounded up (a wait is never shorter than asked), one beyond ~31 years is
// 31 years, NaN is a ValueError.
std::optional<std::chrono::nanoseconds> to_timeout(std::optional<double> seconds) {
  if (!seconds) return std::nullopt;
  if (std::isnan(*seconds)) throw py::value_error("timeout must be a number of seconds, not NaN");
  constexpr double kMaxSeconds = 1e9;
  const double s = std::clamp(*seconds, 0.0, kMaxSeconds);
  return std::chrono::nanoseconds(static_cast<std::int64_t>(std::ceil(s * 1e9)));
}

// A message made into bytes and the fds it needs (internal/frame.h), as Python sees it.
class Frame {
 public:
  explicit Frame(Encoder&& e) : frame_(std::move(e)) {}
  py::bytes data() const { return py::bytes(frame_.bytes()); }
  const std::vector<int>& fds() const { return frame_.fds(); }
  const std::vector<std::uint64_t>& fd_uids() const { return frame_.fd_uids(); }
  void mark_sent() { frame_.mark_sent(); }

 private:
  internal::MessageFrame frame_;
};

// Parses a frame made by Frame in another (or this) process; takes ownership of `fds`.
Decoder parse(const std::string& data, const std::vector<int>& fds) {
  std::span<const std::byte> bytes(reinterpret_cast<const std::byte*>(data.data()), data.size());
  return internal::parse_message_frame(bytes, fds);
}

template <class T>
T decode_whole(Decoder d) {
  T value = d.decode<T>();
  d.finish();
  return value;
}

class PyConnection {
 public:
  explicit PyConnection(Connection c) : c_(std::move(c)) {}
  // A closed peer is shmtensor.ConnectionClosed, an EOFError (errors.cc), as
  // multiprocessing's Connection raises.
  void send(py::bytes data, const std::vector<Tensor>& blocks) {
    Item item = make_item(std::move(data), blocks);
    py::gil_scoped_release release;
    c_.send(item);
  }
  // None on timeout.
  std::optional<py::tuple> recv(std::optional<double> timeout) {
    std::optional<Item> item;
    {
      py::gil_scoped_release release;
      if (timeout) {
        item = c_.try_recv<Item>(*to_timeout(timeout));
      } else {
        item = c_.recv<Item>();
      }
    }
    if (!item) return std::nullopt;
    return item_to_python(std::move(*item));
  }
  bool poll(std::optional<double> timeout) {
    py::gil_scoped_release release;
    return c_.poll(to_timeout(timeout));
  }
  void close() { c_.close(); }
  bool closed() const { return !c_.valid(); }
  int fileno() const {
    if (!c_.valid()) throw py::value_error("handle is closed");
    return c_.native_handle();
  }
  Connection& get() { return c_; }

 private:
  Connection c_;
};

class PyQueue {
 public:
  explicit PyQueue(Queue<Item> q) : q_(std::move(q)) {}
  // False on timeout (0: do not wait; None: wait for room).
  // counted: an item whose task begin_task() counted already (Python's feeder thread sends
  // every item so; begin_task and the count are no-ops unless the queue is joinable).
  bool put(py::bytes data, const std::vector<Tensor>& blocks, std::optional<double> timeout,
           bool counted) {
    if (counted) return put_counted(std::move(data), blocks, timeout);
    Item item = make_item(std::move(data), blocks);
    py::gil_scoped_release release;
    if (!timeout) {
      q_.put(item);
      return true;
    }
    return q_.try_put(item, *to_timeout(timeout));
  }
  // The item's task is ours until QueueCore::put takes it over (it finishes it on failure):
  // an error before, in making or encoding the item, finishes it here.
  bool put_counted(py::bytes data, const std::vector<Tensor>& blocks,
                   std::optional<double> timeout) {
    struct Abandon {
      internal::QueueCore* core;
      ~Abandon() {
        if (core != nullptr) core->abandon_task();
      }
    } abandon{&core()};
    Item item = make_item(std::move(data), blocks);
    py::gil_scoped_release release;
    Encoder e;
    e.encode(item);
    abandon.core = nullptr;
    return core().put(std::move(e), to_timeout(timeout), true);
  }
  std::optional<py::tuple> get(std::optional<double> timeout) {
    std::optional<Item> item = take(timeout);
    if (!item) return std::nullopt;
    return item_to_python(std::move(*item));
  }
  // The next item, waiting without the GIL (None: until one comes); nullopt at the timeout.
  std::optional<Item> take(std::optional<double> timeout) {
    py::gil_scoped_release release;
    if (!timeout) return q_.get();
    return q_.try_get(*to_timeout(timeout));
  }
  // Batches (Queue.put_many / get_many): `items` are (data, blocks) pairs. Returns how many
  // were put (timeout None: all, waiting for room as needed).
  std::size_t put_many(const std::vector<std::pair<py::bytes, std::vector<Tensor>>>& items,
                       std::optional<double> timeout) {
    std::vector<Item> batch;
    batch.reserve(items.size());
    for (const auto& [data, blocks] : items) batch.push_back(make_item(data, blocks));
    py::gil_scoped_release release;
    if (!timeout) {
      q_.put_many(batch);
      return batch.size();
    }
    return q_.try_put_many(batch, *to_timeout(timeout));
  }
  // Up to max_items (data, blocks) tuples; empty on timeout.
  py::list get_many(std::size_t max_items, std::optional<double> timeout) {
    std::vector<Item> items;
    {
      py::gil_scoped_release release;
      items = timeout ? q_.try_get_many(max_items, *to_timeout(timeout)) : q_.get_many(max_items);
    }
    py::list out;
    for (Item& item : items) out.append(item_to_python(std::move(item)));
    return out;
  }
  Queue<Item>& get_queue() { return q_; }
  internal::QueueCore& core() { return internal::QueueAccess::core(q_); }
  // An fd that is readable when an item (or the end of a closed queue) may be there, for
  // multiprocessing.connection.wait (Pool waits on its queues so): the queue's readiness
  // eventfd, owned by the queue.
  int fileno() { return q_.readiness_fd(); }

 private:
  Queue<Item> q_;
};


// A Broadcast of (pickle, blocks) items (shmtensor.multiprocessing.Broadcast), and one
// reader's handle. Blocking calls release the GIL.
class PyBroadcastReader {
 public:
  explicit PyBroadcastReader(Broadcast<Item>::Reader r) : r_(std::move(r)) {}
  // None on timeout.
  std::optional<py::tuple> get(std::optional<double> timeout) {
    std::optional<Item> item;
    {
      py::gil_scoped_release release;
      if (timeout) {
        item = r_.try_get(Duration(to_timeout(timeout)->count() / 1e9));
      } else {
        item = r_.get();
      }
    }
    if (!item) return std::nullopt;
    return item_to_python(std::move(*item));
  }
  int index() const { return r_.index(); }
  Broadcast<Item>::Reader& get_reader() { return r_; }

 private:
  Broadcast<Item>::Reader r_;
};

class PyBroadcast {
 public:
  explicit PyBroadcast(Broadcast<Item> b) : b_(std::move(b)) {}
  void put(py::bytes data, const std::vector<Tensor>& blocks, std::optional<double> timeout) {
    Item item = make_item(std::move(data), blocks);
    std::optional<Duration> t;
    if (timeout) t = Duration(to_timeout(timeout)->count() / 1e9);
    py::gil_scoped_release release;
    b_.put(item, t);
  }
  PyBroadcastReader reader(int i) const { return PyBroadcastReader(b_.reader(i)); }
  Broadcast<Item>& get() { return b_; }

 private:
  Broadcast<Item> b_;
};

}  // namespace

bool native_queue_get(py::handle queue, double timeout, std::string& data,
                      std::vector<Storage>& storages) {
  std::optional<Item> item = py::cast<PyQueue&>(queue).take(timeout);
  if (!item) return false;
  data = std::move(item->first);
  storages = std::move(item->second);
  return true;
}

bool native_queue_try_put(py::handle queue, std::string data) {
  PyQueue& q = py::cast<PyQueue&>(queue);
  Item item{std::move(data), {}};
  py::gil_scoped_release release;
  return q.get_queue().try_put(item, std::chrono::nanoseconds(0));
}

py::tuple native_item_to_python(std::string data, std::vector<Storage> storages) {
  return item_to_python(Item{std::move(data), std::move(storages)});
}

void bind_transport(py::module_& m) {
  m.def(
      "_block_address",
      [](const Tensor& t) { return reinterpret_cast<std::uintptr_t>(t.storage().data()); },
      "Where the storage behind a tensor starts (a key for the block in this process).");

  // A Tensor pickled by reference, named by its block and its view (and its device, which
  // an empty tensor has no block to carry). The Python reducer shares it in place first (as
  // torch's reducer and Connection::send do), through the binding that refuses while NumPy
  // views of its private bytes exist.
  m.def("_tensor_parts", [](const Tensor& t) {
    std::optional<Tensor> block;
    if (t.defined() && t.numel() > 0) {
      if (!t.is_shared()) throw py::value_error("_tensor_parts: share_memory_() first");
      block = whole_block(t.storage());
    }
    return py::make_tuple(block, t.numel() > 0 ? t.storage_offset() : 0, t.sizes().vec(),
                          t.strides().vec(), to_string(t.dtype()), t.device().to_string());
  });
  m.def(
      "_tensor_from_parts",
      [](std::optional<Tensor> block, std::int64_t offset, std::vector<std::int64_t> sizes,
         std::vector<std::int64_t> strides, const std::string& dtype, const py::object& device) {
        DType d = dtype_from_string(dtype);
        if (!block) {
          const Device dev = device.is_none() ? Device::cpu() : device_from_object(device);
          return Tensor::empty(std::move(sizes), d, dev);
        }
        return Tensor::from_storage(block->storage(), offset, std::move(sizes),
                                    std::move(strides), d);
      },
      py::arg("block"), py::arg("offset"), py::arg("sizes"), py::arg("strides"),
      py::arg("dtype"), py::arg("device") = py::none());

  py::class_<Frame>(m, "_Frame")
      .def_property_readonly("data", &Frame::data)
      .def_property_readonly("fds", &Frame::fds)
      .def_property_readonly("fd_uids", &Frame::fd_uids)
      .def("mark_sent", &Frame::mark_sent);

  m.def("_frame_of_blocks", [](const std::vector<Tensor>& blocks) {
    Encoder e;
    e.encode(block_storages(blocks));
    return Frame(std::move(e));
  });
  m.def("_blocks_of_frame", [](const std::string& data, const std::vector<int>& fds) {
    std::vector<Storage> storages;
    {
      py::gil_scoped_release release;
      storages = decode_whole<std::vector<Storage>>(parse(data, fds));
    }
    return blocks_of_storages(storages);
  });

  py::class_<PyConnection>(m, "_Connection")
      .def("send", &PyConnection::send, py::arg("data"), py::arg("blocks"))
      .def("recv", &PyConnection::recv, py::arg("timeout") = py::none())
      .def("poll", &PyConnection::poll, py::arg("timeout") = 0.0)
      .def("close", &PyConnection::close)
      .def_property_readonly("closed", &PyConnection::closed)
      .def("fileno", &PyConnection::fileno)
      .def("_frame", [](PyConnection& c) {
        Encoder e;
        e.encode(c.get());
        return Frame(std::move(e));
      });
  // sockets_only: a socket pair whose every message is a datagram (Python's Pipe(): its
  // fileno() is the socket, readable exactly while a message or the peer's hang-up is there);
  // otherwise pipe()'s rings and socket.
  m.def(
      "_pipe",
      [](bool sockets_only) {
        auto [a, b] = sockets_only ? internal::ConnectionAccess::socket_pair() : pipe();
        return std::make_pair(PyConnection(std::move(a)), PyConnection(std::move(b)));
      },
      py::arg("sockets_only") = false);
  m.def("_connection_of_frame", [](const std::string& data, const std::vector<int>& fds) {
    return PyConnection(decode_whole<Connection>(parse(data, fds)));
  });

  py::class_<PyQueue>(m, "_Queue")
      .def(py::init([](std::size_t maxsize, bool joinable) {
             return joinable ? PyQueue(JoinableQueue<Item>(maxsize))
                             : PyQueue(Queue<Item>(maxsize));
           }),
           py::arg("maxsize") = 0, py::arg("joinable") = false)
      .def("put", &PyQueue::put, py::arg("data"), py::arg("blocks"), py::arg("timeout"),
           py::arg("counted") = false)
      .def("begin_task", [](PyQueue& q) { q.core().begin_task(); })
      .def("get", &PyQueue::get, py::arg("timeout"))
      .def("put_many", &PyQueue::put_many, py::arg("items"), py::arg("timeout"))
      .def("get_many", &PyQueue::get_many, py::arg("max_items"), py::arg("timeout"))
      .def("qsize", [](PyQueue& q) { return q.get_queue().size(); })
      .def(
          "set_busy_poll",
          [](PyQueue& q, std::optional<double> seconds) {
            q.get_queue().set_busy_poll(seconds ? std::optional(Duration(*seconds)) : std::nullopt);
          },
          py::arg("seconds"))
      .def_property_readonly("busy_poll",
                             [](PyQueue& q) -> std::optional<double> {
                               auto b = q.get_queue().busy_poll();
                               if (!b) return std::nullopt;
                               return b->count();
                             })
      .def("fileno", &PyQueue::fileno)
      .def("_ready_now", [](PyQueue& q) { return q.core().ready_now(); })
      // multiprocessing's errors: ValueError for one task_done() too many.
      .def("task_done",
           [](PyQueue& q) {
             try {
               q.core().task_done();
             } catch (const std::logic_error& e) {
               throw py::value_error(e.what());
             }
           })
      .def(
          "join",
          [](PyQueue& q, std::optional<double> timeout) {
            if (!q.core().joinable())
              throw py::value_error("join() on a queue that is not joinable");
            py::gil_scoped_release release;
            return q.core().join(to_timeout(timeout));
          },
          py::arg("timeout") = py::none())
      .def_property_readonly("maxsize", [](PyQueue& q) { return q.get_queue().maxsize(); })
      .def("close", [](PyQueue& q) { q.get_queue().close(); })
      .def_property_readonly("closed", [](PyQueue& q) { return q.get_queue().closed(); })
      .def("_frame", [](PyQueue& q) {
        Encoder e;
        e.encode(q.get_queue());
        return Frame(std::move(e));
      });
  // fds and tickets of plain pickles in flight, kept by shmtensor-manager (keeper.py).
  m.def(
      "_keep_fd",
      [](py::bytes token, int fd) {
        std::string t = token;
        py::gil_scoped_release release;
        internal::keep_fd_for_pickle(t, fd);
      },
      py::arg("token"), py::arg("fd"));
  m.def(
      "_take_kept_fd",
      [](py::bytes token) {
        std::string t = token;
        int fd = -1;
        internal::KeptFdKind kind;
        {
          py::gil_scoped_release release;
          kind = internal::take_fd_of_pickle(t, &fd);
        }
        const char* what = kind == internal::KeptFdKind::kFd       ? "fd"
                           : kind == internal::KeptFdKind::kTicket ? "ticket"
                                                                   : "unknown";
        return py::make_tuple(what, fd);
      },
      py::arg("token"));
  m.def("_fd_keeper_connection", [] { return internal::fd_keeper_connection(); });
  // Named queues (docs/python.md, "Named queues"): NameExistsError, NameNotFoundError.
  m.def(
      "_queue_create_named",
      [](const std::string& name, std::size_t maxsize, bool joinable) {
        py::gil_scoped_release release;
        return joinable ? PyQueue(JoinableQueue<Item>::create(name, maxsize))
                        : PyQueue(Queue<Item>::create(name, maxsize));
      },
      py::arg("name"), py::arg("maxsize") = 0, py::arg("joinable") = false);
  m.def(
      "_queue_open_named",
      [](const std::string& name, bool joinable) {
        py::gil_scoped_release release;
        return joinable ? PyQueue(JoinableQueue<Item>::open(name))
                        : PyQueue(Queue<Item>::open(name));
      },
      py::arg("name"), py::arg("joinable") = false);
  m.def(
      "_queue_unlink_named",
      [](const std::string& name) {
        py::gil_scoped_release release;
        Queue<Item>::unlink(name);
      },
      py::arg("name"));
  m.def("_queue_of_frame", [](const std::string& data, const std::vector<int>& fds) {
    return PyQueue(decode_whole<Queue<Item>>(parse(data, fds)));
  });
  py::class_<PyBroadcastReader>(m, "_BroadcastReader")
      .def("get", &PyBroadcastReader::get, py::arg("timeout") = py::none())
      .def_property_readonly("index", &PyBroadcastReader::index)
      .def("_frame", [](PyBroadcastReader& r) {
        Encoder e;
        e.encode(r.get_reader());
        return Frame(std::move(e));
      });
  py::class_<PyBroadcast>(m, "_Broadcast")
      .def(py::init([](int readers, std::size_t depth, std::optional<std::string> name) {
             // A named one may start the manager daemon (up to seconds): without the GIL.
             py::gil_scoped_release release;
             if (name) return PyBroadcast(Broadcast<Item>::create(*name, readers, depth));
             return PyBroadcast(Broadcast<Item>(readers, depth));
           }),
           py::arg("readers"), py::arg("depth") = 64, py::arg("name") = py::none())
      .def("put", &PyBroadcast::put, py::arg("data"), py::arg("blocks"),
           py::arg("timeout") = py::none())
      .def("reader", &PyBroadcast::reader, py::arg("index"))
      .def_property_readonly("readers", [](PyBroadcast& b) { return b.get().readers(); })
      .def_property_readonly("depth", [](PyBroadcast& b) { return b.get().depth(); })
      .def("behind", [](PyBroadcast& b, int i) { return b.get().behind(i); })
      .def("reader_pid", [](PyBroadcast& b, int i) { return b.get().reader_pid(i); })
      .def("close", [](PyBroadcast& b) { b.get().close(); })
      .def("_frame", [](PyBroadcast& b) {
        Encoder e;
        e.encode(b.get());
        return Frame(std::move(e));
      });
  m.def("_broadcast_open", [](const std::string& name) {
    py::gil_scoped_release release;
    return PyBroadcast(Broadcast<Item>::open(name));
  });
  m.def("_broadcast_unlink", [](const std::string& name) {
    py::gil_scoped_release release;
    Broadcast<Item>::unlink(name);
  });
  m.def("_broadcast_of_frame", [](const std::string& data, const std::vector<int>& fds) {
    return PyBroadcast(decode_whole<Broadcast<Item>>(parse(data, fds)));
  });
  m.def("_broadcast_reader_of_frame", [](const std::string& data, const std::vector<int>& fds) {
    return PyBroadcastReader(decode_whole<Broadcast<Item>::Reader>(parse(data, fds)));
  });
}

}  // namespace shmtensor::python
