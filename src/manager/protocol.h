// The wire format between the library (client) and shmtensor-manager, one SOCK_SEQPACKET
// message each: a fixed 24-byte header, then a payload. docs/manager.md is its prose twin.
//
// Everything a daemon receives is validated by decode(); a message that fails is a
// ProtocolError and the daemon drops that one connection.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

namespace shmtensor::internal::manager {

inline constexpr std::uint32_t kProtocolMagic = 0x4d475453;  // "STGM" little-endian
inline constexpr std::uint16_t kProtocolVersion = 1;
// Upper bound of one message; name lists are split to fit.
inline constexpr std::size_t kMaxMessageSize = 8192;
// Upper bound of a segment name, leading '/' included (NAME_MAX of /dev/shm is 255).
inline constexpr std::size_t kMaxNameLength = 200;
// The prefix of every name the manager tracks or removes.
inline constexpr std::string_view kNamePrefix = "/shmtensor_";

enum class MessageType : std::uint16_t {
  kHello = 1,            // client -> daemon, first message. a: the client's start time
                         // (/proc/<pid>/stat field 22), b: its process group
  kHelloAck = 2,         // daemon -> client. a: daemon pid, b: its features (below)
  kRefused = 3,          // daemon -> client, then close. payload: the reason (text)
  kRegisterCreated = 4,  // names this process is about to create (sent before shm_open)
  kRegisterOpened = 5,   // names this process mapped (it adopted a message's count)
  kRegisterHeld = 6,     // names this process already holds (after a reconnect)
  kRelease = 7,          // one name this process no longer maps. a: 1 if it unlinked it
  kForkBegin = 8,        // this process is about to fork. a: sequence number
  kForkChild = 9,        // sent by the new child on its parent's connection. a: the
                         // sequence number of the kForkBegin, b: the child's pid
  kSync = 10,            // a: token. The daemon answers kSyncAck once all earlier
  kSyncAck = 11,         //   messages are processed and its decisions made. a: token
  // Named channels (memory/channel_registry.h). Each request gets one kChannelReply.
  kPublishChannel = 12,  // a: kind, b: token (non-zero). payload: name, NUL, bytes. fds
  kOpenChannel = 13,     // a: kind, b: 1 = only look (not an end). payload: name, NUL
  kUnlinkChannel = 14,   // b: 0, or only if the channel's token is b. payload: name, NUL
  kListChannels = 15,    // answered by one kChannelEntry per channel, then a kChannelReply
  kChannelReply = 16,    // d->c. a: 0 or an errno (EEXIST, ENOENT, EPROTOTYPE), b: kind.
                         // payload: the channel's bytes (fds attached), or why (text)
  kChannelEntry = 17,    // d->c. a: kind, b: creator pid. payload: name, NUL, opener pids
                         // (decimal, space-separated)
  // fds and tickets of plain pickles in flight (memory/channel_registry.h, keep_fd).
  kKeepFd = 18,          // payload: token (16 bytes); 0 fds (a ticket) or 1. No answer
  kTakeFd = 19,          // payload: token. Answered by one kKeptFd
  kKeptFd = 20,          // d->c. a: 0 (the fd attached), 1 (a ticket) or ENOENT
};
inline constexpr MessageType kLastMessageType = MessageType::kKeptFd;

// What a daemon says it serves in its hello-ack (b); an older daemon says 0.
inline constexpr std::uint64_t kFeatureChannels = 1;  // named channels (types 12..17)
inline constexpr std::uint64_t kFeatureKeeper = 2;    // kept fds and tickets (18..20)
inline constexpr std::uint64_t kDaemonFeatures = kFeatureChannels | kFeatureKeeper;

struct MessageHeader {
  std::uint32_t magic;
  std::uint16_t version;
  std::uint16_t type;
  std::uint64_t a;
  std::uint64_t b;
};
static_assert(sizeof(MessageHeader) == 24);

struct Message {
  MessageType type{};
  std::uint64_t a = 0;
  std::uint64_t b = 0;
  std::vector<std::string> names;  // register*/release
  std::string text;                // refused
  std::string channel;             // the channel messages' name
  std::string data;                // what follows it (bytes, pids), a reply's payload, or a
                                   // kept fd's token
};

// "/shmtensor_" followed by 1..kMaxNameLength-11 characters of [A-Za-z0-9_].
bool is_valid_segment_name(std::string_view name) noexcept;

// Encodes one message. Throws std::length_error if it exceeds kMaxMessageSize.
std::string encode(const Message& m);
// Encodes `names` as one or more messages of type `type`, each within kMaxMessageSize.
std::vector<std::string> encode_names(MessageType type, const std::vector<std::string>& names);
// A header-only message into `out` without allocating (async-signal-safe).
void encode_header(MessageType type, std::uint64_t a, std::uint64_t b, MessageHeader* out) noexcept;
// Parses and validates one received message. Throws ProtocolError saying what is wrong.
Message decode(const void* data, std::size_t size);

}  // namespace shmtensor::internal::manager
