// Broadcast<T>: one writer, N readers, every reader gets every message, in order.
//
//   Broadcast<Tensor> b(3);                  // 3 readers; this process writes
//   auto r = b.reader(1);                    // send r to reader 1's process (or fork)
//   b.put(t, 2s);                            // in the writer
//   Tensor x = r.get();                      // in reader 1
//
// A message is encoded once per reader and framed as a Queue frames it: a tensor's storage
// moves into shared memory once, and every reader's copy names the same block (no copy per
// reader); each copy holds the block for its reader (an in-flight count that reader adopts),
// so the block lives until every reader took the message and dropped it. Each reader's
// messages travel in a bounded queue of its own (queue.h), `depth` deep, and a reader waits
// as a Queue's get() does: an adaptive busy poll, then a futex sleep.
//
// The writer is the process that made the broadcast; a Broadcast sent to another process
// (or a forked child) hands out readers there but cannot put. A reader handle attaches its
// process as that reader on its first get(): one process per reader at a time.
//
// A slow reader: put() waits while any attached (or not yet attached) reader is `depth`
// messages behind, and at its timeout throws BroadcastTimeout naming that reader (index,
// pid, messages behind); the message then went to no reader, so the put can be retried.
// (Once every queue has room a copy goes to each; a queue that had room and still takes
// no copy, which only a forged count or a full socket buffer makes, is given 100 ms past
// the deadline once another reader got the message; then BroadcastTimeout names the
// readers that got it, delivered(), and those that did not.)
// A reader that died (pid and start time, as the Queue's holders): the writer's put()
// looks at whether an attached reader lives when its queue is full, and otherwise on a put
// 100 ms or more after its last look at it (1 ms while its queue is more than half full);
// it drops a dead reader's
// unread messages (their blocks are given back), and from then on skips the reader until
// a process attaches as it again (that process gets the messages put from then on). A
// reader handle dropped in a live process leaves the same way. A process that dies while
// it drops a slot's messages leaves the slot naming it: the writer or an attaching reader
// takes the drop over. A writer that died or closed: readers take what was put, then get
// QueueClosed.
//
// Lifetime and threads: handles are cheap copies; put() from one thread at a time.
#pragma once

#include <cstddef>
#include <memory>
#include <optional>
#include <span>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

#include "shmtensor/codec.h"
#include "shmtensor/error.h"
#include "shmtensor/export.h"
#include "shmtensor/internal/broadcast_core.h"
#include "shmtensor/internal/duration.h"
#include "shmtensor/internal/frame.h"
#include "shmtensor/queue.h"
#include "shmtensor/timeout.h"

namespace shmtensor {

// put() timed out waiting for a reader `behind` messages behind.
class SHMTENSOR_API BroadcastTimeout : public Error {
 public:
  BroadcastTimeout(const std::string& what, int reader, int pid, std::size_t behind,
                   std::vector<int> delivered = {})
      : Error(what), reader_(reader), pid_(pid), behind_(behind), delivered_(std::move(delivered)) {}
  [[nodiscard]] int reader() const noexcept { return reader_; }
  [[nodiscard]] int pid() const noexcept { return pid_; }  // 0: no process attached yet
  [[nodiscard]] std::size_t behind() const noexcept { return behind_; }
  // The readers that got the message, in order: empty unless a queue that had room took no
  // copy by the deadline (see Broadcast::put).
  [[nodiscard]] const std::vector<int>& delivered() const noexcept { return delivered_; }

 private:
  int reader_;
  int pid_;
  std::size_t behind_;
  std::vector<int> delivered_;
};

// Reader i of a Broadcast<T> (Broadcast<T>::Reader): see Broadcast.
template <class T>
class BroadcastReader {
 public:
  // Waits for the next message. Throws QueueClosed when the writer closed or died and
  // every message was taken; ProtocolError or SystemError for a message that cannot be
  // decoded (it is consumed, as Queue::get), or a broadcast a peer broke.
  T get() {
    auto d = core_->get(index_, std::nullopt);  // never empty without a timeout
    return decode(*d);
  }
  // Waits up to `timeout`; nullopt if nothing came.
  std::optional<T> try_get(Duration timeout = Duration::zero()) {
    auto d = core_->get(index_, internal::to_nanoseconds(timeout));
    if (!d) return std::nullopt;
    return decode(*d);
  }
  [[nodiscard]] int index() const noexcept { return index_; }

 private:
  template <class>
  friend class Broadcast;
  friend struct Codec<BroadcastReader>;
  BroadcastReader(std::shared_ptr<internal::BroadcastCore> core, int index)
      : core_(std::move(core)), index_(index) {}
  static T decode(Decoder& d) {
    T value = d.template decode<T>();
    d.finish();
    return value;
  }
  std::shared_ptr<internal::BroadcastCore> core_;
  int index_;
};

template <class T>
class Broadcast {
 public:
  using Reader = BroadcastReader<T>;

