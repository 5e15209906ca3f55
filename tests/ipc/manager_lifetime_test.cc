// How long names live, with real processes: a process that ends cleanly removes the names
// it was the last holder of by itself (no daemon involved).
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <cstdlib>
#include <set>
#include <string>
#include <vector>

#include "ipc/manager_test_util.h"
#include "shmtensor/process.h"
#include "shmtensor/queue.h"
#include "shmtensor/storage.h"
#include "shmtensor/tensor.h"

namespace shmtensor {
namespace {

using testing::fork_child;
using testing::wait_child;
using namespace testing::manager_test;
namespace mgr = internal::manager;

// Puts two small tensors (an arena segment) and a large one (a segment of its own).
void put_three(Queue<Tensor>& q) {
  q.put(Tensor::full({256}, 1.0, DType::kFloat32));
  q.put(Tensor::full({256}, 2.0, DType::kFloat32));
  q.put(Tensor::full({200000}, 3.0, DType::kFloat32));
}

void get_three(Queue<Tensor>& q) {
  for (float expected : {1.0f, 2.0f, 3.0f}) {
    Tensor t = q.get();
    EXPECT_EQ(t.data_ptr<float>()[t.numel() - 1], expected);
  }
}

// A child that ends with exit(): the counts its arena and its inherited segments keep are
// given back by the atexit handler, and the names it was the last holder of go with it,
// while the daemon is stopped and can remove nothing.
TEST_F(ManagerTest, CleanExitRemovesTheNamesItHeldLastWithoutTheDaemon) {
  Storage mine = Storage::allocate_shared(4096);  // connects; the child inherits a count
  const std::string my_name = segment_name(mine);
  const pid_t daemon = mgr::connected_daemon_pid();
  ASSERT_GT(daemon, 0);
  Queue<Tensor> q;
  Pipe go;
  pid_t child = fork_child([&] {
    put_three(q);
    go.receive();
    std::exit(0);  // not _exit: atexit handlers run
  });
  get_three(q);
  empty_cache();  // our counts of the child's segments go (the receive cache)
  const auto child_names = testing::shm_names_of(child);
  EXPECT_EQ(child_names.size(), 2u) << "its arena segment and its large segment";
  {
    Stopped stopped(daemon);
    go.send();
    EXPECT_EQ(wait_child(child), 0);
    // Only the child itself can have removed them: the daemon is stopped.
    EXPECT_EQ(testing::shm_names_of(child), std::set<std::string>{})
        << "a cleanly exiting process left its names for the daemon";
    EXPECT_EQ(refcount_of(mine), 1)
        << "the child gave back the count it inherited";
  }
  mine = Storage();
  empty_cache();
  EXPECT_FALSE(name_exists(my_name));
}

// The same for a Process (fork start method): it ends with _exit, after giving its counts
// back.
TEST_F(ManagerTest, ProcessThatReturnsRemovesTheNamesItHeldLastWithoutTheDaemon) {
  Storage mine = Storage::allocate_shared(4096);
  const pid_t daemon = mgr::connected_daemon_pid();
  ASSERT_GT(daemon, 0);
  Queue<Tensor> q;
  Queue<int> go;
  Process p([q, go]() mutable {
    put_three(q);
    go.get();
  });
  p.start();
  get_three(q);
  empty_cache();
  const pid_t child = p.pid();
  EXPECT_EQ(testing::shm_names_of(child).size(), 2u);
  {
    Stopped stopped(daemon);
    go.put(1);
    p.join();
    EXPECT_EQ(p.exitcode(), 0) << p.error();
    EXPECT_EQ(testing::shm_names_of(child), std::set<std::string>{})
        << "a Process that returned left its names for the daemon";
  }
}

}  // namespace
}  // namespace shmtensor
