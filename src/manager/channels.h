// The daemon's registry of named channels: name -> (kind, fds, bytes), with the process
// that created each (pid + start time) and those it was handed to. It never interprets
// the fds or bytes (memory/channel_registry.h is the contract; docs/manager.md, "Named
// channels"). Single-threaded: the daemon's loop owns it.
#pragma once

#include <chrono>
#include <cstdint>
#include <map>
#include <optional>
#include <string>
#include <vector>

#include "os/proc.h"
#include "os/unique_fd.h"

namespace shmtensor::internal::manager {

struct RegisteredChannel {
  std::uint32_t kind = 0;
  std::vector<UniqueFd> fds;
  std::string bytes;
  std::uint64_t token = 0;  // the publisher's, which an unlink may name
  ProcessId creator;
  std::vector<ProcessId> openers;  // every process it was handed to (dead ones pruned on list)
};

class ChannelTable {
 public:
  // 0, or EEXIST when the name is taken.
  int publish(const std::string& name, std::uint32_t kind, std::vector<UniqueFd> fds,
              std::string bytes, std::uint64_t token, const ProcessId& creator);
  // The channel, or nullptr with *err = ENOENT (no such name) or EPROTOTYPE (another kind).
  // Records `opener` as one of its ends unless look_only.
  const RegisteredChannel* open(const std::string& name, std::uint32_t kind,
                                const ProcessId& opener, bool look_only, int* err);
  // 0, or ENOENT when there is no such name (or, token non-zero, its token is another).
  int unlink(const std::string& name, std::uint64_t token);
  // Removes every channel `p` created; returns their names.
  std::vector<std::string> creator_gone(const ProcessId& p);
  // The creators, each once (the daemon watches them).
  std::vector<ProcessId> creators() const;
  // Every channel, its dead openers pruned first.
  const std::map<std::string, RegisteredChannel>& entries();
  bool empty() const noexcept { return channels_.empty(); }

 private:
  std::map<std::string, RegisteredChannel> channels_;
};

// fds and tickets of plain pickles in flight (Python's multiprocessing.Queue, Pool): a token
// -> one fd (or none: a ticket), held until one process takes it, so that a receiver gets
// it after its sender exited. A token whose sender is gone is dropped `grace` after the
// daemon saw it gone (docs/manager.md, "Kept fds and tickets").
class KeptFds {
 public:
  using Clock = std::chrono::steady_clock;
  explicit KeptFds(std::chrono::milliseconds grace) : grace_(grace) {}
  // Keeps `fd` (invalid: a ticket) under `token`, replacing what it held.
  void keep(const std::string& token, UniqueFd fd, const ProcessId& sender);
  enum class Taken { kFd, kTicket, kUnknown };
  // Takes what `token` holds (once): the fd into *fd.
  Taken take(const std::string& token, UniqueFd* fd);
  bool holds(const std::string& token) const { return kept_.contains(token); }
  // Every sender of a token, each once (the daemon watches them).
  std::vector<ProcessId> senders() const;
  // A sender has died: its tokens expire `grace` from now.
  void sender_gone(const ProcessId& p, Clock::time_point now);
  // Drops the expired tokens; returns when the next one expires (nullopt: none will).
  std::optional<Clock::time_point> expire(Clock::time_point now);
  bool empty() const noexcept { return kept_.empty(); }

 private:
  struct Entry {
    UniqueFd fd;
    ProcessId sender;
    std::optional<Clock::time_point> expires;
  };
  std::chrono::milliseconds grace_;
  std::map<std::string, Entry> kept_;
};

}  // namespace shmtensor::internal::manager
