#include "manager/channels.h"

#include <algorithm>
#include <cerrno>

namespace shmtensor::internal::manager {

int ChannelTable::publish(const std::string& name, std::uint32_t kind, std::vector<UniqueFd> fds,
                          std::string bytes, std::uint64_t token, const ProcessId& creator) {
  if (channels_.contains(name)) return EEXIST;
  RegisteredChannel& c = channels_[name];
  c.kind = kind;
  c.fds = std::move(fds);
  c.bytes = std::move(bytes);
  c.token = token;
  c.creator = creator;
  return 0;
}

const RegisteredChannel* ChannelTable::open(const std::string& name, std::uint32_t kind,
                                            const ProcessId& opener, bool look_only, int* err) {
  auto it = channels_.find(name);
  if (it == channels_.end()) {
    *err = ENOENT;
    return nullptr;
  }
  if (it->second.kind != kind) {
    *err = EPROTOTYPE;
    return &it->second;
  }
  *err = 0;
  auto& openers = it->second.openers;
  if (!look_only && std::find(openers.begin(), openers.end(), opener) == openers.end())
    openers.push_back(opener);
  return &it->second;
}

int ChannelTable::unlink(const std::string& name, std::uint64_t token) {
  auto it = channels_.find(name);
  if (it == channels_.end() || (token != 0 && it->second.token != token))
    return ENOENT;
  channels_.erase(it);
  return 0;
}

std::vector<std::string> ChannelTable::creator_gone(const ProcessId& p) {
  std::vector<std::string> gone;
  std::erase_if(channels_, [&](const auto& entry) {
    if (!(entry.second.creator == p)) return false;
    gone.push_back(entry.first);
    return true;
  });
  return gone;
}

std::vector<ProcessId> ChannelTable::creators() const {
  std::vector<ProcessId> out;
  for (const auto& [name, c] : channels_)
    if (std::find(out.begin(), out.end(), c.creator) == out.end()) out.push_back(c.creator);
  return out;
}

const std::map<std::string, RegisteredChannel>& ChannelTable::entries() {
  for (auto& [name, c] : channels_)
    std::erase_if(c.openers, [](const ProcessId& p) { return !is_alive(p); });
  return channels_;
}

void KeptFds::keep(const std::string& token, UniqueFd fd, const ProcessId& sender) {
  kept_[token] = Entry{std::move(fd), sender, std::nullopt};
}

KeptFds::Taken KeptFds::take(const std::string& token, UniqueFd* fd) {
  auto it = kept_.find(token);
  if (it == kept_.end()) return Taken::kUnknown;
  const bool ticket = !it->second.fd.valid();
  *fd = std::move(it->second.fd);
  kept_.erase(it);
  return ticket ? Taken::kTicket : Taken::kFd;
}

std::vector<ProcessId> KeptFds::senders() const {
  std::vector<ProcessId> out;
  for (const auto& [token, e] : kept_)
    if (!e.expires && std::find(out.begin(), out.end(), e.sender) == out.end())
      out.push_back(e.sender);
  return out;
}

void KeptFds::sender_gone(const ProcessId& p, Clock::time_point now) {
  for (auto& [token, e] : kept_)
    if (e.sender == p && !e.expires) e.expires = now + grace_;
}

std::optional<KeptFds::Clock::time_point> KeptFds::expire(Clock::time_point now) {
  std::optional<Clock::time_point> next;
  std::erase_if(kept_, [&](const auto& entry) {
    const auto& when = entry.second.expires;
    if (!when) return false;
    if (*when <= now) return true;
    if (!next || *when < *next) next = *when;
    return false;
  });
  return next;
}

}  // namespace shmtensor::internal::manager
