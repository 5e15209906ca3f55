// The per-user registry of named channels (a Queue created under a name, later a
// Broadcast): name -> (kind, fds, bytes), kept by shmtensor-manager, which hands dups of a
// channel's fds to any process of the same user that opens it by name. The layers that
// make channels (transport) sit above the manager and may not include it, so the manager
// client installs itself here when the program starts, as it does for segment_observer.h;
// without it, every call below throws Error. docs/manager.md, "Named channels".
//
// Contract: a name is 1..kMaxChannelName characters of [A-Za-z0-9_.-], not starting with
// '.'; a kind is a small number that says what the fds are (ChannelKind). The registry
// never interprets fds or bytes: the layer that publishes a kind validates what it gets
// back (it may come from a hostile peer of the same user). A channel lives until its
// creator process ends (pid + start time) or it is unlinked; processes that opened it
// keep what they hold. Thread-safe; each call is one round trip to the manager.
#pragma once

#include <sys/types.h>

#include <cstddef>
#include <cstdint>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "os/socket.h"
#include "os/unique_fd.h"

namespace shmtensor::internal {

inline constexpr std::size_t kMaxChannelName = 128;
// Upper bounds of what one channel may carry (they fit one manager message).
inline constexpr std::size_t kMaxChannelFds = kMaxFdsPerMessage;  // one SCM_RIGHTS message
inline constexpr std::size_t kMaxChannelBytes = 4096;
// Bytes of a kept fd's token (keep_fd).
inline constexpr std::size_t kKeptTokenBytes = 16;

enum class ChannelKind : std::uint32_t {
  kQueue = 1,      // QueueCore: its five fds (queue_lifetime.cc), no bytes
  kBroadcast = 2,  // BroadcastCore: its encoded bytes and fds (broadcast_lifetime.cc)
};

// What open_channel hands back: dups of the publisher's fds (close-on-exec), its bytes.
struct OpenedChannel {
  std::vector<UniqueFd> fds;
  std::string bytes;
};

// One registered channel as the manager sees it.
struct ChannelListing {
  std::string name;
  std::uint32_t kind = 0;
  pid_t creator = 0;
  std::vector<pid_t> openers;  // live processes the manager handed its fds to
};

// What a token of keep_fd held when it was taken.
enum class KeptKind { kFd, kTicket, kUnknown };

struct ChannelRegistry {
  void (*publish)(const std::string& name, ChannelKind kind, std::span<const int> fds,
                  std::string_view bytes, std::uint64_t token);
  OpenedChannel (*open)(const std::string& name, ChannelKind kind, bool look_only);
  void (*unlink)(const std::string& name, std::uint64_t token);
  std::vector<ChannelListing> (*list)();
  void (*keep)(std::string_view token, int fd);
  KeptKind (*take)(std::string_view token, UniqueFd* fd);
  int (*keeper_connection)() noexcept;
};

// Installs `registry` (static storage; replaces an earlier one).
void set_channel_registry(const ChannelRegistry* registry) noexcept;

// True for a valid channel name (see above).
bool is_valid_channel_name(std::string_view name) noexcept;

// Registers `name` as this process's channel of `kind`; the manager keeps dups of `fds`.
// Returns the publication's token (non-zero), which unlink_channel takes to remove this
// publication and no later one of the same name. Throws NameExists when the name is taken, std::invalid_argument for an invalid name or
// too many fds or bytes, Error when the manager cannot be reached or refuses this process.
std::uint64_t publish_channel(const std::string& name, ChannelKind kind,
                              std::span<const int> fds, std::string_view bytes);
// Dups of the fds of the channel `name`. look_only: the caller is not counted as one of
// its ends (`shmtensor ls`). Throws NameNotFound when there is none, Error when it is of
// another kind (the message names both) or the manager cannot be reached.
OpenedChannel open_channel(const std::string& name, ChannelKind kind, bool look_only = false);
// Removes the name (processes that opened the channel keep it). token: only if it is still
// that publication (0: whichever). Throws NameNotFound when there is none (or another).
void unlink_channel(const std::string& name, std::uint64_t token = 0);
// Every channel of this user's manager (group). Throws Error.
std::vector<ChannelListing> list_channels();

// fds and tickets of plain pickles in flight (include/shmtensor/internal/fd_keeper.h is
// their exported face, for the Python package): the manager holds `fd` (-1: a ticket) under
// a 16-byte token until one process takes it, so that a receiver gets it after its sender
// exited. On this process's own connection to the manager, kept while the process lives
// (a forked child makes its own): a keep is one send and no answer, ordered before any
// take that another process makes after receiving the token. Throws Error when the
// manager cannot be reached, std::invalid_argument for a token that is not 16 bytes.
void keep_fd(std::string_view token, int fd);
KeptKind take_kept_fd(std::string_view token, UniqueFd* fd);
// That connection's fd, -1 while there is none (for leak checks).
int keeper_connection_fd() noexcept;

}  // namespace shmtensor::internal
