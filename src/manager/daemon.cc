#include "manager/daemon.h"

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <ctime>
#include <map>
#include <optional>
#include <thread>
#include <vector>

#include "manager/channels.h"
#include "memory/channel_registry.h"
#include "manager/journal.h"
#include "manager/protocol.h"
#include "manager/segments.h"
#include "manager/tracker.h"
#include "os/daemonize.h"
#include "os/event_fd.h"
#include "os/limits.h"
#include "os/poll.h"
#include "os/private_dir.h"
#include "os/proc_scan.h"
#include "os/shm.h"
#include "os/socket.h"
#include "os/unix_socket.h"
#include "shmtensor/error.h"

namespace shmtensor::internal::manager {

namespace {

using Clock = std::chrono::steady_clock;

// How often liveness is polled for processes without a pidfd (kernels before 5.3).
constexpr int kPollIntervalMs = 250;
// How long a starting daemon waits for an exiting one to release the lock.
constexpr auto kLockWait = std::chrono::seconds(10);
// How long the listener is not watched when a pending connection can be neither accepted
// nor refused (no fd left, not even the spare's).
constexpr auto kAcceptPause = std::chrono::milliseconds(100);

void log(const char* fmt, auto... args) {
  char when[32];
  std::time_t now = std::time(nullptr);
  std::tm tm{};
  ::localtime_r(&now, &tm);
  std::strftime(when, sizeof when, "%F %T", &tm);
  std::fprintf(stderr, "%s shmtensor-manager[%d]: ", when, static_cast<int>(own_pid()));
  if constexpr (sizeof...(args) == 0) {
    std::fputs(fmt, stderr);
  } else {
    std::fprintf(stderr, fmt, args...);
  }
  std::fputc('\n', stderr);
  std::fflush(stderr);
}

class SystemEnvironment : public Tracker::Environment {
 public:
  Journal journal;

  bool alive(const ProcessId& p) override { return is_alive(p); }
  ProcessId identify(pid_t pid) override { return identify_process(pid); }
  std::unordered_map<std::string, std::vector<ProcessId>> scan_mappers() override {
    return scan_shm_mappers("shmtensor_", own_pid());
  }
  SegmentFacts facts(const std::string& name) override { return read_segment_facts(name); }
  pid_t process_group(pid_t pid) override { return read_process_status(pid).process_group; }
  bool group_alive(pid_t pgid) override { return process_group_exists(pgid); }
  bool maps(pid_t pid, const std::string& name) override { return process_maps_shm(pid, name); }
  void drop_count(const std::string& name) override { drop_count_of_dead_holder(name); }
  void unlink(const std::string& name) override {
    if (unlink_named_shm(name)) log("removed %s (no live process holds it)", name.c_str());
  }
  void noted_hold(const std::string& name, const ProcessId& p, pid_t group) override {
    journal.hold(name, p, group);
  }
  void noted_release(const std::string& name, pid_t pid) override { journal.release(name, pid); }
  void noted_adopt(const std::string& name) override { journal.adopt(name); }
  void noted_group(const std::string& name, pid_t group) override { journal.group(name, group); }
  void forgotten(const std::string& name) override { journal.gone(name); }
};

// How long a kept fd or ticket outlives its sender (SHMTENSOR_KEEPER_GRACE_S, seconds;
// default 300): time for a receiver to take it.
std::chrono::milliseconds keeper_grace() {
  const char* s = std::getenv("SHMTENSOR_KEEPER_GRACE_S");
  double seconds = s != nullptr ? std::strtod(s, nullptr) : 300.0;
  if (!(seconds >= 0) || seconds > 1e7) seconds = 300.0;
  return std::chrono::milliseconds(static_cast<long long>(seconds * 1000));
}

// The journal is rewritten from the tracker's state when its appends pass this size.
constexpr std::size_t kJournalCompactBytes = 1 << 20;

struct Connection {
  UniqueFd fd;
  ProcessId peer;   // pid from SO_PEERCRED; start time from the hello
  pid_t group = 0;  // from the hello
  bool greeted = false;
  bool closed = false;
  bool in_service = false;  // its messages are being read (service() is on the stack)
};

bool socket_answers(const std::string& path) {
  int err = 0;
  try {
    return seqpacket_connect(path, &err).valid();
  } catch (const Error&) {
    return false;
  }
}

}  // namespace

struct Daemon::Impl {
  explicit Impl(DaemonOptions o) : options(std::move(o)), tracker(env) {}

