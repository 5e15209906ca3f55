// The daemon's journal: what its Tracker knows (who holds which name, who held it, their
// process groups), so that a daemon replacing a killed one carries on where it stopped
// instead of guessing from creators (cleanup.md G6), and so that `shmtensor gc` keeps a name
// while a message carrying it may still reach a receiver (G5).
//
// A text file beside the socket, "<group>-<dev>.journal", one event a line:
//   "H <name> <pid> <start time> <pgid>"  the process holds a count of <name>
//   "R <name> <pid>"                      it no longer does (released, or taken back)
//   "A <name>"                            <name> was adopted (its counts are unknown)
//   "G <name> <pgid>"                     a process group that may still receive <name>
//   "- <name>"                            <name> is gone
//   "P <pid> <start time> <pgid>"         a client said hello (written before the answer,
//                                         so a name it registered that a killed daemon never
//                                         read still has a known process group)
// Appended in one write per event-loop turn; an "R" is written at once, before the daemon
// takes the count back (so that a successor never takes it twice). Compacted when it grows;
// removed when the daemon exits with nothing tracked. A torn last line (the daemon was
// killed while writing) is ignored.
//
// Not thread-safe: owned by the daemon's loop.
#pragma once

#include <sys/types.h>

#include <map>
#include <set>
#include <string>
#include <vector>

#include "os/proc_scan.h"
#include "os/unique_fd.h"

namespace shmtensor::internal::manager {

struct JournaledHolder {
  ProcessId id;
  pid_t group = 0;
};
struct JournaledName {
  std::vector<JournaledHolder> holders;     // hold a count now
  std::vector<JournaledHolder> ex_holders;  // ever held one (holders included)
  std::set<pid_t> groups;
  bool adopted = false;
};
struct JournalState {
  std::map<std::string, JournaledName> names;
  std::map<pid_t, JournaledHolder> processes;  // clients that said hello
};
using GroupsByName = std::map<std::string, std::set<pid_t>>;

class Journal {
 public:
  Journal() = default;
  // Opens (creates, 0600) `path` for appending. Failure leaves the journal disabled.
  explicit Journal(std::string path);

  void hold(const std::string& name, const ProcessId& p, pid_t group);
  void release(const std::string& name, pid_t pid);  // written at once
  void adopt(const std::string& name);
  void group(const std::string& name, pid_t group);
  void gone(const std::string& name);
  void process(const ProcessId& p, pid_t group);  // written at once
  // Writes what was noted since the last flush (one write).
  void flush() noexcept;
  // Replaces the file's content with `state`.
  void compact(const JournalState& state) noexcept;
  // Bytes appended since the last compaction.
  std::size_t size() const noexcept { return size_; }
  // Deletes the file.
  void remove() noexcept;

 private:
  std::string path_;
  UniqueFd fd_;
  std::string pending_;
  std::size_t size_ = 0;
};

// Reads a journal; missing or unreadable: empty.
JournalState read_journal(const std::string& path);
// Every "*-<dev>.journal" of `dir` (for the current /dev/shm), merged.
JournalState read_all_journals(const std::string& dir);
// For each named segment in /dev/shm: the process groups that may still receive it, from
// `state`: the name's own entry, else the hello of its creator (pid and start time).
GroupsByName segment_groups(const JournalState& state);

}  // namespace shmtensor::internal::manager
