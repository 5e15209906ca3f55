// `shmtensor doctor`: this machine's limits that matter for sharing memory between
// processes, each with a verdict and, when it is not ok, the fix.
#include <iostream>

#include "command.h"
#include "manager/report.h"
#include "os/limits.h"

namespace shmtensor::tool {
namespace {

struct DoctorOptions {
  bool json = false;
  bool strict = false;
};

int run_doctor(const DoctorOptions& o) {
  auto checks = internal::manager::doctor_checks(internal::read_system_limits());
  for (auto& c : internal::manager::cuda_checks(internal::cuda::probe_cuda()))
    checks.push_back(std::move(c));
  std::cout << (o.json ? internal::manager::checks_json(checks)
                       : internal::manager::format_checks(checks));
  if (o.strict)
    for (const auto& c : checks)
      if (c.verdict != "ok" && c.verdict != "n/a") return 1;
  return 0;
}

const bool registered = register_command([](CLI::App& app) {
  auto opts = std::make_shared<DoctorOptions>();
  auto* cmd = app.add_subcommand(
      "doctor", "Check kernel, memfd, /dev/shm, vm.max_map_count, ulimit -n, huge pages and CUDA");
  cmd->add_flag("--json", opts->json, "Print the checks as JSON");
  cmd->add_flag("--strict", opts->strict, "Exit with status 1 if any check is not ok");
  cmd->callback([opts] {
    int rc = run_doctor(*opts);
    if (rc != 0) throw CLI::RuntimeError(rc);
  });
});

}  // namespace
}  // namespace shmtensor::tool
