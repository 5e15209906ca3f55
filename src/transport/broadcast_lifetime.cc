// A broadcast's lifetime (broadcast_state.h): made (create), encoded and rebuilt from the
// parts its encoded form carries (encode, decode, from_parts), published under a name
// through the manager's channel registry, and its handle's last drop in a process.
#include <chrono>
#include <cstdint>
#include <memory>
#include <span>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

#include "memory/channel_registry.h"
#include "os/shm.h"
#include "shmtensor/internal/frame.h"
#include "transport/broadcast_state.h"

namespace shmtensor::internal {

std::shared_ptr<BroadcastCore> BroadcastCore::create(int readers, std::size_t depth) {
  if (readers < 1 || readers > kBroadcastMaxReaders)
    throw std::invalid_argument("Broadcast: readers must be 1 to " +
                                std::to_string(kBroadcastMaxReaders) + ", not " +
                                std::to_string(readers));
  if (depth < 1 || depth > kBroadcastMaxDepth)
    throw std::invalid_argument("Broadcast: depth must be 1 to " + std::to_string(kBroadcastMaxDepth) +
                                ", not " + std::to_string(depth));
  auto st = std::make_unique<State>();
  st->control_fd = create_sealed_memfd(sizeof(BroadcastControl));
  st->control_map =
      Mapping::map_shared(st->control_fd.get(), sizeof(BroadcastControl), "broadcast control");
  BroadcastControl* c = st->control();
  c->layout_version = kBroadcastLayoutVersion;
  c->size_of = sizeof(BroadcastControl);
  c->readers = static_cast<std::uint32_t>(readers);
  c->depth = static_cast<std::uint32_t>(depth);
  c->writer = current_slot_owner();
  c->broken.store(0, std::memory_order_relaxed);
  for (auto& r : c->reader) r.store(kReaderNone, std::memory_order_relaxed);
  std::atomic_ref<std::uint64_t>(c->magic).store(kBroadcastMagic, std::memory_order_release);
  st->readers = readers;
  st->depth = depth;
  st->writer = c->writer;
  for (int i = 0; i < readers; ++i) {
    st->queues.push_back(QueueCore::create(depth));
    st->queues.back()->allow_dedicated_deposits(kBroadcastDedicatedDeposits,
                                                kBroadcastDedicatedBytes);
  }
  st->attached.assign(static_cast<std::size_t>(readers), 0);
  st->attached_in.assign(static_cast<std::size_t>(readers), 0);
  st->cadence = std::make_unique<State::Cadence[]>(static_cast<std::size_t>(readers));
  return std::make_shared<BroadcastCore>(std::move(st));
}

std::shared_ptr<BroadcastCore> BroadcastCore::from_parts(
    int control_fd, std::vector<std::shared_ptr<QueueCore>> queues, int reader) {
  auto st = std::make_unique<State>();
  st->control_fd.reset(control_fd);
  const FdFacts facts = inspect_fd(st->control_fd.get());
  if (!facts.sealed_against_resize || facts.size != sizeof(BroadcastControl))
    throw ProtocolError("received broadcast control block has the wrong size or is not sealed");
  st->control_map =
      Mapping::map_shared(st->control_fd.get(), sizeof(BroadcastControl), "broadcast control");
  const BroadcastControl* c = st->control();
  const std::uint32_t readers = c->readers;
  const std::uint32_t depth = c->depth;
  const std::uint64_t writer = c->writer;
  if (std::atomic_ref<const std::uint64_t>(c->magic).load(std::memory_order_acquire) !=
          kBroadcastMagic ||
      c->layout_version != kBroadcastLayoutVersion || c->size_of != sizeof(BroadcastControl) ||
      readers < 1 || readers > kBroadcastMaxReaders || depth < 1 || depth > kBroadcastMaxDepth ||
      owner_pid(writer) <= 0 || static_cast<std::uint64_t>(owner_pid(writer)) > kBroadcastPidLimit ||
      queues.size() != readers || reader < -1 || reader >= static_cast<int>(readers))
    throw ProtocolError("received broadcast control block is invalid");
  for (std::size_t i = 0; i < queues.size(); ++i) {
    const bool carried = reader < 0 || static_cast<int>(i) == reader;
    if (carried != static_cast<bool>(queues[i]) ||
        (queues[i] && queues[i]->maxsize() != depth))
      throw ProtocolError("received broadcast's queues do not match its control block");
  }
  st->readers = static_cast<int>(readers);
  st->depth = depth;
  st->writer = writer;
  st->carried = reader;
  st->queues = std::move(queues);
  st->attached.assign(readers, 0);
  st->attached_in.assign(readers, 0);
  st->cadence = std::make_unique<State::Cadence[]>(readers);
  return std::make_shared<BroadcastCore>(std::move(st));
}

// Encoded: the control block's fd, which reader's queue follows (kBroadcastAllReaders: every
// reader's, in order), then the queue(s).
void BroadcastCore::encode(Encoder& e, int reader) const {
  state_->check_broken();
  e.write_fd(state_->control_fd.get());
  e.write_pod<std::uint32_t>(reader < 0 ? kBroadcastAllReaders : static_cast<std::uint32_t>(reader));
  if (reader >= 0) {
    state_->queue(reader).encode(e);
    return;
  }
  for (int i = 0; i < state_->readers; ++i) state_->queue(i).encode(e);
}

std::shared_ptr<BroadcastCore> BroadcastCore::decode(Decoder& d, bool counted) {
  UniqueFd control(d.take_fd());
  const auto which = d.read_pod<std::uint32_t>();
  if (which != kBroadcastAllReaders && which >= static_cast<std::uint32_t>(kBroadcastMaxReaders))
    throw ProtocolError("received broadcast names reader " + std::to_string(which));
  // The count of queues comes from the control block, which from_parts validates; read it
  // here only to know how many follow.
  const FdFacts facts = inspect_fd(control.get());
  if (!facts.sealed_against_resize || facts.size != sizeof(BroadcastControl))
    throw ProtocolError("received broadcast control block has the wrong size or is not sealed");
  std::uint32_t readers = 0;
  {
    Mapping m = Mapping::map_shared(control.get(), sizeof(BroadcastControl), "broadcast control");
    readers = reinterpret_cast<const BroadcastControl*>(m.data())->readers;
  }
  if (readers < 1 || readers > kBroadcastMaxReaders ||
      (which != kBroadcastAllReaders && which >= readers))
    throw ProtocolError("received broadcast control block is invalid");
  std::vector<std::shared_ptr<QueueCore>> queues(readers);
  if (which == kBroadcastAllReaders) {
    for (auto& q : queues) q = QueueCore::decode(d, counted);
  } else {
    queues[which] = QueueCore::decode(d, counted);
  }
  return from_parts(control.release(), std::move(queues),
                    which == kBroadcastAllReaders ? -1 : static_cast<int>(which));
}

// The publication is the encoded broadcast's bytes and fds, without the in-flight counts
// an encode adds (the frame gives them back when it goes): the creator holds the queues
// while the name lives, and each open decodes a copy as uncounted (a count taken there
// would be that of a copy of the broadcast in flight in a message).
std::shared_ptr<BroadcastCore> BroadcastCore::create_named(const std::string& name, int readers,
                                                           std::size_t depth) {
  if (!is_valid_channel_name(name))
    throw std::invalid_argument("Broadcast: invalid name \"" + name + "\"");
  // The control block's fd and each reader's queue's (QueueCore's five) in one message.
  constexpr int kMaxNamedReaders = static_cast<int>((kMaxChannelFds - 1) / 5);
  if (readers > kMaxNamedReaders)
    throw std::invalid_argument(
        "Broadcast \"" + name + "\": " + std::to_string(readers) + " readers need " +
        std::to_string(1 + 5 * readers) + " fds, and a named channel carries at most " +
        std::to_string(kMaxChannelFds) + " (at most " + std::to_string(kMaxNamedReaders) +
        " readers by name; an unnamed Broadcast takes up to 64)");
  std::shared_ptr<BroadcastCore> b = create(readers, depth);
  Encoder e;
  b->encode(e, -1);
  const MessageFrame frame(std::move(e));
  b->state_->name_token =
      publish_channel(name, ChannelKind::kBroadcast, frame.fds(), frame.bytes());
  b->state_->name = name;
  b->state_->name_owner = own_pid();
  return b;
}

std::shared_ptr<BroadcastCore> BroadcastCore::open_named(const std::string& name) {
  OpenedChannel ch = open_channel(name, ChannelKind::kBroadcast);
  std::vector<int> fds;
  fds.reserve(ch.fds.size());
  for (UniqueFd& fd : ch.fds) fds.push_back(fd.release());
  Decoder d = parse_message_frame(
      std::span(reinterpret_cast<const std::byte*>(ch.bytes.data()), ch.bytes.size()), fds);
  std::shared_ptr<BroadcastCore> b = decode(d, false);
  d.finish();
  if (b->carried_reader() >= 0)
    throw ProtocolError("the named broadcast \"" + name + "\" is published as one reader");
  return b;
}

void BroadcastCore::unlink_named(const std::string& name) { unlink_channel(name); }

BroadcastCore::BroadcastCore(std::unique_ptr<State> state) : state_(std::move(state)) {}

// A reader attached here leaves (its unread messages dropped); the writer's last handle
// closes the broadcast.
BroadcastCore::~BroadcastCore() {
  if (!state_->name.empty() && state_->name_owner == own_pid()) {
    try {
      unlink_channel(state_->name, state_->name_token);
    } catch (...) {
    }
  }
  const std::uint64_t me = current_slot_owner();
  for (int i = 0; i < state_->readers; ++i) {
    if (state_->attached[static_cast<std::size_t>(i)] != me) continue;
    try {
      state_->drop_messages(i, me);
    } catch (const std::exception&) {
    }
  }
  if (state_->carried < 0 && state_->writer == me) close();
}


}  // namespace shmtensor::internal
