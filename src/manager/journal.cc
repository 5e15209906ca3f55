#include "manager/journal.h"

#include <algorithm>
#include <cstdio>
#include <sstream>

#include "manager/protocol.h"
#include "manager/segments.h"
#include "os/private_dir.h"
#include "os/shm_list.h"

namespace shmtensor::internal::manager {

namespace {

std::string hold_line(const std::string& name, const ProcessId& p, pid_t group) {
  return "H " + name + " " + std::to_string(p.pid) + " " + std::to_string(p.start_time) + " " +
         std::to_string(group) + "\n";
}

void add_holder(std::vector<JournaledHolder>& v, const JournaledHolder& h) {
  for (auto& x : v)
    if (x.id.pid == h.id.pid) {
      x = h;
      return;
    }
  v.push_back(h);
}

}  // namespace

Journal::Journal(std::string path) : path_(std::move(path)), fd_(open_for_append(path_)) {}

void Journal::hold(const std::string& name, const ProcessId& p, pid_t group) {
  if (fd_) pending_ += hold_line(name, p, group);
}

void Journal::release(const std::string& name, pid_t pid) {
  if (!fd_) return;
  pending_ += "R " + name + " " + std::to_string(pid) + "\n";
  flush();
}

void Journal::adopt(const std::string& name) {
  if (fd_) pending_ += "A " + name + "\n";
}

void Journal::group(const std::string& name, pid_t group) {
  if (fd_ && group > 0) pending_ += "G " + name + " " + std::to_string(group) + "\n";
}

void Journal::gone(const std::string& name) {
  if (fd_) pending_ += "- " + name + "\n";
}

void Journal::process(const ProcessId& p, pid_t group) {
  if (!fd_) return;
  pending_ += "P " + std::to_string(p.pid) + " " + std::to_string(p.start_time) + " " +
              std::to_string(group) + "\n";
  flush();
}

void Journal::flush() noexcept {
  if (!fd_ || pending_.empty()) return;
  // One append: a reader sees whole lines except, at worst, a torn last one.
  write_fully(fd_.get(), pending_);
  size_ += pending_.size();
  pending_.clear();
}

void Journal::compact(const JournalState& state) noexcept {
  if (!fd_) return;
  try {
    std::string content;
    for (const auto& [pid, h] : state.processes)
      content += "P " + std::to_string(pid) + " " + std::to_string(h.id.start_time) + " " +
                 std::to_string(h.group) + "\n";
    for (const auto& [name, j] : state.names) {
      if (j.adopted) content += "A " + name + "\n";
      for (const auto& h : j.ex_holders) content += hold_line(name, h.id, h.group);
      // Ex-holders that no longer hold: held once, released since.
      for (const auto& h : j.ex_holders) {
        bool holds = std::any_of(j.holders.begin(), j.holders.end(),
                                 [&](const JournaledHolder& x) { return x.id.pid == h.id.pid; });
        if (!holds) content += "R " + name + " " + std::to_string(h.id.pid) + "\n";
      }
      for (pid_t g : j.groups) content += "G " + name + " " + std::to_string(g) + "\n";
    }
    pending_.clear();
    if (replace_file(path_, content)) {
      fd_ = open_for_append(path_);
      size_ = 0;
    }
  } catch (...) {
  }
}

void Journal::remove() noexcept {
  if (!fd_) return;
  fd_.reset();
  remove_file(path_);
}

namespace {

void parse_into(const std::string& text, JournalState& out) {
  std::istringstream in(text);
  std::string line;
  while (std::getline(in, line)) {
    if (in.eof()) break;  // no '\n': a torn last line
    std::istringstream f(line);
    std::string op, name;
    f >> op;
    if (op == "P") {
      long pid = 0, group = 0;
      unsigned long long start = 0;
      if (f >> pid >> start >> group && pid > 0)
        out.processes[static_cast<pid_t>(pid)] = {{static_cast<pid_t>(pid), start},
                                                  static_cast<pid_t>(group)};
      continue;
    }
    f >> name;
    if (!is_valid_segment_name(name)) continue;
    if (op == "-") {
      out.names.erase(name);
    } else if (op == "A") {
      out.names[name].adopted = true;
    } else if (op == "G") {
      long g = 0;
      if (f >> g && g > 0) out.names[name].groups.insert(static_cast<pid_t>(g));
    } else if (op == "H") {
      long pid = 0, group = 0;
      unsigned long long start = 0;
      if (!(f >> pid >> start >> group) || pid <= 0) continue;
      JournaledHolder h{{static_cast<pid_t>(pid), start}, static_cast<pid_t>(group)};
      auto& j = out.names[name];
      add_holder(j.holders, h);
      add_holder(j.ex_holders, h);
      if (group > 0) j.groups.insert(static_cast<pid_t>(group));
    } else if (op == "R") {
      long pid = 0;
      if (!(f >> pid)) continue;
      auto it = out.names.find(name);
      if (it == out.names.end()) continue;
      std::erase_if(it->second.holders,
                    [&](const JournaledHolder& h) { return h.id.pid == static_cast<pid_t>(pid); });
    }
  }
}

}  // namespace

JournalState read_journal(const std::string& path) {
  JournalState out;
  parse_into(read_small_file(path), out);
  return out;
}

JournalState read_all_journals(const std::string& dir) {
  JournalState out;
  char suffix[40];
  std::snprintf(suffix, sizeof suffix, "-%llx.journal",
                static_cast<unsigned long long>(dev_shm_device()));
  const std::string want = suffix;
  for (const auto& entry : list_directory(dir)) {
    if (entry.size() <= want.size() ||
        entry.compare(entry.size() - want.size(), want.size(), want) != 0)
      continue;
    JournalState one = read_journal(dir + "/" + entry);
    for (auto& [name, j] : one.names) {
      auto& m = out.names[name];
      m.groups.insert(j.groups.begin(), j.groups.end());
      for (const auto& h : j.holders) add_holder(m.holders, h);
      for (const auto& h : j.ex_holders) add_holder(m.ex_holders, h);
      m.adopted = m.adopted || j.adopted;
    }
    out.processes.insert(one.processes.begin(), one.processes.end());
  }
  return out;
}

GroupsByName segment_groups(const JournalState& state) {
  GroupsByName out;
  for (const auto& e : list_shm("shmtensor_", effective_uid())) {
    if (auto it = state.names.find(e.name); it != state.names.end()) {
      if (!it->second.groups.empty()) out[e.name] = it->second.groups;
      continue;
    }
    SegmentFacts f = read_segment_facts(e.name);
    auto p = state.processes.find(f.creator_pid);
    if (p == state.processes.end() || p->second.group <= 0) continue;
    if (f.header_valid && p->second.id.start_time != f.creator_start_time) continue;
    out[e.name] = {p->second.group};
  }
  return out;
}

}  // namespace shmtensor::internal::manager
