// A Pool worker: runs the tasks its parent sends (pool_protocol.h), one at a time, until
// it is told to stop or its parent's end closes.
#include <map>
#include <string>
#include <utility>

#include "os/code_address.h"
#include "process/pool_protocol.h"
#include "shmtensor/internal/connection_access.h"
#include "shmtensor/connection.h"
#include "shmtensor/internal/current_exception.h"
#include "shmtensor/pool.h"

namespace shmtensor {

namespace internal {

namespace {

void worker_loop(Connection& connection) {
  std::map<std::pair<std::string, std::uint64_t>, std::uintptr_t> resolved;
  auto resolve = [&](std::string module, std::uint64_t offset) {
    auto key = std::make_pair(std::move(module), offset);
    auto it = resolved.find(key);
    if (it != resolved.end()) return it->second;
    std::uintptr_t address = resolve_code_address(CodeAddress{key.first, offset});
    resolved.emplace(std::move(key), address);
    return address;
  };
  for (;;) {
    std::optional<Decoder> d;
    try {
      d.emplace(internal::ConnectionAccess::recv(connection, std::nullopt));
    } catch (const ConnectionClosed&) {
      return;  // the parent is gone or gave up on us
    }
    auto id = d->decode<std::uint64_t>();
    if (id == kStop) return;
    auto entry_module = d->decode<std::string>();
    auto entry_offset = d->decode<std::uint64_t>();
    auto fn_module = d->decode<std::string>();
    auto fn_offset = d->decode<std::uint64_t>();
    Encoder reply;
    reply.encode(id);
    reply.encode(std::uint8_t{1});
    try {
      auto entry = reinterpret_cast<PoolEntry>(resolve(entry_module, entry_offset));
      std::uintptr_t fn = resolve(fn_module, fn_offset);
      entry(fn, *d, reply);
    } catch (...) {
      // The partial reply may hold half a result: start over with the error.
      std::string text = describe_current_exception();
      reply = Encoder();
      reply.encode(id);
      reply.encode(std::uint8_t{0});
      reply.encode(text);
    }
    d.reset();  // drop the arguments (and their shared memory) before replying
    internal::ConnectionAccess::send(connection, std::move(reply));
  }
}

}  // namespace

void pool_worker_main(int /*index*/, WorkerLink link) { worker_loop(*link.connection); }

}  // namespace internal
}  // namespace shmtensor
