// Per-thread pools of message states (wire.h): a thread that sends or receives message
// after message reuses the vectors of the last ones instead of allocating new ones.
#include <array>
#include <utility>
#include <vector>

#include "memory/storage_impl.h"
#include "wire/wire.h"

namespace shmtensor::internal {

namespace {

// How many states a thread keeps (a message being encoded while another is decoded, a
// value holding several Decoders: a few cover it), and the most bytes a kept state's
// buffers may hold (a one-off large message does not pin its buffers for good).
constexpr std::size_t kPoolSize = 4;
constexpr std::size_t kMaxKeptBytes = 64 * 1024;

// Whether this thread's pool of State still exists: false once the thread's exit destroyed
// it (a state given back after that, from another thread_local's destructor, is freed).
// Trivially destructible, so it can be read then.
template <class State>
thread_local bool pool_alive = true;

template <class State>
class Pool {
 public:
  ~Pool() { pool_alive<State> = false; }
  std::unique_ptr<State> take() {
    if (size_ == 0) return std::make_unique<State>();
    return std::move(free_[--size_]);
  }
  // Keeps `s` if there is room (no allocation: a fixed array, so that giving back, which
  // runs in destructors, cannot fail); otherwise `s` is freed by the caller.
  void give(std::unique_ptr<State>& s) noexcept {
    if (size_ < kPoolSize) free_[size_++] = std::move(s);
  }

 private:
  std::array<std::unique_ptr<State>, kPoolSize> free_;
  std::size_t size_ = 0;
};

template <class State>
Pool<State>& pool() {
  thread_local Pool<State> p;
  return p;
}

template <class State>
std::unique_ptr<State> take_state() {
  return pool_alive<State> ? pool<State>().take() : std::make_unique<State>();
}

// Called with an emptied state; frees it when the pool is full or gone.
template <class State>
void give_state(std::unique_ptr<State> s) noexcept {
  if (pool_alive<State>) pool<State>().give(s);
}

// Empties `v`, keeping its buffer unless it grew past kMaxKeptBytes (a reserve for a
// hostile count that then failed leaves a vector empty but large). `inline` is a hint GCC
// takes here: without it recycle calls it, ~45 instructions more per message.
template <class T>
inline void reset(std::vector<T>& v) noexcept {
  if (v.capacity() * sizeof(T) > kMaxKeptBytes)
    std::vector<T>().swap(v);
  else
    v.clear();
}

}  // namespace

std::unique_ptr<EncoderState> acquire_encoder_state() { return take_state<EncoderState>(); }

void recycle(std::unique_ptr<EncoderState> st) noexcept {
  if (!st) return;
  reset(st->undo_if_unsent);  // not run: the caller's decision (wire.h)
  reset(st->payload);
  reset(st->storages);
  reset(st->object_fds);
  reset(st->tables);
  reset(st->storage_segment);
  reset(st->fds);
  reset(st->segments);
  reset(st->owned_fds);
  reset(st->in_flight);
  reset(st->in_flight_blocks);
  reset(st->fences);
  give_state(std::move(st));
}

std::unique_ptr<DecoderState> acquire_decoder_state() { return take_state<DecoderState>(); }

void recycle(std::unique_ptr<DecoderState> st) noexcept {
  if (!st) return;
  st->keep.reset();
  st->payload = {};
  st->cursor = 0;
  st->next_object_fd = 0;
  reset(st->storages);
  reset(st->object_fds);
  reset(st->segments);
  reset(st->distinct);
  reset(st->proven);
  give_state(std::move(st));
}

}  // namespace shmtensor::internal
