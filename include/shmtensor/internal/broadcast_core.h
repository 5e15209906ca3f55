// The type-independent part of a Broadcast<T> (broadcast.h): its control block and its
// readers' queues, shared by the broadcast's handles in one process
// (src/transport/broadcast.cc; docs/transport.md, "Broadcast"). Internal.
#pragma once

#include <chrono>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "shmtensor/codec.h"
#include "shmtensor/export.h"

namespace shmtensor::internal {

class QueueCore;

class SHMTENSOR_API BroadcastCore {
 public:
  // This process is the writer. Throws std::invalid_argument for readers outside 1 to 64
  // or depth outside 1 to 4,096; SystemError when its shared memory cannot be made.
  static std::shared_ptr<BroadcastCore> create(int readers, std::size_t depth);
  // The broadcast an encoded one describes, from exactly the parts it carries: its control
  // block's memfd (owned from the call on) and the queues of all its readers (`reader` -1)
  // or of reader `reader` alone (the others null). Validates the control block against
  // them. Throws ProtocolError.
  static std::shared_ptr<BroadcastCore> from_parts(int control_fd,
                                                   std::vector<std::shared_ptr<QueueCore>> queues,
                                                   int reader);
  // create(), published under `name` through the user's shmtensor-manager (channel kind
  // kBroadcast: the bytes and fds of the encoded broadcast) until this handle's process drops
  // its last handle or unlink_named removes it. Throws NameExists, std::invalid_argument for
  // an invalid name, Error when the manager cannot be reached.
  static std::shared_ptr<BroadcastCore> create_named(const std::string& name, int readers,
                                                     std::size_t depth);
  // The whole broadcast published under `name` (readers are taken from it). Throws
  // NameNotFound, ProtocolError for a publication that is not a broadcast.
  static std::shared_ptr<BroadcastCore> open_named(const std::string& name);
  static void unlink_named(const std::string& name);
  // An encoded broadcast (encode): takes its fds. Throws ProtocolError. counted: as
  // QueueCore::decode's (false for the named publication, which carries no counts).
  static std::shared_ptr<BroadcastCore> decode(Decoder& d, bool counted = true);
  // reader -1: the whole broadcast (every reader's queue; put() only in the writer);
  // otherwise reader `reader`'s handle (its queue alone).
  void encode(Encoder& e, int reader) const;
  ~BroadcastCore();
  BroadcastCore(const BroadcastCore&) = delete;
  BroadcastCore& operator=(const BroadcastCore&) = delete;

  [[nodiscard]] int readers() const noexcept;
  // The reader whose queue alone this handle carries (a decoded reader's); -1: all.
  [[nodiscard]] int carried_reader() const noexcept;
  [[nodiscard]] std::size_t depth() const noexcept;
  // One encoded copy of the message per reader (messages.size() == readers()), each moved
  // to its reader's queue, or dropped for a reader that left. Waits while a reader's queue
  // holds depth() messages; throws BroadcastTimeout (naming the first such reader) when the
  // timeout passed first, with the message put to none; or, when a queue that had room took
  // no copy (broadcast.h), after the other readers got it, naming them (delivered()). Throws std::logic_error outside
  // the writer's process, QueueClosed after close(), ProtocolError when broken.
  void put(std::vector<Encoder>& messages, std::optional<std::chrono::nanoseconds> timeout);
  // Reader `reader`'s next message; nullopt on timeout. Attaches this process as that reader
  // on its first call (std::logic_error when another live process is attached). Throws
  // QueueClosed when the writer closed the broadcast or died and nothing is left,
  // ProtocolError when broken.
  [[nodiscard]] std::optional<Decoder> get(int reader,
                                           std::optional<std::chrono::nanoseconds> timeout);
  // Messages put to `reader` and not taken yet (an estimate).
  [[nodiscard]] std::size_t behind(int reader) const;
  // The pid of the process attached as `reader`; 0 when none is.
  [[nodiscard]] int reader_pid(int reader) const noexcept;
  // No more put()s; readers take what is there, then get QueueClosed.
  void close() noexcept;
  // The control block's memfd and reader `reader`'s queue (std::out_of_range when this
  // handle has none), for tests that write them as a peer would.
  [[nodiscard]] int control_fd() const noexcept;
  [[nodiscard]] QueueCore& queue(int reader) const;

  struct State;
  explicit BroadcastCore(std::unique_ptr<State> state);

 private:
  std::unique_ptr<State> state_;
};

// Tests and benchmarks reach a Broadcast's core through this (Broadcast befriends it).
struct BroadcastAccess {
  template <class B>
  static BroadcastCore& core(B& b) noexcept {
    return *b.core_;
  }
};

}  // namespace shmtensor::internal