  DaemonOptions options;
  SystemEnvironment env;
  Tracker tracker;
  ChannelTable channels;
  KeptFds kept{keeper_grace()};
  UniqueFd lock;
  UniqueFd listener;
  UniqueFd signals;
  // An fd held in reserve: at the open-file limit it is closed so that a pending connection
  // can be accepted and refused (the client hears why, and the listener stops being readable).
  UniqueFd spare = try_make_event_fd();
  std::optional<Clock::time_point> accept_paused_until;
  std::vector<std::unique_ptr<Connection>> conns;
  std::map<pid_t, std::pair<ProcessId, UniqueFd>> pidfds;  // watched, with a pidfd
  std::map<pid_t, ProcessId> polled;                       // watched, without one
  std::vector<pid_t> groups;                               // watched process groups (polled)
  std::map<pid_t, JournaledHolder> clients;                // that said hello (for the journal)
  // SHMTENSOR_MANAGER_DEBUG=1: log every message.
  const bool debug = std::getenv("SHMTENSOR_MANAGER_DEBUG") != nullptr;
  bool unclean_predecessor = false;

  void notify(const std::string& line) {
    if (options.notify_fd < 0) return;
    write_all_noexcept(options.notify_fd, line + "\n");
    UniqueFd(options.notify_fd).reset();
    options.notify_fd = -1;
  }

  // Returns 0 when this process now serves, else run()'s result.
  int start() {
    const ManagerLocation& loc = options.location;
    // It holds the fds of every named channel and kept pickle of the user's processes.
    raise_open_files_limit();
    ensure_private_dir(loc.dir);
    if (options.log_to_file) redirect_stderr_to_log(loc.log_path, 1 << 20);
    const auto deadline = Clock::now() + kLockWait;
    for (;;) {
      lock = try_lock_file(loc.lock_path);
      if (lock) break;
      if (socket_answers(loc.socket_path)) {
        notify("EXISTS");
        return kExitAlreadyRunning;
      }
      if (Clock::now() > deadline)
        throw Error("another shmtensor-manager holds " + loc.lock_path +
                    " but does not answer on " + loc.socket_path);
      std::this_thread::sleep_for(std::chrono::milliseconds(20));
    }
    // We hold the lock, so a socket file left here belongs to a daemon that was killed
    // (one that exits removes it first): what it tracked is lost, so sweep.
    unclean_predecessor = remove_file(loc.socket_path);
    // One that exited on a signal while it still tracked names left them in its journal.
    if (file_exists(loc.journal_path)) unclean_predecessor = true;
    listener = seqpacket_listen(loc.socket_path, 128);
    signals = termination_signal_fd();
    notify("OK " + std::to_string(own_pid()));
    log("serving %s (grace %d ms)", loc.socket_path.c_str(), options.grace_ms);
    return 0;
  }

