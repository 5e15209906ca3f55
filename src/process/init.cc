// The re-executed child's entry: init() reads SHMTENSOR_EXEC_CHILD (set by the parent in
// process_state.cc), finds the function by (module, offset), runs it and exits.
#include <cstdio>
#include <cstdlib>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "memory/fence.h"
#include "memory/segment.h"
#include "os/child.h"
#include "os/code_address.h"
#include "process/child_side.h"
#include "shmtensor/process.h"
#include "shmtensor/start_method.h"

namespace shmtensor {

namespace {

using internal::CodeAddress;

struct ExecChild {
  int index = 0;
  int report_fd = -1;
  int args_fd = -1;
  CodeAddress entry;
  CodeAddress fn;
  pid_t parent = 0;
  pid_t parent_thread = 0;
};

std::vector<std::string_view> split(std::string_view s, char sep) {
  std::vector<std::string_view> out;
  for (;;) {
    std::size_t p = s.find(sep);
    out.push_back(s.substr(0, p));
    if (p == std::string_view::npos) return out;
    s.remove_prefix(p + 1);
  }
}

std::optional<std::uintmax_t> parse_number(std::string_view s, int base) {
  if (s.empty() || s.size() > 20) return std::nullopt;
  std::uintmax_t v = 0;
  for (char c : s) {
    int d = (c >= '0' && c <= '9')   ? c - '0'
            : (c >= 'a' && c <= 'f') ? c - 'a' + 10
                                     : 99;
    if (d >= base) return std::nullopt;
    v = v * static_cast<unsigned>(base) + static_cast<unsigned>(d);
  }
  return v;
}

std::optional<int> parse_int(std::string_view s) {
  bool negative = !s.empty() && s[0] == '-';
  if (negative) s.remove_prefix(1);
  auto v = parse_number(s, 10);
  if (!v || *v > 1'000'000'000) return std::nullopt;
  return negative ? -static_cast<int>(*v) : static_cast<int>(*v);
}

std::optional<std::string> unhex(std::string_view s) {
  if (s.size() % 2 != 0) return std::nullopt;
  std::string out;
  for (std::size_t i = 0; i < s.size(); i += 2) {
    auto v = parse_number(s.substr(i, 2), 16);
    if (!v) return std::nullopt;
    out += static_cast<char>(*v);
  }
  return out;
}

// The variable comes from our parent, but the environment is user-controllable: validate.
std::optional<ExecChild> parse(std::string_view value) {
  auto f = split(value, ':');
  if (f.size() != 10 || f[0] != "2") return std::nullopt;
  ExecChild c;
  auto index = parse_int(f[1]), report = parse_int(f[2]), args = parse_int(f[3]);
  auto entry_off = parse_number(f[4], 16), fn_off = parse_number(f[5], 16);
  auto entry_mod = unhex(f[6]), fn_mod = unhex(f[7]);
  auto parent = parse_int(f[8]), parent_thread = parse_int(f[9]);
  if (!index || !report || !args || !entry_off || !fn_off || !entry_mod || !fn_mod || !parent ||
      !parent_thread)
    return std::nullopt;
  if (*index < 0 || *report < 0 || *args < -1 || *parent <= 0 || *parent_thread <= 0)
    return std::nullopt;
  c.parent = static_cast<pid_t>(*parent);
  c.parent_thread = static_cast<pid_t>(*parent_thread);
  c.index = *index;
  c.report_fd = *report;
  c.args_fd = *args;
  c.entry = CodeAddress{*entry_mod, static_cast<std::uintptr_t>(*entry_off)};
  c.fn = CodeAddress{*fn_mod, static_cast<std::uintptr_t>(*fn_off)};
  return c;
}

// An exec child dies with the thread that started it, as a forked child does: armed when
// the library is loaded, before the program's own static initializers and main (which may
// take long, or call init() late), so that only the exec and the loader run unarmed. Only
// in a child of the process the variable names (not in a program it inherited the variable
// by); init() arms again, and ends a child whose parent is gone. Nothing else happens here:
// init() removes the variable, and says what is wrong with it.
[[gnu::constructor(101)]] void die_with_the_starting_thread() noexcept {
  const char* value = std::getenv(internal::kExecChildEnv);
  if (value == nullptr) return;
  try {
    auto child = parse(value);
    if (child && internal::parent_pid() == child->parent)
      internal::die_with_parent(child->parent, child->parent_thread);
  } catch (...) {  // parse allocates; init() reports what it cannot
  }
}

// Reads and removes the variable (so that programs this child runs do not see it).
std::optional<ExecChild> take_exec_child() {
  const char* value = std::getenv(internal::kExecChildEnv);
  if (value == nullptr) return std::nullopt;
  std::string copy = value;
  ::unsetenv(internal::kExecChildEnv);
  auto child = parse(copy);
  if (!child || !internal::fd_is_open(child->report_fd) ||
      (child->args_fd >= 0 && !internal::fd_is_open(child->args_fd))) {
    std::fprintf(stderr, "shmtensor: malformed %s=%s; exiting\n", internal::kExecChildEnv,
                 copy.c_str());
    internal::exit_now(2);
  }
  return child;
}

}  // namespace

bool is_exec_child() noexcept { return std::getenv(internal::kExecChildEnv) != nullptr; }

void init(int /*argc*/, char** /*argv*/) {
  auto child = take_exec_child();
  if (!child) return;
  internal::die_with_parent(child->parent, child->parent_thread);
  int code = 0;
  try {
    // Our fds stay ours: nothing this function execs should inherit them.
    internal::set_cloexec(child->report_fd, true);
    if (child->args_fd >= 0) internal::set_cloexec(child->args_fd, true);
    internal::write_all_raw(child->report_fd, &internal::kStartedMarker, 1);
    auto entry =
        reinterpret_cast<internal::ExecEntry>(internal::resolve_code_address(child->entry));
    std::uintptr_t fn = internal::resolve_code_address(child->fn);
    entry(fn, child->index, child->args_fd);
  } catch (...) {
    std::string text;
    try {
      text = internal::describe_current_exception();
    } catch (...) {
      text = "unknown exception: (could not be described)";
    }
    internal::report_error(child->report_fd, text);
    code = 1;
  }
  internal::flush_stdio();
  // _exit runs no atexit handler.
  internal::complete_fences_before_exit();
  internal::release_named_segments_before_exit();
  internal::exit_now(code);
}

namespace internal {

void fail_exec_child_without_init() noexcept {
  const char* value = std::getenv(kExecChildEnv);
  std::optional<ExecChild> child;
  if (value != nullptr) child = parse(value);
  static constexpr const char* kText =
      "shmtensor::Error: this program was re-executed for the exec start method but "
      "shmtensor::init(argc, argv) was not called at the top of main, so it ran main again "
      "and tried to start a child process; call init first thing in main";
  if (child && fd_is_open(child->report_fd)) report_error(child->report_fd, kText);
  std::fprintf(stderr, "%s\n", kText);
  flush_stdio();
  exit_now(1);
}

}  // namespace internal
}  // namespace shmtensor
