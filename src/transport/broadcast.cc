// Broadcast (include/shmtensor/broadcast.h): a control block (broadcast_control.h) and one
// bounded queue per reader (queue.h), of which the writer is the one producer. A message is
// put to every reader's queue or to none: the writer first waits until each queue has room
// (it alone fills them, so the room stays), then puts a copy to each. Each copy is framed
// as a Queue frames it, so a tensor's block is one for all the readers, held by one
// in-flight count per reader's copy. Readers wait in Queue::get (busy poll, spin, futex),
// in slices, between which they look at whether the writer lives.
#include <algorithm>
#include <chrono>
#include <optional>
#include <stdexcept>
#include <string>
#include <vector>

#include "shmtensor/broadcast.h"
#include "transport/broadcast_state.h"

namespace shmtensor::internal {

int BroadcastCore::readers() const noexcept { return state_->readers; }
int BroadcastCore::carried_reader() const noexcept { return state_->carried; }
std::size_t BroadcastCore::depth() const noexcept { return state_->depth; }
int BroadcastCore::control_fd() const noexcept { return state_->control_fd.get(); }

std::size_t BroadcastCore::behind(int reader) const { return state_->queue(reader).size(); }

int BroadcastCore::reader_pid(int reader) const noexcept {
  if (reader < 0 || reader >= state_->readers) return 0;
  const std::uint64_t v = state_->control()->reader[reader].load(std::memory_order_seq_cst);
  return v > kReaderDropping ? owner_pid(v) : 0;
}

void BroadcastCore::close() noexcept {
  for (auto& q : state_->queues)
    if (q) q->close();
}

void BroadcastCore::put(std::vector<Encoder>& messages,
                        std::optional<std::chrono::nanoseconds> timeout) {
  State& st = *state_;
  st.check_broken();
  if (st.carried >= 0 || st.writer != current_slot_owner())
    throw std::logic_error("Broadcast::put: only the process that made the broadcast puts");
  if (messages.size() != static_cast<std::size_t>(st.readers))
    throw std::invalid_argument("Broadcast::put: one encoded copy per reader");
  const Deadline deadline = deadline_after(timeout);
  std::vector<char> skip(static_cast<std::size_t>(st.readers), 0);
  for (int i = 0; i < st.readers; ++i) {
    for (;;) {
      const std::uint64_t v = st.reader_word(i);
      if (v == kReaderLeft || v == kReaderDropping) {
        skip[static_cast<std::size_t>(i)] = 1;
        break;
      }
      QueueCore& q = st.queue(i);
      auto slice = std::chrono::duration_cast<std::chrono::nanoseconds>(kBroadcastLookEvery);
      if (deadline) {
        const auto left = *deadline - std::chrono::steady_clock::now();
        slice = std::clamp(std::chrono::duration_cast<std::chrono::nanoseconds>(left),
                           std::chrono::nanoseconds(0), slice);
      }
      if (q.wait_for_room(std::chrono::nanoseconds(0))) break;
      if (v != kReaderNone && !slot_owner_alive(v)) {
        st.drop_messages(i, v);
        continue;
      }
      if (slice.count() == 0) {
        const std::size_t n = q.size();
        throw BroadcastTimeout("Broadcast::put timed out: reader " + std::to_string(i) +
                                   (v == kReaderNone ? std::string(" (not attached yet)")
                                                     : " (pid " + std::to_string(owner_pid(v)) +
                                                           ")") +
                                   " is " + std::to_string(n) + " messages behind",
                               i, v == kReaderNone ? 0 : owner_pid(v), n);
      }
      (void)q.wait_for_room(slice);
    }
  }
  for (int i = 0; i < st.readers; ++i) {
    if (skip[static_cast<std::size_t>(i)]) continue;
    // Room is there (only this writer fills the queue); a peer that forged the count
    // could make it wait: then the deadline holds.
    std::optional<std::chrono::nanoseconds> left;
    if (deadline)
      left = std::max(std::chrono::nanoseconds(0),
                      std::chrono::duration_cast<std::chrono::nanoseconds>(
                          *deadline - std::chrono::steady_clock::now()));
    if (!st.queue(i).put(std::move(messages[static_cast<std::size_t>(i)]), left)) {
      const std::uint64_t v = st.reader_word(i);
      throw BroadcastTimeout("Broadcast::put timed out: reader " + std::to_string(i) +
                                 "'s queue stayed full (the message went to readers 0 to " +
                                 std::to_string(i - 1) + ")",
                             i, v > kReaderDropping ? owner_pid(v) : 0, st.queue(i).size());
    }
  }
}

std::optional<Decoder> BroadcastCore::get(int reader,
                                          std::optional<std::chrono::nanoseconds> timeout) {
  State& st = *state_;
  st.check_broken();
  QueueCore& q = st.queue(reader);
  const Deadline deadline = deadline_after(timeout);
  if (!st.attach(reader, deadline)) return std::nullopt;
  for (;;) {
    auto slice = std::chrono::duration_cast<std::chrono::nanoseconds>(kBroadcastLookEvery);
    if (deadline) {
      const auto left = *deadline - std::chrono::steady_clock::now();
      slice = std::clamp(std::chrono::duration_cast<std::chrono::nanoseconds>(left),
                         std::chrono::nanoseconds(0), slice);
    }
    std::optional<Decoder> d = q.get(slice);
    st.check_broken();
    if (d) return d;
    (void)st.attach(reader, deadline);  // still ours (validated)
    if (!st.writer_alive()) {
      // Nothing more comes: one more look takes what it published before it died (a place
      // it took and never filled counts in size(), so size() cannot say this).
      if (std::optional<Decoder> last = q.get(std::chrono::nanoseconds(0))) return last;
      throw QueueClosed("Broadcast: its writer (pid " + std::to_string(owner_pid(st.writer)) +
                        ") died and every message it put was taken");
    }
    if (slice.count() == 0 || (deadline && std::chrono::steady_clock::now() >= *deadline))
      return std::nullopt;
  }
}

}  // namespace shmtensor::internal
