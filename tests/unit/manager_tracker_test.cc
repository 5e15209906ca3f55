// The manager's decision rules, driven through the Tracker with a scripted world (which
// processes live, who maps what, what the headers say). The real world is tested in
// tests/ipc/manager_daemon_test.cc.
#include <gtest/gtest.h>

#include <map>
#include <set>
#include <string>

#include "manager/tracker.h"

namespace shmtensor::internal::manager {
namespace {

class World : public Tracker::Environment {
 public:
  struct Seg {
    std::int64_t refcount = 1;
    ProcessId creator;
  };
  std::map<pid_t, ProcessId> live;  // pid -> identity
  std::map<pid_t, pid_t> group_of;
  std::map<std::string, Seg> segs;
  std::map<std::string, std::set<pid_t>> mapped;  // name -> pids mapping it
  std::vector<std::string> unlinked;
  int scans = 0;

  ProcessId spawn(pid_t pid, pid_t group = 0) {
    ProcessId id{pid, 1000u + static_cast<std::uint64_t>(pid)};
    live[pid] = id;
    group_of[pid] = group == 0 ? pid : group;
    return id;
  }
  void kill(pid_t pid) {
    live.erase(pid);
    for (auto& [n, pids] : mapped) pids.erase(pid);
  }

  bool alive(const ProcessId& p) override {
    auto it = live.find(p.pid);
    return it != live.end() && it->second == p;
  }
  ProcessId identify(pid_t pid) override {
    auto it = live.find(pid);
    return it == live.end() ? ProcessId{pid, 0} : it->second;
  }
  std::unordered_map<std::string, std::vector<ProcessId>> scan_mappers() override {
    ++scans;
    std::unordered_map<std::string, std::vector<ProcessId>> out;
    for (auto& [n, pids] : mapped)
      for (pid_t p : pids)
        if (live.count(p)) out[n].push_back(live[p]);
    return out;
  }
  SegmentFacts facts(const std::string& name) override {
    SegmentFacts f;
    auto it = segs.find(name);
    if (it == segs.end()) return f;
    f.exists = true;
    f.header_valid = true;
    f.refcount = it->second.refcount;
    f.creator_pid = it->second.creator.pid;
    f.creator_start_time = it->second.creator.start_time;
    return f;
  }
  pid_t process_group(pid_t pid) override { return live.count(pid) ? group_of[pid] : 0; }
  bool maps(pid_t pid, const std::string& name) override {
    return live.count(pid) && mapped[name].count(pid);
  }
  bool group_alive(pid_t pgid) override {
    for (auto& [pid, id] : live)
      if (group_of[pid] == pgid) return true;
    return false;
  }
  void drop_count(const std::string& name) override {
    if (segs.count(name)) --segs[name].refcount;
  }
  void unlink(const std::string& name) override {
    segs.erase(name);
    unlinked.push_back(name);
  }
};

class ManagerTrackerTest : public ::testing::Test {
 protected:
  World world;
  Tracker tracker{world};
  const std::string n = "/shmtensor_10_ab_0";

