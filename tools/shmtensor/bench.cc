// `shmtensor bench`: cross-process benchmark scenarios. Scenario names are stable:
//   queue_fresh      producers put --count fresh tensors of --bytes; consumers get and drop
//   queue_preshared  the same shared tensor sent --count times
//   pingpong         round trips of one tensor over a pipe (latency percentiles)
//   retain           like queue_fresh, but consumers keep every tensor (reports how far it
//                    got if a limit is hit)
//   dataloader       a DataLoader with --workers over --samples samples of
//                    --tensors-per-sample tensors of --bytes (bench_dataloader.cc); run
//                    only when named
// Prints a table, or with --json one object per line per scenario and strategy.
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <dirent.h>
#include <fstream>
#include <iostream>
#include <map>
#include <optional>
#include <string>
#include <vector>

#include "bench_dataloader.h"
#include "command.h"
#include "shmtensor/connection.h"
#include "shmtensor/queue.h"

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
  std::int64_t consumer_fds = 0, consumer_mappings = 0;
  std::int64_t consumer_peak_rss_kb = 0;  // VmHWM: resident set, shared pages included
  std::string error;
};

double now_ns() {
  return static_cast<double>(
      std::chrono::duration_cast<std::chrono::nanoseconds>(
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
        for (std::int64_t i = 0; i < per_consumer; ++i) {
          auto [sent_ns, t] = q.get();
          double now = now_ns();
          if (i == 0) r.first_ns = now;
          r.last_ns = now;
          if (i % every == 0) r.latencies_us.push_back((now - sent_ns) / 1000.0);
          if (keep) kept.push_back(std::move(t));
          ++r.received;
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
      Tensor same = Tensor::empty({elems}, DType::kUInt8);
      same.share_memory_();
      for (std::int64_t i = 0; i < share; ++i) {
        if (preshared) {
          q.put({now_ns(), same});
        } else {
          Tensor t = Tensor::empty({elems}, DType::kUInt8);
          q.put({now_ns(), t});
        }
      }
    }));
  }
  double start = now_ns();
  for (int p = 0; p < o.producers; ++p) go.put(1);
  Result res;
  double last = start;
  std::vector<double> lat;
  for (int c = 0; c < o.consumers; ++c) {
    // A consumer that died without reporting must not hang the benchmark.
    std::optional<Report> got;
    while (!(got = reports.try_get(std::chrono::milliseconds(200)))) {
      bool any_alive = false;
      for (pid_t pid : consumers) any_alive |= waitpid(pid, nullptr, WNOHANG) == 0;
      if (!any_alive) break;
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
        "\"consumer_peak_rss_kb\":%lld,\"error\":\"%s\"}\n",
        r.scenario.c_str(), r.strategy.c_str(), r.bytes, static_cast<long long>(r.count),
        static_cast<long long>(r.completed), r.tensors_per_s, r.gb_per_s, r.p50_us, r.p99_us,
        static_cast<long long>(r.consumer_fds), static_cast<long long>(r.consumer_mappings),
        static_cast<long long>(r.consumer_peak_rss_kb), json_escape(r.error).c_str());
  } else {
    std::printf("%-16s %-16s %10zu %10lld %10lld %14.0f %9.3f %9.1f %9.1f %6lld %6lld %7lld  %s\n",
                r.scenario.c_str(), r.strategy.c_str(), r.bytes, static_cast<long long>(r.count),
                static_cast<long long>(r.completed), r.tensors_per_s, r.gb_per_s, r.p50_us,
                r.p99_us, static_cast<long long>(r.consumer_fds),
                static_cast<long long>(r.consumer_mappings),
                static_cast<long long>(r.consumer_peak_rss_kb / 1024), r.error.substr(0, 60).c_str());
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
    std::printf("%-16s %-16s %10s %10s %10s %14s %9s %9s %9s %6s %6s %7s\n", "scenario",
                "strategy", "bytes", "count", "completed", "tensors/s", "GB/s", "p50_us",
                "p99_us", "fds", "maps", "rss_mb");
  std::vector<std::string> scenarios = o.scenarios;
  if (scenarios.empty()) scenarios = {"queue_fresh", "queue_preshared", "pingpong", "retain"};
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
  cmd->add_option("--workers", o->loader.workers, "dataloader: worker processes")
      ->check(CLI::NonNegativeNumber)->capture_default_str();
  cmd->add_option("--samples", o->loader.samples, "dataloader: samples per epoch")
      ->check(CLI::PositiveNumber)->capture_default_str();
  cmd->add_option("--tensors-per-sample", o->loader.tensors_per_sample,
                  "dataloader: tensors in each sample")->check(CLI::PositiveNumber)->capture_default_str();
  cmd->add_option("--batch-size", o->loader.batch_size, "dataloader: samples per batch")
      ->check(CLI::PositiveNumber)->capture_default_str();
  cmd->add_option("--prefetch", o->loader.prefetch, "dataloader: prefetch_factor")
      ->check(CLI::PositiveNumber)->capture_default_str();
  cmd->add_flag("--keep", o->loader.keep, "dataloader: the consumer keeps every batch");
  cmd->callback([o] { run_bench(*o); });
});

}  // namespace
}  // namespace shmtensor::tool
