// The daemon's table of named channels (src/manager/channels.h): names taken and missing,
// kinds, tokens, and a creator that is gone.
#include <gtest/gtest.h>

#include <cerrno>

#include "manager/channels.h"
#include "os/event_fd.h"

namespace shmtensor::internal::manager {
namespace {

std::vector<UniqueFd> one_fd() {
  std::vector<UniqueFd> v;
  v.push_back(make_event_fd("test", ""));
  return v;
}

TEST(ManagerChannelsTest, NamesKindsTokensAndCreators) {
  ChannelTable t;
  const ProcessId a{100, 1}, b{200, 2}, reborn{100, 3};
  EXPECT_TRUE(t.empty());
  EXPECT_EQ(t.publish("q", 1, one_fd(), "xy", 7, a), 0);
  EXPECT_EQ(t.publish("q", 1, one_fd(), "", 8, b), EEXIST);
  EXPECT_EQ(t.publish("r", 2, one_fd(), "", 9, b), 0);
  int err = -1;
  const RegisteredChannel* c = t.open("q", 1, b, false, &err);
  ASSERT_NE(c, nullptr);
  EXPECT_EQ(err, 0);
  EXPECT_EQ(c->bytes, "xy");
  EXPECT_EQ(c->fds.size(), 1u);
  EXPECT_EQ(c->openers, std::vector<ProcessId>{b});
  (void)t.open("q", 1, b, false, &err);  // counted once
  (void)t.open("q", 1, reborn, true, &err);  // only looks
  EXPECT_EQ(t.open("q", 1, b, false, &err)->openers, std::vector<ProcessId>{b});
  EXPECT_EQ(t.open("q", 2, b, false, &err)->kind, 1u);
  EXPECT_EQ(err, EPROTOTYPE);
  EXPECT_EQ(t.open("missing", 1, b, false, &err), nullptr);
  EXPECT_EQ(err, ENOENT);
  EXPECT_EQ(t.creators(), (std::vector<ProcessId>{a, b}));
  // Another process with a's pid is not a.
  EXPECT_TRUE(t.creator_gone(reborn).empty());
  EXPECT_EQ(t.creator_gone(a), std::vector<std::string>{"q"});
  EXPECT_EQ(t.open("q", 1, b, false, &err), nullptr);
  // An unlink with another token removes nothing; with none, or the right one, it does.
  EXPECT_EQ(t.unlink("r", 10), ENOENT);
  EXPECT_EQ(t.unlink("r", 9), 0);
  EXPECT_EQ(t.unlink("r", 0), ENOENT);
  EXPECT_TRUE(t.empty());
}

TEST(ManagerChannelsTest, KeptFdsAreTakenOnceAndExpireAfterTheirSenderIsGone) {
  using namespace std::chrono_literals;
  KeptFds k(100ms);
  const ProcessId a{100, 1}, b{200, 2};
  k.keep("tokenA", std::move(one_fd()[0]), a);
  k.keep("ticket", UniqueFd(), a);
  k.keep("tokenB", std::move(one_fd()[0]), b);
  EXPECT_EQ(k.senders(), (std::vector<ProcessId>{a, b}));
  UniqueFd fd;
  EXPECT_EQ(k.take("tokenA", &fd), KeptFds::Taken::kFd);
  EXPECT_TRUE(fd.valid());
  EXPECT_EQ(k.take("tokenA", &fd), KeptFds::Taken::kUnknown);
  const auto t0 = KeptFds::Clock::time_point{} + 1h;
  EXPECT_EQ(k.expire(t0), std::nullopt);  // nobody is gone: nothing expires
  k.sender_gone(a, t0);
  EXPECT_EQ(k.senders(), std::vector<ProcessId>{b});
  EXPECT_EQ(k.expire(t0 + 99ms), t0 + 100ms);
  EXPECT_TRUE(k.holds("ticket"));
  EXPECT_EQ(k.expire(t0 + 100ms), std::nullopt);
  EXPECT_FALSE(k.holds("ticket"));
  EXPECT_EQ(k.take("tokenB", &fd), KeptFds::Taken::kFd);
  EXPECT_TRUE(k.empty());
}

}  // namespace
}  // namespace shmtensor::internal::manager