  // Opens the journal. After a killed predecessor, first carries on from its journal (its
  // holders that died meanwhile give their counts back), then sweeps the names it did not
  // know: orphans go, the rest is adopted.
  void recover() {
    const std::string& path = options.location.journal_path;
    JournalState prior;
    if (unclean_predecessor) prior = read_journal(path);
    env.journal = Journal(path);  // appends to the predecessor's: restore() writes to it
    for (const auto& [pid, h] : prior.processes)
      if (is_alive(h.id)) clients.emplace(pid, h);
    if (unclean_predecessor) {
      tracker.restore(prior);
      if (!prior.names.empty())
        log("carried on with %zu names from the journal", prior.names.size());
      if (options.sweep) {
        try {
          std::set<std::string> known;
          for (const auto& [name, j] : prior.names) known.insert(name);
          // Every group's journal: a name another group's daemon keeps for a live job
          // (its creator dead, a message in flight) is kept here too.
          JournalState all = read_all_journals(options.location.dir);
          SweepReport r = sweep_orphans(false, own_pid(), segment_groups(all), known);
          for (const auto& s : r.removed)
            log("start sweep removed %s (creator %d gone, no process maps it)", s.name.c_str(),
                static_cast<int>(s.facts.creator_pid));
          for (const auto& s : r.kept)
            tracker.adopt(s.name, {s.live_groups.begin(), s.live_groups.end()});
        } catch (const Error& e) {
          log("start sweep failed: %s", e.what());
        }
      }
    }
    compact_journal();
  }

  void compact_journal() {
    JournalState state = tracker.snapshot();
    std::erase_if(clients, [](const auto& c) { return !is_alive(c.second.id); });
    state.processes = clients;
    env.journal.compact(state);
  }

  void close_connection(Connection& c) {
    if (c.closed) return;
    c.closed = true;
    c.fd.reset();
    if (c.greeted) tracker.connection_closed(c.peer);
  }

  void reply(Connection& c, MessageType type, std::uint64_t a, std::uint64_t b = 0) {
    MessageHeader h{};
    encode_header(type, a, b, &h);
    if (send_packet(c.fd.get(), &h, sizeof h, true) != 0) close_connection(c);
  }

  void refuse(UniqueFd fd, const std::string& why) {
    std::string msg = encode(Message{MessageType::kRefused, 0, 0, {}, why, {}, {}});
    send_packet(fd.get(), msg.data(), msg.size(), true);
    log("refused a connection: %s", why.c_str());
  }

  // At the open-file limit, a pending connection that cannot be accepted keeps the listener
  // readable: it is taken with the spare fd's slot and refused. True when one was; when even
  // that failed (not for want of a pending connection), the listener is not watched for
  // kAcceptPause, so that the loop does not spin.
  bool refuse_for_want_of_fds() {
    spare.reset();
    int err = 0;
    UniqueFd fd = accept_connection(listener.get(), &err);
    if (fd) {
      // Not read_system_limits(): it opens files, and this process has no fd to spare.
      const std::uint64_t limit = open_files_soft_limit();
      refuse(std::move(fd),
             "the shmtensor manager is at its open-file limit (" +
                 (limit == UINT64_MAX ? std::string("unlimited") : std::to_string(limit)) +
                 " fds: it holds the fds of named channels and of messages in flight); close "
                 "channels, or raise `ulimit -n` in the process that starts the manager");
    }
    spare = try_make_event_fd();
    if (fd) return true;
    // accept4 takes an fd before it looks for a connection: EMFILE did not say one is pending.
    if (err == EAGAIN || err == ECONNABORTED) return false;
    accept_paused_until = Clock::now() + kAcceptPause;
    log("no fd to accept a connection with (errno %d): not accepting for %lld ms", err,
        static_cast<long long>(kAcceptPause.count()));
    return false;
  }

  void accept_all() {
    for (;;) {
      int err = 0;
      UniqueFd fd = accept_connection(listener.get(), &err);
      if (!fd) {
        if ((err == EMFILE || err == ENFILE) && refuse_for_want_of_fds()) continue;
        return;
      }
      PeerCredentials cred;
      try {
        cred = peer_credentials(fd.get());
      } catch (const Error&) {
        continue;
      }
      if (cred.uid != effective_uid()) {
        refuse(std::move(fd), "peer uid " + std::to_string(cred.uid) +
                                  " is not this manager's uid " + std::to_string(effective_uid()));
        continue;
      }
      if (cred.pid <= 0) {
        refuse(std::move(fd), "peer pid not visible (another pid namespace)");
        continue;
      }
      // The peer may be gone already (a short-lived process): its messages still count.
      auto c = std::make_unique<Connection>();
      c->fd = std::move(fd);
      c->peer = {cred.pid, 0};
      conns.push_back(std::move(c));
    }
  }

