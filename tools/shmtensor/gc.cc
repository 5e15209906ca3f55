// `shmtensor gc [--dry-run]`: removes this user's named shmtensor segments whose creator is
// gone and that no live process maps, and says what it removed. The manager daemon applies
// the same rule when it starts after a daemon was killed.
#include <iostream>

#include "command.h"
#include "manager/journal.h"
#include "manager/paths.h"
#include "manager/report.h"
#include "manager/segments.h"

namespace shmtensor::tool {
namespace {

const bool registered = register_command([](CLI::App& app) {
  auto dry_run = std::make_shared<bool>(false);
  auto* cmd =
      app.add_subcommand("gc", "Remove named shmtensor segments that no live process holds");
  cmd->add_flag("-n,--dry-run", *dry_run, "Only list what would be removed");
  cmd->callback([dry_run] {
    // Names whose past holders' process groups live on (a receiver may still get them)
    // are kept: the managers' journals know those groups.
    auto groups = internal::manager::segment_groups(
        internal::manager::read_all_journals(internal::manager::default_manager_dir()));
    auto report = internal::manager::sweep_orphans(*dry_run, 0, groups);
    std::cout << internal::manager::format_sweep(report, *dry_run);
  });
});

}  // namespace
}  // namespace shmtensor::tool
