// Delivery latency of Broadcast<T> in C++ alone (docs/benchmarks.md, "Broadcast (1 → N)"):
// what python/bench/bench_broadcast.py measures, without Python's pickling and calls.
//
//   build/bench/broadcast_bench [--messages N] [--readers 1,2,3] [--sizes 4096,1048576]
//                               [--strategy file_descriptor|file_system]
//
// One writer, N forked reader processes. The message is (phase, the writer's steady_clock
// time taken just before put, a uint8 tensor made by Tensor::empty_shared: its block is in
// the writer's arena already, so put() copies nothing). Each reader takes its own time
// after get(): delivery latency, p50/p99 over the messages of all readers. Phases, as the
// Python benchmark's:
//   latency   N messages 1 ms apart (default 300)
//   idle      no message for 2 s: each reader's CPU time (user + sys) over the gap
//   cadence   one message every 5 ms for 1 s: CPU per reader and p50 latency
// It also prints the writer's put() time (p50 over the latency phase): the part of the
// delivery latency spent before any reader could have the message.
//
// Before the broadcasts, for each reader count, the OS floor in the same run ("bare
// FUTEX_WAKE"): N forked processes asleep in FUTEX_WAIT, each on its own word in a shared
// anonymous mapping; the writer stores its time in each reader's word pair and wakes each
// with FUTEX_WAKE, 1 ms apart as the latency phase; each reader takes its time when it
// wakes. No message, no copy: what waking N sleeping processes costs on this machine; and
// the same with each reader busy for 5 µs after it wakes (about what taking a message
// costs it), which a reader that shares a CPU with another makes that one wait for. The
// writer's wake loop (from its clock to its last FUTEX_WAKE's return) is printed as "put".
#include <linux/futex.h>
#include <sys/mman.h>
#include <sys/resource.h>
#include <sys/syscall.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <thread>
#include <tuple>
#include <vector>

#include "shmtensor/broadcast.h"
#include "shmtensor/connection.h"
#include "shmtensor/sharing_strategy.h"
#include "shmtensor/tensor.h"

