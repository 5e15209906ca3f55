// `shmtensor ls` and `shmtensor gc` against real segments: ls shows a live segment with its
// creator and holders; gc --dry-run lists orphans and removes nothing; gc removes them and
// leaves what a live process holds.
#include <sys/wait.h>

#include <cstdio>
#include <cstring>

#include "ipc/manager_test_util.h"
#include "manager/journal.h"
#include "manager/report.h"
#include "manager/segments.h"
#include "memory/storage_impl.h"
#include "os/shm.h"
#include "shmtensor/internal/storage_access.h"
#include "shmtensor/storage.h"

namespace shmtensor {
namespace {

using testing::fork_child;
using testing::wait_child;
using namespace testing::manager_test;
namespace mgr = internal::manager;

const mgr::SegmentInfo* find(const std::vector<mgr::SegmentInfo>& v, const std::string& name) {
  for (const auto& s : v)
    if (s.name == name) return &s;
  return nullptr;
}

// Output and exit status of the `shmtensor` program next to shmtensor-manager in the
// build tree; nullopt when it is not there (an installed library).
std::optional<std::pair<std::string, int>> run_tool(const std::string& args) {
  std::string manager = mgr::manager_program_candidates().at(0);
  std::string tool = manager.substr(0, manager.rfind('/')) + "/shmtensor";
  if (::access(tool.c_str(), X_OK) != 0) return std::nullopt;
  std::FILE* p = ::popen((tool + " " + args + " 2>&1").c_str(), "r");
  if (p == nullptr) return std::nullopt;
  std::string out;
  char buf[4096];
  while (std::size_t n = std::fread(buf, 1, sizeof buf, p)) out.append(buf, n);
  int status = ::pclose(p);
  return std::make_pair(out, WIFEXITED(status) ? WEXITSTATUS(status) : -1);
}

// Leaves a named segment whose creator died together with its daemon: what the manager
// cannot clean up by itself until a new daemon (or gc) sweeps. The child is a job
// of its own (a process group: while a job lives, a message carrying its names may still
// reach one of its processes, so gc keeps them) and uses a daemon group of its own, so that
// no daemon of the test's group is affected (a new one would clean up before gc runs).
class ManagerToolsTest : public ManagerTest {
 protected:
  void TearDown() override {
    for (const auto& f : journals_) ::unlink(f.c_str());
    ManagerTest::TearDown();
  }
  std::string make_orphan(bool own_job = true);
  std::vector<std::string> journals_;
};

std::string ManagerToolsTest::make_orphan(bool own_job) {
  const std::string& group = group_;
  static int counter = 0;
  const std::string orphan_group = group + "-o" + std::to_string(counter++);
  Pipe report;
  pid_t child = fork_child([&] {
    if (own_job) ::setpgid(0, 0);
    ::setenv("SHMTENSOR_MANAGER_GROUP", orphan_group.c_str(), 1);
    Storage s = Storage::allocate_shared(64 * 1024);
    report.send_line(internal::StorageAccess::impl(s)->segment()->name());
    report.send_line(std::to_string(mgr::connected_daemon_pid()));
    for (;;) ::pause();
  });
  std::string name = report.receive_line();
  pid_t daemon = std::stoi(report.receive_line());
  {
    // Stopped first: a live client would start a replacement at once, which would see
    // the child die.
    Stopped stopped(child);
    ::kill(daemon, SIGKILL);
    EXPECT_TRUE(eventually([&] { return !process_lives(daemon); }));
    ::kill(child, SIGKILL);
  }
  wait_child(child);
  auto loc = mgr::manager_location(mgr::default_manager_dir(), orphan_group);
  for (const auto& f : {loc.socket_path, loc.lock_path, loc.log_path}) ::unlink(f.c_str());
  journals_.push_back(loc.journal_path);  // gc reads it
  return name;
}

TEST_F(ManagerToolsTest, LsShowsALiveSegmentWithItsCreatorAndHolders) {
  Storage s = Storage::allocate_shared(100000);
  const std::string name = internal::StorageAccess::impl(s)->segment()->name();
  auto segments = mgr::list_segments();
  const auto* info = find(segments, name);
  ASSERT_NE(info, nullptr) << name;
  EXPECT_EQ(info->facts.creator_pid, ::getpid());
  EXPECT_TRUE(info->creator_alive);
  EXPECT_TRUE(info->facts.header_valid);
  EXPECT_EQ(info->facts.refcount, 1);
  EXPECT_GE(info->facts.size, 100000u);
  EXPECT_EQ(info->holders, std::vector<pid_t>{::getpid()});

  std::string table = mgr::format_segments(segments);
  EXPECT_NE(table.find(name), std::string::npos) << table;
  std::string json = mgr::segments_json(segments);
  EXPECT_NE(json.find("\"name\": \"" + name + "\""), std::string::npos) << json;
  EXPECT_NE(json.find("\"creator_pid\": " + std::to_string(::getpid())), std::string::npos);

  if (auto r = run_tool("ls --json")) {
    EXPECT_EQ(r->second, 0) << r->first;
    EXPECT_NE(r->first.find("\"name\": \"" + name + "\""), std::string::npos) << r->first;
    EXPECT_NE(r->first.find("\"holders\": [" + std::to_string(::getpid()) + "]"), std::string::npos)
        << r->first;
  }
}

TEST_F(ManagerToolsTest, GcDryRunListsOrphansAndRemovesNothing) {
  Storage live = Storage::allocate_shared(4096);
  const std::string live_name = internal::StorageAccess::impl(live)->segment()->name();
  const std::string orphan = make_orphan();
  // Any daemon that replaces a killed one sweeps every name of the user: under ctest -j,
  // another test's may remove the orphan first.
  if (!name_exists(orphan)) GTEST_SKIP() << "a concurrent sweep removed the orphan first";
  auto report = mgr::sweep_orphans(/*dry_run=*/true);
  EXPECT_NE(find(report.removed, orphan), nullptr);
  EXPECT_EQ(find(report.removed, live_name), nullptr);
  EXPECT_NE(find(report.kept, live_name), nullptr);
  EXPECT_TRUE(name_exists(orphan)) << "--dry-run removed it";
  std::string text = mgr::format_sweep(report, true);
  EXPECT_NE(text.find("would remove " + orphan), std::string::npos) << text;
  EXPECT_NE(text.find("nothing was removed"), std::string::npos) << text;
  if (auto r = run_tool("gc --dry-run")) {
    EXPECT_EQ(r->second, 0);
    EXPECT_NE(r->first.find("would remove " + orphan), std::string::npos) << r->first;
    EXPECT_TRUE(name_exists(orphan));
  }
  // No leftovers for the leak check. (Not a sweep: under ctest -j it would remove what
  // other tests' jobs still need; a sweep's keep rules are what gc --dry-run just showed.)
  internal::unlink_named_shm(orphan);
}

TEST_F(ManagerToolsTest, GcRemovesOrphansAndKeepsWhatLiveProcessesHold) {
  Storage live = Storage::allocate_shared(4096);
  const std::string live_name = internal::StorageAccess::impl(live)->segment()->name();
  // Mapped by a live process that did not create it: kept too.
  Pipe ready;
  pid_t mapper = fork_child([&] {
    ready.send();
    for (;;) ::pause();
  });
  ASSERT_EQ(ready.receive(), 'x');
  const std::string orphan = make_orphan();
  const std::string orphan2 = make_orphan();
  // (Another test's daemon may sweep them first under ctest -j: then gc cannot name them.)
  const bool there = name_exists(orphan), there2 = name_exists(orphan2);
  std::optional<std::pair<std::string, int>> tool = run_tool("gc");
  mgr::SweepReport report;
  if (!tool)
    report = mgr::sweep_orphans(
        false, 0, mgr::segment_groups(mgr::read_all_journals(mgr::default_manager_dir())));
  EXPECT_FALSE(name_exists(orphan));
  EXPECT_FALSE(name_exists(orphan2));
  EXPECT_TRUE(name_exists(live_name));
  if (tool) {
    EXPECT_EQ(tool->second, 0);
    if (there) EXPECT_NE(tool->first.find("removed " + orphan), std::string::npos) << tool->first;
    if (there2) EXPECT_NE(tool->first.find("removed " + orphan2), std::string::npos) << tool->first;
  } else if (there) {
    EXPECT_NE(find(report.removed, orphan), nullptr);
  }
  ::kill(mapper, SIGKILL);
  wait_child(mapper);
}

TEST_F(ManagerToolsTest, GcKeepsANameThatALiveJobMayStillReceive) {
  // Its creator is dead and nobody maps it, but its job (this process's group) lives: a
  // message carrying it may be in a queue. The killed daemon's journal tells gc so.
  const std::string name = make_orphan(/*own_job=*/false);
  if (auto r = run_tool("gc")) {
    EXPECT_EQ(r->second, 0);
    EXPECT_EQ(r->first.find(name), std::string::npos) << r->first;
    EXPECT_TRUE(name_exists(name));
  }
  auto groups = mgr::segment_groups(mgr::read_all_journals(mgr::default_manager_dir()));
  EXPECT_EQ(mgr::sweep_orphans(true, 0, groups).removed.size(), 0u);
  // Without the journals the header says the same: a count is left (the dead child's, or
  // a message's) and the creator's process group, this one, lives.
  auto bare = mgr::sweep_orphans(true);
  EXPECT_EQ(find(bare.removed, name), nullptr);
  const auto* kept = find(bare.kept, name);
  ASSERT_NE(kept, nullptr);
  EXPECT_EQ(kept->facts.creator_pgid, ::getpgrp());
  EXPECT_EQ(kept->live_groups, std::vector<pid_t>{::getpgrp()});
  internal::unlink_named_shm(name);
}

}  // namespace
}  // namespace shmtensor
