#include "process/process_state.h"

#include <array>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <span>
#include <string_view>

#include "os/code_address.h"
#include "os/poll.h"
#include "os/proc.h"
#include "process/child_side.h"

namespace shmtensor::internal {

namespace {

// Enough for any exception message; a child cannot make the parent hold more than this.
constexpr std::size_t kReportLimit = std::size_t{1} << 20;

std::string hex(std::string_view bytes) {
  static constexpr char kDigits[] = "0123456789abcdef";
  std::string out;
  for (unsigned char c : bytes) {
    out += kDigits[c >> 4];
    out += kDigits[c & 15];
  }
  return out;
}

std::string hex_number(std::uintptr_t v) {
  char buf[32];
  int n = std::snprintf(buf, sizeof buf, "%jx", static_cast<std::uintmax_t>(v));
  return std::string(buf, static_cast<std::size_t>(n));
}

// Format (parsed by init(), process/init.cc):
//   2:<index>:<report fd>:<args fd>:<entry offset>:<fn offset>:<entry module>:<fn module>:
//     <parent>:<parent thread>
// offsets in hex, module names hex-encoded (they are paths and may contain ':'); parent and
// parent thread: the pid and the thread whose end the child dies with (die_with_parent).
std::string exec_child_value(int index, int report_fd, int args_fd, const CodeAddress& entry,
                             const CodeAddress& fn, pid_t parent, pid_t parent_thread) {
  return "2:" + std::to_string(index) + ":" + std::to_string(report_fd) + ":" +
         std::to_string(args_fd) + ":" + hex_number(entry.offset) + ":" +
         hex_number(fn.offset) + ":" + hex(entry.module) + ":" + hex(fn.module) + ":" +
         std::to_string(parent) + ":" + std::to_string(parent_thread);
}

std::vector<char*> pointers(std::vector<std::string>& strings) {
  std::vector<char*> out;
  out.reserve(strings.size() + 1);
  for (auto& s : strings) out.push_back(s.data());
  out.push_back(nullptr);
  return out;
}

}  // namespace

std::unique_ptr<ProcessState> ProcessState::start(const LaunchSpec& spec, StartMethod method) {
  if (is_exec_child()) fail_exec_child_without_init();
  if (method == StartMethod::kExec && spec.exec_entry == nullptr)
    throw Error("cannot start this callable with StartMethod::kExec: " + spec.exec_unavailable);
  if (method == StartMethod::kFork && !spec.fork_body)
    throw Error("cannot start an empty callable");

  auto [report_read, report_write] = make_report_pipe();
  const pid_t parent = own_pid();

  if (method == StartMethod::kFork) {
    const pid_t parent_thread = own_thread_id();
    pid_t pid = fork_process();
    if (pid == 0) run_forked_child(spec.fork_body, report_write.get(), parent, parent_thread);
    ChildProcess child(pid);
    report_write.reset();  // so that only children hold write ends
    return std::unique_ptr<ProcessState>(
        new ProcessState(std::move(child), std::move(report_read), false));
  }

  // kExec: this program again (spawn_self: posix_spawn, no copy of this process's memory,
  // no fork handler), told by the environment what to run.
  CodeAddress entry = code_address_of(reinterpret_cast<std::uintptr_t>(spec.exec_entry));
  CodeAddress fn = code_address_of(spec.exec_fn);
  std::unique_ptr<ExecArgs> args = spec.exec_args ? spec.exec_args() : nullptr;
  const int args_fd = args ? args->child_fd() : -1;

  std::vector<std::string> argv_strings = self_cmdline();
  if (argv_strings.empty()) argv_strings.emplace_back("/proc/self/exe");
  std::vector<std::string> env_strings;
  const std::string prefix = std::string(kExecChildEnv) + "=";
  for (auto& e : environment())
    if (e.compare(0, prefix.size(), prefix) != 0) env_strings.push_back(std::move(e));
  env_strings.push_back(prefix + exec_child_value(spec.index, report_write.get(), args_fd,
                                                  entry, fn, parent, own_thread_id()));
  std::vector<char*> argv = pointers(argv_strings);
  std::vector<char*> envp = pointers(env_strings);
  const int inherit[] = {report_write.get(), args_fd};
  const pid_t pid = spawn_self(argv.data(), envp.data(),
                               std::span<const int>(inherit, args_fd >= 0 ? 2 : 1));
  ChildProcess child(pid);
  report_write.reset();
  std::unique_ptr<ProcessState> state(
      new ProcessState(std::move(child), std::move(report_read), true));
  // Sending may fail (the child died at once, or a value cannot be encoded); the state's
  // destructor then kills and reaps the child.
  if (args) args->after_fork();
  return state;
}

void ProcessState::drain() noexcept {
  if (!report_) return;
  try {
    if (!read_available(report_.get(), raw_, kReportLimit)) report_.reset();
  } catch (...) {
    report_.reset();
  }
}

bool ProcessState::poll() {
  drain();
  if (child_.reaped()) return true;
  if (!child_.poll()) return false;
  // Everything the child wrote is in the pipe now. Stop listening even if a grandchild
  // still holds a write end.
  drain();
  report_.reset();
  return true;
}

void ProcessState::wait() {
  while (!poll()) {
    std::array<int, 2> fds{child_.pidfd(), report_.get()};
    std::optional<std::chrono::nanoseconds> timeout;
    if (needs_polling()) timeout = kPollInterval;
    wait_readable(fds, timeout);
  }
}

bool ProcessState::failed() const {
  if (!child_.reaped()) return false;
  if (*child_.exitcode() != 0) return true;
  return exec_ && (raw_.empty() || raw_[0] != kStartedMarker);
}

std::string ProcessState::error() const {
  std::string_view r = raw_;
  bool started = !r.empty() && r[0] == kStartedMarker;
  if (started) r.remove_prefix(1);
  if (!r.empty() && r[0] == kErrorMarker) return std::string(r.substr(1));
  if (exec_ && !started && child_.reaped() && *child_.exitcode() == 0)
    return "shmtensor::Error: the program was re-executed for the exec start method but never "
           "ran the function: call shmtensor::init(argc, argv) at the top of main";
  return {};
}

}  // namespace shmtensor::internal
