#include "transport/hangup_watch.h"

#include <array>
#include <mutex>
#include <new>
#include <unordered_map>
#include <utility>

#include "os/epoll.h"
#include "os/event_fd.h"
#include "os/fork_handlers.h"
#include "os/thread.h"
#include "os/unique_fd.h"

namespace shmtensor::internal {

namespace {

constexpr std::size_t kThreadStack = 64 * 1024;
// The epoll data of the thread's stop eventfd; watches are numbered from 1.
constexpr std::uint64_t kStopId = 0;

struct Watch {
  int sock;
  void (*fire)(void*);
  void* context;
};

// One running thread and the fds it owns: its epoll set and the eventfd that stops it.
struct Thread {
  ThreadHandle handle{};
  int epoll = -1;
  int stop = -1;
};

// Threads taken out of State to be stopped (outside the lock) are listed until they are:
// a child forked meanwhile closes their fds too.
constexpr std::size_t kMaxStopping = 8;

struct State {
  std::mutex lock;
  std::unordered_map<std::uint64_t, Watch> watches;
  std::uint64_t next_id = 1;  // never reused, in a forked child either
  bool running = false;
  bool failed = false;  // the thread ended on an error (run)
  Thread thread;
  std::array<Thread, kMaxStopping> stopping{};
  std::size_t stopping_count = 0;
};

// Leaked on purpose: the thread may still run while static destructors do at exit.
State& state() {
  static State* s = new State;
  return *s;
}

void close_fd(int& fd) noexcept { const UniqueFd closing(std::exchange(fd, -1)); }

void* run(void* arg) {
  const Thread t = *static_cast<Thread*>(arg);
  delete static_cast<Thread*>(arg);
  State& s = state();
  std::uint64_t ready[16];
  for (;;) {
    const int n = wait_epoll(t.epoll, ready);
    if (n < 0) {
      // Cannot happen with fds we own. Should it, every watch fires (its owner then waits
      // in slices, as without a watch) rather than leave a sleeper that nothing wakes.
      const std::lock_guard<std::mutex> hold(s.lock);
      for (auto& [id, w] : s.watches) w.fire(w.context);
      s.failed = true;  // no new watch until the last one ends (joins this thread)
      return nullptr;
    }
    for (int i = 0; i < n; ++i) {
      if (ready[i] == kStopId) return nullptr;
      const std::lock_guard<std::mutex> hold(s.lock);
      // Ended meanwhile: unwatch_hangup removed it (EPOLLONESHOT: it fires once).
      if (auto it = s.watches.find(ready[i]); it != s.watches.end())
        it->second.fire(it->second.context);
    }
  }
}

// Starts the thread (under the lock). False, with nothing left behind, when it cannot.
bool start(State& s) noexcept {
  Thread t;
  t.epoll = try_make_epoll().release();
  t.stop = try_make_event_fd().release();
  auto* arg = new (std::nothrow) Thread(t);
  const bool ok = t.epoll >= 0 && t.stop >= 0 && arg != nullptr &&
                  try_add_to_epoll(t.epoll, t.stop, kEpollIn, kStopId) &&
                  start_thread(run, arg, kThreadStack, "shmtensor-watch", &t.handle);
  if (!ok) {
    delete arg;
    close_fd(t.epoll);
    close_fd(t.stop);
    return false;
  }
  s.thread = t;
  s.running = true;
  return true;
}

// Takes the thread out of `s` (under the lock) when it has no watch left, listed as
// stopping; the caller stops it outside the lock (stop_thread). (With kMaxStopping stops
// under way, it stays running, idle, for the next watch or the next stop.)
Thread take_idle_thread(State& s) noexcept {
  if (!s.running || !s.watches.empty() || s.stopping_count == kMaxStopping) return {};
  s.running = false;
  s.failed = false;
  Thread t = s.thread;
  s.thread = {};
  s.stopping[s.stopping_count++] = t;
  return t;
}

void stop_thread(Thread t) noexcept {
  if (t.stop < 0) return;
  signal_event_fd(t.stop);
  join_thread(t.handle);
  State& s = state();
  const std::lock_guard<std::mutex> hold(s.lock);
  for (std::size_t i = 0; i < s.stopping_count; ++i) {
    if (s.stopping[i].stop != t.stop) continue;
    s.stopping[i] = s.stopping[--s.stopping_count];
    break;
  }
  close_fd(t.epoll);  // under the lock: a fork copies the list and the fd table together
  close_fd(t.stop);
}

// Fork: the lock is taken across it, so the child's copy is consistent; the child has no
// thread, and closes the fds its parent's thread owns (inherited copies).
void prepare() noexcept { state().lock.lock(); }
void parent(bool) noexcept { state().lock.unlock(); }
void child() noexcept {
  State& s = state();
  s.watches.clear();
  if (s.running) {
    close_fd(s.thread.epoll);
    close_fd(s.thread.stop);
    s.thread = {};
    s.running = false;
  }
  for (std::size_t i = 0; i < s.stopping_count; ++i) {
    close_fd(s.stopping[i].epoll);
    close_fd(s.stopping[i].stop);
  }
  s.stopping_count = 0;
  s.failed = false;
  s.lock.unlock();
}
constexpr ForkHandlers kForkHandlers{prepare, parent, child};

}  // namespace

std::uint64_t watch_hangup(int sock, void (*fire)(void*), void* context) noexcept {
  static const bool installed = [] {
    install_fork_handlers(ForkStage::kHangupWatch, &kForkHandlers);
    return true;
  }();
  (void)installed;
  State& s = state();
  std::uint64_t id = 0;
  Thread idle;
  {
    const std::lock_guard<std::mutex> hold(s.lock);
    if (s.failed || (!s.running && !start(s))) return 0;
    try {
      id = s.next_id++;
      s.watches.emplace(id, Watch{sock, fire, context});
    } catch (...) {  // no memory
      id = 0;
    }
    // EPOLLHUP and EPOLLERR are always reported.
    if (id != 0 && !try_add_to_epoll(s.thread.epoll, sock, kEpollReadHangup | kEpollOneShot, id)) {
      s.watches.erase(id);
      id = 0;
    }
    if (id == 0) idle = take_idle_thread(s);
  }
  stop_thread(idle);
  return id;
}

void unwatch_hangup(std::uint64_t id) noexcept {
  if (id == 0) return;
  State& s = state();
  Thread idle;
  {
    const std::lock_guard<std::mutex> hold(s.lock);
    const auto it = s.watches.find(id);
    if (it == s.watches.end()) return;
    remove_from_epoll(s.thread.epoll, it->second.sock);
    s.watches.erase(it);
    idle = take_idle_thread(s);
  }
  stop_thread(idle);
}

bool hangup_watch_running() noexcept {
  State& s = state();
  const std::lock_guard<std::mutex> hold(s.lock);
  return s.running;
}

std::size_t hangup_watch_count() noexcept {
  State& s = state();
  const std::lock_guard<std::mutex> hold(s.lock);
  return s.watches.size();
}

}  // namespace shmtensor::internal
