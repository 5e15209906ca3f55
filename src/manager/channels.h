// The daemon's registry of named channels: name -> (kind, fds, bytes), with the process
// that created each (pid + start time) and those it was handed to. It never interprets
// the fds or bytes (memory/channel_registry.h is the contract; docs/manager.md, "Named
// channels"). Single-threaded: the daemon's loop owns it.
#pragma once

#include <cstdint>
#include <map>
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

}  // namespace shmtensor::internal::manager
