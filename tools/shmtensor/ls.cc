// `shmtensor ls`: this user's named (file_system) shmtensor segments, with size, creator
// and whether it lives, refcount, and the processes that map them; then the named channels
// of the manager group (SHMTENSOR_MANAGER_GROUP): kind, depth, creator and ends.
#include <iostream>
#include <sstream>

#include "command.h"
#include "manager/report.h"
#include "manager/segments.h"
#include "memory/channel_registry.h"
#include "shmtensor/error.h"
#include "shmtensor/internal/queue_core.h"

namespace shmtensor::tool {
namespace {

// One line per channel: name, kind, depth/bound, creator, ends (the live processes that
// hold it). Empty when there is none.
std::string format_channels() {
  std::ostringstream out;
  for (const auto& c : internal::list_channels()) {
    if (out.tellp() == 0) out << "channels:\n";
    out << "  " << c.name;
    if (c.kind == static_cast<std::uint32_t>(internal::ChannelKind::kQueue)) {
      out << "  queue";
      try {
        auto f = internal::QueueCore::inspect_named(c.name);
        out << "  depth " << f.size;
        if (f.maxsize != 0) out << "/" << f.maxsize;
        out << "  creator " << c.creator << "  ends";
        for (auto pid : f.holders) out << " " << pid;
      } catch (const Error& e) {  // gone meanwhile, or not a queue's fds
        out << "  (" << e.what() << ")";
      }
    } else {
      out << "  kind " << c.kind << "  creator " << c.creator << "  opened by";
      for (auto pid : c.openers) out << " " << pid;
    }
    out << "\n";
  }
  return out.str();
}

const bool registered = register_command([](CLI::App& app) {
  auto json = std::make_shared<bool>(false);
  auto* cmd = app.add_subcommand("ls", "List named shmtensor segments and channels");
  cmd->add_flag("--json", *json, "Print the segments as JSON (channels are not included)");
  cmd->callback([json] {
    auto segments = internal::manager::list_segments();
    if (*json) {
      std::cout << internal::manager::segments_json(segments);
      return;
    }
    std::cout << internal::manager::format_segments(segments) << format_channels();
  });
});

}  // namespace
}  // namespace shmtensor::tool
