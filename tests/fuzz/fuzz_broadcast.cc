// libFuzzer harness for a Broadcast's control block (src/transport/broadcast_control.h) as a
// hostile peer writes it. Each input makes a Broadcast<int64_t> of two readers, both read by
// this process, and runs a sequence of puts and gets that never wait, with writes of any
// value over the control block's words (readers, depth, writer, broken, each reader slot,
// "dropping" words naming this process, a dead one or none among them) between them; then
// the broadcast is encoded, its control block's words written again, and rebuilt from its
// parts. Every call must return or throw one of the errors the API names
// (ProtocolError, BroadcastTimeout, QueueClosed, std::logic_error for a reader slot naming
// another live process): never crash, overrun or wait. While no word was written, every
// reader gets every value put, in order (docs/transport.md, "What a peer that writes the
// shared memory can do").
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
#include "shmtensor/broadcast.h"
#include "fuzz_input.h"
#include "shmtensor/error.h"
#include "transport/broadcast_control.h"

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
    } else {
      write_word(c, in);
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
