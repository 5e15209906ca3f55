// A ring of fixed-size message slots in shared memory: many producer and many consumer
// processes (and threads), no syscall on the way of a message when nobody sleeps, and no
// wait that a SIGKILLed peer can make endless. The building block of the descriptor ring
// the transport issue asks for (docs/transport.md, "The message ring"): messages that
// carry no fds and fit a slot are to travel here instead of as socket datagrams.
//
// Layout: a sealed memfd (it travels to other processes as one fd, and cannot be truncated
// under a reader) holding a header, a table of holder processes, and `slot_count` slots of
// `slot_bytes` each. Every slot starts with a 64-bit word that says whose it is:
//
//   pos (50 bits) | state (2) | holder (7) | epoch (5)
//
// (kept less its slot's index in `pos`, so that a slot never written, all zeros, is FREE for
// its first position: ring_layout.h, index_bias; a new ring writes no slot's page)
// `pos` is the position (lap * slot_count + index) the slot is for; `state` is FREE (a
// producer may claim it for pos), WRITING (claimed by a producer), READY (a message for
// pos) or READING (claimed by a consumer). A claim is one CAS on the word that also names
// the claimer's holder record and the record's epoch, so a process that dies between its
// claim and its next store is always known: anyone who finds a slot WRITING or READING for
// a holder that is dead (or whose record was taken over since, a new epoch) frees it. A
// consumer then skips the position (the message was never finished, or was taken by a
// consumer that died with it). `tail` and `head` are hints that every process helps
// forward; the slot words decide.
//
// Waiting: consumers sleep on the `published` futex word and producers on `freed`, each
// with a count of sleepers, so a push or pop makes a FUTEX_WAKE only when someone sleeps.
// Sleeps are sliced (50 ms) so that a claim held by a process that died is noticed.
//
// A peer can scribble on the shared memory: the geometry is read once from a validated
// copy of the header, a message longer than its slot or a word no protocol state explains
// is a ProtocolError (the slot is freed first where that is possible), never a crash.
// Hints a peer moved are put back where the slot words say (resync_hints): no message is
// lost to them and no push fails; a message a moved tail passed by more than a lap is
// renumbered forward (resync_hints, or the claim that meets it), never freed (transport.md,
// "A hostile peer", says what that does not cover). A hint is read as the 50 bits of
// position a slot word keeps (positions stay below kPosLimit), so no value of a hint
// aliases a position. The highest slot word leads, however far above the others: a peer
// that moves hints leaves honest words laps apart, which a forged word cannot be told from.
// A ring whose positions run out (kPosLimit) is broken, and says so to every caller. A claim
// lasts a copy, or as long as its claimer waits with it (a queue's marker: reserve, and a
// held pop), whose position the claimer's holder record then names: a claim of a live
// process that is neither stopped nor waiting with it, standing for kClaimStuckAfter while
// a thread waits behind it, was written by a peer, and that thread's calls throw
// ProtocolError (watch_claim) while the word stands. Layout: transport/ring_layout.h.
#pragma once

#include <chrono>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <optional>
#include <span>

#include "os/mapping.h"
#include "os/unique_fd.h"

namespace shmtensor::internal {

struct RingHeader;

class Ring {
 public:
  static constexpr std::uint32_t kSlotHeaderBytes = 16;  // word, size, tag
  static constexpr std::uint32_t kMaxSlotCount = 1u << 20;
  static constexpr std::uint32_t kMaxSlotBytes = 1u << 16;
  // Where the tail and head hints are in the memfd (for tests and the fuzz target, which
  // write over them as a hostile peer would).
  static constexpr std::size_t kTailOffset = 64;
  static constexpr std::size_t kHeadOffset = 128;
  // Bytes of the header left to the ring's user (Connection keeps its locks there).
  static constexpr std::size_t kUserBytes = 1024;
  using Deadline = std::optional<std::chrono::steady_clock::time_point>;
  // A deadline that has always passed (the clock's epoch): a pop given it looks once and
  // does not wait, without reading the clock.
  static constexpr std::chrono::steady_clock::time_point kNoWait{};

  // A new ring in a new sealed memfd. slot_count: a power of two in [2, kMaxSlotCount];
  // slot_bytes: a multiple of 64 in [64, kMaxSlotBytes]. Throws std::invalid_argument,
  // SystemError.
  static Ring create(std::uint32_t slot_count, std::uint32_t slot_bytes);
  // Maps a ring another process made. Throws ProtocolError when the fd is not a sealed
  // memfd of the size its header says, or the header is not a ring's (magic, version,
  // geometry); SystemError when it cannot be mapped.
  static Ring attach(UniqueFd fd);

