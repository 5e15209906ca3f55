#include "transport/depot.h"

#include <array>
#include <chrono>
#include <new>
#include <optional>
#include <span>
#include <vector>

#include "memory/registry.h"
#include "memory/segment.h"
#include "memory/storage_impl.h"
#include "os/socket.h"
#include "os/unique_fd.h"
#include "shmtensor/error.h"
#include "shmtensor/internal/storage_access.h"
#include "transport/announced.h"

namespace shmtensor::internal {

namespace {

enum : std::uint64_t { kDepositing = 0, kDeposited = 1, kDepositFailed = 2 };

// The most datagrams a process looks at in a depot for one segment: more than the senders
// put there (kDepotSegments), so that a peer's junk cannot make it look for ever.
constexpr int kDepotScan = 4 * kDepotSegments;

// The entry of `uid`, or -1. With `claimed`, a free entry is taken for it when it has none,
// and `claimed` says whether this call took it (and must deposit).
int find_entry(DepotTable* t, std::uint64_t uid, bool* claimed = nullptr) noexcept {
  if (uid == 0) return -1;  // 0 marks a free entry
  // Entries are taken in order and never freed: the first free one ends the search.
  for (int i = 0; i < kDepotSegments; ++i) {
    std::uint64_t u = t->entries[i].uid.load(std::memory_order_acquire);
    if (u == uid) return i;
    if (u != 0) continue;
    if (claimed == nullptr) return -1;
    if (t->entries[i].uid.compare_exchange_strong(u, uid, std::memory_order_acq_rel)) {
      *claimed = true;
      return i;
    }
    if (u == uid) return i;  // another sender took it for the same segment
  }
  return -1;
}

}  // namespace

void init_depot(DepotTable* t) {
  // Deposits are fetched by peeks at an offset: only where the kernel's work (os/socket.h).
  t->usable.store(peek_offset_works() ? 1 : 0, std::memory_order_relaxed);
  t->lock.state.store(0, std::memory_order_relaxed);
  for (auto& e : t->entries) {
    e.uid.store(0, std::memory_order_relaxed);
    e.state.store(kDepositing, std::memory_order_relaxed);
  }
}

bool depositable(const Segment& seg) noexcept {
  // A device segment's memfd is a file_descriptor one whatever the sharing strategy.
  return seg.strategy() == SharingStrategy::kFileDescriptor &&
         (seg.kind() == SegmentKind::kArena ||
          (seg.kind() == SegmentKind::kDeviceArena && seg.is_device()));
}

bool is_dedicated_host(const Segment& seg) noexcept {
  return seg.strategy() == SharingStrategy::kFileDescriptor &&
         seg.kind() == SegmentKind::kDedicated && !seg.is_device();
}

bool depot_omit(DepotTable* t, int deposit_sock, const Segment& seg,
                DedicatedDeposits* dedicated) {
  if (t->usable.load(std::memory_order_relaxed) == 0) return false;
  int entry = -1;
  bool claimed = false;
  if (depositable(seg)) {
    entry = find_entry(t, seg.uid(), &claimed);
  } else if (is_dedicated_host(seg) && dedicated != nullptr) {
    // Claimed only within the allowance: the depot keeps the segment's memory while the
    // channel lives, whatever its arena does with it. An entry this sender did not claim
    // (a peer wrote it) is not used: the segment's messages carry its fd.
    entry = find_entry(t, seg.uid());
    if (entry >= 0 && dedicated->claimed[entry] != seg.uid()) return false;
    if (entry < 0) {
      if (dedicated->segments <= 0 || dedicated->bytes < seg.mapped_size()) return false;
      entry = find_entry(t, seg.uid(), &claimed);
      if (!claimed) return false;  // the table is full, or a peer wrote the uid meanwhile
      --dedicated->segments;
      dedicated->bytes -= seg.mapped_size();
      dedicated->claimed[entry] = seg.uid();
    }
  }
  if (entry < 0) return false;
  if (!claimed) {
    // A deposit that failed may be tried again by one sender (this CAS decides who).
    std::uint64_t failed = kDepositFailed;
    claimed = t->entries[entry].state.compare_exchange_strong(failed, kDepositing,
                                                              std::memory_order_acq_rel);
  }
  if (!claimed) return t->entries[entry].state.load(std::memory_order_acquire) == kDeposited;
  std::uint64_t uid = seg.uid();
  // A device segment's two fds in the order of a message's: the memfd, then the allocation's.
  const int fds[2] = {seg.fd(), seg.is_device() ? seg.device_fd() : -1};
  bool deposited = false;
  try {
    deposited = send_message(deposit_sock, std::array{std::as_bytes(std::span(&uid, 1))},
                             std::span(fds, seg.is_device() ? 2 : 1), /*nonblocking=*/true);
  } catch (const SystemError&) {  // ETOOMANYREFS, ENOBUFS: see docs/transport.md
  }
  // The uid stays: an entry never changes hands, so whoever read it reads it right.
  t->entries[entry].state.store(deposited ? kDeposited : kDepositFailed, std::memory_order_release);
  return false;  // this message carries the fd
}

bool depot_names(DepotTable* t, std::uint64_t uid) noexcept { return find_entry(t, uid) >= 0; }

bool depot_has(DepotTable* t, const Segment& seg) noexcept {
  if (!depositable(seg) || t->usable.load(std::memory_order_relaxed) == 0) return false;
  const int entry = find_entry(t, seg.uid());
  return entry >= 0 && t->entries[entry].state.load(std::memory_order_acquire) == kDeposited;
}

FetchedSegment depot_fetch(DepotTable* t, int peek_sock, std::uint64_t uid, bool device) {
  const int entry = find_entry(t, uid);
  if (entry < 0 || t->entries[entry].state.load(std::memory_order_acquire) != kDeposited)
    return {};
  if (auto seg = Registry::instance().find_segment(uid)) return {std::move(seg), {}, {}};
  const std::size_t want = device ? 2 : 1;  // the fds a deposit of this kind carries
  std::vector<UniqueFd> found;
  {
    // A fetch has no caller's deadline (it runs inside a parse): it waits at most
    // kStuckAfter, also for a holder that is stopped, then says so.
    const auto until = std::chrono::steady_clock::now() + kStuckAfter;
    if (lock_shared(t->lock, until, LockHold::kBrief, "a depot's lock") == Locked::kTimeout)
      throw ProtocolError(
          "a depot's lock was held for more than 1 s by a stopped process (or "
          "another process wrote over it): the segment it names cannot be "
          "fetched now");
    SharedLockGuard unlock{t->lock};
    // Datagram by datagram, each peek at the byte offset where the next one starts (a
    // peek moves the shared offset by the bytes it copied, not by the datagram: set it
    // each time). MSG_TRUNC returns a datagram's whole length. An empty datagram is
    // returned once (n = 0), then stepped over at the same offset.
    std::size_t at = 0;
    for (int i = 0; i < kDepotScan && found.empty() && at < (1u << 30); ++i) {
      set_peek_offset(peek_sock, static_cast<int>(at), "a depot");
      std::uint64_t id = 0;
      // ECONNRESET is retried: the peer's last copy of its depot socket closed with our
      // deposits in it (reported once, by the next receive, peeks included), and its
      // deposits are still here. The fds the peek installs here are owned at once.
      std::optional<Peeked> p =
          peek_message(peek_sock, std::as_writable_bytes(std::span(&id, 1)), "a depot");
      if (!p) break;  // looked at all
      at += p->size;
      // What a sender deposits: exactly 8 bytes (the uid) and its fds (one; two for a device
      // segment). Anything else is a holder's junk, stepped over.
      const bool ours = p->size == sizeof id && id == uid;
      if (ours && p->fds_cut && p->fds.size() < want)
        throw FdsCutError(
            "a message names a segment that this process must map from its channel's "
            "depot, and the depot's fd did not arrive (MSG_CTRUNC): this process is at its "
            "open-file limit. Raise it with `ulimit -n`");
      if (ours && p->fds.size() == want && !p->fds_cut) found = std::move(p->fds);
    }
    clear_peek_offset(peek_sock);  // peeks without an offset again
  }
  if (found.empty()) return {};
  // Two threads may fetch at once: attach_fd (and map_device_memory, for the parse)
  // registers one segment per uid.
  std::shared_ptr<Segment> seg = Registry::instance().find_segment(uid);
  if (seg) return {std::move(seg), {}, {}};
  if (device) return {nullptr, std::move(found[0]), std::move(found[1])};
  seg = Segment::attach_fd(std::move(found[0]), uid);
  if (!depositable(*seg) && !is_dedicated_host(*seg))
    throw ProtocolError(
        "a depot holds a segment that is neither an arena's nor a dedicated host one");
  return {std::move(seg), {}, {}};
}

bool DepotSide::omit_fd(void* context, const Segment& seg) {
  auto& side = *static_cast<DepotSide*>(context);
  const bool omit =
      side.send_table_ != nullptr &&
      depot_omit(side.send_table_, side.deposit_sock_, seg,
                 side.dedicated_allowed_ ? &side.dedicated_ : nullptr);
  (omit ? side.fds_omitted_ : side.fds_sent_).fetch_add(seg.is_device() ? 2 : 1,
                                                        std::memory_order_relaxed);
  return omit;
}

FetchedSegment DepotSide::fetch_deposited(void* context, std::uint64_t uid, bool device) {
  auto& side = *static_cast<DepotSide*>(context);
  // Fetched before (only a segment of this depot is pinned here): no look at the shared
  // table, the registry or the socket.
  if (auto pinned = side.pins_.find(uid)) return {std::move(pinned), {}, {}};
  if (side.recv_table_ == nullptr) return {};
  FetchedSegment f = depot_fetch(side.recv_table_, side.peek_sock_, uid, device);
  if (f.segment) side.pins_.pin(f.segment);
  return f;
}

void DepotSide::keep_imported(void* context, const std::shared_ptr<Segment>& seg) noexcept {
  static_cast<DepotSide*>(context)->pins_.pin(seg);
}

void DepotSide::pin_received(Decoder& d) noexcept {
  if (recv_table_ == nullptr) return;
  for (const Storage& s : CodecAccess::state(d).storages) {
    const auto& seg = StorageAccess::impl(s)->segment();
    if ((depositable(*seg) || is_dedicated_host(*seg)) && depot_names(recv_table_, seg->uid()))
      pins_.pin(seg);
  }
}

DepotPins::~DepotPins() {
  for (int i = 0; i < kDepotSegments; ++i)
    if (ready_[i].load(std::memory_order_acquire))
      std::launder(reinterpret_cast<Ptr*>(slots_[i]))->~Ptr();
}

void DepotPins::pin(const std::shared_ptr<Segment>& seg) noexcept {
  const std::uint64_t uid = seg->uid();
  for (int i = 0; i < kDepotSegments; ++i) {
    std::uint64_t u = uids_[i].load(std::memory_order_acquire);
    if (u == uid) return;
    if (u != 0) continue;
    if (uids_[i].compare_exchange_strong(u, uid, std::memory_order_acq_rel)) {
      new (slots_[i]) Ptr(seg);
      ready_[i].store(true, std::memory_order_release);
      return;
    }
    if (u == uid) return;
  }
}

std::shared_ptr<Segment> DepotPins::find(std::uint64_t uid) const noexcept {
  for (int i = 0; i < kDepotSegments; ++i) {
    const std::uint64_t u = uids_[i].load(std::memory_order_acquire);
    // Slots are claimed in order and never given back: none is taken after a free one.
    if (u == 0) return nullptr;
    if (u == uid && ready_[i].load(std::memory_order_acquire))
      return *std::launder(reinterpret_cast<const Ptr*>(slots_[i]));
  }
  return nullptr;
}

}  // namespace shmtensor::internal
