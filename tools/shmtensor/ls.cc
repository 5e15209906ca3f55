// `shmtensor ls`: this user's named (file_system) shmtensor segments, with size, creator
// and whether it lives, refcount, and the processes that map them.
#include <iostream>

#include "command.h"
#include "manager/report.h"
#include "manager/segments.h"

namespace shmtensor::tool {
namespace {

const bool registered = register_command([](CLI::App& app) {
  auto json = std::make_shared<bool>(false);
  auto* cmd = app.add_subcommand("ls", "List named shmtensor segments in /dev/shm");
  cmd->add_flag("--json", *json, "Print the segments as JSON");
  cmd->callback([json] {
    auto segments = internal::manager::list_segments();
    std::cout << (*json ? internal::manager::segments_json(segments)
                        : internal::manager::format_segments(segments));
  });
});

}  // namespace
}  // namespace shmtensor::tool
