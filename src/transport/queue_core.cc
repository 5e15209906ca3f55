#include <atomic>
#include <thread>

#include "os/futex.h"
#include "os/mapping.h"
#include "os/shm.h"
#include "os/socket.h"
#include "shmtensor/queue.h"
#include "transport/channel.h"
#include "wire/wire.h"

namespace shmtensor::internal {

namespace {

constexpr std::uint64_t kQueueMagic = 0x314555455154534dULL;  // "MSTQUEU1"
constexpr std::uint32_t kQueueLayoutVersion = 1;

// Shared by every process holding the queue (a sealed memfd, so it can be passed on).
struct QueueControl {
  std::uint64_t magic;
  std::uint32_t layout_version;
  std::uint32_t size_of;
  std::uint64_t maxsize;  // 0 = unbounded
  // Items put and not yet taken. Futex word of producers waiting for room. A producer
  // reserves a slot by CAS before sending (acq_rel pairs with consumers' release of a slot),
  // so at most maxsize items are ever in the socket.
  alignas(64) std::atomic<std::uint32_t> count;
  // 1 once close() was called anywhere; also a futex wake-up source for producers.
  alignas(64) std::atomic<std::uint32_t> closed;
  std::uint8_t pad[60];
};
static_assert(std::is_standard_layout_v<QueueControl>);
static_assert(sizeof(QueueControl) == 192);

}  // namespace

struct QueueCore::State {
  UniqueFd send_fd;
  UniqueFd recv_fd;
  UniqueFd control_fd;
  Mapping control_map;
  QueueControl* control() const { return reinterpret_cast<QueueControl*>(control_map.data()); }
};

QueueCore::QueueCore(std::unique_ptr<State> state) : state_(std::move(state)) {}
QueueCore::~QueueCore() = default;

std::shared_ptr<QueueCore> QueueCore::create(std::size_t maxsize) {
  if (maxsize > 0x7fffffff) throw std::invalid_argument("Queue maxsize too large");
  auto st = std::make_unique<State>();
  auto [a, b] = seqpacket_pair();
  st->send_fd = std::move(a);
  st->recv_fd = std::move(b);
  st->control_fd = create_sealed_memfd(sizeof(QueueControl));
  st->control_map = Mapping::map_shared(st->control_fd.get(), sizeof(QueueControl), "queue control");
  auto* c = st->control();
  c->layout_version = kQueueLayoutVersion;
  c->size_of = sizeof(QueueControl);
  c->maxsize = maxsize;
  c->count.store(0, std::memory_order_relaxed);
  c->closed.store(0, std::memory_order_relaxed);
  std::atomic_ref<std::uint64_t>(c->magic).store(kQueueMagic, std::memory_order_release);
  return std::make_shared<QueueCore>(std::move(st));
}

std::shared_ptr<QueueCore> QueueCore::adopt(int send_fd, int recv_fd, int control_fd) {
  auto st = std::make_unique<State>();
  st->send_fd.reset(send_fd);
  st->recv_fd.reset(recv_fd);
  st->control_fd.reset(control_fd);
  FdFacts facts = inspect_fd(control_fd);
  if (!facts.sealed_against_resize || facts.size != sizeof(QueueControl))
    throw ProtocolError("received queue control block has the wrong size or is not sealed");
  st->control_map = Mapping::map_shared(control_fd, sizeof(QueueControl), "queue control");
  auto* c = st->control();
  if (std::atomic_ref<std::uint64_t>(c->magic).load(std::memory_order_acquire) != kQueueMagic ||
      c->layout_version != kQueueLayoutVersion || c->size_of != sizeof(QueueControl) ||
      c->maxsize > 0x7fffffff)
    throw ProtocolError("received queue control block is invalid");
  return std::make_shared<QueueCore>(std::move(st));
}

bool QueueCore::put(Encoder&& e, std::optional<std::chrono::nanoseconds> timeout) {
  auto* c = state_->control();
  using Clock = std::chrono::steady_clock;
  const auto deadline = timeout ? Clock::now() + *timeout : Clock::time_point::max();
  const std::uint32_t maxsize = static_cast<std::uint32_t>(c->maxsize);
  // Reserve a slot (bounded) or just count (unbounded).
  for (;;) {
    if (c->closed.load(std::memory_order_acquire)) throw QueueClosed("put() on a closed queue");
    std::uint32_t n = c->count.load(std::memory_order_acquire);
    if (maxsize == 0 || n < maxsize) {
      if (c->count.compare_exchange_weak(n, n + 1, std::memory_order_acq_rel)) break;
      continue;
    }
    // Bounded sleeps: a close() that lands between our check of `closed` and the wait
    // would otherwise wake nobody.
    std::chrono::nanoseconds left = std::chrono::milliseconds(50);
    if (timeout) {
      auto until = deadline - Clock::now();
      if (until <= until.zero()) return false;
      left = std::min(left, std::chrono::duration_cast<std::chrono::nanoseconds>(until));
    }
    futex_wait(&c->count, n, left);
  }
  try {
    OutgoingFrame frame = finish_frame(std::move(e));
    if (timeout) {
      // Non-blocking sends until the deadline: the socket buffer may be full.
      while (!send_frame(state_->send_fd.get(), frame, true)) {
        auto left = deadline - Clock::now();
        if (left <= left.zero()) {
          c->count.fetch_sub(1, std::memory_order_acq_rel);
          futex_wake(&c->count, 1);
          return false;
        }
        std::this_thread::sleep_for(std::chrono::microseconds(200));
      }
    } else {
      send_frame(state_->send_fd.get(), frame);
    }
  } catch (const SystemError& err) {
    c->count.fetch_sub(1, std::memory_order_acq_rel);
    futex_wake(&c->count, 1);
    if (err.error_code() == EPIPE) throw QueueClosed("put() on a closed queue");
    throw;
  } catch (...) {
    c->count.fetch_sub(1, std::memory_order_acq_rel);
    futex_wake(&c->count, 1);
    throw;
  }
  return true;
}

std::optional<Decoder> QueueCore::get(std::optional<std::chrono::nanoseconds> timeout) {
  auto* c = state_->control();
  RecvResult r;
  try {
    r = recv_value(state_->recv_fd.get(), timeout);
  } catch (const ProtocolError&) {
    // The malformed datagram was consumed: its slot is free again.
    c->count.fetch_sub(1, std::memory_order_acq_rel);
    if (c->maxsize) futex_wake(&c->count, 1);
    throw;
  }
  if (r.status == RecvStatus::kTimeout) return std::nullopt;
  if (r.status == RecvStatus::kEof) throw QueueClosed("get() on a closed and empty queue");
  // release: a producer that sees the freed slot may reuse it.
  c->count.fetch_sub(1, std::memory_order_acq_rel);
  if (c->maxsize) futex_wake(&c->count, 1);
  return std::move(r.decoder);
}

void QueueCore::close() noexcept {
  auto* c = state_->control();
  c->closed.store(1, std::memory_order_release);
  // Readers everywhere get EOF once drained; writers get EPIPE.
  shutdown_write(state_->send_fd.get());
  // Wake producers waiting for room so they see `closed`.
  c->count.fetch_add(0, std::memory_order_acq_rel);
  futex_wake(&c->count, 0x7fffffff);
}

bool QueueCore::closed() const noexcept {
  return state_->control()->closed.load(std::memory_order_acquire) != 0;
}

std::size_t QueueCore::size() const noexcept {
  return state_->control()->count.load(std::memory_order_relaxed);
}

std::size_t QueueCore::maxsize() const noexcept { return state_->control()->maxsize; }

void QueueCore::encode(Encoder& e) const {
  e.write_fd(state_->send_fd.get());
  e.write_fd(state_->recv_fd.get());
  e.write_fd(state_->control_fd.get());
}

}  // namespace shmtensor::internal