  Ring() noexcept;
  Ring(Ring&&) noexcept;
  Ring& operator=(Ring&&) noexcept;
  Ring(const Ring&) = delete;
  Ring& operator=(const Ring&) = delete;
  // Frees this process's holder record (a forked child frees its own, not its parent's).
  ~Ring();

  [[nodiscard]] int fd() const noexcept { return fd_.get(); }
  [[nodiscard]] std::uint32_t slot_count() const noexcept { return slot_count_; }
  [[nodiscard]] std::uint32_t slot_bytes() const noexcept { return slot_bytes_; }
  // Where the first slot starts in the memfd (tests, fuzzing).
  [[nodiscard]] std::size_t slots_offset() const noexcept { return slots_offset_; }
  // The most bytes one message may have.
  [[nodiscard]] std::size_t max_message() const noexcept { return slot_bytes_ - kSlotHeaderBytes; }

  enum class Status { kOk, kTimeout, kClosed };
  // Writes one message (at most max_message() bytes; std::invalid_argument otherwise) with
  // a caller-defined tag. Waits while the ring is full, until `deadline` (nullopt: for
  // ever; a past one: does not wait). kClosed once close() was called anywhere: nothing
  // was written. Throws ProtocolError when the shared words are corrupt.
  Status push(std::span<const std::byte> message, std::uint32_t tag, Deadline deadline) {
    return push_parts(std::span(&message, 1), tag, deadline);
  }
  // The same for a message in parts, copied one after the other into the slot.
  // Wake::kDeferred makes no FUTEX_WAKE: the caller, which publishes a batch, calls
  // wake_consumers() once after it (and before it waits for anything: a consumer asleep
  // meanwhile wakes only at the end of its 50 ms slice).
  enum class Wake { kNow, kDeferred };
  Status push_parts(std::span<const std::span<const std::byte>> parts, std::uint32_t tag,
                    Deadline deadline, Wake wake = Wake::kNow);
  // Wakes up to `n` consumers asleep (no syscall when none sleeps).
  void wake_consumers(int n) noexcept;
  // A push in two steps, for a message whose place in the order must be taken before it
  // can be written (a queue's marker, whose datagram is sent in between): reserve() claims
  // the next position (waiting like push), then commit() writes and publishes it, or
  // cancel() gives it up (consumers step over it). Until then the claim is named as held
  // while waiting (HolderRecord::waiting): the caller may wait in between. A process killed in
  // between leaves an abandoned claim, found and skipped as any other. The parts must fit
  // max_message().
  struct Reservation {
    Status status = Status::kTimeout;
    std::uint64_t pos = 0;  // kOk
  };
  Reservation reserve(Deadline deadline);
  // commit() is false, having written and published nothing, when the claim is no longer
  // ours: it was freed as a dead process's (a wrong judgement: /proc said this process
  // was gone) or a peer wrote over it.
  [[nodiscard]] bool commit(std::uint64_t pos, std::span<const std::span<const std::byte>> parts,
                            std::uint32_t tag, Wake wake = Wake::kNow) noexcept;
  void cancel(std::uint64_t pos) noexcept;
  struct Popped {
    Status status = Status::kTimeout;
    std::uint32_t tag = 0;
    std::size_t size = 0;   // bytes written to `out`
    std::uint64_t pos = 0;  // kOk: the message's position
  };
  // Takes the oldest message into `out` (at least max_message() bytes). Waits while the
  // ring is empty, until `deadline`. kClosed once the ring is closed and nothing is left.
  // Throws ProtocolError for a corrupt word or a message size larger than its slot (that
  // slot is freed first: the next pop goes on). A message whose tag is `hold_tag` stays
  // claimed (READING, in this process's name, named as held while waiting) until
  // release(pos) or unread(pos): what the caller does with it is not over when the copy is
  // (a queue's marker, until its datagram is taken). A pop that waits behind a claim of a
  // live process throws ProtocolError once watch_claim judges it a peer's.
  static constexpr std::uint32_t kHoldNone = 0xffffffffu;
  Popped pop(std::span<std::byte> out, Deadline deadline, std::uint32_t hold_tag = kHoldNone);
  // Whether this process's pops spin briefly before they sleep (busy_poll.h,
  // spin_before_sleep; on by default): off for a consumer among more processes than CPUs,
  // whose spin would keep the CPU from the one being woken.
  void set_spin_before_sleep(bool on) noexcept;
  [[nodiscard]] bool spins_before_sleep() const noexcept;
  // Frees a slot that pop() left claimed.
  void release(std::uint64_t pos) noexcept;
  // Gives a message that pop() left claimed back, published as before: the next pop takes
  // it (the head hint is moved back to it). For a consumer that cannot finish with it in
  // time (a queue's marker whose datagram is behind one another consumer holds).
  void unread(std::uint64_t pos) noexcept;
  // Moves the head hint back to `pos` if it is past it: the next pop looks there first (a
  // message given back below the head by another consumer).
  void rewind_head(std::uint64_t pos) noexcept;
  // What the slot of `pos` says about that position now: gone (its message was taken and
  // freed, or skipped, or the slot never reached it), or being written, published, or
  // being read; and for a claim, whether its claimer still lives.
  enum class Where { kGone, kWriting, kReady, kReading };
  struct SlotView {
    Where where = Where::kGone;
    bool claimer_alive = false;
  };
  [[nodiscard]] SlotView inspect(std::uint64_t pos) const noexcept;
  // Whether the message at `pos` is published or being read (READY or READING: not taken
  // and done with) and its tag is `tag`, whoever holds it and whether it lives (no /proc
  // read: for a scan on every message). A queue's marker so is one whose datagram may
  // still be in the socket (unread() gives a marker back READY).
  [[nodiscard]] bool pending(std::uint64_t pos, std::uint32_t tag) const noexcept;
  // For a thread that waits behind the claim of `pos` (WRITING or READING) outside the
  // ring's own waits (a queue's consumer whose datagram is behind an earlier marker's).
  // How long a live claim has stood while its claimer was neither stopped nor waiting with
  // it (its holder record names `pos`: HolderRecord::waiting) is added up per thread, ring
  // handle and position, a look at most kClaimWatchStep of it; once that is
  // kClaimStuckAfter, the claim is a peer's and this throws ProtocolError (and again at each
  // later look that finds the claimer running, while the thread waits at that position).
  // Nothing for a slot that holds no live claim for `pos`. The ring's pops and pushes watch
  // the claims they wait behind so too.
  static constexpr std::chrono::milliseconds kClaimStuckAfter{1000};
  static constexpr std::chrono::milliseconds kClaimWatchStep{100};
  void watch_claim(std::uint64_t pos);
  // Every later push returns kClosed; pops return what is left, then kClosed; every
  // sleeper wakes.
  void close() noexcept;
  [[nodiscard]] bool closed() const noexcept;
  // Whether the ring is broken (it has no position left: every push, and every pop that
  // finds nothing, throws ProtocolError); a broken ring is closed() too.
  [[nodiscard]] bool broken() const noexcept;
  // kUserBytes of shared memory in the ring's header, zero in a new ring, for the user's
  // own words (a peer can write them too: validate what is read there).
  [[nodiscard]] std::byte* user_area() const noexcept;
  // For a consumer that waits without popping (a poll, or a pop that must not sleep in
  // pop: Connection looks at its socket between waits): publish_count() before looking at
  // the ring, then wait_for_publish(seen) sleeps until a message is published (or kick()
  // is called) after that read, at most one 50 ms slice and until `deadline`. False when
  // the deadline has passed.
  [[nodiscard]] std::uint32_t publish_count() const noexcept;
  bool wait_for_publish(std::uint32_t seen, Deadline deadline) noexcept;
  // The same with no time limit (no kernel timer: cheaper by a timer's set-up and cancel):
  // for a caller that made sure whatever else it waits for calls kick() (a Connection
  // whose socket's hang-up is watched: transport/hangup_watch.h).
  void wait_for_publish_untimed(std::uint32_t seen) noexcept;
  // For busy polling: spins (no syscall, no store to shared memory) until publish_count()
  // differs from `seen` (true) or `until` has passed (false). One cache line is watched,
  // so the producer's publish is seen within a few tens of nanoseconds.
  bool spin_for_publish(std::uint32_t seen,
                        std::chrono::steady_clock::time_point until) const noexcept;
  // Wakes every consumer in wait_for_publish (a Connection's close: they look at the
  // socket). pop() waiters look at the ring again and sleep on.
  void kick() noexcept;
  // Messages published and not yet taken (a snapshot; abandoned claims count until they
  // are found).
  [[nodiscard]] std::uint64_t size() const noexcept;
  // False only when no message is published or being written: the tail hint
  // equals the head hint (a claimer moves the tail past its position before it writes).
  // One pair of loads, for a readiness check; true may be stale.
  [[nodiscard]] bool maybe_nonempty() const noexcept;
  // Whether a published message waits (a slot between the head and tail hints is READY for
  // its position): unlike maybe_nonempty, false while claims are only being written or were
  // given up. For readiness fds, which must not stay readable for a cancelled claim.
  [[nodiscard]] bool has_ready() const noexcept;
  // Claims of processes that died, found and freed so far (each a message lost: never
  // finished, or taken by a consumer that died with it).
  [[nodiscard]] std::uint64_t abandoned() const noexcept;

