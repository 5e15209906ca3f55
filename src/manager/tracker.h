// The manager daemon's bookkeeping and its one decision: when to shm_unlink a name.
// Pure logic over an Environment (liveness, /proc scans, headers, unlink), so that it can
// be driven by the daemon's event loop and tested in-process.
//
// Model. Each process that maps a named segment owns one count in the segment header's
// refcount (a forked child gets its own count of every named segment, added by the memory
// layer at fork); a message in flight owns one count too. The process whose release takes
// the count to 0 unlinks the name: that is the whole story while nobody crashes. The
// tracker exists for the rest: processes that die without releasing (SIGKILL, _exit).
//
//  - A "holder" of a name is a process that told the daemon it holds a count (it created
//    or opened the name, held it when it reconnected, or was forked by a holder). When a
//    holder dies without releasing, the tracker takes its count off the refcount; so it
//    does for a holder without a connection that no longer maps the name (it exec'd).
//  - A name nobody holds is decided from the header, liveness, and (only when that does not
//    settle it) one scan of /proc/*/maps:
//      * header refcount <= 0 (or no valid header): unlink unless a live process maps it
//        (one that released its count and still maps the name for a moment does not count);
//      * refcount > 0: messages carrying the name are in flight (or a count leaked in a
//        crash window). Keep it while a process that ever held it ("ex-holder": the senders)
//        lives, or a live process maps it, or the process group of an ex-holder still has
//        a member: receivers share a queue with the sender, and processes that share a
//        queue are its relatives (fork, exec), which stay in its process group. A sender
//        may exit right after put(); its receiver still gets the value;
//      * "adopted" names (found by the start-up sweep, or first heard of in a
//        kRegisterHeld after the previous daemon died; their counts are unknown): unlink
//        once no live process maps it, its creator is dead, and no process group the
//        predecessor's journal had for it has a member.
//    Otherwise the name stays "pending" and what keeps it is watched: the death of a
//    watched process, or the end of a watched process group, re-decides every pending name.
//
// Not thread-safe: one event loop owns it.
#pragma once

#include <cstdint>
#include <map>
#include <set>
#include <string>
#include <unordered_map>
#include <vector>

#include "manager/journal.h"
#include "manager/segments.h"
#include "os/proc_scan.h"

namespace shmtensor::internal::manager {

class Tracker {
 public:
  // What the tracker asks of the world. The daemon's implementation uses /proc, /dev/shm
  // and the segment headers; tests may substitute their own.
  class Environment {
   public:
    virtual ~Environment() = default;
    virtual bool alive(const ProcessId& p) = 0;
    virtual ProcessId identify(pid_t pid) = 0;
    // name -> live processes mapping it (the daemon itself excluded).
    virtual std::unordered_map<std::string, std::vector<ProcessId>> scan_mappers() = 0;
    virtual SegmentFacts facts(const std::string& name) = 0;
    virtual pid_t process_group(pid_t pid) = 0;  // 0 if unknown
    virtual bool maps(pid_t pid, const std::string& name) = 0;
    virtual bool group_alive(pid_t pgid) = 0;
    virtual void drop_count(const std::string& name) = 0;  // drop_count_of_dead_holder
    virtual void unlink(const std::string& name) = 0;
    // What changed, for the journal (journal.h). noted_release comes before the count is
    // taken back (drop_count), so that a journal never makes a successor take it twice.
    virtual void noted_hold(const std::string&, const ProcessId&, pid_t /*group*/) {}
    virtual void noted_release(const std::string&, pid_t) {}
    virtual void noted_adopt(const std::string&) {}
    virtual void noted_group(const std::string&, pid_t) {}
    virtual void forgotten(const std::string&) {}
  };

  enum class Registration { kCreated, kOpened, kHeld };

  explicit Tracker(Environment& env) : env_(env) {}

