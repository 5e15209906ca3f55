// The library's side of the named-channel registry (memory/channel_registry.h): each call
// is one request on a connection of its own (greeted_connection), answered before the
// connection closes, so it shares no state with the segment client's connection (client.cc)
// and needs no fork handling. The daemon keeps the channels (channels.h).
#include <cerrno>
#include <cstdlib>
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

// A connection to a daemon that serves named channels. One of an older build (another
// installation's, started first by one of its programs) closes the connection on a
// channel request: say so, and what to do, instead.
UniqueFd channel_connection() {
  pid_t daemon = 0;
  std::uint64_t features = 0;
  UniqueFd conn = greeted_connection(&daemon, &features);
  if ((features & kFeatureChannels) == 0)
    throw Error("the shmtensor-manager serving this user (pid " + std::to_string(daemon) +
                ", group " + manager_location().group +
                ") is of an older shmtensor without named channels. It exits once no "
                "process of that shmtensor uses it; or set SHMTENSOR_MANAGER_GROUP to a group "
                "of this program's own");
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

constexpr ChannelRegistry kRegistry{publish, open, unlink, list};

}  // namespace

const ChannelRegistry& channel_registry_client() noexcept { return kRegistry; }

}  // namespace shmtensor::internal::manager