  void channel_reply(Connection& c, int err, std::uint32_t kind, const std::string& data,
                     std::span<const int> fds = {}) {
    std::string msg = encode(Message{MessageType::kChannelReply, static_cast<std::uint64_t>(err),
                                     kind, {}, {}, {}, data});
    const std::span<const std::byte> part = std::as_bytes(std::span(msg));
    try {
      if (!send_message(c.fd.get(), std::span(&part, 1), fds, true)) close_connection(c);
    } catch (const Error&) {
      close_connection(c);
    }
  }

  void list_channels(Connection& c) {
    for (const auto& [name, ch] : channels.entries()) {
      std::string pids;
      for (const auto& p : ch.openers) pids += (pids.empty() ? "" : " ") + std::to_string(p.pid);
      std::string msg = encode(Message{MessageType::kChannelEntry, ch.kind,
                                       static_cast<std::uint64_t>(ch.creator.pid), {}, {}, name,
                                       pids});
      if (send_packet(c.fd.get(), msg.data(), msg.size(), true) != 0) {
        close_connection(c);
        return;
      }
    }
    channel_reply(c, 0, 0, {});
  }

  // Named channels (memory/channel_registry.h): the requests of a greeted connection.
  void dispatch_channel(Connection& c, const Message& m, std::vector<UniqueFd>& fds) {
    const auto kind = static_cast<std::uint32_t>(m.a);
    switch (m.type) {
      case MessageType::kKeepFd:
        if (fds.size() > 1)
          throw ProtocolError("a kept fd came with " + std::to_string(fds.size()) + " fds");
        kept.keep(m.data, fds.empty() ? UniqueFd() : std::move(fds[0]), c.peer);
        return;
      case MessageType::kTakeFd: {
        // Its keep may still be queued on the sender's connection (the pickle that names
        // the token left the sender after the keep did): read every connection first.
        if (!kept.holds(m.data)) drain_others();
        UniqueFd fd;
        const KeptFds::Taken t = kept.take(m.data, &fd);
        MessageHeader h{};
        encode_header(MessageType::kKeptFd,
                      t == KeptFds::Taken::kFd       ? 0
                      : t == KeptFds::Taken::kTicket ? 1
                                                     : ENOENT,
                      0, &h);
        const std::span<const std::byte> part = std::as_bytes(std::span(&h, 1));
        const int raw[] = {fd.get()};
        try {
          if (!send_message(c.fd.get(), std::span(&part, 1),
                            fd.valid() ? std::span<const int>(raw) : std::span<const int>(), true))
            close_connection(c);
        } catch (const Error&) {
          close_connection(c);
        }
        return;
      }
      case MessageType::kPublishChannel: {
        if (fds.empty() || fds.size() > kMaxChannelFds)
          throw ProtocolError("a channel published with " + std::to_string(fds.size()) + " fds");
        if (channels.publish(m.channel, kind, std::move(fds), m.data, m.b, c.peer) != 0) {
          int err = 0;
          const RegisteredChannel* old = channels.open(m.channel, kind, c.peer, true, &err);
          channel_reply(c, EEXIST, kind,
                        "a channel named \"" + m.channel + "\" exists (created by pid " +
                            std::to_string(old->creator.pid) + ")");
          return;
        }
        log("channel %s (kind %u) published by pid %d", m.channel.c_str(), kind,
            static_cast<int>(c.peer.pid));
        channel_reply(c, 0, kind, {});
        return;
      }
      case MessageType::kOpenChannel: {
        int err = 0;
        const RegisteredChannel* ch = channels.open(m.channel, kind, c.peer, m.b == 1, &err);
        if (err == ENOENT) {
          channel_reply(c, err, kind, "no channel named \"" + m.channel + "\"");
        } else if (err != 0) {
          channel_reply(c, err, ch->kind,
                        "the channel \"" + m.channel + "\" is of kind " +
                            std::to_string(ch->kind) + ", not " + std::to_string(kind));
        } else {
          std::vector<int> raw;
          for (const auto& fd : ch->fds) raw.push_back(fd.get());
          channel_reply(c, 0, kind, ch->bytes, raw);
        }
        return;
      }
      case MessageType::kUnlinkChannel: {
        int err = channels.unlink(m.channel, m.b);
        if (err == 0) log("channel %s unlinked by pid %d", m.channel.c_str(), static_cast<int>(c.peer.pid));
        channel_reply(c, err, 0, err == 0 ? "" : "no channel named \"" + m.channel + "\"");
        return;
      }
      default:
        list_channels(c);
        return;
    }
  }

