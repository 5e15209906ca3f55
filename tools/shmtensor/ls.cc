// `shmtensor ls`: this user's named (file_system) shmtensor segments, with size, creator
// and whether it lives, refcount, and the processes that map them; then the named channels
// of the manager group (SHMTENSOR_MANAGER_GROUP): kind, depth (a broadcast: each reader's
// process and how far behind), creator and ends.
#include <iostream>
#include <span>
#include <string>
#include <vector>

#include "command.h"
#include "manager/report.h"
#include "manager/segments.h"
#include "memory/channel_registry.h"
#include "shmtensor/error.h"
#include "shmtensor/internal/broadcast_core.h"
#include "shmtensor/internal/frame.h"
#include "shmtensor/internal/queue_core.h"

namespace shmtensor::tool {
namespace {

// A named broadcast's readers: the pid attached as each (0: none) and how many messages it
// is behind. Looks without counting this process as one of its ends.
std::vector<internal::manager::ChannelReport::Reader> broadcast_readers(const std::string& name) {
  internal::OpenedChannel ch = internal::open_channel(name, internal::ChannelKind::kBroadcast, true);
  std::vector<int> fds;
  for (auto& fd : ch.fds) fds.push_back(fd.release());
  Decoder d = internal::parse_message_frame(
      std::span(reinterpret_cast<const std::byte*>(ch.bytes.data()), ch.bytes.size()), fds);
  auto b = internal::BroadcastCore::decode(d, false);
  d.finish();
  std::vector<internal::manager::ChannelReport::Reader> readers;
  for (int i = 0; i < b->readers(); ++i) readers.push_back({b->reader_pid(i), b->behind(i)});
  return readers;
}

// The manager group's named channels, each looked at.
std::vector<internal::manager::ChannelReport> gather_channels() {
  std::vector<internal::manager::ChannelReport> out;
  for (const auto& c : internal::list_channels()) {
    internal::manager::ChannelReport r;
    r.name = c.name;
    r.creator = c.creator;
    try {
      if (c.kind == static_cast<std::uint32_t>(internal::ChannelKind::kQueue)) {
        r.kind = "queue";
        auto f = internal::QueueCore::inspect_named(c.name);
        r.depth = f.size;
        r.maxsize = f.maxsize;
        r.ends.assign(f.holders.begin(), f.holders.end());
      } else if (c.kind == static_cast<std::uint32_t>(internal::ChannelKind::kBroadcast)) {
        r.kind = "broadcast";
        r.readers = broadcast_readers(c.name);
      } else {
        r.kind = "kind " + std::to_string(c.kind);
        r.ends = c.openers;
      }
    } catch (const Error& e) {  // gone meanwhile, or not that kind's fds
      r.error = e.what();
    }
    out.push_back(std::move(r));
  }
  return out;
}

const bool registered = register_command([](CLI::App& app) {
  auto json = std::make_shared<bool>(false);
  auto* cmd = app.add_subcommand("ls", "List named shmtensor segments and channels");
  cmd->add_flag("--json", *json,
                "Print one JSON object: {\"segments\": [...], \"channels\": [...]}");
  cmd->callback([json] {
    auto segments = internal::manager::list_segments();
    auto channels = gather_channels();
    if (*json) {
      std::cout << internal::manager::listing_json(segments, channels);
      return;
    }
    std::cout << internal::manager::format_segments(segments)
              << internal::manager::format_channels(channels);
  });
});

}  // namespace
}  // namespace shmtensor::tool
