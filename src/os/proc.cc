#include "os/proc.h"

#include <unistd.h>

#include <cstdio>
#include <cstdlib>
#include <cstring>

namespace shmtensor::internal {

pid_t current_pid() noexcept { return ::getpid(); }

std::uint64_t process_start_time(pid_t pid) noexcept {
  char path[64];
  std::snprintf(path, sizeof path, "/proc/%d/stat", static_cast<int>(pid));
  FILE* f = std::fopen(path, "re");
  if (f == nullptr) return 0;
  char buf[1024];
  std::size_t n = std::fread(buf, 1, sizeof buf - 1, f);
  std::fclose(f);
  buf[n] = '\0';
  // The command name (field 2) may contain spaces and ')'; fields resume after the last ')'.
  const char* p = std::strrchr(buf, ')');
  if (p == nullptr) return 0;
  // After ") " come fields 3..; start time is field 22, i.e. the 20th after the ')'.
  int field = 2;
  for (++p; *p != '\0'; ++p) {
    if (*p == ' ') {
      ++field;
      if (field == 22) return std::strtoull(p + 1, nullptr, 10);
    }
  }
  return 0;
}

bool process_matches(pid_t pid, std::uint64_t start_time) noexcept {
  if (pid <= 0) return false;
  std::uint64_t now = process_start_time(pid);
  return now != 0 && now == start_time;
}

}  // namespace shmtensor::internal