namespace {

using Clock = std::chrono::steady_clock;
using Message = std::tuple<std::int64_t, std::int64_t, shmtensor::Tensor>;

enum Phase : std::int64_t { kLatency = 0, kIdleEnd = 1, kCadence = 2 };
constexpr auto kIdle = std::chrono::seconds(2);
constexpr auto kCadenceGap = std::chrono::milliseconds(5);
constexpr int kCadenceMessages = 200;

std::int64_t now_ns() {
  return std::chrono::duration_cast<std::chrono::nanoseconds>(Clock::now().time_since_epoch())
      .count();
}

double cpu_s() {
  rusage u{};
  ::getrusage(RUSAGE_SELF, &u);
  return static_cast<double>(u.ru_utime.tv_sec + u.ru_stime.tv_sec) +
         static_cast<double>(u.ru_utime.tv_usec + u.ru_stime.tv_usec) / 1e6;
}

// What a reader sends back: its latencies (ns) per phase, idle CPU seconds, cadence CPU
// share.
struct Result {
  std::vector<std::int64_t> latency, cadence;
  double idle_cpu_s = 0, cadence_cpu = 0;
};

void reader_main(shmtensor::Broadcast<Message>::Reader r, int messages,
                 shmtensor::Connection out) {
  Result res;
  // The CPU clock is read where a phase's CPU time starts or ends only (getrusage is a
  // system call: read at every message, it would be work of the readers' own that delays
  // the others on a machine with fewer CPUs than readers).
  const int latency_messages = messages - 1 - kCadenceMessages;
  double last_cpu = cpu_s(), cad_cpu0 = 0;
  std::int64_t cad_t0 = 0;
  for (int k = 0; k < messages; ++k) {
    auto [phase, t0, tensor] = r.get();
    const std::int64_t t = now_ns();
    if (tensor.data_ptr<std::uint8_t>()[0] != 7) std::abort();
    if (phase == kLatency) {
      res.latency.push_back(t - t0);
      if (k == latency_messages - 1) last_cpu = cpu_s();
    } else if (phase == kIdleEnd) {
      const double c = cpu_s();
      res.idle_cpu_s = c - last_cpu;
      cad_cpu0 = c;
      cad_t0 = t;
    } else {
      res.cadence.push_back(t - t0);
    }
  }
  res.cadence_cpu = (cpu_s() - cad_cpu0) / (static_cast<double>(now_ns() - cad_t0) / 1e9);
  out.send(res.latency);
  out.send(res.cadence);
  out.send(std::vector<double>{res.idle_cpu_s, res.cadence_cpu});
}

// One sleeping reader's words of the bare baseline, a cache line each.
struct alignas(64) BareSlot {
  std::atomic<std::uint32_t> seq{0};  // the futex word: messages stored so far
  std::atomic<std::int64_t> t0{0};    // the writer's time of the latest one
};
static_assert(std::atomic<std::uint32_t>::is_always_lock_free &&
              std::atomic<std::int64_t>::is_always_lock_free);

long futex(std::atomic<std::uint32_t>* word, int op, std::uint32_t value) {
  return ::syscall(SYS_futex, reinterpret_cast<std::uint32_t*>(word), op, value, nullptr,
                   nullptr, 0);
}

void bare_reader(BareSlot* slot, int messages, std::int64_t work_ns, shmtensor::Connection out) {
  std::vector<std::int64_t> latency;
  for (std::uint32_t k = 0; k < static_cast<std::uint32_t>(messages); ++k) {
    while (slot->seq.load(std::memory_order_acquire) == k) futex(&slot->seq, FUTEX_WAIT, k);
    const std::int64_t t = now_ns();
    latency.push_back(t - slot->t0.load(std::memory_order_relaxed));
    while (now_ns() < t + work_ns) {
    }
  }
  out.send(latency);
}

double pct_us(std::vector<std::int64_t> v, double q);

// The bare FUTEX_WAKE floor for `readers` sleeping processes (see the top of the file).
void bare_baseline(long readers, int messages, std::int64_t work_ns) {
  void* m = ::mmap(nullptr, sizeof(BareSlot) * static_cast<std::size_t>(readers),
                   PROT_READ | PROT_WRITE, MAP_SHARED | MAP_ANONYMOUS, -1, 0);
  if (m == MAP_FAILED) std::abort();
  auto* slots = static_cast<BareSlot*>(m);
  for (long i = 0; i < readers; ++i) new (&slots[i]) BareSlot();
  std::vector<shmtensor::Connection> results;
  std::vector<pid_t> procs;
  for (long i = 0; i < readers; ++i) {
    auto [mine, theirs] = shmtensor::pipe();
    const pid_t pid = ::fork();
    if (pid == 0) {
      mine.close();
      bare_reader(&slots[i], messages, work_ns, std::move(theirs));
      std::_Exit(0);
    }
    procs.push_back(pid);
    results.push_back(std::move(mine));
  }
  std::this_thread::sleep_for(std::chrono::milliseconds(500));
  auto next = Clock::now();
  std::vector<std::int64_t> wake_ns;
  for (int k = 0; k < messages; ++k) {
    next += std::chrono::milliseconds(1);
    std::this_thread::sleep_until(next);
    const std::int64_t t0 = now_ns();
    for (long i = 0; i < readers; ++i) slots[i].t0.store(t0, std::memory_order_relaxed);
    for (long i = 0; i < readers; ++i) {
      slots[i].seq.fetch_add(1, std::memory_order_release);
      futex(&slots[i].seq, FUTEX_WAKE, 1);
    }
    wake_ns.push_back(now_ns() - t0);
  }
  std::vector<std::int64_t> lat;
  for (auto& c : results) {
    auto l = c.recv<std::vector<std::int64_t>>();
    lat.insert(lat.end(), l.begin(), l.end());
  }
  for (pid_t p : procs) ::waitpid(p, nullptr, 0);
  ::munmap(m, sizeof(BareSlot) * static_cast<std::size_t>(readers));
  std::printf("bare FUTEX_WAKE, reader busy %ld us  readers=%ld  put %5.1f us  p50 %7.1f us  "
              "p99 %8.1f us\n",
              static_cast<long>(work_ns / 1000), readers, pct_us(wake_ns, 0.5), pct_us(lat, 0.5),
              pct_us(lat, 0.99));
  std::fflush(stdout);
}

double pct_us(std::vector<std::int64_t> v, double q) {
  if (v.empty()) return 0;
  std::sort(v.begin(), v.end());
  const auto i = std::min(v.size() - 1, static_cast<std::size_t>(q * static_cast<double>(v.size())));
  return static_cast<double>(v[i]) / 1e3;
}

std::vector<long> parse_list(const char* s) {
  std::vector<long> out;
  for (const char* p = s; *p;) {
    char* end = nullptr;
    out.push_back(std::strtol(p, &end, 10));
    p = *end == ',' ? end + 1 : end;
    if (end == p && *end != '\0') break;
  }
  return out;
}

}  // namespace