  void dispatch(Connection& c, const Message& m, std::vector<UniqueFd>& fds) {
    if (debug)
      log("pid %d: type %d a=%llu b=%llu %s", static_cast<int>(c.peer.pid),
          static_cast<int>(m.type), static_cast<unsigned long long>(m.a),
          static_cast<unsigned long long>(m.b), m.names.empty() ? "" : m.names[0].c_str());
    if (!c.greeted && m.type != MessageType::kHello)
      throw ProtocolError("first message is not a hello");
    if (m.type == MessageType::kPublishChannel || m.type == MessageType::kOpenChannel ||
        m.type == MessageType::kUnlinkChannel || m.type == MessageType::kListChannels ||
        m.type == MessageType::kKeepFd || m.type == MessageType::kTakeFd) {
      dispatch_channel(c, m, fds);
      return;
    }
    if (!fds.empty())
      throw ProtocolError("message type " + std::to_string(static_cast<int>(m.type)) +
                          " carried fds");
    switch (m.type) {
      case MessageType::kHello:
        if (c.greeted) throw ProtocolError("second hello");
        // A forked child announces itself (kForkChild) on its parent's connection before
        // it can connect on its own: read everything already queued elsewhere first, so
        // that the announcement is applied before anything the child says itself.
        drain_others();
        c.greeted = true;
        // The start time it claims (same uid: trusted) identifies it even if it is gone and
        // its pid reused by now; an old client that sends none is identified from /proc.
        c.peer.start_time = m.a != 0 ? m.a : identify_process(c.peer.pid).start_time;
        if (c.peer.start_time == 0) c.peer.start_time = UINT64_MAX;  // gone, unknown: dead
        c.group = static_cast<pid_t>(m.b);
        tracker.connection_opened(c.peer);
        // Durable before the answer: whatever it registers next, a successor knows its group.
        clients[c.peer.pid] = {c.peer, c.group};
        env.journal.process(c.peer, c.group);
        reply(c, MessageType::kHelloAck, static_cast<std::uint64_t>(own_pid()),
              kDaemonFeatures);
        break;
      case MessageType::kRegisterCreated:
      case MessageType::kRegisterOpened:
      case MessageType::kRegisterHeld: {
        auto how = m.type == MessageType::kRegisterCreated  ? Tracker::Registration::kCreated
                   : m.type == MessageType::kRegisterOpened ? Tracker::Registration::kOpened
                                                            : Tracker::Registration::kHeld;
        for (const auto& n : m.names) tracker.registered(c.peer, n, how, c.group);
        break;
      }
      case MessageType::kRelease:
        tracker.released(c.peer, m.names[0], m.a == 1);
        break;
      case MessageType::kForkBegin:
        tracker.fork_begin(c.peer, m.a);
        break;
      case MessageType::kForkChild:
        tracker.fork_child(c.peer, m.a, static_cast<pid_t>(m.b));
        break;
      case MessageType::kSync:
        settle();
        // Durable before the answer: a client that synced before we are killed knows our
        // successor will carry on with what it registered.
        env.journal.flush();
        reply(c, MessageType::kSyncAck, m.a);
        break;
      default:
        throw ProtocolError("a client sent a daemon's message type " +
                            std::to_string(static_cast<int>(m.type)));
    }
  }

