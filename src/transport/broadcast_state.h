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
#include "os/thread.h"
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
// How long a get() without a deadline waits, in all, for a live process that drops its
// reader slot's messages before it attaches (with a deadline: until the deadline). An
// honest drop is `depth` parses, each quick unless a depot's lock is held (up to 1 s); a
// dropper still there after this is wedged or was named by a peer: the get throws
// ProtocolError and the broadcast stays usable (docs/transport.md, "Broadcast").
inline constexpr std::chrono::seconds kBroadcastDroppingLimit{10};
// Errors in a row after which a drop stops: the queue is broken, not one message.
inline constexpr int kDropErrorsInARow = 8;
// How often the writer's put() looks at whether an attached reader lives (a read of
// /proc/<pid>/stat): at most once per kBroadcastLivenessEvery per reader, and at most once
// per kBroadcastLivenessBusy while that reader's queue is more than half full.
inline constexpr std::chrono::milliseconds kBroadcastLivenessEvery{100};
inline constexpr std::chrono::milliseconds kBroadcastLivenessBusy{1};
// Once a message went to one reader, how long past put()'s deadline each other reader's
// copy may still take (its queue has room, which only a forged count or a full socket
// buffer makes last).
inline constexpr std::chrono::milliseconds kBroadcastDeliverGrace{100};

// The writer deposits dedicated segments (tensors over 256 KiB) in each reader's queue's
// depot, up to this many and this many bytes per queue (QueueCore::allow_dedicated_deposits):
// a tensor sent again (or its segment reused by the arena for the next one) then travels
// without its fd; the depot keeps those segments' memory while the broadcast lives.
inline constexpr int kBroadcastDedicatedDeposits = 16;
inline constexpr std::size_t kBroadcastDedicatedBytes = std::size_t{64} << 20;

