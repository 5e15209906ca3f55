// The library's side of the named-channel registry (memory/channel_registry.h): each call
// is one request on a connection of its own (greeted_connection), answered before the
// connection closes, so it shares no state with the segment client's connection (client.cc)
// and needs no fork handling. The daemon keeps the channels (channels.h).
#include <cerrno>
#include <cstdlib>
#include <mutex>
#include <span>

#include "manager/client.h"
#include "manager/paths.h"
#include "manager/protocol.h"
#include "os/private_dir.h"
#include "memory/channel_registry.h"
#include "os/socket.h"
#include "shmtensor/error.h"

namespace shmtensor::internal::manager {

namespace {

void send_request(int conn, const Message& m, std::span<const int> fds = {}) {
  std::string msg = encode(m);
  const std::span<const std::byte> part = std::as_bytes(std::span(msg));
  send_message(conn, std::span(&part, 1), fds);
}

// Reads the next message of the daemon: a kChannelReply or a kChannelEntry.
Message read_reply(int conn, std::vector<UniqueFd>* fds) {
  std::byte buf[kMaxMessageSize];
  Received r = receive_message(conn, buf);
  if (r.eof) throw Error("shmtensor-manager closed the connection before it answered");
  Message m = decode(buf, r.size);
  if (m.type != MessageType::kChannelReply && m.type != MessageType::kChannelEntry)
    throw ProtocolError("shmtensor-manager answered a channel request with message type " +
                        std::to_string(static_cast<int>(m.type)));
  if (fds != nullptr) {
    *fds = std::move(r.fds);
  } else if (!r.fds.empty()) {
    throw ProtocolError("shmtensor-manager sent fds where none belong");
  }
  return m;
}

// The reply's error as an exception: NameExists, NameNotFound, Error.
void check(const Message& reply) {
  if (reply.type != MessageType::kChannelReply)
    throw ProtocolError("shmtensor-manager answered with a channel entry");
  if (reply.a == 0) return;
  if (reply.a == EEXIST) throw NameExists(reply.data);
  if (reply.a == ENOENT) throw NameNotFound(reply.data);
  throw Error(reply.data);
}

// A connection to a daemon that serves `feature`. One of an older build (another
// installation's, started first by one of its programs) closes the connection on a
// request it does not know: say so, and what to do, instead.
UniqueFd channel_connection(std::uint64_t feature = kFeatureChannels) {
  pid_t daemon = 0;
  std::uint64_t features = 0;
  UniqueFd conn = greeted_connection(&daemon, &features);
  if ((features & feature) == 0)
    throw Error("the shmtensor-manager serving this user (pid " + std::to_string(daemon) +
                ", group " + manager_location().group + ") is of an older shmtensor without " +
                (feature == kFeatureChannels ? "named channels" : "kept fds") +
                ". It exits once no process of that shmtensor uses it; or set "
                "SHMTENSOR_MANAGER_GROUP to a group of this program's own");
  return conn;
}

Message request(MessageType type, const std::string& name, std::uint64_t a, std::uint64_t b) {
  Message m{type, a, b, {}, {}, name, {}};
  return m;
}

void publish(const std::string& name, ChannelKind kind, std::span<const int> fds,
             std::string_view bytes, std::uint64_t token) {
  UniqueFd conn = channel_connection();
  Message m =
      request(MessageType::kPublishChannel, name, static_cast<std::uint32_t>(kind), token);
  m.data = bytes;
  send_request(conn.get(), m, fds);
  check(read_reply(conn.get(), nullptr));
}

OpenedChannel open(const std::string& name, ChannelKind kind, bool look_only) {
  UniqueFd conn = channel_connection();
  send_request(conn.get(), request(MessageType::kOpenChannel, name,
                                   static_cast<std::uint32_t>(kind), look_only ? 1 : 0));
  OpenedChannel out;
  Message reply = read_reply(conn.get(), &out.fds);
  check(reply);
  out.bytes = std::move(reply.data);
  return out;
}

void unlink(const std::string& name, std::uint64_t token) {
  // A publication's own unlink (its creator's last drop, maybe at exit): with no daemon
  // there is no channel, and none is started for it.
  if (token != 0 && !file_exists(manager_location().socket_path)) return;
  UniqueFd conn = channel_connection();
  send_request(conn.get(), request(MessageType::kUnlinkChannel, name, 0, token));
  check(read_reply(conn.get(), nullptr));
}

std::vector<ChannelListing> list() {
  // No daemon, no channel: a listing does not start one.
  if (!file_exists(manager_location().socket_path)) return {};
  UniqueFd conn = channel_connection();
  send_request(conn.get(), Message{MessageType::kListChannels, 0, 0, {}, {}, {}, {}});
  std::vector<ChannelListing> out;
  for (;;) {
    Message m = read_reply(conn.get(), nullptr);
    if (m.type == MessageType::kChannelReply) {
      check(m);
      return out;
    }
    ChannelListing l;
    l.name = m.channel;
    l.kind = static_cast<std::uint32_t>(m.a);
    l.creator = static_cast<pid_t>(m.b);
    const char* p = m.data.c_str();
    while (*p != '\0') {
      char* end = nullptr;
      long pid = std::strtol(p, &end, 10);
      if (end == p || pid <= 0) throw ProtocolError("shmtensor-manager sent a bad pid list");
      l.openers.push_back(static_cast<pid_t>(pid));
      p = end;
      while (*p == ' ') ++p;
    }
    out.push_back(std::move(l));
  }
}

// ---- kept fds and tickets --------------------------------------------------------------
// One connection per process, kept for its life (a keep is one send, no answer: it must go
// on a connection the daemon has accepted, and stay ordered before later requests). The
// manager client's fork handlers (client.cc) hold its lock across fork, and the child
// closes its copy of the parent's connection.

struct Keeper {
  std::mutex mu;
  UniqueFd fd;
};

Keeper& keeper() {
  static Keeper* k = [] {
    install_client_fork_handlers();  // they hold and reset this one's lock too
    return new Keeper;               // leaked: used until exit
  }();
  return *k;
}

// Sends `m` (with `fd` attached unless -1) on the keeper connection, connecting first; a
// connection that failed (the daemon exited or died) is replaced once.
void keeper_send(Keeper& k, const Message& m, int fd) {
  std::string msg = encode(m);
  const std::span<const std::byte> part = std::as_bytes(std::span(msg));
  const int raw[] = {fd};
  const std::span<const int> fds = fd >= 0 ? std::span<const int>(raw) : std::span<const int>();
  for (int attempt = 0;; ++attempt) {
    if (!k.fd) k.fd = channel_connection(kFeatureKeeper);
    try {
      send_message(k.fd.get(), std::span(&part, 1), fds);
      return;
    } catch (const SystemError&) {
      k.fd.reset();
      if (attempt == 1) throw;
    }
  }
}

void keep(std::string_view token, int fd) {
  Keeper& k = keeper();
  std::lock_guard lock(k.mu);
  keeper_send(k, Message{MessageType::kKeepFd, 0, 0, {}, {}, {}, std::string(token)}, fd);
}

KeptKind take(std::string_view token, UniqueFd* fd) {
  Keeper& k = keeper();
  std::lock_guard lock(k.mu);
  keeper_send(k, Message{MessageType::kTakeFd, 0, 0, {}, {}, {}, std::string(token)}, -1);
  std::byte buf[kMaxMessageSize];
  Received r;
  try {
    r = receive_message(k.fd.get(), buf);
  } catch (...) {
    k.fd.reset();  // whatever it was, the next request starts on a fresh connection
    throw;
  }
  if (r.eof) {
    k.fd.reset();
    throw Error("shmtensor-manager closed the connection before it answered");
  }
  Message m = decode(buf, r.size);
  if (m.type != MessageType::kKeptFd || r.fds.size() != (m.a == 0 ? 1u : 0u)) {
    k.fd.reset();
    throw ProtocolError("shmtensor-manager answered a take with message type " +
                        std::to_string(static_cast<int>(m.type)) + " and " +
                        std::to_string(r.fds.size()) + " fds");
  }
  if (m.a == 0) {
    *fd = std::move(r.fds[0]);
    return KeptKind::kFd;
  }
  return m.a == 1 ? KeptKind::kTicket : KeptKind::kUnknown;
}

int keeper_connection() noexcept {
  Keeper& k = keeper();
  std::lock_guard lock(k.mu);
  return k.fd ? k.fd.get() : -1;
}

constexpr ChannelRegistry kRegistry{publish, open, unlink, list, keep, take, keeper_connection};

}  // namespace

const ChannelRegistry& channel_registry_client() noexcept { return kRegistry; }

void keeper_prepare_fork() noexcept { keeper().mu.lock(); }

void keeper_parent_after_fork() noexcept { keeper().mu.unlock(); }

void keeper_child_after_fork() noexcept {
  Keeper& k = keeper();
  k.fd.reset();  // our copy only: the parent's connection stays the parent's
  k.mu.unlock();
}

}  // namespace shmtensor::internal::manager
