// `shmtensor bench`: cross-process benchmark scenarios. Scenario names are stable:
//   queue_fresh      producers put --count fresh tensors of --bytes; consumers get and drop
//   queue_preshared  the same shared tensor sent --count times
//   pingpong         round trips of one tensor over a pipe (latency percentiles)
//   retain           like queue_fresh, but consumers keep every tensor (reports how far it
//                    got if a limit is hit)
//   dataloader       a DataLoader with --workers over --samples samples of
//                    --tensors-per-sample tensors of --bytes (bench_dataloader.cc); run
//                    only when named
// Bare OS baselines, measured first in the same run whenever a scenario above (but the
// dataloader) runs, between two processes like the scenarios:
//   bare_futex       round trips through one word of shared memory, FUTEX_WAIT/FUTEX_WAKE
//   bare_seqpacket   round trips of a --bytes datagram over a SOCK_SEQPACKET socket pair
//   bare_stream      --count datagrams of --bytes one way: the ceiling of any transport
//                    that costs one datagram per message
//   ring_pingpong    round trips of a --bytes message through the message ring
//                    (src/transport/ring.h: one ring each way), blocking like bare_futex
//                    and like a Connection's receive (a sleep with no time limit)
//   ring_stream      --count messages of --bytes one way through one ring: the ceiling of
//                    a transport whose messages are ring slots (no encoding, no tensors)
// Each scenario's x_bare column is its cost per message over the bare one: pingpong's p50
// over bare_futex's p50, and for queue_fresh, queue_preshared and retain bare_stream's
// messages/s over the scenario's tensors/s.
// Prints a table, or with --json one object per line per scenario and strategy.
#include <dirent.h>
#include <linux/futex.h>
#include <sys/mman.h>
#include <sys/socket.h>
#include <sys/syscall.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdio>
#include <fstream>
#include <iostream>
#include <map>
#include <optional>
#include <string>
#include <vector>

#include "bench_dataloader.h"
#include "command.h"
#include "shmtensor/busy_poll.h"
#include "shmtensor/connection.h"
#include "shmtensor/queue.h"
#include "transport/busy_poll.h"
#include "transport/ring.h"

