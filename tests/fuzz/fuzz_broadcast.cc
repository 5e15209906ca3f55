// libFuzzer harness for a Broadcast's shared words as a hostile peer writes them: its control
// block (src/transport/broadcast_control.h) and its readers' queues' words (each reader's
// Queue: the control block's counts, flags, locks, holder and sending slots, taken_below,
// src/transport/queue_control.h; its ring's hints, counts, closed word and slot words,
// src/transport/ring_layout.h). Each input makes a Broadcast<int64_t> of two readers, both
// read by this process, and runs a sequence of puts and gets that never wait, with writes
// of any value over those words (a control block's reader slots and "dropping" words naming
// this process, a dead one or none among them; lock words naming this thread, a dead one or
// any value) between them; then the broadcast is encoded, its control block's words written
// again, and rebuilt from its parts. Every call must return or throw one of the errors the
// API names (ProtocolError, BroadcastTimeout, QueueClosed, std::logic_error for a reader slot
// naming another live process): never crash, overrun or wait past the lock's grace. While no
// word was written, every reader gets every value put, in order (docs/transport.md, "What a
// peer that writes the shared memory can do").
#include <sys/syscall.h>
#include <unistd.h>

#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <deque>
#include <optional>
#include <stdexcept>
#include <string>
#include <vector>

#include "os/mapping.h"
#include "os/shared_lock.h"
#include "shmtensor/broadcast.h"
#include "fuzz_input.h"
#include "shmtensor/error.h"
#include "transport/broadcast_control.h"
#include "transport/queue_control.h"
#include "transport/ring_layout.h"

