#include "manager/protocol.h"

#include <climits>
#include <cstring>
#include <stdexcept>

#include "memory/channel_registry.h"
#include "shmtensor/error.h"

namespace shmtensor::internal::manager {

namespace {

bool carries_names(MessageType t) {
  return t == MessageType::kRegisterCreated || t == MessageType::kRegisterOpened ||
         t == MessageType::kRegisterHeld || t == MessageType::kRelease;
}

bool names_channel(MessageType t) {
  return t == MessageType::kPublishChannel || t == MessageType::kOpenChannel ||
         t == MessageType::kUnlinkChannel || t == MessageType::kChannelEntry;
}

[[noreturn]] void bad(const std::string& what) {
  throw ProtocolError("shmtensor-manager message: " + what);
}

}  // namespace

bool is_valid_segment_name(std::string_view name) noexcept {
  if (name.size() <= kNamePrefix.size() || name.size() > kMaxNameLength) return false;
  if (name.substr(0, kNamePrefix.size()) != kNamePrefix) return false;
  for (char c : name.substr(kNamePrefix.size())) {
    bool ok =
        (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || (c >= '0' && c <= '9') || c == '_';
    if (!ok) return false;
  }
  return true;
}

void encode_header(MessageType type, std::uint64_t a, std::uint64_t b,
                   MessageHeader* out) noexcept {
  out->magic = kProtocolMagic;
  out->version = kProtocolVersion;
  out->type = static_cast<std::uint16_t>(type);
  out->a = a;
  out->b = b;
}

std::string encode(const Message& m) {
  MessageHeader h{};
  encode_header(m.type, m.a, m.b, &h);
  std::string out(reinterpret_cast<const char*>(&h), sizeof h);
  for (const auto& n : m.names) {
    out += n;
    out.push_back('\0');
  }
  out += m.text;
  if (names_channel(m.type)) {
    out += m.channel;
    out.push_back('\0');
  }
  out += m.data;
  if (out.size() > kMaxMessageSize) throw std::length_error("shmtensor-manager message too long");
  return out;
}

std::vector<std::string> encode_names(MessageType type, const std::vector<std::string>& names) {
  std::vector<std::string> out;
  Message m;
  m.type = type;
  std::size_t size = sizeof(MessageHeader);
  for (const auto& n : names) {
    if (size + n.size() + 1 > kMaxMessageSize && !m.names.empty()) {
      out.push_back(encode(m));
      m.names.clear();
      size = sizeof(MessageHeader);
    }
    m.names.push_back(n);
    size += n.size() + 1;
  }
  if (!m.names.empty()) out.push_back(encode(m));
  return out;
}

Message decode(const void* data, std::size_t size) {
  if (size < sizeof(MessageHeader))
    bad(std::to_string(size) + " bytes, shorter than the 24-byte header");
  if (size > kMaxMessageSize) bad(std::to_string(size) + " bytes, over the limit");
  MessageHeader h;
  std::memcpy(&h, data, sizeof h);
  if (h.magic != kProtocolMagic) bad("bad magic (not a shmtensor client)");
  if (h.version != kProtocolVersion)
    bad("protocol version " + std::to_string(h.version) + ", this manager speaks " +
        std::to_string(kProtocolVersion));
  if (h.type < static_cast<std::uint16_t>(MessageType::kHello) ||
      h.type > static_cast<std::uint16_t>(kLastMessageType))
    bad("unknown type " + std::to_string(h.type));
  Message m;
  m.type = static_cast<MessageType>(h.type);
  m.a = h.a;
  m.b = h.b;
  const char* p = static_cast<const char*>(data) + sizeof h;
  const char* end = static_cast<const char*>(data) + size;
  if (carries_names(m.type)) {
    if (p == end) bad("a name list is empty");
    if (end[-1] != '\0') bad("a name is not NUL-terminated");
    while (p < end) {
      std::size_t len = std::strlen(p);
      std::string_view name(p, len);
      if (!is_valid_segment_name(name))
        bad("invalid segment name \"" + std::string(name.substr(0, 64)) + "\"");
      m.names.emplace_back(name);
      p += len + 1;
    }
    if (m.type == MessageType::kRelease) {
      if (m.names.size() != 1) bad("a release names " + std::to_string(m.names.size()));
      if (m.a > 1) bad("a release's unlinked flag is " + std::to_string(m.a));
    }
  } else if (m.type == MessageType::kRefused) {
    m.text.assign(p, end);
  } else if (names_channel(m.type)) {
    const void* nul = std::memchr(p, '\0', static_cast<std::size_t>(end - p));
    if (nul == nullptr) bad("a channel name is not NUL-terminated");
    m.channel.assign(p, static_cast<const char*>(nul));
    if (!is_valid_channel_name(m.channel))
      bad("invalid channel name \"" + m.channel.substr(0, 64) + "\"");
    m.data.assign(static_cast<const char*>(nul) + 1, end);
    if ((m.type == MessageType::kOpenChannel || m.type == MessageType::kUnlinkChannel) &&
        !m.data.empty())
      bad("unexpected bytes after a channel name");
    if (m.type == MessageType::kOpenChannel && m.b > 1)
      bad("an open's flag is " + std::to_string(m.b));
    if (m.type == MessageType::kPublishChannel && m.b == 0) bad("a publish without a token");
  } else if (m.type == MessageType::kChannelReply) {
    m.data.assign(p, end);
  } else if (m.type == MessageType::kKeepFd || m.type == MessageType::kTakeFd) {
    if (static_cast<std::size_t>(end - p) != kKeptTokenBytes)
      bad("a token of " + std::to_string(end - p) + " bytes, not " +
          std::to_string(kKeptTokenBytes));
    m.data.assign(p, end);
  } else if (p != end) {
    bad("unexpected payload of " + std::to_string(end - p) + " bytes");
  }
  if (m.type == MessageType::kForkChild && (m.b == 0 || m.b > INT_MAX))
    bad("fork child pid " + std::to_string(m.b));
  return m;
}

}  // namespace shmtensor::internal::manager
