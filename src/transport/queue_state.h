// A Queue handle's state in one process (QueueCore::State), and the steps of a queue that
// its files share: places and holder slots (queue_places.cc), the queue's making, sending
// and last drop (queue_lifetime.cc), its puts and gets (queue_core.cc). docs/transport.md,
// "Queue".
#pragma once

#include <atomic>
#include <chrono>
#include <cstdint>
#include <deque>
#include <exception>
#include <memory>
#include <mutex>
#include <optional>

#include "os/mapping.h"
#include "os/proc.h"
#include "os/unique_fd.h"
#include "shmtensor/internal/queue_core.h"
#include "transport/channel.h"
#include "transport/endpoint.h"
#include "transport/queue_control.h"
#include "transport/ring.h"

namespace shmtensor::internal {

struct QueueCore::State {
  UniqueFd send_fd;
  UniqueFd recv_fd;
  UniqueFd control_fd;
  Mapping control_map;
  // The queue's one direction (endpoint.h): its ring (items without fds that fit a slot
  // travel there; the others as datagrams, each announced by a marker slot), its depot, and
  // its readiness fd, readable while an item may be in the ring or the queue is closed, for
  // poll/select callers (multiprocessing.Pool waits on it).
  Endpoint endpoint;
  // Whether this handle counted itself a reader of the readiness fd (for good).
  std::atomic<bool> readiness_counted{false};
  // The name this process published the queue under (create_named), removed when this
  // state goes in that process (not in a forked child's copy).
  std::string name;
  std::uint64_t name_token = 0;  // publish_channel's
  pid_t name_owner = 0;
  int slot = -1;       // our holder slot (-1: none, overflow was set)
  int fork_slot = -1;  // claimed in prepare_fork for the child about to be forked
  // An error get_many() met after it had taken items: thrown by the next get or get_many.
  // One per item that failed, thrown one per call, oldest first. deferred_mu is held
  // across fork (fork handlers); a child starts with none (they are its parent's).
  std::mutex deferred_mu;
  std::deque<std::exception_ptr> deferred;
  std::atomic<bool> has_deferred{false};
  // This handle's own busy-poll budget (set_busy_poll), in nanoseconds; -1: the process's.
  // It holds in the process that set it: a forked child (whose copy of this state is its
  // parent's) follows its own process's setting, as a process the queue is sent to does.
  std::atomic<std::int64_t> busy_poll_ns{-1};
  std::atomic<std::uint32_t> busy_poll_fork_generation{0};
  std::optional<std::chrono::nanoseconds> busy_poll() const {
    const std::int64_t ns = busy_poll_ns.load(std::memory_order_relaxed);
    if (ns < 0 ||
        busy_poll_fork_generation.load(std::memory_order_relaxed) != internal::fork_generation())
      return std::nullopt;
    return std::chrono::nanoseconds(ns);
  }
  QueueControl* control() const { return reinterpret_cast<QueueControl*>(control_map.data()); }
  Ring& ring() noexcept { return endpoint.ring(); }
  // Once the sockets and the control block exist. The depot's fds sit in the receive queue
  // of the sending end: a producer deposits by sending on the receiving end, and nobody
  // takes from the sending end's.
  void bind(Ring ring, UniqueFd ready_fd) noexcept {
    QueueControl* c = control();
    const EndpointWords words{&c->send_lock,  &c->recv_lock, &c->taken_below, &c->readiness_wanted,
                              &c->signalling, &c->closed,    &c->depot,       &c->depot};
    endpoint.bind(std::move(ring), std::move(ready_fd), words,
                  {.send = send_fd.get(),
                   .recv = recv_fd.get(),
                   .deposit = recv_fd.get(),
                   .peek = send_fd.get()},
                  kQueueNames, 1);
  }
};

// ---- Places and holder slots (queue_places.cc) ----

// Frees one item's place; never below 0 (a raw peer may send a datagram for which no
// producer reserved one). Returns whether it freed one (false: the count was 0 already).
bool release_item(QueueControl* c) noexcept;
// One unfinished task fewer (task_done(), or a put that published nothing); join()s asleep
// are woken when none is left. False, and nothing changes, when there was none.
bool finish_task(QueueControl* c) noexcept;
// Takes a free holder slot for `owner` (or a dead holder's); -1 (and the overflow flag) if
// none is free.
int claim_holder(QueueControl* c, std::uint64_t owner) noexcept;

// One item's place in the queue, taken at admission: given back unless sent() was called.
class ItemPlace {
 public:
  ItemPlace() noexcept = default;
  ItemPlace(const ItemPlace&) = delete;
  ItemPlace& operator=(const ItemPlace&) = delete;
  ~ItemPlace() {
    if (control_ == nullptr) return;
    done_sending();
    release_item(control_);
  }
  // `slot`: the taking process's holder slot (-1: it has none, and a death while sending
  // loses the place).
  void take(QueueControl* c, int slot) noexcept {
    control_ = c;
    slot_ = slot;
    if (slot_ >= 0) control_->sending[slot_].fetch_add(1, std::memory_order_acq_rel);
  }
  void sent() noexcept {
    done_sending();
    control_ = nullptr;
  }

 private:
  void done_sending() noexcept {
    if (slot_ < 0) return;
    // Never below 0: a reclaimer may have taken this count already (reclaim_dead_senders,
    // queue_places.cc).
    auto& sending = control_->sending[slot_];
    std::uint32_t n = sending.load(std::memory_order_relaxed);
    while (n > 0 && !sending.compare_exchange_weak(n, n - 1, std::memory_order_acq_rel)) {
    }
  }
  QueueControl* control_ = nullptr;
  int slot_ = -1;
};

// Admission, decided before the item is framed (so a refused put moves nothing into shared
// memory): the queue must be open and, when bounded, have room. Takes the item's place for
// holder slot `slot`. Throws QueueClosed; false when the deadline passed first.
bool admit(QueueControl* c, const Deadline& deadline, int slot, ItemPlace* place);
// Sleeps on `word` while it holds `seen`, for at most 50 ms and until the deadline, counted
// in `sleepers` (whoever changes the word calls FUTEX_WAKE only while that is not 0). False,
// without sleeping, when the deadline has passed.
bool sleep_slice(std::atomic<std::uint32_t>* word, std::uint32_t seen,
                 std::atomic<std::uint32_t>* sleepers, const Deadline& deadline);

// ---- Taking items off the ring (queue_core.cc) ----

// One item taken off the ring, not parsed yet: its bytes at `data` (in `buffer`), or its
// datagram.
struct TakenItem {
  Ring::Status status = Ring::Status::kTimeout;
  std::shared_ptr<std::byte[]> buffer;
  std::byte* data = nullptr;
  std::size_t size = 0;
  std::uint32_t tag = 0;
  std::uint64_t pos = 0;  // a marker's, whose slot stays claimed until released
  // Whether the pop got something: an item, or the end of a closed queue.
  explicit operator bool() const noexcept { return status != Ring::Status::kTimeout; }
};

// Into `at`, max_message() bytes of `buffer`; by default this thread's receive buffer.
TakenItem take_item(Ring& ring, const Deadline& deadline,
                    std::shared_ptr<std::byte[]> buffer = nullptr, std::byte* at = nullptr);

}  // namespace shmtensor::internal
