#include "manager/segments.h"

#include <algorithm>
#include <atomic>
#include <cstdlib>
#include <cstring>

#include "memory/segment_header.h"
#include "os/mapping.h"
#include "os/shm.h"
#include "os/shm_list.h"
#include "shmtensor/error.h"

namespace shmtensor::internal::manager {

namespace {

constexpr char kListPrefix[] = "shmtensor_";

bool header_is_ours(const SegmentHeader& h) {
  return h.magic == kSegmentMagic && h.layout_version == kSegmentLayoutVersion &&
         h.header_size == kSegmentHeaderSize;
}

}  // namespace

pid_t creator_pid_from_name(const std::string& name) noexcept {
  const std::size_t start = sizeof("/shmtensor_") - 1;
  if (name.size() <= start) return 0;
  char* end = nullptr;
  long v = std::strtol(name.c_str() + start, &end, 10);
  if (end == name.c_str() + start || *end != '_' || v <= 0 || v > INT32_MAX) return 0;
  return static_cast<pid_t>(v);
}

SegmentFacts read_segment_facts(const std::string& name) noexcept {
  SegmentFacts f;
  alignas(SegmentHeader) unsigned char buf[sizeof(SegmentHeader)] = {};
  long n = peek_shm(name, buf, sizeof buf, &f.size);
  if (n < 0) return f;
  f.exists = true;
  SegmentHeader h;
  std::memcpy(static_cast<void*>(&h), buf, sizeof h);
  if (n == static_cast<long>(sizeof h) && header_is_ours(h)) {
    f.header_valid = true;
    f.creator_pid = h.creator_pid;
    f.creator_start_time = h.creator_start_time;
    f.refcount = h.refcount.load(std::memory_order_relaxed);
    f.creator_pgid = h.creator_pgid;
  } else {
    f.creator_pid = creator_pid_from_name(name);
  }
  return f;
}

bool creator_alive(const SegmentFacts& facts) noexcept {
  if (facts.header_valid) return is_alive({facts.creator_pid, facts.creator_start_time});
  return facts.creator_pid > 0 && identify_process(facts.creator_pid).start_time != 0;
}

std::optional<std::int64_t> drop_count_of_dead_holder(const std::string& name) noexcept {
  try {
    UniqueFd fd = open_named_shm(name);
    if (inspect_fd(fd.get()).size < kSegmentHeaderSize) return std::nullopt;
    Mapping map = Mapping::map_shared(fd.get(), kSegmentHeaderSize, name.c_str());
    auto* h = reinterpret_cast<SegmentHeader*>(map.data());
    if (std::atomic_ref<std::uint64_t>(h->magic).load(std::memory_order_acquire) != kSegmentMagic ||
        h->layout_version != kSegmentLayoutVersion)
      return std::nullopt;
    // acq_rel, as every release of a count: a decision made on the result sees the other
    // holders' releases.
    return h->refcount.fetch_sub(1, std::memory_order_acq_rel) - 1;
  } catch (const Error&) {
    return std::nullopt;
  }
}

std::vector<SegmentInfo> list_segments() {
  std::vector<SegmentInfo> out;
  auto entries = list_shm(kListPrefix, effective_uid());
  if (entries.empty()) return out;
  // This process maps none of them (headers are read with pread), but a library user
  // calling this maps its own: do not leave them out.
  auto mappers = scan_shm_mappers(kListPrefix, 0);
  for (const auto& e : entries) {
    SegmentInfo info;
    info.name = e.name;
    info.mtime = e.mtime;
    info.facts = read_segment_facts(e.name);
    if (!info.facts.exists) continue;  // removed meanwhile
    info.creator_alive = creator_alive(info.facts);
    if (auto it = mappers.find(e.name); it != mappers.end())
      for (const auto& id : it->second) info.holders.push_back(id.pid);
    out.push_back(std::move(info));
  }
  return out;
}

SweepReport sweep_orphans(bool dry_run, pid_t exclude,
                          const std::map<std::string, std::set<pid_t>>& groups,
                          const std::set<std::string>& skip) {
  SweepReport report;
  auto entries = list_shm(kListPrefix, effective_uid());
  if (entries.empty()) return report;
  auto mappers = scan_shm_mappers(kListPrefix, exclude);
  for (const auto& e : entries) {
    if (skip.count(e.name) != 0) continue;
    SegmentInfo info;
    info.name = e.name;
    info.mtime = e.mtime;
    info.facts = read_segment_facts(e.name);
    if (!info.facts.exists) continue;
    info.creator_alive = creator_alive(info.facts);
    if (auto it = mappers.find(e.name); it != mappers.end())
      for (const auto& id : it->second) info.holders.push_back(id.pid);
    if (auto g = groups.find(e.name); g != groups.end())
      for (pid_t pgid : g->second)
        if (process_group_exists(pgid)) info.live_groups.push_back(pgid);
    // Counts left on a name whose creator is dead and that nobody maps are messages in
    // flight (or counts of holders that died unseen): the creator's relatives may still
    // receive them. Keeping the name until that job ends costs little; removing it loses
    // the message.
    const pid_t creator_group = info.facts.creator_pgid;
    if (info.facts.header_valid && info.facts.refcount > 0 && creator_group > 0 &&
        std::find(info.live_groups.begin(), info.live_groups.end(), creator_group) ==
            info.live_groups.end() &&
        process_group_exists(creator_group))
      info.live_groups.push_back(creator_group);
    bool orphan = !info.creator_alive && info.holders.empty() && info.live_groups.empty();
    if (orphan && (dry_run || unlink_named_shm(e.name)))
      report.removed.push_back(std::move(info));
    else if (!orphan)
      report.kept.push_back(std::move(info));
  }
  return report;
}

}  // namespace shmtensor::internal::manager