  // Reads every message queued on `c` now.
  // Reads what every connection not being read already has queued. A take or hello met
  // while doing so drains again (each connection is read by one service() at a time), so
  // a keep queued on any connection is applied before a take that needs it is answered.
  void drain_others() {
    for (std::size_t i = 0; i < conns.size(); ++i)
      if (!conns[i]->in_service) service(*conns[i]);
  }

  void service(Connection& c) {
    static thread_local std::byte buf[kMaxMessageSize];
    c.in_service = true;
    struct Done {
      Connection& c;
      ~Done() { c.in_service = false; }
    } done{c};
    while (!c.closed) {
      // Fds a message carries (only a publish may) are owned at once and closed with `r`
      // unless the registry takes them.
      Received r;
      try {
        r = receive_message(c.fd.get(), buf, true);
        if (r.would_block) return;
        if (r.eof) {  // the process exited or disconnected
          close_connection(c);
          return;
        }
        dispatch(c, decode(buf, r.size), r.fds);
      } catch (const ProtocolError& e) {
        log("dropping the connection of pid %d: %s", static_cast<int>(c.peer.pid), e.what());
        close_connection(c);
      } catch (const Error& e) {  // the socket itself failed
        close_connection(c);
      }
    }
  }

  void settle() {
    tracker.settle();  // SystemEnvironment::unlink logs each removal
  }

  // A watched process has exited. What it sent before it died is read first: a release it
  // made must be seen before the daemon takes its counts back, or a count would go twice.
  void process_died(const ProcessId& p) {
    for (auto& c : conns)
      if (!c->closed && c->peer.pid == p.pid) service(*c);
    tracker.died(p);
    kept.sender_gone(p, Clock::now());
    for (const auto& name : channels.creator_gone(p))
      log("channel %s removed: its creator, pid %d, is gone", name.c_str(), static_cast<int>(p.pid));
  }

  // Keeps one pidfd (or a polling entry) per watched process.
  void update_watches() {
    std::vector<ProcessId> want = tracker.watched();
    for (const auto& list : {channels.creators(), kept.senders()})
      for (const auto& p : list)
        if (std::find(want.begin(), want.end(), p) == want.end()) want.push_back(p);
    std::vector<ProcessId> dead;
    std::map<pid_t, std::pair<ProcessId, UniqueFd>> next;
    std::map<pid_t, ProcessId> next_polled;
    for (const auto& p : want) {
      if (auto it = pidfds.find(p.pid); it != pidfds.end() && it->second.first == p) {
        next.emplace(p.pid, std::move(it->second));
        continue;
      }
      bool unsupported = false;
      UniqueFd fd = open_pidfd(p.pid, &unsupported);
      if (unsupported) {
        next_polled.emplace(p.pid, p);
      } else if (!fd || !is_alive(p)) {
        dead.push_back(p);  // checked after opening: no exit can slip between
      } else {
        next.emplace(p.pid, std::make_pair(p, std::move(fd)));
      }
    }
    pidfds = std::move(next);
    polled = std::move(next_polled);
    for (const auto& p : dead) process_died(p);
    groups = tracker.watched_groups();
  }