// A reader's wait for a message it can predict (BroadcastCore::get): when messages come
// kBroadcastPredictMin to kBroadcastPredictMax apart (closer, the busy poll serves), the
// reader sleeps until kBroadcastSpinAhead before the next one is due, then polls its queue
// without sleeping until kBroadcastSpinAfter past that time, then sleeps as any get. The
// window pays for a wake-up the writer need not make (a futex wake across vCPUs, and the
// reader's wake-up, 20 to 60 µs on a VM) with at most its own length of CPU per message:
// 4 % of a core at one message every 5 ms. When it is due: the writer's schedule as the
// reader sees it (State::Cadence): the mean gap, from the last arrival that was not late.
// Only where the readers and the writer each have a CPU (the reader's affinity mask allows
// more CPUs than there are readers): spinning readers that outnumber the free CPUs take
// the writer's CPU when it is about to put, and every reader's message comes later.
inline constexpr std::chrono::microseconds kBroadcastSpinAhead{100};
inline constexpr std::chrono::microseconds kBroadcastSpinAfter{100};
inline constexpr std::chrono::microseconds kBroadcastPredictMin{400};
inline constexpr std::chrono::milliseconds kBroadcastPredictMax{100};

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
  // Per reader: the fork generation (os/proc.h) `attached` was set in: a get in that same
  // process knows its slot_owner without asking the kernel for its pid.
  std::vector<std::uint32_t> attached_in;
  // The fork generation in which this process was found to be the writer (0: not yet).
  std::atomic<std::uint32_t> writer_in{0};
  bool is_writer() {
    const std::uint32_t generation = fork_generation();
    if (writer_in.load(std::memory_order_relaxed) == generation) return true;
    if (carried >= 0 || writer != current_slot_owner()) return false;
    writer_in.store(generation, std::memory_order_relaxed);
    return true;
  }
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
  // A reader slot's value, validated: a marker, a slot_owner with a possible pid, or
  // reader_dropping of one.
  std::uint64_t reader_word(int i) const {
    const std::uint64_t v = control()->reader[i].load(std::memory_order_seq_cst);
    const std::uint64_t owner = reader_dropper(v);
    if ((owner > kReaderLeft || is_reader_dropping(v)) &&
        (owner_pid(owner) <= 0 || static_cast<std::uint64_t>(owner_pid(owner)) > kBroadcastPidLimit))
      fail("reader " + std::to_string(i) + "'s slot holds " + std::to_string(v));
    return v;
  }
  QueueCore& queue(int i) const {
    if (i < 0 || i >= readers || !queues[static_cast<std::size_t>(i)])
      throw std::out_of_range("Broadcast: this handle has no reader " + std::to_string(i));
    return *queues[static_cast<std::size_t>(i)];
  }
  // Drops reader i's unread messages (their blocks' holds are given back as each is
  // dropped) once this process moved its slot from `from` (its reader's slot_owner, or a
  // dead dropper's word) to reader_dropping(this process), then marks the slot left. False
  // when the slot no longer held `from`. Messages that cannot be parsed are dropped as well.
  bool drop_messages(int i, std::uint64_t from);
  // Settles a slot `v` whose process (reader or dropper) is dead: its messages dropped, the
  // slot left. False when that process lives.
  bool drop_if_dead(int i, std::uint64_t v) {
    const std::uint64_t owner = reader_dropper(v);
    if (owner <= kReaderLeft || slot_owner_alive(owner)) return false;
    (void)drop_messages(i, v);
    return true;
  }
  // Attaches this process as reader i (once per process). False when the deadline passed
  // while a live process dropped the slot's messages (see kBroadcastDroppingLimit).
  bool attach(int i, const Deadline& deadline);
  bool writer_alive() const {
    const std::uint64_t w = control()->writer;
    if (w != writer) fail("its writer word changed");
    return slot_owner_alive(w);
  }
  // Per reader, in this process: the writer's schedule as this reader sees it. A message
  // that came later than its window was most likely on time and found the reader asleep
  // (its wake-up delayed it): the schedule keeps its time, unless three in a row did.
  // A gap outside half to twice the mean is a pause or a burst: the mean starts over at
  // the second such gap in a row. Steady-clock nanoseconds; 0: nothing yet.
  struct Cadence {
    std::mutex mu;
    std::int64_t last = 0;    // the last arrival
    std::int64_t anchor = 0;  // when the last message was (taken to be) sent
    std::int64_t period = 0;  // the mean gap
    int odd = 0, late = 0;    // gaps out of range, and late arrivals, in a row
    // The next message's due time; 0 when none is predicted.
    std::int64_t due() {
      std::lock_guard lock(mu);
      const std::chrono::nanoseconds p(period);
      if (anchor == 0 || p < kBroadcastPredictMin || p > kBroadcastPredictMax) return 0;
      return anchor + period;
    }
    void arrived(std::int64_t t) {
      std::lock_guard lock(mu);
      const std::int64_t gap = t - last;
      last = t;
      if (anchor == 0 || period == 0 || gap > 2 * period || 2 * gap < period) {
        if (anchor == 0 || period == 0 || ++odd >= 2) {
          period = anchor == 0 ? 0 : gap;
          odd = 0;
        }
        anchor = t;
        late = 0;
        return;
      }
      odd = 0;
      period += (gap - period) / 8;
      const std::int64_t predicted = anchor + period;
      const auto after = std::chrono::nanoseconds(kBroadcastSpinAfter).count();
      if (t <= predicted + after || ++late >= 3) {
        anchor = t;
        late = 0;
      } else {
        anchor = predicted;
      }
    }
  };
  std::unique_ptr<Cadence[]> cadence;
  // Whether this process's readers wait for predicted messages (set as it attaches).
  std::atomic<bool> predict{false};
  // The writer's: when put() last looked at whether reader i lives.
  std::vector<std::chrono::steady_clock::time_point> looked_at;
  // put()'s first step for reader i: waits until its queue has room (true) or finds it
  // gone (false: the message skips it). Throws BroadcastTimeout at the deadline.
  bool wait_for_reader(int i, const Deadline& deadline,
                       std::chrono::steady_clock::time_point now);
};

}  // namespace shmtensor::internal
