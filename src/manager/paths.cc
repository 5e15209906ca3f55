#include "manager/paths.h"

#include <cstdio>
#include <cstdlib>

#include "os/code_address.h"
#include "os/private_dir.h"
#include "os/proc_scan.h"
#include "os/shm_list.h"
#include "os/unix_socket.h"
#include "shmtensor/error.h"

#ifndef SHMTENSOR_BUILD_BINDIR
#define SHMTENSOR_BUILD_BINDIR ""
#endif
#ifndef SHMTENSOR_INSTALL_BINDIR
#define SHMTENSOR_INSTALL_BINDIR ""
#endif

namespace shmtensor::internal::manager {

namespace {

std::string env(const char* name) {
  const char* v = std::getenv(name);
  return v == nullptr ? std::string() : std::string(v);
}

// The directory that holds `path` after resolving symbolic links; "" if it cannot be resolved.
std::string real_dir_of(const std::string& path) {
  std::string file = real_path(path);
  auto slash = file.rfind('/');
  return slash == std::string::npos ? std::string() : file.substr(0, slash);
}

// libshmtensor.so's own directory when the shared library is in use (a Python interpreter in
// /usr/bin loading it from a site-packages or /usr/local/lib, say: /proc/self/exe would point
// at /usr/bin); "" when the library is linked into the program statically.
std::string library_dir() {
  std::string module;
  try {
    module = code_address_of(reinterpret_cast<std::uintptr_t>(&library_dir)).module;
  } catch (const Error&) {
    // Code not in any loaded module cannot happen for a function of ours; fall back anyway.
  }
  return module.empty() ? std::string() : real_dir_of(module);
}

}  // namespace

bool is_valid_group(const std::string& group) noexcept {
  if (group.empty() || group.size() > 64) return false;
  for (char c : group) {
    bool ok = (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || (c >= '0' && c <= '9') ||
              c == '_' || c == '.' || c == '-';
    if (!ok) return false;
  }
  return group != "." && group != "..";
}

std::string default_manager_dir() {
  std::string dir = env("SHMTENSOR_MANAGER_DIR");
  if (!dir.empty()) return dir;
  std::string xdg = env("XDG_RUNTIME_DIR");
  if (!xdg.empty() && xdg[0] == '/' && is_own_directory(xdg)) return xdg + "/shmtensor";
  return "/tmp/shmtensor-" + std::to_string(effective_uid());
}

ManagerLocation manager_location(const std::string& dir, const std::string& group) {
  if (!is_valid_group(group))
    throw ConfigurationError(
        "invalid shmtensor-manager group \"" + group +
        "\" (SHMTENSOR_MANAGER_GROUP): use 1 to 64 characters of A-Z a-z 0-9 _ . -, other than "
        "\".\" and \"..\"");
  char dev[32];
  std::snprintf(dev, sizeof dev, "%llx", static_cast<unsigned long long>(dev_shm_device()));
  // "+2": daemons that serve named channels and kept fds (protocol.h, kDaemonFeatures) live
  // beside an older installation's of the same group, whose clients would be refused the
  // requests they do not know ('+' is no group's character).
  std::string base = dir + "/" + group + "+2-" + dev;
  ManagerLocation loc{dir, group, base + ".sock", base + ".lock", base + ".log", base + ".journal"};
  if (loc.socket_path.size() > max_unix_socket_path())
    throw ConfigurationError(
        "the shmtensor-manager socket path " + loc.socket_path + " is " +
        std::to_string(loc.socket_path.size()) + " bytes, more than the " +
        std::to_string(max_unix_socket_path()) +
        " a unix socket address holds: set SHMTENSOR_MANAGER_DIR to a shorter directory "
        "(or a shorter SHMTENSOR_MANAGER_GROUP)");
  return loc;
}

ManagerLocation manager_location() {
  std::string group = env("SHMTENSOR_MANAGER_GROUP");
  return manager_location(default_manager_dir(), group.empty() ? "default" : group);
}

std::vector<std::string> manager_program_candidates() {
  std::string over = env("SHMTENSOR_MANAGER");
  if (!over.empty()) return {over};
  std::vector<std::string> out;
  auto add = [&](const std::string& dir) {
    if (dir.empty()) return;
    std::string p = dir + "/shmtensor-manager";
    for (const auto& q : out)
      if (q == p) return;
    out.push_back(p);
  };
  // The shared library looks next to itself first (a build tree: build/libshmtensor.so beside
  // build/shmtensor-manager; a Python package that ships both), then in its ../bin (an
  // installed prefix: lib/libshmtensor.so, bin/shmtensor-manager). Then, and first for a
  // static link, where this build put it or installs it, then next to the running program.
  std::string lib = library_dir();
  add(lib);
  if (!lib.empty()) add(real_path(lib + "/../bin"));
  add(SHMTENSOR_BUILD_BINDIR);
  add(SHMTENSOR_INSTALL_BINDIR);
  add(real_dir_of("/proc/self/exe"));
  return out;
}

int manager_grace_ms() {
  std::string v = env("SHMTENSOR_MANAGER_GRACE_MS");
  if (v.empty()) return 2000;
  char* end = nullptr;
  long ms = std::strtol(v.c_str(), &end, 10);
  if (end == v.c_str() || *end != '\0') return 2000;
  if (ms < 0) ms = 0;
  if (ms > 600000) ms = 600000;
  return static_cast<int>(ms);
}

}  // namespace shmtensor::internal::manager
