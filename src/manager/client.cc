#include "manager/client.h"

#include <cerrno>
#include <chrono>
#include <condition_variable>
#include <cstring>
#include <mutex>
#include <optional>
#include <span>
#include <thread>
#include <unordered_set>
#include <vector>

#include "manager/paths.h"
#include "manager/protocol.h"
#include "memory/segment_observer.h"
#include "os/daemonize.h"
#include "os/event_fd.h"
#include "os/fork_handlers.h"
#include "os/poll.h"
#include "os/private_dir.h"
#include "os/proc.h"
#include "os/proc_scan.h"
#include "os/syscall.h"
#include "os/unix_socket.h"
#include "shmtensor/error.h"

namespace shmtensor::internal::manager {

namespace {

using Clock = std::chrono::steady_clock;

// A daemon that takes longer than this to start, to answer a hello or to take a message is
// treated as broken (its socket buffer is ~200 KiB: a live daemon never makes us wait).
constexpr int kIoTimeoutMs = 10000;
constexpr auto kConnectDeadline = std::chrono::seconds(20);

// A thread that watches one connection for the daemon's end of it to close (the daemon
// died, or dropped us), so that a replacement starts at once, while this process and the
// other holders still live to tell it what they hold, rather than at this process's next
// send, which may never come (clients of a killed daemon that only exit left their names
// to the next use of shmtensor). One per connection: started once the hello is answered,
// stopped when the connection closes. It polls the connection and an eventfd (to be
// stopped); what it decides it decides under Client::mu, which it only ever try_locks: the
// thread that stops it holds that lock and waits for it to finish.
//
// Its start is waited for: a fork while a thread is starting can leave a lock of the
// runtime (ASan's thread registry: its pthread_create returns before the new thread
// registers) held in the child for ever, and the child's own first connection, which
// starts a thread, then hangs. It is detached, not joined: a forked child inherits the
// runtime's record of every joinable thread, and TSan refuses a new thread that reuses one
// ("dup thread with used id").
struct Watch {
  UniqueFd wake;  // eventfd: stop
  std::thread::id thread;
  std::mutex mu;  // guards started, stop and done
  std::condition_variable cv;
  bool started = false;
  bool stop = false;
  bool done = false;
  // The Client's reference and the thread's: the last one to let go deletes it.
  std::atomic<int> refs{2};
};

void unref(Watch* w) noexcept {
  // acq_rel: the deleting side sees every write the other side made to *w.
  if (w->refs.fetch_sub(1, std::memory_order_acq_rel) == 1) delete w;
}

struct Client {
  std::mutex mu;
  UniqueFd fd;
  pid_t daemon_pid = 0;
  Watch* watch = nullptr;  // of fd, when one could be started
  // Names this process holds a count of and has registered: what a new connection
  // re-registers, and what a forked child inherits (as a copy of this memory).
  std::unordered_set<std::string> held;
  std::uint64_t fork_seq = 0;
  bool fork_announced = false;
};

void prepare_fork() noexcept;
void parent_after_fork() noexcept;
void child_after_fork() noexcept;
constexpr ForkHandlers kForkHandlers{
    prepare_fork, [](bool /*fork_failed*/) noexcept { parent_after_fork(); }, child_after_fork};
void connect_locked(Client& c);

Client& client() {
  // Leaked: segments may be released during static destruction.
  static Client* c = [] {
    auto* p = new Client;
    install_fork_handlers(ForkStage::kManagerClient, &kForkHandlers);
    return p;
  }();
  return *c;
}

// Stops the watch of the current connection and waits until its thread has let go of
// the connection and closed its eventfd (so that the daemon sees our end close now, and
// an idle process keeps no fd). Its own thread does not wait for itself.
void stop_watch(Client& c) noexcept {
  Watch* w = std::exchange(c.watch, nullptr);
  if (w == nullptr) return;
  {
    // Under w->mu: the watch thread closes its eventfd under the same lock once it stops,
    // so the fd written here is still the eventfd (not an fd number reused meanwhile).
    std::lock_guard lock(w->mu);
    w->stop = true;
    if (w->wake.valid()) signal_event_fd(w->wake.get());
  }
  if (std::this_thread::get_id() != w->thread) {
    std::unique_lock lock(w->mu);
    w->cv.wait(lock, [w] { return w->done; });
  }
  unref(w);
}

void disconnect(Client& c) noexcept {
  stop_watch(c);
  c.fd.reset();
  c.daemon_pid = 0;
}

// The daemon's end of our connection closed. A replacement starts now if this process
// holds names: it carries on from the dead one's journal and sweeps (cleanup.md G6), and
// we re-register what we hold. If none can start, the next send tries again.
void daemon_lost_locked(Client& c) noexcept {
  disconnect(c);
  if (c.held.empty()) return;
  try {
    connect_locked(c);
  } catch (...) {
  }
}

bool stop_requested(Watch* w) {
  std::lock_guard lock(w->mu);
  return w->stop;
}

// Under the client's lock: reads what is pending on the connection. Nobody waits for an
// answer then (whoever asks holds the lock until it has read its answer), so a message is
// one left by a request that gave up, and is dropped. True when the connection has ended.
bool connection_ended(int conn) noexcept {
  for (;;) {
    char buf[1024];
    RecvResult r = recv_packet(conn, buf, sizeof buf, true);
    if (r.size > 0) continue;
    return r.size == 0 || (r.error != EAGAIN && r.error != EWOULDBLOCK);
  }
}

void watch_connection(Watch* w, int conn) noexcept {
  Client& c = client();
  {
    std::lock_guard lock(w->mu);
    w->started = true;
  }
  w->cv.notify_all();
  const int fds[] = {conn, w->wake.get()};
  for (;;) {
    bool failed = false;
    try {
      wait_readable(fds, std::nullopt);
    } catch (...) {
      failed = true;
    }
    if (stop_requested(w)) break;
    if (!c.mu.try_lock()) {
      // Its holder may be reading an answer, or sending (and about to find the daemon gone
      // itself). Look again in a moment, unless told to stop.
      try {
        wait_readable(std::span(fds).subspan(1), std::chrono::milliseconds(1));
      } catch (...) {
      }
      continue;
    }
    std::unique_lock lock(c.mu, std::adopt_lock);
    if (c.watch != w) break;  // cannot happen: whoever detaches it holds the lock until done
    const bool lost = connection_ended(conn);
    if (!failed && !lost) continue;
    // From here on this thread no longer watches: detach it from the client first, so
    // that the disconnect below does not wait for it.
    c.watch = nullptr;
    unref(w);
    if (lost) daemon_lost_locked(c);
    break;
  }
  {
    std::lock_guard lock(w->mu);
    w->wake.reset();
    w->done = true;
  }
  w->cv.notify_all();
  unref(w);
}

// Watches the connection just made. Without a thread (none can be made now) a dead
// daemon is noticed at the next send on the connection.
void start_watch(Client& c) noexcept {
  Watch* w = nullptr;
  try {
    w = new Watch;
    w->wake = make_event_fd();
    std::thread t(watch_connection, w, c.fd.get());
    w->thread = t.get_id();
    t.detach();
    c.watch = w;
    std::unique_lock lock(w->mu);
    w->cv.wait(lock, [w] { return w->started; });
  } catch (...) {
    delete w;
  }
}

[[noreturn]] void cannot_start(const std::string& tried) {
  throw Error(
      "cannot start shmtensor-manager, the daemon that removes file_system shared memory "
      "left by crashed processes. Looked for it at:" +
      tried +
      "\nBuild the shmtensor-manager target, install shmtensor, or set SHMTENSOR_MANAGER to "
      "its path — or use set_sharing_strategy(\"file_descriptor\"), which needs no daemon");
}

// Starts a daemon for `loc` and waits until it serves (or says another one does): returns
// "". A daemon that died before it reported (killed while starting) is no reason to give
// up: returns what happened, and the caller tries again. Throws for what will not change.
std::string start_daemon(const ManagerLocation& loc) {
  std::string tried;
  for (const auto& path : manager_program_candidates()) {
    if (!file_exists(path)) {
      tried += "\n  " + path + " (does not exist)";
      continue;
    }
    UniqueFd report = spawn_detached(
        path, {"--detach", "--dir", loc.dir, "--group", loc.group, "--notify-fd",
               std::to_string(kDaemonNotifyFd), "--grace-ms", std::to_string(manager_grace_ms())});
    bool timed_out = false;
    std::string line = read_line(report.get(), kIoTimeoutMs, &timed_out);
    if (line.rfind("OK", 0) == 0 || line == "EXISTS") return {};
    if (line.rfind("EXEC ", 0) == 0) {
      int err = std::atoi(line.c_str() + 5);
      tried += "\n  " + path + " (cannot execute: " + std::strerror(err) + ")";
      continue;
    }
    if (line.rfind("ERROR ", 0) == 0)
      throw Error("shmtensor-manager (" + path + ") could not start: " + line.substr(6));
    if (timed_out)
      throw Error("shmtensor-manager (" + path + ") did not report within " +
                  std::to_string(kIoTimeoutMs / 1000) + " s; see its log " + loc.log_path);
    return "shmtensor-manager (" + path + ") exited without reporting; see its log " + loc.log_path;
  }
  cannot_start(tried);
}

// Sends every name this process holds on a fresh connection. False if the daemon went away.
bool reregister(Client& c) {
  if (c.held.empty()) return true;
  std::vector<std::string> names(c.held.begin(), c.held.end());
  for (const auto& msg : encode_names(MessageType::kRegisterHeld, names))
    if (send_packet(c.fd.get(), msg.data(), msg.size(), false) != 0) return false;
  return true;
}

}  // namespace

UniqueFd greeted_connection(pid_t* daemon_pid, std::uint64_t* features) {
  const ManagerLocation loc = manager_location();
  ensure_private_dir(loc.dir);
  const auto deadline = Clock::now() + kConnectDeadline;
  for (;;) {
    int err = 0;
    UniqueFd fd = seqpacket_connect(loc.socket_path, &err);
    if (!fd) {
      if (err != ENOENT && err != ECONNREFUSED)
        throw_system_error(err, "connect", "shmtensor-manager at " + loc.socket_path);
      std::string failure = start_daemon(loc);
      if (Clock::now() > deadline)
        throw Error(failure.empty() ? "shmtensor-manager started but " + loc.socket_path +
                                          " does not accept connections"
                                    : failure);
      continue;
    }
    set_socket_timeouts(fd.get(), kIoTimeoutMs);
    MessageHeader hello{};
    // Who we are, as the daemon may read it only after we are gone (a short-lived process):
    // our start time (to tell us from a later process with our pid) and process group (to
    // keep names we sent in messages while our relatives live).
    encode_header(MessageType::kHello, own_process_id().start_time,
                  static_cast<std::uint64_t>(own_process_group()), &hello);
    if (send_packet(fd.get(), &hello, sizeof hello, false) == 0) {
      char buf[1024];
      RecvResult r = recv_packet(fd.get(), buf, sizeof buf, false);
      if (r.size < 0 && (r.error == EAGAIN || r.error == EWOULDBLOCK))
        throw Error("shmtensor-manager at " + loc.socket_path + " did not answer within " +
                    std::to_string(kIoTimeoutMs / 1000) + " s (is it stopped?)");
      if (r.size > 0 && !r.truncated) {
        Message m = decode(buf, static_cast<std::size_t>(r.size));
        if (m.type == MessageType::kRefused)
          throw Error("shmtensor-manager at " + loc.socket_path +
                      " refused this process: " + m.text);
        if (m.type != MessageType::kHelloAck)
          throw ProtocolError("shmtensor-manager answered a hello with message type " +
                              std::to_string(static_cast<int>(m.type)));
        *daemon_pid = static_cast<pid_t>(m.a);
        if (features != nullptr) *features = m.b;
        return fd;
      }
    }
    // End of stream before the answer: that daemon is exiting (it closed its listener with
    // us in the backlog). The next connect finds no socket and starts a new one.
    if (Clock::now() > deadline)
      throw Error("could not connect to shmtensor-manager at " + loc.socket_path +
                  ": it keeps closing connections");
    std::this_thread::sleep_for(std::chrono::milliseconds(5));
  }
}

namespace {

void connect_locked(Client& c) {
  const auto deadline = Clock::now() + kConnectDeadline;
  for (;;) {
    pid_t daemon = 0;
    c.fd = greeted_connection(&daemon);
    c.daemon_pid = daemon;
    if (reregister(c)) {
      start_watch(c);
      return;
    }
    disconnect(c);
    if (Clock::now() > deadline)
      throw Error("shmtensor-manager keeps closing the connection");
    std::this_thread::sleep_for(std::chrono::milliseconds(5));
  }
}

bool daemon_gone(int err) {
  return err == EPIPE || err == ECONNRESET || err == ENOTCONN || err == ECONNREFUSED;
}

// Sends one message, connecting first if needed. If the daemon died, reconnects (which
// starts a new one and re-registers every held name) and sends again, unless `reconnect`
// is false: then the message is dropped.
void send_locked(Client& c, const void* data, std::size_t size, bool reconnect) {
  for (int attempt = 0; attempt < 3; ++attempt) {
    if (!c.fd) {
      if (attempt > 0 && !reconnect) return;
      connect_locked(c);
    }
    int err = send_packet(c.fd.get(), data, size, false);
    if (err == 0) return;
    disconnect(c);
    if (err == EAGAIN || err == EWOULDBLOCK)
      throw Error("shmtensor-manager did not take a message within " +
                  std::to_string(kIoTimeoutMs / 1000) + " s (is it stopped?)");
    if (!daemon_gone(err)) throw_system_error(err, "send", "to shmtensor-manager");
  }
  throw Error("shmtensor-manager keeps closing the connection");
}

void send_locked(Client& c, const std::string& msg, bool reconnect) {
  send_locked(c, msg.data(), msg.size(), reconnect);
}

std::string one_name(MessageType type, const std::string& name, std::uint64_t a = 0) {
  return encode(Message{type, a, 0, {name}, {}, {}, {}});
}

// ---- fork ------------------------------------------------------------------------------
// Run first of the library's fork handlers (os/fork_handlers.h says why).

void prepare_fork() noexcept {
  const int saved = errno;
  keeper_prepare_fork();  // first: a keeper request never takes the client's lock
  Client& c = client();
  c.mu.lock();  // held across fork: the child must not inherit it locked by another thread
  c.fork_announced = false;
  if (!c.held.empty()) {
    try {
      MessageHeader h{};
      encode_header(MessageType::kForkBegin, ++c.fork_seq, 0, &h);
      // A process that inherited names and never connected connects now (we are in the
      // parent, before fork: a normal context).
      send_locked(c, &h, sizeof h, true);
      c.fork_announced = true;
    } catch (...) {
      // The daemon then learns of the child when it connects, or never (its counts stay,
      // and the name is kept until every process that held it is gone).
    }
  }
  errno = saved;
}

void parent_after_fork() noexcept {
  const int saved = errno;
  client().mu.unlock();
  keeper_parent_after_fork();
  errno = saved;
}

void child_after_fork() noexcept {
  // Async-signal-safe only: one non-blocking send of a fixed-size message, and close.
  const int saved = errno;
  Client& c = client();
  if (c.fd) {
    if (c.fork_announced) {
      MessageHeader h{};
      encode_header(MessageType::kForkChild, c.fork_seq, static_cast<std::uint64_t>(own_pid()), &h);
      send_packet(c.fd.get(), &h, sizeof h, true);
    }
    c.fd.reset();  // the parent's connection stays the parent's: its end tells of its death
  }
  if (c.watch != nullptr) {
    // Its thread is the parent's. Close our copy of its eventfd and forget it (no free()
    // here: the parent's thread still counts on it in the parent's memory, not ours).
    c.watch->wake.reset();
    c.watch = nullptr;
  }
  c.daemon_pid = 0;
  c.fork_announced = false;
  c.mu.unlock();
  keeper_child_after_fork();
  errno = saved;
}

}  // namespace

void register_created(const std::string& name) {
  Client& c = client();
  std::lock_guard lock(c.mu);
  send_locked(c, one_name(MessageType::kRegisterCreated, name), true);
  c.held.insert(name);
}

void register_opened(const std::string& name) noexcept {
  Client& c = client();
  std::lock_guard lock(c.mu);
  try {
    send_locked(c, one_name(MessageType::kRegisterOpened, name), true);
    c.held.insert(name);
  } catch (...) {
    if (c.held.empty()) disconnect(c);
  }
}

void release(const std::string& name, bool unlinked) noexcept {
  Client& c = client();
  std::lock_guard lock(c.mu);
  const bool was_held = c.held.erase(name) > 0;
  try {
    // The daemon must hear of a count we gave back while the name lives on: otherwise it
    // would take that count off again when this process dies. A name we unlinked needs no
    // word unless we are connected anyway (the daemon then forgets it at once).
    if (c.fd || (was_held && !unlinked)) {
      send_locked(c, one_name(MessageType::kRelease, name, unlinked ? 1 : 0),
                  was_held && !unlinked);
    }
  } catch (...) {
  }
  if (c.held.empty()) disconnect(c);
}

namespace {

// Reads until the answer to `token`. False when the connection ended first.
bool await_sync_ack(Client& c, std::uint64_t token) {
  for (;;) {
    char buf[1024];
    RecvResult r = recv_packet(c.fd.get(), buf, sizeof buf, false);
    if (r.size < 0 && (r.error == EAGAIN || r.error == EWOULDBLOCK)) {
      disconnect(c);
      throw Error("shmtensor-manager did not answer a sync within " +
                  std::to_string(kIoTimeoutMs / 1000) + " s (is it stopped?)");
    }
    if (r.size <= 0 || r.truncated) return false;
    Message m = decode(buf, static_cast<std::size_t>(r.size));
    if (m.type == MessageType::kSyncAck && m.a == token) return true;
  }
}

}  // namespace

void sync() {
  Client& c = client();
  std::lock_guard lock(c.mu);
  static std::uint64_t token = 0;
  for (int attempt = 0;; ++attempt) {
    MessageHeader h{};
    encode_header(MessageType::kSync, ++token, 0, &h);
    send_locked(c, &h, sizeof h, true);
    if (await_sync_ack(c, token)) break;
    // The daemon died before it answered: sync with its replacement, which carries on
    // from its journal and hears again what we hold.
    daemon_lost_locked(c);
    if (attempt == 2) throw Error("shmtensor-manager closed the connection during a sync");
  }
  if (c.held.empty()) disconnect(c);
}

void install_client_fork_handlers() noexcept { (void)client(); }

pid_t connected_daemon_pid() noexcept {
  Client& c = client();
  std::lock_guard lock(c.mu);
  return c.fd ? c.daemon_pid : 0;
}

std::size_t held_name_count() noexcept {
  Client& c = client();
  std::lock_guard lock(c.mu);
  return c.held.size();
}

namespace {

// The memory layer, below us, reports named segments through a hook (segment_observer.h)
// and knows nothing of the manager. The hook is installed here, by a static initializer,
// so it is in place before the library can be used (before main(), or when the shared
// library is loaded). Not from a later "first use" above memory: every path to a named
// segment (Storage::share_memory_, a Tensor put on a queue, a received message) enters
// memory through memory's own public Storage API or the wire decoder, and no layer above
// memory lies on all of them. A static initializer alone is fragile in a static library:
// the linker keeps this object only if something refers to it, and nothing in the library
// does. So the static shmtensor target makes every program refer to
// shmtensor_manager_client_anchor (a "-u" link option, in CMakeLists.txt and shmtensor.pc);
// were it dropped anyway, memory would throw at the first named segment rather than create
// a name nobody watches.
const SegmentObserver kObserver{register_created, register_opened, release};
[[maybe_unused]] const bool kObserverInstalled = (set_segment_observer(&kObserver), true);
// The named-channel registry's client (channel_client.cc), installed with it.
[[maybe_unused]] const bool kChannelRegistryInstalled =
    (set_channel_registry(&channel_registry_client()), true);

}  // namespace

}  // namespace shmtensor::internal::manager

extern "C" void shmtensor_manager_client_anchor() noexcept {}