  // `creator` creates and maps n (refcount 1).
  void create(const ProcessId& creator) {
    world.segs[n] = {1, creator};
    world.mapped[n].insert(creator.pid);
    tracker.registered(creator, n, Tracker::Registration::kCreated);
  }
  bool exists() const { return world.segs.count(n) != 0; }
};

TEST_F(ManagerTrackerTest, HolderKilledAloneIsUnlinked) {
  ProcessId p = world.spawn(10);
  create(p);
  tracker.settle();
  EXPECT_TRUE(exists());
  world.kill(10);
  tracker.died(p);
  EXPECT_EQ(world.segs[n].refcount, 0) << "its count is taken back";
  tracker.settle();
  EXPECT_FALSE(exists());
  EXPECT_EQ(tracker.name_count(), 0u);
  EXPECT_TRUE(tracker.idle());
}

TEST_F(ManagerTrackerTest, NameIsKeptWhileAnotherHolderLives) {
  ProcessId a = world.spawn(10), b = world.spawn(11);
  create(a);
  ++world.segs[n].refcount;  // b opened it
  world.mapped[n].insert(11);
  tracker.registered(b, n, Tracker::Registration::kOpened);
  world.kill(10);
  tracker.died(a);
  tracker.settle();
  EXPECT_TRUE(exists());
  EXPECT_EQ(world.segs[n].refcount, 1);
  EXPECT_EQ(tracker.holders_of(n), std::vector<pid_t>{11});
  EXPECT_FALSE(tracker.idle());
}

TEST_F(ManagerTrackerTest, InFlightNameWaitsForTheSendersGroup) {
  // The sender puts the name in a queue (+1) and exits; its parent (same group) lives.
  ProcessId parent = world.spawn(9, 9);
  ProcessId sender = world.spawn(10, 9);
  create(sender);
  ++world.segs[n].refcount;  // in flight
  --world.segs[n].refcount;  // the sender drops its own count...
  world.mapped[n].erase(10);
  tracker.released(sender, n, false);  // ...and says so
  world.kill(10);
  tracker.died(sender);
  tracker.settle();
  EXPECT_TRUE(exists()) << "a receiver in the sender's process group may still get it";
  EXPECT_EQ(tracker.watched_groups(), std::vector<pid_t>{9});
  EXPECT_FALSE(tracker.idle());
  // The receiver adopts it, then drops the last count (and unlinks it itself).
  tracker.registered(parent, n, Tracker::Registration::kOpened);
  EXPECT_TRUE(tracker.watched_groups().empty());
  world.segs.erase(n);
  tracker.released(parent, n, true);
  EXPECT_EQ(tracker.name_count(), 0u);
}

TEST_F(ManagerTrackerTest, InFlightNameGoesWithTheWholeGroup) {
  ProcessId other = world.spawn(9, 9);
  ProcessId sender = world.spawn(10, 9);
  create(sender);
  world.mapped[n].erase(10);
  tracker.released(sender, n, false);  // refcount stays 1: a message in flight
  tracker.settle();
  EXPECT_TRUE(exists()) << "the sender lives";
  EXPECT_EQ(world.scans, 0) << "a live sender settles it without scanning /proc";
  world.kill(10);
  tracker.died(sender);
  tracker.settle();
  EXPECT_TRUE(exists());
  world.kill(9);
  tracker.group_ended();
  tracker.settle();
  EXPECT_FALSE(exists());
  (void)other;
}

TEST_F(ManagerTrackerTest, MapperKeepsAZeroCountName) {
  // A forked child the daemon never heard of still maps it: never unlink under it.
  ProcessId a = world.spawn(10);
  create(a);
  world.spawn(12);
  world.mapped[n].insert(12);
  world.kill(10);
  tracker.died(a);
  tracker.settle();
  EXPECT_TRUE(exists());
  auto w = tracker.watched();
  ASSERT_EQ(w.size(), 1u);
  EXPECT_EQ(w[0].pid, 12);
  world.kill(12);
  tracker.died(w[0]);
  tracker.settle();
  EXPECT_FALSE(exists());
}

TEST_F(ManagerTrackerTest, ForkedChildHoldsItsParentsNames) {
  ProcessId parent = world.spawn(10);
  create(parent);
  tracker.fork_begin(parent, 1);
  ++world.segs[n].refcount;  // the memory layer's count for the child
  ProcessId child = world.spawn(20);
  world.mapped[n].insert(20);
  tracker.fork_child(parent, 1, 20);
  EXPECT_EQ(tracker.holders_of(n), (std::vector<pid_t>{10, 20}));
  // The child _exits without releasing; the parent drops its count normally.
  world.kill(20);
  tracker.died(child);
  EXPECT_EQ(world.segs[n].refcount, 1);
  --world.segs[n].refcount;
  world.segs.erase(n);  // the parent reached 0 and unlinked
  tracker.released(parent, n, true);
  EXPECT_EQ(tracker.name_count(), 0u);
}

TEST_F(ManagerTrackerTest, ForkChildThatIsAlreadyGoneGivesItsCountsBack) {
  ProcessId parent = world.spawn(10);
  create(parent);
  tracker.fork_begin(parent, 5);
  ++world.segs[n].refcount;
  tracker.fork_child(parent, 5, 21);  // never alive as far as the world knows
  EXPECT_EQ(world.segs[n].refcount, 1);
  EXPECT_EQ(tracker.holders_of(n), std::vector<pid_t>{10});
}

TEST_F(ManagerTrackerTest, RecycledPidIsADifferentProcess) {
  ProcessId old = world.spawn(10);
  create(old);
  world.kill(10);
  ProcessId reborn{10, 99999};
  world.live[10] = reborn;
  tracker.registered(reborn, "/shmtensor_10_cd_0", Tracker::Registration::kCreated);
  // Registering the new process under the pid ends the old one: its count is taken back.
  EXPECT_EQ(world.segs[n].refcount, 0);
  tracker.settle();
  EXPECT_FALSE(exists());
}

TEST_F(ManagerTrackerTest, AdoptedNameGoesWhenItsCreatorDiesUnmapped) {
  ProcessId creator = world.spawn(10);
  world.segs[n] = {3, creator};  // counts from before this daemon: unknown
  tracker.adopt(n);
  tracker.settle();
  EXPECT_TRUE(exists());
  world.kill(10);
  tracker.died(creator);
  tracker.settle();
  EXPECT_FALSE(exists()) << "an adopted name ignores its (untrusted) refcount";
}

TEST_F(ManagerTrackerTest, HolderThatExecdLetsGoOfItsNames) {
  // The parent creates; a forked child is announced (it holds a count, no connection);
  // the child execs: its mappings and its connection-less count vanish without a word.
  ProcessId parent = world.spawn(10);
  tracker.connection_opened(parent);
  create(parent);
  tracker.fork_begin(parent, 1);
  ++world.segs[n].refcount;
  ProcessId child = world.spawn(20);
  world.mapped[n].insert(20);
  tracker.fork_child(parent, 1, 20);
  world.mapped[n].erase(20);  // exec
  // The parent drops its count (2 -> 1) and says so: the child is found not to map it.
  --world.segs[n].refcount;
  world.mapped[n].erase(10);
  tracker.released(parent, n, false);
  EXPECT_EQ(world.segs[n].refcount, 0) << "the exec'd child's count is taken back";
  tracker.settle();
  EXPECT_FALSE(exists());
  EXPECT_TRUE(world.alive(child));
}

TEST_F(ManagerTrackerTest, ConnectedHolderIsNotCheckedForMappings) {
  // A creator registers before it maps: while connected it is never judged by its maps.
  ProcessId a = world.spawn(10), b = world.spawn(11);
  tracker.connection_opened(a);
  tracker.connection_opened(b);
  world.segs[n] = {2, a};
  tracker.registered(a, n, Tracker::Registration::kCreated);  // not mapped yet
  tracker.registered(b, n, Tracker::Registration::kOpened);
  --world.segs[n].refcount;
  tracker.released(b, n, false);  // b unmapped it
  EXPECT_EQ(world.segs[n].refcount, 1);
  EXPECT_EQ(tracker.holders_of(n), std::vector<pid_t>{10});
  // Once it disconnects alive without mapping it (it exec'd), it is.
  tracker.connection_closed(a);
  EXPECT_EQ(world.segs[n].refcount, 0);
  tracker.settle();
  EXPECT_FALSE(exists());
}

TEST_F(ManagerTrackerTest, RestoredStateTakesBackTheCountsOfHoldersThatDiedMeanwhile) {
  // A killed daemon's journal: n held by 10 (alive) and 20 (died while no daemon ran).
  ProcessId a = world.spawn(10);
  ProcessId dead{20, 1020};
  world.segs[n] = {2, a};
  world.mapped[n] = {10};
  JournalState state;
  state.names[n].holders = {{a, 10}, {dead, 10}};
  state.names[n].ex_holders = state.names[n].holders;
  state.names[n].groups = {10};
  tracker.restore(state);
  EXPECT_EQ(world.segs[n].refcount, 1) << "the dead holder's count, once";
  EXPECT_EQ(tracker.holders_of(n), std::vector<pid_t>{10});
  tracker.settle();
  EXPECT_TRUE(exists());
  // And the tracker carries on as if it had never stopped.
  world.kill(10);
  tracker.died(a);
  tracker.settle();
  EXPECT_FALSE(exists());
}

TEST_F(ManagerTrackerTest, SnapshotRestoresToTheSameDecisions) {
  ProcessId a = world.spawn(10, 3), b = world.spawn(11, 3);
  create(a);
  ++world.segs[n].refcount;
  tracker.registered(b, n, Tracker::Registration::kOpened);
  JournalState s = tracker.snapshot();
  ASSERT_EQ(s.names.count(n), 1u);
  EXPECT_EQ(s.names[n].holders.size(), 2u);
  EXPECT_EQ(s.names[n].groups, std::set<pid_t>{3});
  Tracker successor(world);
  successor.restore(s);
  EXPECT_EQ(successor.holders_of(n), (std::vector<pid_t>{10, 11}));
  EXPECT_EQ(world.segs[n].refcount, 2) << "live holders keep their counts";
}

TEST_F(ManagerTrackerTest, ReleaserThatStillMapsForAMomentDoesNotKeepIt) {
  // A process gives its count back before it unmaps, and the daemon may scan in between.
  ProcessId a = world.spawn(10);
  tracker.connection_opened(a);
  create(a);
  tracker.fork_begin(a, 1);
  ++world.segs[n].refcount;  // the forked child's count
  world.spawn(20);
  tracker.fork_child(a, 1, 20);   // the child then exec'd: it does not map n
  --world.segs[n].refcount;       // a drops its count (2 -> 1)...
  tracker.released(a, n, false);  // ...says so, and still maps n for a moment
  ASSERT_TRUE(world.mapped[n].count(10));
  EXPECT_EQ(world.segs[n].refcount, 0) << "the exec'd child's count is taken back";
  tracker.settle();
  EXPECT_FALSE(exists()) << "kept because its releaser had not unmapped yet";
}

TEST_F(ManagerTrackerTest, NameThatVanishedIsForgotten) {
  ProcessId a = world.spawn(10);
  create(a);
  world.segs.erase(n);  // unlinked by someone else (gc, the last holder)
  tracker.released(a, n, false);
  tracker.settle();
  EXPECT_EQ(tracker.name_count(), 0u);
  EXPECT_TRUE(world.unlinked.empty());
}

}  // namespace
}  // namespace shmtensor::internal::manager