namespace {

using shmtensor::Broadcast;
using shmtensor::internal::BroadcastControl;

using shmtensor::fuzz::Input;

// One of the control block's words, written with `v` (or a value near one a process
// writes: none, left, this process's slot_owner or one of another pid or start time, each
// of those as a dropper's, reader_dropping).
void write_word(BroadcastControl* c, Input& in) {
  const std::uint8_t which = in.byte() % 8;
  std::uint64_t v = in.u64();
  const std::uint8_t form = in.byte();
  switch (form % 4) {
    case 0: v %= 3; break;
    case 1: v = c->writer + (v % 3); break;
    case 2: v = (v & 0xffffffff00000000ULL) | (c->writer & 0xffffffffu); break;
    default: break;
  }
  if (form & 4) v = shmtensor::internal::reader_dropping(v);
  switch (which) {
    case 0: c->readers = static_cast<std::uint32_t>(v); break;
    case 1: c->depth = static_cast<std::uint32_t>(v); break;
    case 2: c->writer = v; break;
    case 3: c->broken.store(static_cast<std::uint32_t>(v & 1)); break;
    case 4: c->magic = v; break;
    default: c->reader[(which - 5) % 2].store(v); break;
  }
}

// A value for a lock's state: this thread, a dead one (pids at the top of the kernel's range
// are not in use here), or any.
std::uint64_t lock_value(Input& in) {
  using namespace shmtensor::internal;
  switch (in.byte() % 3) {
    case 0:
      return thread_lock_state(static_cast<std::uint32_t>(::getpid()),
                               static_cast<std::uint32_t>(::syscall(SYS_gettid)));
    case 1: return lock_state(0x3ffff0u + (in.byte() & 7), 12345, in.byte());
    default: return in.u64();
  }
}

// One word of reader `r`'s queue: its control block or its ring (header or a slot's word),
// written with a value near the one there or any.
void write_queue_word(shmtensor::internal::QueueControl* q, shmtensor::internal::RingHeader* h,
                      std::byte* slots, std::uint32_t slot_count, std::uint32_t slot_bytes,
                      Input& in) {
  using namespace shmtensor::internal;
  const std::uint8_t which = in.byte() % 16;
  const std::uint64_t any = in.u64();
  const std::uint64_t near = in.byte() % 5;  // a small value, or a small step from the word's
  auto small = [&](std::uint64_t was) { return in.byte() & 1 ? was + near - 2 : any; };
  switch (which) {
    case 0: q->count.store(static_cast<std::uint32_t>(small(q->count.load()))); break;
    case 1: q->closed.store(static_cast<std::uint32_t>(any & 1)); break;
    case 2: q->in_flight.store(static_cast<std::uint32_t>(small(q->in_flight.load()))); break;
    case 3: q->overflow.store(static_cast<std::uint32_t>(any & 1)); break;
    case 4: q->waiters.store(static_cast<std::uint32_t>(small(q->waiters.load()))); break;
    case 5: q->signalling.store(static_cast<std::uint32_t>(small(q->signalling.load()))); break;
    case 6: q->taken_below = small(q->taken_below); break;
    case 7: q->send_lock.state.store(lock_value(in)); break;
    case 8: q->recv_lock.state.store(lock_value(in)); break;
    case 9: q->holders[any % kQueueHolderSlots].store(in.u64()); break;
    case 10: q->sending[any % kQueueHolderSlots].store(static_cast<std::uint32_t>(in.u64())); break;
    case 11: h->tail.store(small(h->tail.load())); break;
    case 12: h->head.store(small(h->head.load())); break;
    case 13: h->closed.store(static_cast<std::uint32_t>(any & 3)); break;
    case 14: h->consumers_asleep.store(static_cast<std::uint32_t>(small(h->consumers_asleep.load()))); break;
    default: {  // a slot's stored word
      auto* head = reinterpret_cast<SlotHead*>(slots + (any % slot_count) * slot_bytes);
      head->stored.store(in.byte() & 1 ? head->stored.load() + (near << 14) : in.u64());
      break;
    }
  }
}

template <class F>
bool allowed(F&& call) {
  try {
    call();
    return true;
  } catch (const shmtensor::ProtocolError&) {
  } catch (const shmtensor::BroadcastTimeout&) {
  } catch (const shmtensor::QueueClosed&) {
  } catch (const std::logic_error&) {
  }
  return false;
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  Input in(data, size);
  Broadcast<std::int64_t> b(2, 4);
  auto control = shmtensor::internal::Mapping::map_shared(
      shmtensor::internal::BroadcastAccess::core(b).control_fd(), sizeof(BroadcastControl),
      "fuzz");
  auto* c = reinterpret_cast<BroadcastControl*>(control.data());
  // Each reader's queue: its control block and its ring, mapped as a peer would.
  std::vector<shmtensor::internal::Mapping> queue_maps;
  struct QueueWords {
    shmtensor::internal::QueueControl* control;
    shmtensor::internal::RingHeader* ring;
    std::byte* slots;
    std::uint32_t slot_count, slot_bytes;
  } queues[2];
  for (int r = 0; r < 2; ++r) {
    const auto fds = shmtensor::internal::BroadcastAccess::core(b).queue(r).shared_fds();
    queue_maps.push_back(shmtensor::internal::Mapping::map_shared(
        fds.control, sizeof(shmtensor::internal::QueueControl), "fuzz"));
    auto* q = reinterpret_cast<shmtensor::internal::QueueControl*>(queue_maps.back().data());
    queue_maps.push_back(shmtensor::internal::Mapping::map_shared(
        fds.ring, sizeof(shmtensor::internal::RingHeader), "fuzz"));
    auto* h = reinterpret_cast<shmtensor::internal::RingHeader*>(queue_maps.back().data());
    queue_maps.push_back(shmtensor::internal::Mapping::map_shared(fds.ring, h->total_bytes, "fuzz"));
    auto* whole = reinterpret_cast<std::byte*>(queue_maps.back().data());
    queues[r] = {q, h, whole + h->slots_offset, h->slot_count, h->slot_bytes};
  }
  bool written = false;
  std::deque<std::int64_t> expected[2];
  std::int64_t next = 0;
  for (int step = 0; step < 64 && !in.done(); ++step) {
    const std::uint8_t op = in.byte() % 4;
    if (op == 0) {
      const std::int64_t v = next++;
      const bool ok = allowed([&] { b.put(v, shmtensor::Duration(0)); });
      if (!written && ok)
        for (auto& e : expected) e.push_back(v);
      if (!written && !ok && expected[0].size() < 4 && expected[1].size() < 4) std::abort();
    } else if (op == 1 || op == 2) {
      const int r = op - 1;
      std::optional<std::int64_t> got;
      const bool ok = allowed([&] { got = b.reader(r).try_get(shmtensor::Duration(0)); });
      if (!written) {
        if (!ok) std::abort();
        if (got) {
          if (expected[r].empty() || expected[r].front() != *got) std::abort();
          expected[r].pop_front();
        } else if (!expected[r].empty()) {
          std::abort();
        }
      }
    } else if (in.byte() & 1) {
      write_word(c, in);
      written = true;
    } else {
      const QueueWords& q = queues[in.byte() % 2];
      write_queue_word(q.control, q.ring, q.slots, q.slot_count, q.slot_bytes, in);
      written = true;
    }
  }
  // Encoded (refused once broken), written over, rebuilt: a valid broadcast or an error.
  std::optional<shmtensor::internal::MessageFrame> parts;
  if (!allowed([&] { parts.emplace(b.parts()); })) return 0;
  if (!in.done()) write_word(c, in);
  std::vector<int> fds;
  for (int fd : parts->fds()) fds.push_back(::dup(fd));
  const std::string bytes = parts->bytes();
  (void)allowed([&] {
    auto opened = Broadcast<std::int64_t>::from_parts(
        std::span(reinterpret_cast<const std::byte*>(bytes.data()), bytes.size()), fds);
    (void)opened.reader(0).try_get(shmtensor::Duration(0));
  });
  return 0;
}