  // For tests: claims the next position as a producer (or, with `as_consumer`, the oldest
  // message as a consumer) and leaves it so, as a process killed at that instant would.
  // Returns false when there was nothing to claim.
  bool test_claim_and_abandon(bool as_consumer);

 private:
  Ring(UniqueFd fd, Mapping map, std::uint32_t slot_count, std::uint32_t slot_bytes);
  // Defined in ring_local.h (inline in each of the ring's files).
  inline RingHeader* header() const noexcept;
  inline std::byte* slot(std::uint64_t pos) const noexcept;
  // The word of pos's slot, read, written or compared-and-swapped as a word (ring_layout.h:
  // it is stored less index_bias of the slot's index).
  inline std::uint64_t load_word(std::uint64_t pos) const noexcept;
  inline void store_word(std::uint64_t pos, std::uint64_t word,
                         std::memory_order order = std::memory_order_seq_cst) noexcept;
  inline bool cas_word(std::uint64_t pos, std::uint64_t& expected, std::uint64_t desired,
                       std::memory_order order = std::memory_order_seq_cst) noexcept;
  // This process's holder record (index, epoch), claimed on first use in each process.
  inline std::pair<std::uint32_t, std::uint32_t> holder();
  [[gnu::noinline]] std::pair<std::uint32_t, std::uint32_t> claim_holder_record();
  // Whether the claimer a WRITING or READING word names is gone (look_at_claimer).
  bool claimer_dead(std::uint64_t word) const noexcept;
  // The claimer of the WRITING or READING word `word` of `pos`, with one read of /proc:
  // gone (dead, or its record moved on), stopped, waiting with this claim (its record names
  // `pos`, or has more such claims than it can name), or none of those (running: a claim
  // it holds should end within a copy).
  enum class Claimer { kGone, kStopped, kWaiting, kRunning };
  Claimer look_at_claimer(std::uint64_t pos, std::uint64_t word) const noexcept;
  // watch_claim for a word already read and judged.
  void watch_claim(std::uint64_t pos, std::uint64_t word, Claimer claimer);
  // This process's claim of `pos` is held while it waits from now on (start_waiting: entered
  // in its holder record `who`, HolderRecord::waiting), or no longer (stop_waiting). The
  // counts of claims not named never go below zero: a peer may have written them.
  void start_waiting(std::uint32_t who, std::uint64_t pos) noexcept;
  void stop_waiting(std::uint64_t pos) noexcept;
  // reserve() and commit() without naming the claim as held while waiting (push_parts).
  Reservation claim_tail(Deadline deadline);
  bool publish(std::uint64_t pos, std::span<const std::span<const std::byte>> parts,
               std::uint32_t tag, Wake wake) noexcept;
  void free_holder() noexcept;
  inline void wake_producers() noexcept;
  // Moves a hint that is further from the slot words than any honest ring puts it back to
  // where the words say; true when it moved one.
  bool resync_hints() noexcept;
  // Moves the published message in the slot of `pos` (whose word is `word`, READY) to
  // position `to` of the same slot, and wakes a consumer; false when the word changed.
  // Out of line, and `word` by value: the claim (reserve) that calls it keeps its word in a
  // register.
  [[gnu::noinline, gnu::cold]] bool renumber(std::uint64_t pos, std::uint64_t word,
                                             std::uint64_t to) noexcept;
  // resync_hints after a sleep with nothing published, at most once a second (kIdleScanEvery).
  void idle_scan() noexcept;
  // Marks the ring broken (ring_layout.h, kRingBroken), wakes every sleeper, and throws
  // its ProtocolError: for a ring whose slot words say it has no position left.
  [[noreturn]] void break_ring();

  UniqueFd fd_;
  Mapping map_;
  // From the validated copy of the header; never re-read from shared memory.
  std::uint32_t slot_count_ = 0;
  std::uint32_t slot_bytes_ = 0;
  std::size_t slots_offset_ = 0;
  // The holder record this process took, claimed once per process (a forked child
  // claims its own); threads of one process share it.
  struct Local;
  std::unique_ptr<Local> local_;
};

}  // namespace shmtensor::internal