  // Events, as they arrive from the process `p` (identified by its connection). `group` is
  // p's process group as it said in its hello (0: ask the environment, which fails once p
  // is gone).
  void registered(const ProcessId& p, const std::string& name, Registration how, pid_t group = 0);
  void released(const ProcessId& p, const std::string& name, bool unlinked);
  void fork_begin(const ProcessId& parent, std::uint64_t seq);
  void fork_child(const ProcessId& parent, std::uint64_t seq, pid_t child);
  // Connections of `p` opened (after its hello) and closed. A holder with no connection
  // (a forked child that never connected, or a process that exec'd: exec closes the
  // connection and drops every mapping without releasing) that no longer maps a name it
  // holds has let go of it without saying so: the tracker then takes its count back. This
  // is checked when such a process disconnects alive, and when another holder releases.
  // A closed connection whose process is gone reports its death (died()).
  void connection_opened(const ProcessId& p);
  void connection_closed(const ProcessId& p);
  // `p` has exited (its pidfd fired, or its connection closed and it is not alive).
  // Idempotent; ignored when p is not the process the tracker knows under that pid.
  void died(const ProcessId& p);
  // A name found at start-up that the sweep did not remove, with the process groups a
  // killed predecessor's journal had for it.
  void adopt(const std::string& name, const std::set<pid_t>& groups = {});
  // A watched process group has ended: re-decide the pending names.
  void group_ended();

  // Decides every name that needs it (one /proc scan for all). Call after each batch of
  // events. Returns the names it unlinked.
  std::vector<std::string> settle();

  // Processes whose death the caller must report with died(): holders, and those that
  // keep a pending name.
  std::vector<ProcessId> watched() const;
  // Process groups whose end the caller must report with group_ended() (polled: no fd
  // tells of a group's end).
  std::vector<pid_t> watched_groups() const;
  // True when a process the tracker knows holds pids it has not checked since settle().
  bool needs_settle() const { return !dirty_.empty(); }
  // Nothing tracked that needs the daemon to stay: no holder and no pending name.
  bool idle() const;

  // For tests and diagnostics.
  std::size_t name_count() const { return names_.size(); }
  bool tracks(const std::string& name) const { return names_.count(name) != 0; }
  std::vector<pid_t> holders_of(const std::string& name) const;
  // Everything tracked, for the journal; and back. restore() is for a daemon replacing a
  // killed one: holders that died meanwhile are handled as by died().
  JournalState snapshot() const;
  void restore(const JournalState& state);

 private:
  struct NameState {
    std::set<pid_t> holders;
    std::vector<ProcessId> ex_holders;  // live ones (the dead are pruned)
    // Processes that released their count and hold none: one may still map the name for a
    // moment (it releases before it unmaps), which must not keep it.
    std::set<pid_t> released_by;
    std::set<pid_t> groups;  // process groups of every ex-holder, dead or alive
    bool adopted = false;
    std::vector<ProcessId> keepers;  // when pending: who keeps it
    std::vector<pid_t> keeper_groups;
  };
  struct ProcState {
    ProcessId id;
    pid_t group = 0;
    std::set<std::string> holds;
    std::map<std::uint64_t, std::vector<std::string>> fork_snapshots;
  };

  ProcState& process(const ProcessId& p, pid_t group);
  NameState& name_state(const std::string& name, bool adopted);
  void hold(ProcState& proc, const std::string& name, bool adopted);
  void forget(const std::string& name);
  void erase_if_unused(pid_t pid);
  // Takes back the counts of holders of `name` without a connection that do not map it.
  void check_silent_holders(const std::string& name);
  bool connected(pid_t pid) const;

  Environment& env_;
  std::map<std::string, NameState> names_;
  std::map<pid_t, ProcState> procs_;
  std::set<std::string> dirty_;    // names to decide at the next settle()
  std::set<std::string> pending_;  // names nobody holds that something keeps
  std::map<pid_t, int> connections_;
};

}  // namespace shmtensor::internal::manager