namespace shmtensor::tool {
namespace {

struct BenchOptions {
  std::vector<std::string> scenarios;
  std::vector<std::string> strategies{"file_descriptor", "file_system"};
  std::size_t bytes = 40;
  std::int64_t count = 100000;
  int producers = 1;
  int consumers = 1;
  bool json = false;
  bool bare = true;         // run the bare baselines first
  double busy_poll_us = 0;  // set_busy_poll for the scenarios (0: off)
  std::int64_t batch = 1;   // queue scenarios: put_many / get_many of this many (1: put / get)
  DataLoaderBenchOptions loader;
};

struct Report {  // what one consumer sends back
  std::int64_t received = 0;
  double first_ns = 0, last_ns = 0;
  std::vector<double> latencies_us;
  std::int64_t fds = 0, mappings = 0;
  std::int64_t peak_rss_kb = 0;
  std::string error;
  SHMTENSOR_FIELDS(received, first_ns, last_ns, latencies_us, fds, mappings, peak_rss_kb, error)
};

struct Result {
  std::string scenario, strategy;
  std::size_t bytes = 0;
  std::int64_t count = 0, completed = 0;
  double tensors_per_s = 0, gb_per_s = 0, p50_us = 0, p99_us = 0;
  double x_bare = 0;  // cost per message over the bare baseline's (0: none)
  std::int64_t consumer_fds = 0, consumer_mappings = 0;
  std::int64_t consumer_peak_rss_kb = 0;  // VmHWM: resident set, shared pages included
  std::string error;
};

double now_ns() {
  return static_cast<double>(std::chrono::duration_cast<std::chrono::nanoseconds>(
                                 std::chrono::steady_clock::now().time_since_epoch())
                                 .count());
}

std::int64_t count_entries(const char* dir) {
  std::int64_t n = 0;
  if (DIR* d = opendir(dir)) {
    while (dirent* e = readdir(d))
      if (e->d_name[0] != '.') ++n;
    closedir(d);
  }
  return n;
}

std::int64_t count_lines(const char* path) {
  std::ifstream f(path);
  std::string line;
  std::int64_t n = 0;
  while (std::getline(f, line)) ++n;
  return n;
}

// VmHWM of /proc/self/status: the peak resident set size, in KiB.
std::int64_t peak_rss_kb() {
  std::ifstream f("/proc/self/status");
  std::string line;
  while (std::getline(f, line))
    if (line.rfind("VmHWM:", 0) == 0) return std::strtoll(line.c_str() + 6, nullptr, 10);
  return 0;
}

double percentile(std::vector<double>& v, double p) {
  if (v.empty()) return 0;
  std::size_t k = static_cast<std::size_t>(p * static_cast<double>(v.size() - 1));
  std::nth_element(v.begin(), v.begin() + static_cast<std::ptrdiff_t>(k), v.end());
  return v[k];
}

pid_t fork_worker(const std::function<void()>& fn) {
  std::fflush(nullptr);
  pid_t pid = fork();
  if (pid == 0) {
    int code = 0;
    try {
      fn();
    } catch (const std::exception& e) {
      std::fprintf(stderr, "bench worker %d: %s\n", getpid(), e.what());
      code = 1;
    }
    std::fflush(nullptr);
    _exit(code);
  }
  return pid;
}

// Whether `pid` (a child) has ended, and how, without reaping it: reap() still waits for
// it, and a pid not reaped yet cannot belong to another process when reap() kills it.
struct Ended {
  bool ended = false;
  bool ok = false;  // exited with status 0
};
Ended peek_child(pid_t pid) {
  siginfo_t info{};
  if (::waitid(P_PID, static_cast<id_t>(pid), &info, WEXITED | WNOHANG | WNOWAIT) != 0 ||
      info.si_pid != pid)
    return {};
  return {true, info.si_code == CLD_EXITED && info.si_status == 0};
}

void reap(pid_t pid, bool kill_it) {
  if (kill_it) kill(pid, SIGKILL);
  int status;
  while (waitpid(pid, &status, 0) == -1 && errno == EINTR) {
  }
}

// queue_fresh, queue_preshared, retain.
Result run_queue(const std::string& scenario, const BenchOptions& o) {
  const bool preshared = scenario == "queue_preshared";
  const bool keep = scenario == "retain";
  const std::int64_t elems = static_cast<std::int64_t>(std::max<std::size_t>(o.bytes, 1));
  Queue<std::pair<double, Tensor>> q(1024);
  Queue<int> go;
  Queue<Report> reports;
  std::vector<pid_t> producers, consumers;
  const std::int64_t per_consumer = o.count / o.consumers;
  const std::int64_t total = per_consumer * o.consumers;
  for (int c = 0; c < o.consumers; ++c) {
    consumers.push_back(fork_worker([&] {
      Report r;
      std::vector<Tensor> kept;
      if (keep) kept.reserve(static_cast<std::size_t>(per_consumer));
      // Every k-th latency: enough for percentiles, small enough for the report message.
      const std::int64_t every = std::max<std::int64_t>(1, per_consumer / 5000);
      try {
        // One item (get), or what get_many takes in one call. Reused: a get costs the
        // benchmark no allocation of its own.
        std::vector<std::pair<double, Tensor>> got;
        for (std::int64_t i = 0; i < per_consumer;) {
          got.clear();
          if (o.batch > 1)
            got = q.get_many(static_cast<std::size_t>(std::min(o.batch, per_consumer - i)));
          else
            got.push_back(q.get());
          double now = now_ns();
          if (i == 0) r.first_ns = now;
          r.last_ns = now;
          for (auto& [sent_ns, t] : got) {
            if (i % every == 0) r.latencies_us.push_back((now - sent_ns) / 1000.0);
            if (keep) kept.push_back(std::move(t));
            ++r.received;
            ++i;
          }
        }
      } catch (const std::exception& e) {
        r.error = e.what();
      }
      // At an fd limit, listing /proc/self/fd itself needs one fd: free one first.
      if (!r.error.empty() && !kept.empty()) kept.pop_back();
      r.fds = count_entries("/proc/self/fd");
      r.mappings = count_lines("/proc/self/maps");
      r.peak_rss_kb = peak_rss_kb();
      kept.clear();  // frees fds, so that the report itself can be sent at a limit
      reports.put(r);
    }));
  }
  for (int p = 0; p < o.producers; ++p) {
    std::int64_t share = total / o.producers + (p < total % o.producers ? 1 : 0);
    producers.push_back(fork_worker([&, share] {
      go.get();
      // The data is written, as torch.ones writes it: a benchmark of fresh tensors must
      // pay for new pages as users' code does.
      Tensor same = Tensor::ones({elems}, DType::kUInt8);
      same.share_memory_();
      std::vector<std::pair<double, Tensor>> batch;
      for (std::int64_t i = 0; i < share; ++i) {
        Tensor t = preshared ? same : Tensor::ones({elems}, DType::kUInt8);
        if (o.batch <= 1) {
          q.put({now_ns(), t});
          continue;
        }
        batch.emplace_back(now_ns(), std::move(t));
        if (static_cast<std::int64_t>(batch.size()) == o.batch || i + 1 == share) {
          q.put_many(batch);
          batch.clear();
        }
      }
    }));
  }
  double start = now_ns();
  for (int p = 0; p < o.producers; ++p) go.put(1);
  Result res;
  double last = start;
  std::vector<double> lat;
  bool producer_failed = false;
  for (int c = 0; c < o.consumers; ++c) {
    // A consumer that died without reporting must not hang the benchmark.
    std::optional<Report> got;
    while (!(got = reports.try_get(std::chrono::milliseconds(200)))) {
      bool any_alive = false;
      for (pid_t pid : consumers) any_alive |= !peek_child(pid).ended;
      if (!any_alive) break;
      // Nor one whose producer failed (it printed why): its items never come, so the
      // consumers would wait for them for good. Closing the queue ends their gets.
      for (pid_t pid : producers) {
        const Ended e = peek_child(pid);
        if (e.ended && !e.ok) {
          producer_failed = true;
          q.close();  // the other producers' puts fail too, and say so
        }
      }
    }
    if (!got) {
      res.error = "a consumer died without reporting";
      break;
    }
    Report& r = *got;
    res.completed += r.received;
    last = std::max(last, r.last_ns);
    lat.insert(lat.end(), r.latencies_us.begin(), r.latencies_us.end());
    res.consumer_fds = std::max(res.consumer_fds, r.fds);
    res.consumer_mappings = std::max(res.consumer_mappings, r.mappings);
    res.consumer_peak_rss_kb = std::max(res.consumer_peak_rss_kb, r.peak_rss_kb);
    if (!r.error.empty() && res.error.empty()) res.error = r.error;
  }
  if (producer_failed) res.error = "a producer failed (its message is above)";
  bool failed = res.completed < total;
  for (pid_t pid : producers) reap(pid, failed);
  for (pid_t pid : consumers) reap(pid, failed);
  double secs = (last - start) / 1e9;
  res.count = total;
  res.bytes = o.bytes;
  res.tensors_per_s = secs > 0 ? static_cast<double>(res.completed) / secs : 0;
  res.gb_per_s = res.tensors_per_s * static_cast<double>(o.bytes) / 1e9;
  res.p50_us = percentile(lat, 0.5);
  res.p99_us = percentile(lat, 0.99);
  return res;
}

Result run_pingpong(const BenchOptions& o) {
  auto [a, b] = pipe();
  const std::int64_t elems = static_cast<std::int64_t>(std::max<std::size_t>(o.bytes, 1));
  pid_t child = fork_worker([&, &b = b] {
    a.close();
    for (std::int64_t i = 0; i < o.count; ++i) b.send(b.recv<Tensor>());
    b.send(std::make_pair(count_entries("/proc/self/fd"), count_lines("/proc/self/maps")));
  });
  b.close();
  Tensor t = Tensor::zeros({elems}, DType::kUInt8);
  std::vector<double> rtt;
  rtt.reserve(static_cast<std::size_t>(o.count));
  double start = now_ns();
  for (std::int64_t i = 0; i < o.count; ++i) {
    double t0 = now_ns();
    a.send(t);
    t = a.recv<Tensor>();
    rtt.push_back((now_ns() - t0) / 1000.0);
  }
  double secs = (now_ns() - start) / 1e9;
  auto [fds, maps] = a.recv<std::pair<std::int64_t, std::int64_t>>();
  reap(child, false);
  Result res;
  res.count = res.completed = o.count;
  res.bytes = o.bytes;
  res.tensors_per_s = static_cast<double>(o.count) / secs;
  res.gb_per_s = res.tensors_per_s * static_cast<double>(o.bytes) / 1e9;
  res.p50_us = percentile(rtt, 0.5);
  res.p99_us = percentile(rtt, 0.99);
  res.consumer_fds = fds;
  res.consumer_mappings = maps;
  return res;
}

// ---- bare baselines: the OS alone, no library code ----------------------------------------

long futex(std::atomic<std::uint32_t>* word, int op, std::uint32_t value) {
  return ::syscall(SYS_futex, reinterpret_cast<std::uint32_t*>(word), op, value, nullptr, nullptr,
                   0);
}

// Waits until *word == want, sleeping in FUTEX_WAIT (a blocking wait, as a blocking get).
void futex_wait_for(std::atomic<std::uint32_t>* word, std::uint32_t want) {
  for (std::uint32_t v; (v = word->load(std::memory_order_acquire)) != want;)
    futex(word, FUTEX_WAIT, v);
}

void futex_set(std::atomic<std::uint32_t>* word, std::uint32_t value) {
  word->store(value, std::memory_order_release);
  futex(word, FUTEX_WAKE, 1);
}

Result finish_round_trips(std::vector<double>& rtt, double secs, std::int64_t count,
                          std::size_t bytes) {
  Result res;
  res.count = res.completed = count;
  res.bytes = bytes;
  res.tensors_per_s = secs > 0 ? static_cast<double>(count) / secs : 0;
  res.gb_per_s = res.tensors_per_s * static_cast<double>(bytes) / 1e9;
  res.p50_us = percentile(rtt, 0.5);
  res.p99_us = percentile(rtt, 0.99);
  return res;
}

// `count` messages of `bytes` one way in `secs`.
Result finish_stream(double secs, std::int64_t count, std::size_t bytes) {
  Result res;
  res.count = res.completed = count;
  res.bytes = bytes;
  res.tensors_per_s = static_cast<double>(count) / secs;
  res.gb_per_s = res.tensors_per_s * static_cast<double>(bytes) / 1e9;
  return res;
}

Result run_bare_futex(const BenchOptions& o) {
  void* page = ::mmap(nullptr, 4096, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_ANONYMOUS, -1, 0);
  if (page == MAP_FAILED) throw Error("bare_futex: mmap failed");
  auto* word = new (page) std::atomic<std::uint32_t>(0);
  // Odd values: the parent's turn is over; even: the child's.
  pid_t child = fork_worker([&] {
    for (std::int64_t i = 0; i < o.count; ++i) {
      futex_wait_for(word, static_cast<std::uint32_t>(2 * i + 1));
      futex_set(word, static_cast<std::uint32_t>(2 * i + 2));
    }
  });
  std::vector<double> rtt;
  rtt.reserve(static_cast<std::size_t>(o.count));
  const double start = now_ns();
  for (std::int64_t i = 0; i < o.count; ++i) {
    const double t0 = now_ns();
    futex_set(word, static_cast<std::uint32_t>(2 * i + 1));
    futex_wait_for(word, static_cast<std::uint32_t>(2 * i + 2));
    rtt.push_back((now_ns() - t0) / 1000.0);
  }
  const double secs = (now_ns() - start) / 1e9;
  reap(child, false);
  ::munmap(page, 4096);
  return finish_round_trips(rtt, secs, o.count, sizeof(std::uint32_t));
}

std::pair<int, int> bare_socket_pair() {
  int sv[2];
  if (::socketpair(AF_UNIX, SOCK_SEQPACKET | SOCK_CLOEXEC, 0, sv) != 0)
    throw Error("bare baseline: socketpair failed");
  return {sv[0], sv[1]};
}

Result run_bare_seqpacket(const BenchOptions& o) {
  auto [a, b] = bare_socket_pair();
  const std::size_t n = std::min<std::size_t>(std::max<std::size_t>(o.bytes, 1), 65536);
  pid_t child = fork_worker([&, a = a, b = b] {
    ::close(a);
    std::vector<char> buf(n);
    for (std::int64_t i = 0; i < o.count; ++i)
      if (::recv(b, buf.data(), n, 0) <= 0 || ::send(b, buf.data(), n, MSG_NOSIGNAL) < 0)
        throw Error("bare_seqpacket: the socket failed");
  });
  ::close(b);
  std::vector<char> buf(n, 1);
  std::vector<double> rtt;
  rtt.reserve(static_cast<std::size_t>(o.count));
  const double start = now_ns();
  for (std::int64_t i = 0; i < o.count; ++i) {
    const double t0 = now_ns();
    if (::send(a, buf.data(), n, MSG_NOSIGNAL) < 0 || ::recv(a, buf.data(), n, 0) <= 0)
      throw Error("bare_seqpacket: the socket failed");
    rtt.push_back((now_ns() - t0) / 1000.0);
  }
  const double secs = (now_ns() - start) / 1e9;
  ::close(a);
  reap(child, false);
  return finish_round_trips(rtt, secs, o.count, n);
}

Result run_bare_stream(const BenchOptions& o) {
  auto [a, b] = bare_socket_pair();
  const std::size_t n = std::min<std::size_t>(std::max<std::size_t>(o.bytes, 1), 65536);
  pid_t child = fork_worker([&, a = a, b = b] {
    ::close(b);
    std::vector<char> buf(n, 1);
    for (std::int64_t i = 0; i < o.count; ++i)
      if (::send(a, buf.data(), n, MSG_NOSIGNAL) < 0) throw Error("bare_stream: send failed");
  });
  ::close(a);
  std::vector<char> buf(n);
  const double start = now_ns();
  for (std::int64_t i = 0; i < o.count; ++i)
    if (::recv(b, buf.data(), n, 0) <= 0) throw Error("bare_stream: recv failed");
  const double secs = (now_ns() - start) / 1e9;
  ::close(b);
  reap(child, false);
  return finish_stream(secs, o.count, n);
}

// The message ring alone (not a bare OS baseline: our own code, without encoding). Ring
// slots of 256 bytes hold a message of up to 240: larger --bytes are cut to that.
std::size_t ring_message_bytes(const BenchOptions& o) {
  return std::min<std::size_t>(std::max<std::size_t>(o.bytes, 1), 240);
}

// A blocking pop as a Connection's receive makes it: a look, the short spin before a
// sleep (where this process may run on several CPUs: busy_poll.h), then a sleep on the
// ring's futex with no time limit (the Connection's hang-up watch stands for the limit).
internal::Ring::Popped pop_blocking(internal::Ring& ring, std::span<std::byte> buf) {
  using internal::Ring;
  bool spun = false;
  for (;;) {
    const std::uint32_t seen = ring.publish_count();
    const Ring::Popped p = ring.pop(buf, Ring::kNoWait);
    if (p.status != Ring::Status::kTimeout) return p;
    if (!spun) {
      spun = true;
      if (const auto until = internal::spin_before_sleep_until(std::nullopt);
          until && ring.spin_for_publish(seen, *until))
        continue;
    }
    ring.wait_for_publish_untimed(seen);
  }
}

Result run_ring_pingpong(const BenchOptions& o) {
  using internal::Ring;
  Ring there = Ring::create(64, 256), back = Ring::create(64, 256);
  const std::size_t n = ring_message_bytes(o);
  pid_t child = fork_worker([&] {
    std::vector<std::byte> buf(there.max_message());
    for (std::int64_t i = 0; i < o.count; ++i) {
      auto p = pop_blocking(there, buf);
      if (p.status != Ring::Status::kOk ||
          back.push(std::span(buf.data(), p.size), 0, std::nullopt) != Ring::Status::kOk)
        throw Error("ring_pingpong: the ring failed");
    }
  });
  std::vector<std::byte> buf(there.max_message(), std::byte{1});
  std::vector<double> rtt;
  rtt.reserve(static_cast<std::size_t>(o.count));
  const double start = now_ns();
  for (std::int64_t i = 0; i < o.count; ++i) {
    const double t0 = now_ns();
    if (there.push(std::span(buf.data(), n), 0, std::nullopt) != Ring::Status::kOk ||
        pop_blocking(back, buf).status != Ring::Status::kOk)
      throw Error("ring_pingpong: the ring failed");
    rtt.push_back((now_ns() - t0) / 1000.0);
  }
  const double secs = (now_ns() - start) / 1e9;
  reap(child, false);
  return finish_round_trips(rtt, secs, o.count, n);
}

Result run_ring_stream(const BenchOptions& o) {
  using internal::Ring;
  Ring ring = Ring::create(1024, 256);
  const std::size_t n = ring_message_bytes(o);
  pid_t child = fork_worker([&] {
    std::vector<std::byte> buf(n, std::byte{1});
    for (std::int64_t i = 0; i < o.count; ++i)
      if (ring.push(buf, 0, std::nullopt) != Ring::Status::kOk)
        throw Error("ring_stream: push failed");
  });
  std::vector<std::byte> buf(ring.max_message());
  const double start = now_ns();
  for (std::int64_t i = 0; i < o.count; ++i)
    if (ring.pop(buf, std::nullopt).status != Ring::Status::kOk)
      throw Error("ring_stream: pop failed");
  const double secs = (now_ns() - start) / 1e9;
  reap(child, false);
  return finish_stream(secs, o.count, n);
}

std::string json_escape(const std::string& s) {
  std::string out;
  for (char c : s) {
    if (c == '"' || c == '\\') out += '\\';
    if (static_cast<unsigned char>(c) < 0x20) continue;
    out += c;
  }
  return out;
}

void print(const Result& r, bool json) {
  if (json) {
    std::printf(
        "{\"scenario\":\"%s\",\"strategy\":\"%s\",\"bytes\":%zu,\"count\":%lld,"
        "\"completed\":%lld,\"tensors_per_s\":%.1f,\"gb_per_s\":%.4f,\"p50_us\":%.2f,"
        "\"p99_us\":%.2f,\"consumer_fds\":%lld,\"consumer_mappings\":%lld,"
        "\"consumer_peak_rss_kb\":%lld,\"x_bare\":%.2f,\"error\":\"%s\"}\n",
        r.scenario.c_str(), r.strategy.c_str(), r.bytes, static_cast<long long>(r.count),
        static_cast<long long>(r.completed), r.tensors_per_s, r.gb_per_s, r.p50_us, r.p99_us,
        static_cast<long long>(r.consumer_fds), static_cast<long long>(r.consumer_mappings),
        static_cast<long long>(r.consumer_peak_rss_kb), r.x_bare, json_escape(r.error).c_str());
  } else {
    char x_bare[16] = "-";
    if (r.x_bare > 0) std::snprintf(x_bare, sizeof x_bare, "%.2f", r.x_bare);
    std::printf(
        "%-16s %-16s %10zu %10lld %10lld %14.0f %9.3f %9.1f %9.1f %6lld %6lld %7lld %7s  %s\n",
        r.scenario.c_str(), r.strategy.c_str(), r.bytes, static_cast<long long>(r.count),
        static_cast<long long>(r.completed), r.tensors_per_s, r.gb_per_s, r.p50_us, r.p99_us,
        static_cast<long long>(r.consumer_fds), static_cast<long long>(r.consumer_mappings),
        static_cast<long long>(r.consumer_peak_rss_kb / 1024), x_bare,
        r.error.substr(0, 60).c_str());
  }
  std::fflush(stdout);
}

void run_bench(BenchOptions o) {
  const auto named = std::find(o.scenarios.begin(), o.scenarios.end(), "dataloader");
  if (named != o.scenarios.end()) {
    o.scenarios.erase(named);
    o.loader.json = o.json;
    o.loader.bytes = o.bytes;
    if (!o.json) print_dataloader_header();
    for (const auto& strategy : o.strategies) {
      set_sharing_strategy(strategy);
      run_dataloader_bench(o.loader, strategy);
    }
    if (o.scenarios.empty()) return;
  }
  if (!o.json)
    std::printf("%-16s %-16s %10s %10s %10s %14s %9s %9s %9s %6s %6s %7s %7s\n", "scenario",
                "strategy", "bytes", "count", "completed", "tensors/s", "GB/s", "p50_us", "p99_us",
                "fds", "maps", "rss_mb", "x_bare");
  std::vector<std::string> scenarios = o.scenarios;
  if (scenarios.empty()) scenarios = {"queue_fresh", "queue_preshared", "pingpong", "retain"};
  // The baselines first, in the same run, on the same machine state.
  std::map<std::string, Result> bare;
  if (o.bare)
    for (const auto& [name, run] : {std::pair{"bare_futex", &run_bare_futex},
                                    std::pair{"bare_seqpacket", &run_bare_seqpacket},
                                    std::pair{"bare_stream", &run_bare_stream},
                                    std::pair{"ring_pingpong", &run_ring_pingpong},
                                    std::pair{"ring_stream", &run_ring_stream}}) {
      Result r = run(o);
      r.scenario = name;
      r.strategy = "-";
      print(r, o.json);
      bare[name] = r;
    }
  set_busy_poll(std::chrono::duration<double, std::micro>(o.busy_poll_us));
  for (const auto& strategy : o.strategies) {
    for (const auto& scenario : scenarios) {
      set_sharing_strategy(strategy);
      Result r;
      if (scenario == "pingpong") {
        r = run_pingpong(o);
      } else if (scenario == "queue_fresh" || scenario == "queue_preshared" ||
                 scenario == "retain") {
        r = run_queue(scenario, o);
      } else {
        throw Error("unknown scenario \"" + scenario +
                    "\": valid are queue_fresh, queue_preshared, pingpong, retain, dataloader");
      }
      r.scenario = scenario;
      r.strategy = strategy;
      if (scenario == "pingpong" && bare["bare_futex"].p50_us > 0)
        r.x_bare = r.p50_us / bare["bare_futex"].p50_us;
      else if (scenario != "pingpong" && r.tensors_per_s > 0)
        r.x_bare = bare["bare_stream"].tensors_per_s / r.tensors_per_s;
      print(r, o.json);
    }
  }
}

const bool registered = register_command([](CLI::App& app) {
  auto o = std::make_shared<BenchOptions>();
  auto* cmd = app.add_subcommand("bench", "Cross-process benchmark scenarios");
  cmd->add_option("scenarios", o->scenarios,
                  "queue_fresh, queue_preshared, pingpong, retain (default: all), dataloader");
  cmd->add_option("--strategy", o->strategies, "file_descriptor and/or file_system")
      ->check(CLI::IsMember({"file_descriptor", "file_system"}));
  cmd->add_option("--bytes", o->bytes, "bytes per tensor")->capture_default_str();
  cmd->add_option("--count", o->count, "tensors per run")->capture_default_str();
  cmd->add_option("--producers", o->producers, "producer processes")->check(CLI::PositiveNumber);
  cmd->add_option("--consumers", o->consumers, "consumer processes")->check(CLI::PositiveNumber);
  cmd->add_flag("--json", o->json, "one JSON object per line");
  cmd->add_option("--batch", o->batch,
                  "queue_fresh, queue_preshared, retain: put_many / get_many of this many items "
                  "(1: put / get)")
      ->check(CLI::PositiveNumber)
      ->capture_default_str();
  cmd->add_option("--busy-poll-us", o->busy_poll_us,
                  "set_busy_poll for the scenarios' processes, in microseconds (0: off)")
      ->check(CLI::Range(0.0, 1e6))
      ->capture_default_str();
  cmd->add_flag("!--no-bare", o->bare,
                "skip the bare baselines (to count a scenario's syscalls alone, say)");
  cmd->add_option("--workers", o->loader.workers, "dataloader: worker processes")
      ->check(CLI::NonNegativeNumber)
      ->capture_default_str();
  cmd->add_option("--samples", o->loader.samples, "dataloader: samples per epoch")
      ->check(CLI::PositiveNumber)
      ->capture_default_str();
  cmd->add_option("--tensors-per-sample", o->loader.tensors_per_sample,
                  "dataloader: tensors in each sample")
      ->check(CLI::PositiveNumber)
      ->capture_default_str();
  cmd->add_option("--batch-size", o->loader.batch_size, "dataloader: samples per batch")
      ->check(CLI::PositiveNumber)
      ->capture_default_str();
  cmd->add_option("--prefetch", o->loader.prefetch, "dataloader: prefetch_factor")
      ->check(CLI::PositiveNumber)
      ->capture_default_str();
  cmd->add_flag("--keep", o->loader.keep, "dataloader: the consumer keeps every batch");
  cmd->callback([o] { run_bench(*o); });
});

}  // namespace
}  // namespace shmtensor::tool