int main(int argc, char** argv) {
  int latency_messages = 300;
  std::vector<long> reader_counts{1, 2, 3}, sizes{4096, 1 << 20};
  for (int i = 1; i + 1 < argc; i += 2) {
    if (!std::strcmp(argv[i], "--messages")) latency_messages = std::atoi(argv[i + 1]);
    else if (!std::strcmp(argv[i], "--readers")) reader_counts = parse_list(argv[i + 1]);
    else if (!std::strcmp(argv[i], "--sizes")) sizes = parse_list(argv[i + 1]);
    else if (!std::strcmp(argv[i], "--strategy"))
      shmtensor::set_sharing_strategy(!std::strcmp(argv[i + 1], "file_system")
                                          ? shmtensor::SharingStrategy::kFileSystem
                                          : shmtensor::SharingStrategy::kFileDescriptor);
  }
  const int total = latency_messages + 1 + kCadenceMessages;
  for (std::int64_t work_ns : {0, 5000})
    for (long readers : reader_counts) bare_baseline(readers, latency_messages, work_ns);
  for (long bytes : sizes) {
    for (long readers : reader_counts) {
      shmtensor::Broadcast<Message> b(static_cast<int>(readers), 16);
      std::vector<shmtensor::Connection> results;
      std::vector<pid_t> procs;
      for (int i = 0; i < readers; ++i) {
        auto [mine, theirs] = shmtensor::pipe();
        auto r = b.reader(i);
        const pid_t pid = ::fork();
        if (pid == 0) {
          mine.close();
          reader_main(r, total, std::move(theirs));
          std::_Exit(0);
        }
        procs.push_back(pid);
        results.push_back(std::move(mine));
      }
      shmtensor::Tensor t = shmtensor::Tensor::empty_shared({bytes}, shmtensor::DType::kUInt8);
      std::memset(t.data_ptr<std::uint8_t>(), 7, 8);
      std::this_thread::sleep_for(std::chrono::milliseconds(500));
      auto next = Clock::now();
      std::vector<std::int64_t> put_ns;
      auto send = [&](Phase phase, Clock::duration gap) {
        next += gap;
        std::this_thread::sleep_until(next);
        const std::int64_t t0 = now_ns();
        b.put(Message{phase, t0, t});
        if (phase == kLatency) put_ns.push_back(now_ns() - t0);
      };
      for (int k = 0; k < latency_messages; ++k) send(kLatency, std::chrono::milliseconds(1));
      send(kIdleEnd, kIdle);
      for (int k = 0; k < kCadenceMessages; ++k) send(kCadence, kCadenceGap);
      std::vector<std::int64_t> lat, cad;
      double idle_max = 0, cad_cpu_max = 0;
      for (auto& c : results) {
        auto l = c.recv<std::vector<std::int64_t>>();
        auto d = c.recv<std::vector<std::int64_t>>();
        auto cpu = c.recv<std::vector<double>>();
        lat.insert(lat.end(), l.begin(), l.end());
        cad.insert(cad.end(), d.begin(), d.end());
        idle_max = std::max(idle_max, cpu.at(0));
        cad_cpu_max = std::max(cad_cpu_max, cpu.at(1));
      }
      for (pid_t p : procs) ::waitpid(p, nullptr, 0);
      std::printf("C++ Broadcast %7ld B readers=%ld  put %5.1f us  p50 %7.1f us  p99 %8.1f us  "
                  "idle CPU %5.1f %%  5 ms cadence: CPU %5.1f %%, p50 %7.1f us\n",
                  bytes, readers, pct_us(put_ns, 0.5), pct_us(lat, 0.5), pct_us(lat, 0.99),
                  idle_max / std::chrono::duration<double>(kIdle).count() * 100,
                  cad_cpu_max * 100, pct_us(cad, 0.5));
      std::fflush(stdout);
    }
  }
  return 0;
}