  void serve() {
    std::optional<Clock::time_point> idle_since;
    for (;;) {
      std::erase_if(conns, [](const auto& c) { return c->closed; });
      settle();
      update_watches();
      env.journal.flush();
      if (env.journal.size() > kJournalCompactBytes) compact_journal();
      if (tracker.needs_settle()) continue;  // deaths found while updating the watches

      int timeout = -1;
      const std::optional<Clock::time_point> expiry = kept.expire(Clock::now());
      if (conns.empty() && tracker.idle() && channels.empty() && kept.empty()) {
        if (!idle_since) idle_since = Clock::now();
        auto left = options.grace_ms - std::chrono::duration_cast<std::chrono::milliseconds>(
                                           Clock::now() - *idle_since)
                                           .count();
        if (left <= 0) return;
        timeout = static_cast<int>(left);
      } else {
        idle_since.reset();
      }
      if (!polled.empty() || !groups.empty())
        timeout = timeout < 0 ? kPollIntervalMs : std::min(timeout, kPollIntervalMs);
      if (expiry) {
        const auto left = std::chrono::duration_cast<std::chrono::milliseconds>(
                              *expiry - Clock::now()).count() + 1;
        const int until = static_cast<int>(std::clamp<long long>(left, 0, 1 << 30));
        timeout = timeout < 0 ? until : std::min(timeout, until);
      }

      if (accept_paused_until) {
        if (Clock::now() >= *accept_paused_until) {
          accept_paused_until.reset();
        } else {
          const auto left = std::chrono::ceil<std::chrono::milliseconds>(*accept_paused_until -
                                                                          Clock::now());
          const int until = static_cast<int>(left.count());
          timeout = timeout < 0 ? until : std::min(timeout, until);
        }
      }
      std::vector<int> fds{signals.get(), accept_paused_until ? -1 : listener.get()};
      for (auto& c : conns) fds.push_back(c->fd.get());
      std::vector<ProcessId> pid_order;
      for (auto& [pid, w] : pidfds) {
        fds.push_back(w.second.get());
        pid_order.push_back(w.first);
      }
      std::vector<bool> ready(fds.size(), false);
      std::optional<std::chrono::nanoseconds> wait;
      if (timeout >= 0) wait = std::chrono::milliseconds(timeout);
      for (std::size_t i : wait_readable(fds, wait)) ready[i] = true;

      if (ready[0]) {
        int sig = read_signal(signals.get());
        log("signal %d: exiting", sig);
        return;
      }
      if (ready[1]) accept_all();
      const std::size_t nconns = fds.size() - 2 - pid_order.size();
      for (std::size_t i = 0; i < nconns; ++i) {
        if (ready[2 + i]) service(*conns[i]);
      }
      for (std::size_t i = 0; i < pid_order.size(); ++i) {
        if (ready[2 + nconns + i]) {
          process_died(pid_order[i]);
          pidfds.erase(pid_order[i].pid);
        }
      }
      for (const auto& [pid, p] : polled)
        if (!is_alive(p)) process_died(p);
      for (pid_t g : groups) {
        if (!process_group_exists(g)) {
          tracker.group_ended();
          break;
        }
      }
    }
  }

  void shut_down() {
    // First the socket, so that a client arriving now starts a new daemon (which waits for
    // our lock) instead of queueing on a listener nobody will accept from. Clients in the
    // backlog get EOF before their hello is answered, and retry.
    remove_file(options.location.socket_path);
    listener.reset();
    for (auto& c : conns) c->fd.reset();
    conns.clear();
    // Whatever is still tracked (only after a signal) goes on in the journal for the next
    // daemon; after an idle exit nothing is tracked, and the journal goes.
    if (tracker.name_count() == 0) {
      env.journal.remove();
    } else {
      compact_journal();
    }
    log("exiting");
  }
};

Daemon::Daemon(DaemonOptions options) : impl_(std::make_unique<Impl>(std::move(options))) {}
Daemon::~Daemon() = default;

int Daemon::run() noexcept {
  try {
    int rc = impl_->start();
    if (rc != 0) return rc;
  } catch (const std::exception& e) {
    log("cannot start: %s", e.what());
    impl_->notify(std::string("ERROR ") + e.what());
    return 1;
  }
  try {
    impl_->recover();
    impl_->serve();
  } catch (const std::exception& e) {
    log("fatal: %s", e.what());
  }
  try {
    impl_->shut_down();
  } catch (const std::exception& e) {
    log("shutting down: %s", e.what());
  }
  return 0;
}

}  // namespace shmtensor::internal::manager
