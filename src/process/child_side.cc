#include "process/child_side.h"

#include <cxxabi.h>

#include <cstdio>
#include <cstdlib>
#include <exception>
#include <iostream>
#include <memory>

#include "memory/fence.h"
#include "memory/segment.h"
#include "os/child.h"
#include "os/unique_fd.h"

namespace shmtensor::internal {

std::string describe_current_exception() {
  std::string type = "unknown exception";
  if (const std::type_info* ti = abi::__cxa_current_exception_type()) {
    int status = 0;
    std::unique_ptr<char, decltype(&std::free)> name(
        abi::__cxa_demangle(ti->name(), nullptr, nullptr, &status), &std::free);
    type = (status == 0 && name) ? name.get() : ti->name();
  }
  std::string message;
  try {
    throw;
  } catch (const std::exception& e) {
    message = e.what();
  } catch (...) {
    message = "(not derived from std::exception; no message)";
  }
  return type + ": " + message;
}

void report_error(int report_fd, const std::string& text) noexcept {
  if (report_fd < 0) return;
  write_all_raw(report_fd, &kErrorMarker, 1);
  write_all_raw(report_fd, text.data(), text.size());
}

void flush_stdio() noexcept {
  try {
    std::cout.flush();
    std::cerr.flush();
    std::clog.flush();
  } catch (...) {
  }
  std::fflush(nullptr);
}

void close_in_forked_child(LaunchSpec& spec, std::vector<int> fds) {
  if (!spec.fork_body) return;
  spec.fork_body = [fds = std::move(fds), body = std::move(spec.fork_body)] {
    // The objects that own these fds in the parent are never destroyed in the child (it
    // ends with _exit), so nothing closes the numbers a second time.
    for (int fd : fds) UniqueFd(fd).reset();
    body();
  };
}

void run_forked_child(const std::function<void()>& body, int report_fd, int parent_pid,
                      int parent_thread) noexcept {
  die_with_parent(parent_pid, parent_thread);
  int code = 0;
  try {
    body();
  } catch (...) {
    std::string text;
    try {
      text = describe_current_exception();
    } catch (...) {
      text = "unknown exception: (could not be described)";
    }
    report_error(report_fd, text);
    code = 1;
  }
  flush_stdio();
  // _exit runs no atexit handler.
  complete_fences_before_exit();
  release_named_segments_before_exit();
  exit_now(code);
}

}  // namespace shmtensor::internal