  // Throws std::invalid_argument for readers outside 1 to 64 or depth outside 1 to 4,096.
  explicit Broadcast(int readers, std::size_t depth = 64)
      : core_(internal::BroadcastCore::create(readers, depth)) {}

  // A broadcast any process of this user can open by name (open(name).reader(i)), through
  // the user's shmtensor-manager (started on demand), as Queue<T>::create(name) does; the
  // name lives until this process drops its last handle, exits or dies, or unlink()
  // removes it. Throws NameExists, std::invalid_argument (a bad name, readers or depth),
  // Error when the manager cannot be reached.
  static Broadcast create(const std::string& name, int readers, std::size_t depth = 64) {
    return Broadcast(internal::BroadcastCore::create_named(name, readers, depth));
  }
  // The broadcast published under `name`: hands out readers, cannot put. Throws
  // NameNotFound; ProtocolError when what is published there is not a broadcast.
  static Broadcast open(const std::string& name) {
    return Broadcast(internal::BroadcastCore::open_named(name));
  }
  // Removes the name (handles keep working). Throws NameNotFound.
  static void unlink(const std::string& name) { internal::BroadcastCore::unlink_named(name); }

  // Every reader's copy, or none: see the header comment. Throws BroadcastTimeout;
  // QueueClosed after close(); std::logic_error outside the writer's process; what
  // Queue::put throws for a value that cannot be framed.
  void put(const T& value, Timeout timeout = std::nullopt) {
    std::vector<Encoder> copies(static_cast<std::size_t>(core_->readers()));
    for (Encoder& e : copies) e.encode(value);
    core_->put(copies, internal::to_nanoseconds(timeout));
  }
  // Reader i's handle (0 <= i < readers()). Throws std::out_of_range.
  [[nodiscard]] Reader reader(int i) const {
    if (i < 0 || i >= core_->readers())
      throw std::out_of_range("Broadcast::reader: no reader " + std::to_string(i));
    return Reader(core_, i);
  }
  [[nodiscard]] int readers() const noexcept { return core_->readers(); }
  [[nodiscard]] std::size_t depth() const noexcept { return core_->depth(); }
  // Messages reader i has not taken yet (an estimate), and its process (0: none attached).
  [[nodiscard]] std::size_t behind(int i) const { return core_->behind(i); }
  [[nodiscard]] int reader_pid(int i) const noexcept { return core_->reader_pid(i); }
  // No more puts; readers take what is there, then get QueueClosed. The writer's last
  // handle closes the broadcast too.
  void close() noexcept { core_->close(); }

  // The broadcast as bytes and fds, and back: exactly what an encoded Broadcast carries,
  // for a registry of names to keep (the manager's named channels). The frame holds the
  // counts that keep the broadcast's queues from being drained while it is in flight: keep
  // it (or mark it sent and keep its fds) as long as the name is published.
  [[nodiscard]] internal::MessageFrame parts() const {
    Encoder e;
    e.encode(*this);
    return internal::MessageFrame(std::move(e));
  }
  // Owns `fds` from the call on. Throws ProtocolError.
  static Broadcast from_parts(std::span<const std::byte> bytes, std::span<const int> fds) {
    Decoder d = internal::parse_message_frame(bytes, fds);
    Broadcast b = d.decode<Broadcast>();
    d.finish();
    return b;
  }

 private:
  friend struct Codec<Broadcast>;
  friend struct internal::BroadcastAccess;
  explicit Broadcast(std::shared_ptr<internal::BroadcastCore> core) : core_(std::move(core)) {}
  std::shared_ptr<internal::BroadcastCore> core_;
};

template <class T>
struct Codec<Broadcast<T>> {
  static void encode(Encoder& e, const Broadcast<T>& b) { b.core_->encode(e, -1); }
  static Broadcast<T> decode(Decoder& d) {
    auto core = internal::BroadcastCore::decode(d);
    if (core->carried_reader() >= 0)
      throw ProtocolError("received a Broadcast reader where a whole Broadcast was expected");
    return Broadcast<T>(std::move(core));
  }
};

// A reader's handle carries that reader's queue alone. Throws ProtocolError when what was
// received is a whole broadcast.
template <class T>
struct Codec<BroadcastReader<T>> {
  static void encode(Encoder& e, const BroadcastReader<T>& r) { r.core_->encode(e, r.index_); }
  static BroadcastReader<T> decode(Decoder& d) {
    auto core = internal::BroadcastCore::decode(d);
    const int index = core->carried_reader();
    if (index < 0) throw ProtocolError("received a whole Broadcast where a reader was expected");
    return BroadcastReader<T>(std::move(core), index);
  }
};

}  // namespace shmtensor
