#include "memory/channel_registry.h"

#include <atomic>
#include <stdexcept>

#include "os/proc.h"
#include "shmtensor/error.h"
#include "shmtensor/internal/fd_keeper.h"

namespace shmtensor::internal {

namespace {

std::atomic<const ChannelRegistry*> g_registry{nullptr};

const ChannelRegistry& registry() {
  const ChannelRegistry* r = g_registry.load(std::memory_order_acquire);
  if (r == nullptr)
    throw Error("named channels need the shmtensor-manager client, which is not linked in");
  return *r;
}

void check_name(const std::string& name) {
  if (!is_valid_channel_name(name))
    throw std::invalid_argument("invalid channel name \"" + name.substr(0, 64) + "\": 1 to " +
                                std::to_string(kMaxChannelName) +
                                " characters of A-Z a-z 0-9 _ . -, not starting with '.'");
}

}  // namespace

void set_channel_registry(const ChannelRegistry* r) noexcept {
  g_registry.store(r, std::memory_order_release);
}

bool is_valid_channel_name(std::string_view name) noexcept {
  if (name.empty() || name.size() > kMaxChannelName || name[0] == '.') return false;
  for (char c : name) {
    bool ok = (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || (c >= '0' && c <= '9') ||
              c == '_' || c == '.' || c == '-';
    if (!ok) return false;
  }
  return true;
}

std::uint64_t publish_channel(const std::string& name, ChannelKind kind,
                              std::span<const int> fds, std::string_view bytes) {
  check_name(name);
  if (fds.empty() || fds.size() > kMaxChannelFds || bytes.size() > kMaxChannelBytes)
    throw std::invalid_argument("a channel carries 1 to " + std::to_string(kMaxChannelFds) +
                                " fds and at most " + std::to_string(kMaxChannelBytes) +
                                " bytes");
  // Unique among this user's publications: pid and start time of this process, and a
  // count of its publications.
  static std::atomic<std::uint64_t> count{0};
  const ProcessId me = own_process_id();
  const std::uint64_t token = (slot_owner(me.pid, me.start_time) * 0x9e3779b97f4a7c15ULL) ^
                              (count.fetch_add(1, std::memory_order_relaxed) + 1);
  registry().publish(name, kind, fds, bytes, token == 0 ? 1 : token);
  return token == 0 ? 1 : token;
}

OpenedChannel open_channel(const std::string& name, ChannelKind kind, bool look_only) {
  check_name(name);
  return registry().open(name, kind, look_only);
}

void unlink_channel(const std::string& name, std::uint64_t token) {
  check_name(name);
  registry().unlink(name, token);
}

std::vector<ChannelListing> list_channels() { return registry().list(); }

namespace {

void check_token(std::string_view token) {
  if (token.size() != kKeptTokenBytes)
    throw std::invalid_argument("a kept fd's token is " + std::to_string(kKeptTokenBytes) +
                                " bytes, not " + std::to_string(token.size()));
}

}  // namespace

void keep_fd(std::string_view token, int fd) {
  check_token(token);
  registry().keep(token, fd);
}

KeptKind take_kept_fd(std::string_view token, UniqueFd* fd) {
  check_token(token);
  return registry().take(token, fd);
}

int keeper_connection_fd() noexcept {
  const ChannelRegistry* r = g_registry.load(std::memory_order_acquire);
  return r == nullptr ? -1 : r->keeper_connection();
}

}  // namespace shmtensor::internal

namespace shmtensor::internal {

void keep_fd_for_pickle(const std::string& token, int fd) { keep_fd(token, fd); }

KeptFdKind take_fd_of_pickle(const std::string& token, int* fd) {
  UniqueFd taken;
  switch (take_kept_fd(token, &taken)) {
    case KeptKind::kFd:
      *fd = taken.release();
      return KeptFdKind::kFd;
    case KeptKind::kTicket:
      return KeptFdKind::kTicket;
    default:
      return KeptFdKind::kUnknown;
  }
}

int fd_keeper_connection() noexcept { return keeper_connection_fd(); }

}  // namespace shmtensor::internal
