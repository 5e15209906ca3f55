#include "manager/tracker.h"

#include <algorithm>
#include <optional>

namespace shmtensor::internal::manager {

namespace {

void add_unique(std::vector<ProcessId>& v, const ProcessId& p) {
  if (std::find(v.begin(), v.end(), p) == v.end()) v.push_back(p);
}

// Fork snapshots a process keeps for children whose kForkChild has not arrived yet. A
// child sends it right after fork, so more than a few outstanding means they were lost
// (a child killed between fork and its handler, a full socket buffer).
constexpr std::size_t kMaxForkSnapshots = 16;

}  // namespace

Tracker::ProcState& Tracker::process(const ProcessId& p, pid_t group) {
  auto it = procs_.find(p.pid);
  if (it != procs_.end() && !(it->second.id == p)) {
    // The pid was recycled: the process we knew under it is dead.
    died(it->second.id);
    it = procs_.find(p.pid);
  }
  if (it == procs_.end()) {
    if (group <= 0) group = env_.process_group(p.pid);
    it = procs_.emplace(p.pid, ProcState{p, group, {}, {}}).first;
  } else if (it->second.group <= 0 && group > 0) {
    it->second.group = group;
  }
  return it->second;
}

Tracker::NameState& Tracker::name_state(const std::string& name, bool adopted) {
  auto [it, inserted] = names_.try_emplace(name);
  if (inserted) it->second.adopted = adopted;
  return it->second;
}

void Tracker::hold(ProcState& proc, const std::string& name, bool adopted) {
  NameState& ns = name_state(name, adopted);
  if (adopted && ns.holders.empty() && ns.ex_holders.empty()) env_.noted_adopt(name);
  proc.holds.insert(name);
  if (ns.holders.insert(proc.id.pid).second) env_.noted_hold(name, proc.id, proc.group);
  ns.released_by.erase(proc.id.pid);
  add_unique(ns.ex_holders, proc.id);
  if (proc.group > 0) ns.groups.insert(proc.group);
  ns.keepers.clear();
  ns.keeper_groups.clear();
  dirty_.erase(name);
  pending_.erase(name);
}

void Tracker::forget(const std::string& name) {
  auto it = names_.find(name);
  if (it == names_.end()) return;
  std::set<pid_t> holders = std::move(it->second.holders);
  names_.erase(it);
  env_.forgotten(name);
  dirty_.erase(name);
  pending_.erase(name);
  for (pid_t pid : holders) {
    auto p = procs_.find(pid);
    if (p == procs_.end()) continue;
    p->second.holds.erase(name);
    erase_if_unused(pid);
  }
}

void Tracker::erase_if_unused(pid_t pid) {
  auto it = procs_.find(pid);
  if (it != procs_.end() && it->second.holds.empty() && it->second.fork_snapshots.empty())
    procs_.erase(it);
}

void Tracker::registered(const ProcessId& p, const std::string& name, Registration how,
                         pid_t group) {
  const bool adopted = how == Registration::kHeld && names_.count(name) == 0;
  hold(process(p, group), name, adopted);
}

void Tracker::released(const ProcessId& p, const std::string& name, bool unlinked) {
  if (unlinked) {
    forget(name);
    return;
  }
  auto pit = procs_.find(p.pid);
  if (pit != procs_.end() && pit->second.id == p) {
    pit->second.holds.erase(name);
    erase_if_unused(p.pid);
  }
  auto nit = names_.find(name);
  if (nit == names_.end()) return;  // a count of a name we never heard of: not ours to decide
  if (nit->second.holders.erase(p.pid) != 0) env_.noted_release(name, p.pid);
  nit->second.released_by.insert(p.pid);
  check_silent_holders(name);
}

bool Tracker::connected(pid_t pid) const {
  auto it = connections_.find(pid);
  return it != connections_.end() && it->second > 0;
}

void Tracker::check_silent_holders(const std::string& name) {
  auto nit = names_.find(name);
  if (nit == names_.end()) return;
  NameState& ns = nit->second;
  std::vector<pid_t> gone;
  for (pid_t h : ns.holders) {
    // A connected holder may not map it yet (a creator between register and mmap).
    if (!connected(h) && !env_.maps(h, name)) gone.push_back(h);
  }
  for (pid_t h : gone) {
    ns.holders.erase(h);
    env_.noted_release(name, h);
    if (!ns.adopted) env_.drop_count(name);
    auto p = procs_.find(h);
    if (p != procs_.end()) {
      p->second.holds.erase(name);
      erase_if_unused(h);
    }
  }
  if (ns.holders.empty()) dirty_.insert(name);
}

void Tracker::connection_opened(const ProcessId& p) { ++connections_[p.pid]; }

void Tracker::connection_closed(const ProcessId& p) {
  auto it = connections_.find(p.pid);
  if (it != connections_.end() && --it->second <= 0) connections_.erase(it);
  if (connected(p.pid)) return;
  if (!env_.alive(p)) {
    died(p);
    return;
  }
  auto pit = procs_.find(p.pid);
  if (pit == procs_.end() || !(pit->second.id == p)) return;
  std::vector<std::string> names(pit->second.holds.begin(), pit->second.holds.end());
  for (const auto& name : names) check_silent_holders(name);
}

void Tracker::fork_begin(const ProcessId& parent, std::uint64_t seq) {
  auto it = procs_.find(parent.pid);
  if (it == procs_.end() || !(it->second.id == parent) || it->second.holds.empty()) return;
  auto& snaps = it->second.fork_snapshots;
  snaps[seq] = std::vector<std::string>(it->second.holds.begin(), it->second.holds.end());
  while (snaps.size() > kMaxForkSnapshots) snaps.erase(snaps.begin());
}

void Tracker::fork_child(const ProcessId& parent, std::uint64_t seq, pid_t child) {
  auto it = procs_.find(parent.pid);
  if (it == procs_.end() || !(it->second.id == parent)) return;
  auto snap = it->second.fork_snapshots.extract(seq);
  // A child starts in its parent's process group (and rarely leaves it).
  const pid_t parent_group = it->second.group;
  erase_if_unused(parent.pid);
  if (snap.empty()) return;
  const ProcessId cid = env_.identify(child);
  if (cid.start_time == 0) {
    // The child is gone already: it died holding the counts it got at fork.
    for (const auto& name : snap.mapped()) {
      auto n = names_.find(name);
      if (n == names_.end()) continue;
      if (!n->second.adopted) env_.drop_count(name);
      if (n->second.holders.empty()) dirty_.insert(name);
    }
    return;
  }
  auto known = procs_.find(child);
  if (known != procs_.end() && known->second.id == cid) return;  // it registered itself
  ProcState& cp = process(cid, parent_group);
  for (const auto& name : snap.mapped())
    if (names_.count(name) != 0) hold(cp, name, false);
  erase_if_unused(child);
}

void Tracker::died(const ProcessId& dead) {
  const ProcessId p = dead;  // `dead` may refer into procs_, erased below
  auto it = procs_.find(p.pid);
  if (it != procs_.end() && it->second.id == p) {
    std::set<std::string> holds = std::move(it->second.holds);
    procs_.erase(it);
    for (const auto& name : holds) {
      auto n = names_.find(name);
      if (n == names_.end()) continue;
      n->second.holders.erase(p.pid);
      env_.noted_release(name, p.pid);
      // Its count would never be released: take it off, so that the refcount again counts
      // live holders plus messages in flight.
      if (!n->second.adopted) env_.drop_count(name);
      if (n->second.holders.empty()) dirty_.insert(name);
    }
  }
  // It may have kept pending names (as a mapper, an ex-holder or a creator).
  dirty_.insert(pending_.begin(), pending_.end());
}

void Tracker::adopt(const std::string& name, const std::set<pid_t>& groups) {
  const bool fresh = names_.count(name) == 0;
  NameState& ns = name_state(name, true);
  if (fresh) env_.noted_adopt(name);
  for (pid_t g : groups)
    if (ns.groups.insert(g).second) env_.noted_group(name, g);
  dirty_.insert(name);
}

JournalState Tracker::snapshot() const {
  JournalState out;
  for (const auto& [name, ns] : names_) {
    JournaledName& j = out.names[name];
    j.adopted = ns.adopted;
    j.groups = ns.groups;
    auto group_of = [&](pid_t pid) {
      auto p = procs_.find(pid);
      return p == procs_.end() ? pid_t{0} : p->second.group;
    };
    for (const auto& p : ns.ex_holders) j.ex_holders.push_back({p, group_of(p.pid)});
    for (pid_t pid : ns.holders) {
      auto p = procs_.find(pid);
      if (p == procs_.end()) continue;
      JournaledHolder h{p->second.id, p->second.group};
      j.holders.push_back(h);
      if (std::find(ns.ex_holders.begin(), ns.ex_holders.end(), h.id) == ns.ex_holders.end())
        j.ex_holders.push_back(h);
    }
  }
  return out;
}

void Tracker::restore(const JournalState& state) {
  for (const auto& [name, j] : state.names) {
    NameState& ns = names_[name];
    ns.adopted = j.adopted;
    ns.groups.insert(j.groups.begin(), j.groups.end());
    for (const auto& h : j.ex_holders) add_unique(ns.ex_holders, h.id);
    for (const auto& h : j.holders) {
      ProcState& p = process(h.id, h.group);
      p.holds.insert(name);
      ns.holders.insert(h.id.pid);
    }
    dirty_.insert(name);
  }
  // Holders that ended while no daemon watched: as if we had seen them go.
  std::vector<ProcessId> ids;
  for (const auto& [pid, p] : procs_) ids.push_back(p.id);
  for (const auto& id : ids)
    if (!env_.alive(id)) died(id);
}

void Tracker::group_ended() { dirty_.insert(pending_.begin(), pending_.end()); }

std::vector<std::string> Tracker::settle() {
  std::vector<std::string> unlinked;
  std::vector<std::string> todo;
  for (const auto& name : dirty_) {
    auto it = names_.find(name);
    if (it == names_.end()) continue;
    if (!it->second.holders.empty()) {
      pending_.erase(name);
      continue;
    }
    todo.push_back(name);
  }
  dirty_.clear();
  // The scan of every process's maps is the expensive part: made once, and only when the
  // cheaper facts (a live ex-holder, a live creator) do not settle some name.
  std::optional<std::unordered_map<std::string, std::vector<ProcessId>>> mappers;
  for (const auto& name : todo) {
    NameState& ns = names_[name];
    const SegmentFacts f = env_.facts(name);
    if (!f.exists) {
      forget(name);
      continue;
    }
    // Drop dead ex-holders for good: a pid never comes back with the same start time.
    std::erase_if(ns.ex_holders, [&](const ProcessId& p) { return !env_.alive(p); });
    const bool in_flight = !ns.adopted && f.header_valid && f.refcount > 0;
    std::vector<ProcessId> keep;
    std::vector<pid_t> keep_groups;
    if (ns.adopted) {
      ProcessId creator = f.header_valid ? ProcessId{f.creator_pid, f.creator_start_time}
                                         : env_.identify(f.creator_pid);
      if (creator.pid > 0 && env_.alive(creator)) keep.push_back(creator);
    } else if (in_flight) {
      keep = ns.ex_holders;
    }
    if (keep.empty()) {
      if (!mappers) mappers = env_.scan_mappers();
      if (auto m = mappers->find(name); m != mappers->end())
        for (const auto& p : m->second)
          if (ns.released_by.count(p.pid) == 0) keep.push_back(p);
    }
    if (keep.empty() && (in_flight || ns.adopted)) {
      for (pid_t g : ns.groups)
        if (env_.group_alive(g)) keep_groups.push_back(g);
    }
    if (keep.empty() && keep_groups.empty()) {
      env_.unlink(name);
      unlinked.push_back(name);
      forget(name);
    } else {
      ns.keepers = std::move(keep);
      ns.keeper_groups = std::move(keep_groups);
      pending_.insert(name);
    }
  }
  return unlinked;
}

std::vector<ProcessId> Tracker::watched() const {
  std::vector<ProcessId> out;
  for (const auto& [pid, proc] : procs_) add_unique(out, proc.id);
  for (const auto& name : pending_) {
    auto it = names_.find(name);
    if (it == names_.end()) continue;
    for (const auto& p : it->second.keepers) add_unique(out, p);
  }
  return out;
}

std::vector<pid_t> Tracker::watched_groups() const {
  std::set<pid_t> out;
  for (const auto& name : pending_) {
    auto it = names_.find(name);
    if (it != names_.end())
      out.insert(it->second.keeper_groups.begin(), it->second.keeper_groups.end());
  }
  return {out.begin(), out.end()};
}

bool Tracker::idle() const {
  if (!dirty_.empty()) return false;
  for (const auto& [pid, proc] : procs_)
    if (!proc.holds.empty()) return false;
  return pending_.empty();
}

std::vector<pid_t> Tracker::holders_of(const std::string& name) const {
  auto it = names_.find(name);
  if (it == names_.end()) return {};
  return {it->second.holders.begin(), it->second.holders.end()};
}

}  // namespace shmtensor::internal::manager
