#include "transport/hangup_watch.h"

#include <pthread.h>
#include <signal.h>
#include <sys/epoll.h>
#include <sys/eventfd.h>
#include <unistd.h>

#include <array>
#include <cerrno>
#include <mutex>
#include <new>
#include <unordered_map>

#include "os/fork_handlers.h"

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
  pthread_t handle{};
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

void close_fd(int& fd) noexcept {
  if (fd >= 0) ::close(fd);
  fd = -1;
}

void* run(void* arg) {
  const Thread t = *static_cast<Thread*>(arg);
  delete static_cast<Thread*>(arg);
  State& s = state();
  epoll_event events[16];
  for (;;) {
    const int n = ::epoll_wait(t.epoll, events, 16, -1);
    if (n < 0) {
      if (errno == EINTR) continue;
      // Cannot happen with fds we own. Should it, every watch fires (its owner then waits
      // in slices, as without a watch) rather than leave a sleeper that nothing wakes.
      const std::lock_guard<std::mutex> hold(s.lock);
      for (auto& [id, w] : s.watches) w.fire(w.context);
      s.failed = true;  // no new watch until the last one ends (joins this thread)
      return nullptr;
    }
    for (int i = 0; i < n; ++i) {
      if (events[i].data.u64 == kStopId) return nullptr;
      const std::lock_guard<std::mutex> hold(s.lock);
      // Ended meanwhile: unwatch_hangup removed it (EPOLLONESHOT: it fires once).
      if (auto it = s.watches.find(events[i].data.u64); it != s.watches.end())
        it->second.fire(it->second.context);
    }
  }
}

// Starts the thread (under the lock). False, with nothing left behind, when it cannot.
bool start(State& s) noexcept {
  Thread t;
  t.epoll = ::epoll_create1(EPOLL_CLOEXEC);
  t.stop = ::eventfd(0, EFD_CLOEXEC | EFD_NONBLOCK);
  epoll_event ev{};
  ev.events = EPOLLIN;
  ev.data.u64 = kStopId;
  auto* arg = new (std::nothrow) Thread(t);
  pthread_attr_t attr;
  bool ok = t.epoll >= 0 && t.stop >= 0 && arg != nullptr &&
            ::epoll_ctl(t.epoll, EPOLL_CTL_ADD, t.stop, &ev) == 0 &&
            ::pthread_attr_init(&attr) == 0;
  if (ok) {
    (void)::pthread_attr_setstacksize(&attr, kThreadStack);
    // Every signal blocked in the new thread (it inherits the mask it is created with).
    sigset_t all, old;
    ::sigfillset(&all);
    ::pthread_sigmask(SIG_SETMASK, &all, &old);
    ok = ::pthread_create(&t.handle, &attr, run, arg) == 0;
    // glibc carves static TLS out of the stack: where a loaded library has much of it (EINVAL
    // for a stack too small to hold it), the default size.
    if (!ok) ok = ::pthread_create(&t.handle, nullptr, run, arg) == 0;
    ::pthread_sigmask(SIG_SETMASK, &old, nullptr);
    ::pthread_attr_destroy(&attr);
  }
  if (!ok) {
    delete arg;
    close_fd(t.epoll);
    close_fd(t.stop);
    return false;
  }
  (void)::pthread_setname_np(t.handle, "shmtensor-watch");
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
  const std::uint64_t one = 1;
  (void)!::write(t.stop, &one, sizeof one);
  ::pthread_join(t.handle, nullptr);
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
    epoll_event ev{};
    ev.events = EPOLLRDHUP | EPOLLONESHOT;  // EPOLLHUP and EPOLLERR are always reported
    ev.data.u64 = id;
    if (id != 0 && ::epoll_ctl(s.thread.epoll, EPOLL_CTL_ADD, sock, &ev) != 0) {
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
    (void)::epoll_ctl(s.thread.epoll, EPOLL_CTL_DEL, it->second.sock, nullptr);
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
