// The daemon's journal: what is written reads back, a torn last line is ignored,
// compaction keeps the state, and garbage lines are skipped.
#include <gtest/gtest.h>
#include <unistd.h>

#include <cstdio>
#include <fstream>
#include <string>

#include "manager/journal.h"

namespace shmtensor::internal::manager {
namespace {

class ManagerJournalTest : public ::testing::Test {
 protected:
  void TearDown() override {
    std::remove(path_.c_str());
    std::remove((path_ + ".tmp").c_str());
  }
  std::string read_text() {
    std::ifstream in(path_);
    return std::string((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  }
  const std::string path_ = "/tmp/shmtensor-journal-test-" + std::to_string(::getpid());
  const std::string a_ = "/shmtensor_10_ab_0", b_ = "/shmtensor_10_ab_1";
};

TEST_F(ManagerJournalTest, EventsReadBack) {
  {
    Journal j(path_);
    j.process({10, 111}, 7);
    j.hold(a_, {10, 111}, 7);
    j.hold(a_, {20, 222}, 8);
    j.hold(b_, {10, 111}, 7);
    j.release(a_, 10);  // written at once, with what was pending
    j.adopt(b_);
    j.group(b_, 9);
    j.flush();
  }
  JournalState s = read_journal(path_);
  ASSERT_EQ(s.processes.count(10), 1u);
  EXPECT_EQ(s.processes[10].id.start_time, 111u);
  EXPECT_EQ(s.processes[10].group, 7);
  ASSERT_EQ(s.names.count(a_), 1u);
  ASSERT_EQ(s.names[a_].holders.size(), 1u);
  EXPECT_EQ(s.names[a_].holders[0].id.pid, 20);
  EXPECT_EQ(s.names[a_].ex_holders.size(), 2u);
  EXPECT_EQ(s.names[a_].groups, (std::set<pid_t>{7, 8}));
  EXPECT_TRUE(s.names[b_].adopted);
  EXPECT_EQ(s.names[b_].groups, (std::set<pid_t>{7, 9}));
  {
    Journal j(path_);
    j.gone(a_);
    j.flush();
  }
  EXPECT_EQ(read_journal(path_).names.count(a_), 0u);
}

TEST_F(ManagerJournalTest, UnflushedEventsAreNotWritten) {
  {
    Journal j(path_);
    j.hold(a_, {10, 111}, 7);
  }
  EXPECT_EQ(read_text(), "");
}

TEST_F(ManagerJournalTest, TornLastLineAndGarbageAreIgnored) {
  {
    std::ofstream out(path_);
    out << "H " << a_ << " 10 111 7\n"
        << "H /etc/passwd 10 111 7\n"
        << "Q what\n"
        << "H " << b_ << " 10 11";  // the daemon was killed mid-write
  }
  JournalState s = read_journal(path_);
  EXPECT_EQ(s.names.size(), 1u);
  EXPECT_EQ(s.names.count(a_), 1u);
}

TEST_F(ManagerJournalTest, CompactionKeepsTheState) {
  JournalState s;
  s.processes[10] = {{10, 111}, 7};
  auto& n = s.names[a_];
  n.holders = {{{10, 111}, 7}};
  n.ex_holders = {{{10, 111}, 7}, {{20, 222}, 8}};
  n.groups = {7, 8};
  s.names[b_].adopted = true;
  s.names[b_].groups = {9};
  {
    Journal j(path_);
    j.hold("/shmtensor_99_zz_0", {99, 1}, 1);
    j.flush();
    j.compact(s);
    EXPECT_EQ(j.size(), 0u);
  }
  JournalState back = read_journal(path_);
  EXPECT_EQ(back.names.count("/shmtensor_99_zz_0"), 0u) << "compaction replaces the file";
  ASSERT_EQ(back.names.count(a_), 1u);
  ASSERT_EQ(back.names[a_].holders.size(), 1u);
  EXPECT_EQ(back.names[a_].holders[0].id.pid, 10);
  EXPECT_EQ(back.names[a_].ex_holders.size(), 2u);
  EXPECT_EQ(back.names[a_].groups, (std::set<pid_t>{7, 8}));
  EXPECT_TRUE(back.names[b_].adopted);
  EXPECT_EQ(back.names[b_].groups, std::set<pid_t>{9});
  EXPECT_EQ(back.processes[10].group, 7);
}

TEST_F(ManagerJournalTest, RemoveDeletesTheFile) {
  Journal j(path_);
  j.hold(a_, {10, 111}, 7);
  j.flush();
  j.remove();
  EXPECT_FALSE(std::ifstream(path_).good());
}

}  // namespace
}  // namespace shmtensor::internal::manager
