// A Broadcast handle's state in one process (BroadcastCore::State) and what the broadcast's
// files share: the making, sending, naming and last drop of a broadcast
// (broadcast_lifetime.cc), its puts and gets (broadcast.cc). docs/transport.md, "Broadcast".
#pragma once

#include <atomic>
#include <chrono>
#include <cstdint>
#include <memory>
#include <mutex>
#include <stdexcept>
#include <string>
#include <vector>

#include "os/futex.h"
#include "os/mapping.h"
#include "os/proc.h"
#include "os/unique_fd.h"
#include "shmtensor/error.h"
#include "shmtensor/internal/broadcast_core.h"
#include "shmtensor/internal/queue_core.h"
#include "shmtensor/queue.h"
#include "transport/broadcast_control.h"
#include "transport/channel.h"

namespace shmtensor::internal {

inline constexpr std::size_t kBroadcastMaxDepth = 4096;
// How long a reader's get() waits in its queue before it looks at the writer again, and
// the writer's wait for room before it looks at the slow reader again.
inline constexpr std::chrono::milliseconds kBroadcastLookEvery{100};
// A reader's busy-poll budget (busy_poll.h): it adapts down to 1/64 of this when messages
// come further apart, so a reader at a slow cadence spends little polling.
inline constexpr std::chrono::microseconds kBroadcastReaderPoll{50};
// The highest pid Linux hands out (PID_MAX_LIMIT).
inline constexpr std::uint64_t kBroadcastPidLimit = 4194304;
// How long an attach waits for another process's drop of a slot's messages before it
// calls the slot forged. An honest drop is `depth` parses, each of them quick unless a
// depot's lock is held (up to 1 s each): a drop slower than this, or a dropper killed
// mid-drop, also ends here, and breaks the broadcast (docs/transport.md, "Broadcast").
inline constexpr std::chrono::seconds kBroadcastDroppingLimit{2};
// Errors in a row after which a drop stops: the queue is broken, not one message.
inline constexpr int kDropErrorsInARow = 8;

inline int owner_pid(std::uint64_t owner) noexcept { return static_cast<int>(owner >> 32); }

// What the reader's encoded form says about which queues follow.
inline constexpr std::uint32_t kBroadcastAllReaders = 0xffffffffu;

struct BroadcastCore::State {
  UniqueFd control_fd;
  Mapping control_map;
  int readers = 0;
  std::size_t depth = 0;
  std::uint64_t writer = 0;  // as read at creation or decode
  int carried = -1;          // the reader whose queue alone this handle has; -1: all
  std::vector<std::shared_ptr<QueueCore>> queues;
  // A named broadcast's publication (create_named): removed by its process's last handle.
  std::string name;
  std::uint64_t name_token = 0;
  int name_owner = 0;
  // Per reader: the slot_owner this process attached as (0: not attached here). A forked
  // child's copy names its parent, so it attaches anew.
  std::mutex attach_mu;
  std::vector<std::uint64_t> attached;
  BroadcastControl* control() const {
    return reinterpret_cast<BroadcastControl*>(control_map.data());
  }

  [[noreturn]] void fail(const std::string& what) const {
    control()->broken.store(1, std::memory_order_seq_cst);
    throw ProtocolError("Broadcast: " + what + " (a peer wrote its shared memory)");
  }
  void check_broken() const {
    if (control()->broken.load(std::memory_order_acquire) != 0)
      throw ProtocolError("Broadcast is broken: a process found words in its shared memory "
                          "that no honest peer writes");
  }
  // A reader slot's value, validated: a marker, or a slot_owner with a possible pid.
  std::uint64_t reader_word(int i) const {
    const std::uint64_t v = control()->reader[i].load(std::memory_order_seq_cst);
    if (v > kReaderDropping && (owner_pid(v) <= 0 || static_cast<std::uint64_t>(owner_pid(v)) >
                                                         kBroadcastPidLimit))
      fail("reader " + std::to_string(i) + "'s slot holds " + std::to_string(v));
    return v;
  }
  QueueCore& queue(int i) const {
    if (i < 0 || i >= readers || !queues[static_cast<std::size_t>(i)])
      throw std::out_of_range("Broadcast: this handle has no reader " + std::to_string(i));
    return *queues[static_cast<std::size_t>(i)];
  }
  // Drops reader i's unread messages (their blocks' holds are given back as each is
  // dropped) once this process moved its slot from `from` to kReaderDropping, then marks
  // the slot left. Messages that cannot be parsed are dropped as well.
  void drop_messages(int i, std::uint64_t from) {
    std::uint64_t expected = from;
    if (!control()->reader[i].compare_exchange_strong(expected, kReaderDropping,
                                                      std::memory_order_seq_cst))
      return;
    QueueCore& q = queue(i);
    // A message that cannot be parsed is consumed, so errors in a row mean the queue itself
    // is broken (a broken ring, a forged lock): the drop stops there.
    int errors_in_a_row = 0;
    while (errors_in_a_row < kDropErrorsInARow) {
      try {
        if (!q.get(std::chrono::nanoseconds(0))) break;
        errors_in_a_row = 0;
      } catch (const QueueClosed&) {
        break;
      } catch (const Error&) {
        ++errors_in_a_row;
      }
    }
    control()->reader[i].store(kReaderLeft, std::memory_order_seq_cst);
  }
  // Attaches this process as reader i (once per process). False when the deadline passed
  // while another process dropped the slot's messages; a slot that stays "dropping" longer
  // than any drop takes (kBroadcastDroppingLimit) was written by a peer.
  bool attach(int i, const Deadline& deadline) {
    const std::uint64_t me = current_slot_owner();
    std::lock_guard lock(attach_mu);
    if (attached[static_cast<std::size_t>(i)] == me) {
      if (reader_word(i) != me)
        fail("reader " + std::to_string(i) + "'s slot no longer names its process");
      return true;
    }
    const auto start = std::chrono::steady_clock::now();
    for (;;) {
      std::uint64_t v = reader_word(i);
      if (v == kReaderDropping) {
        const auto now = std::chrono::steady_clock::now();
        if (now - start > kBroadcastDroppingLimit)
          fail("reader " + std::to_string(i) + "'s slot stayed 'dropping' for 2 s");
        if (deadline && now >= *deadline) return false;
        // Another process drops the slot's messages: a millisecond's sleep (ended early
        // only by the broken flag).
        futex_wait(&control()->broken, 0, std::chrono::milliseconds(1));
        check_broken();
        continue;
      }
      if (v != kReaderNone && v != kReaderLeft) {
        if (slot_owner_alive(v))
          throw std::logic_error("Broadcast reader " + std::to_string(i) +
                                 " is attached in another process (pid " +
                                 std::to_string(owner_pid(v)) + ")");
        drop_messages(i, v);  // a dead reader's: dropped, then the slot is left
        continue;
      }
      if (control()->reader[i].compare_exchange_strong(v, me, std::memory_order_seq_cst)) break;
    }
    attached[static_cast<std::size_t>(i)] = me;
    queue(i).set_busy_poll(kBroadcastReaderPoll);
    return true;
  }
  bool writer_alive() const {
    const std::uint64_t w = control()->writer;
    if (w != writer) fail("its writer word changed");
    return slot_owner_alive(w);
  }
};

}  // namespace shmtensor::internal
