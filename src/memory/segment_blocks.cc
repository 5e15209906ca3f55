// Block words and holder slots of a segment: the cross-process half of the arena protocol.
// docs/design.md ("Block refcounts") states the invariants and proves them; in short:
//   I1  A block's word is non-zero while any process holds it or a message carries it.
//   I2  Only a holder adds to a word (a count for a message, or for a forked child), so a
//       word at 0 stays 0 until the creator claims it again (under its arena's lock).
//   I3  A slot's bit is set and cleared only by the slot's owner, except that the creator
//       clears the bits of an owner that is dead (same pid *and* start time gone).
// Memory orders: every release of a hold is acq_rel (the holder's writes to the block
// happen before the creator's reuse, which claims with acquire); adding a count needs no
// order (the adder holds the block, so the word cannot be 0 meanwhile).
#include <cstdio>

#include "memory/arena.h"
#include "memory/segment.h"
#include "os/proc.h"
#include "os/proc_scan.h"
#include "shmtensor/error.h"

namespace shmtensor::internal {

namespace {
using WordRef = std::atomic_ref<std::uint64_t>;
}  // namespace

// Also marks the block, so that the creator's arena never collects it as free later (a
// rescan would see a zeroed word as free while a holder still reads the block).
void Segment::report_corruption(const char* what, std::uint32_t block,
                                std::uint64_t word) noexcept {
  quarantined_[block / 64].fetch_or(std::uint64_t{1} << (block % 64), std::memory_order_relaxed);
  std::fprintf(stderr,
               "shmtensor: corrupted block word in shared memory (%s; block %u, word 0x%llx): "
               "the block is left alone and never reused\n",
               what, block, static_cast<unsigned long long>(word));
}

std::uint64_t* Segment::word_ptr(std::uint32_t block) const noexcept {
  return reinterpret_cast<std::uint64_t*>(mapping_.data() + geometry_.words_offset) + block;
}

std::uint64_t* Segment::slot_ptr(int slot) const noexcept {
  return reinterpret_cast<std::uint64_t*>(mapping_.data() + geometry_.slots_offset) + slot;
}

std::int64_t Segment::block_at(std::uint64_t offset) const noexcept {
  if (offset % geometry_.block_size != 0) return -1;
  const std::uint64_t i = offset / geometry_.block_size;
  return i < geometry_.block_count ? static_cast<std::int64_t>(i) : -1;
}

std::size_t Segment::clear_slot_bits(int s) noexcept {
  // Only the process that took slot `s` over from its dead owner (one CAS decides who) runs
  // this, before it sets any bit of its own there: the bits it clears are the dead owner's.
  std::size_t freed = 0;
  const std::uint64_t bit = std::uint64_t{1} << s;
  for (std::uint32_t b = 0; b < geometry_.block_count; ++b) {
    WordRef w(*word_ptr(b));
    if ((w.load(std::memory_order_relaxed) & bit) == 0) continue;
    if (w.fetch_and(~bit, std::memory_order_acq_rel) == bit) ++freed;
  }
  return freed;
}

void Segment::claim_slot(bool creator) noexcept {
  const std::uint64_t me = current_slot_owner();
  slot_ = -1;
  slot_owner_ = 0;
  // The creator takes slot 0 of its fresh segment; others the first free one.
  for (int s = 0; s < static_cast<int>(kSlotCount); ++s) {
    std::uint64_t expected = 0;
    if (WordRef(*slot_ptr(s)).compare_exchange_strong(expected, me, std::memory_order_acq_rel)) {
      slot_ = s;
      slot_owner_ = me;
      return;
    }
    if (creator) return;
  }
  // None is free: take over the slot of an owner that is dead (a holder SIGKILLed before the
  // creator reclaimed it). Whoever wins the CAS from the dead owner's value clears its bits
  // first, then holds through the slot; otherwise every later process would hold by count,
  // and a count of a process that dies is never given back.
  for (int s = 0; s < static_cast<int>(kSlotCount); ++s) {
    std::uint64_t owner = WordRef(*slot_ptr(s)).load(std::memory_order_acquire);
    if (owner == 0 || owner == me || slot_owner_alive(owner)) continue;
    if (!WordRef(*slot_ptr(s)).compare_exchange_strong(owner, me, std::memory_order_acq_rel))
      continue;
    if (clear_slot_bits(s) > 0) note_freed_by_other();
    slot_ = s;
    slot_owner_ = me;
    return;
  }
}

void Segment::release_slot() noexcept {
  if (slot_ < 0) return;
  // Every hold of ours is gone (each storage keeps this Segment alive). CAS, not a store:
  // if the creator judged us dead (it cannot, we live) the slot is no longer ours.
  std::uint64_t expected = slot_owner_;
  WordRef(*slot_ptr(slot_)).compare_exchange_strong(expected, 0, std::memory_order_acq_rel);
  slot_ = -1;
}

std::uint64_t Segment::block_word(std::uint32_t block) const noexcept {
  return WordRef(*word_ptr(block)).load(std::memory_order_acquire);
}

bool Segment::holds_block(std::uint32_t block) const noexcept {
  return slot_ >= 0 && (block_word(block) & (std::uint64_t{1} << slot_)) != 0;
}

bool Segment::claim_free_block(std::uint32_t block) noexcept {
  std::uint64_t expected = 0;
  const std::uint64_t held = slot_ >= 0 ? std::uint64_t{1} << slot_ : kCountUnit;
  if (WordRef(*word_ptr(block)).compare_exchange_strong(expected, held, std::memory_order_acquire))
    return true;
  report_corruption("a free block is held", block, expected);
  return false;
}

void Segment::add_block_in_flight(std::uint32_t block) {
  // A CAS, not fetch_add: adding to a count of kCountMax would carry out of the word and
  // leave it reading 0 (free) for a moment, breaking I1.
  WordRef w(*word_ptr(block));
  std::uint64_t cur = w.load(std::memory_order_relaxed);
  do {
    if (block_count_of(cur) >= kCountMax)
      throw Error(
          "a shared storage is carried by 65535 messages that were not received yet: "
          "receive some before sending it again");
  } while (!w.compare_exchange_weak(cur, cur + kCountUnit, std::memory_order_relaxed));
}

void Segment::note_freed_by_other() noexcept {
  if (!own()) header()->release_epoch.fetch_add(1, std::memory_order_release);
}

void Segment::block_freed(std::uint32_t block) noexcept {
  if (own())
    arena_block_freed(*this, block);
  else
    note_freed_by_other();
}

bool Segment::drop_block_in_flight(std::uint32_t block) noexcept {
  const std::uint64_t prev =
      WordRef(*word_ptr(block)).fetch_sub(kCountUnit, std::memory_order_acq_rel);
  if (block_count_of(prev) == 0) {
    WordRef(*word_ptr(block)).fetch_add(kCountUnit, std::memory_order_relaxed);
    report_corruption("a count to drop is missing", block, prev);
    return false;
  }
  const bool freed = prev == kCountUnit;
  if (freed) block_freed(block);
  return freed;
}

bool Segment::adopt_block_in_flight(std::uint32_t block, bool* counted) noexcept {
  WordRef w(*word_ptr(block));
  std::uint64_t cur = w.load(std::memory_order_relaxed);
  for (;;) {
    if (block_count_of(cur) == 0) return false;
    const std::uint64_t bit = slot_ >= 0 ? std::uint64_t{1} << slot_ : 0;
    // Without a slot, or with our bit still set by a storage of ours being destroyed on
    // another thread, the message's count becomes our hold as it is.
    if (bit == 0 || (cur & bit) != 0) {
      *counted = true;
      return true;
    }
    if (w.compare_exchange_weak(cur, (cur - kCountUnit) | bit, std::memory_order_acq_rel)) {
      *counted = false;
      return true;
    }
  }
}

bool Segment::drop_duplicate_in_flight(std::uint32_t block, bool* freed) noexcept {
  WordRef w(*word_ptr(block));
  std::uint64_t cur = w.load(std::memory_order_relaxed);
  do {
    if (block_count_of(cur) == 0) return false;
  } while (!w.compare_exchange_weak(cur, cur - kCountUnit, std::memory_order_acq_rel));
  *freed = cur == kCountUnit;
  if (*freed) block_freed(block);
  return true;
}

bool Segment::release_block(std::uint32_t block, bool counted) noexcept {
  WordRef w(*word_ptr(block));
  std::uint64_t prev;
  if (counted) {
    prev = w.fetch_sub(kCountUnit, std::memory_order_acq_rel);
    if (block_count_of(prev) == 0) {
      w.fetch_add(kCountUnit, std::memory_order_relaxed);
      report_corruption("our counted hold is missing", block, prev);
      return false;
    }
    if (prev != kCountUnit) return false;
  } else {
    const std::uint64_t bit = std::uint64_t{1} << slot_;
    prev = w.fetch_and(~bit, std::memory_order_acq_rel);
    if ((prev & bit) == 0) {
      report_corruption("our slot's bit is missing", block, prev);
      return false;
    }
    if (prev != bit) {
      // Others hold it still: a dedicated block of ours that we no longer use.
      if (own() && is_dedicated_kind(geometry_.kind)) arena_block_handed_over(*this);
      return false;
    }
  }
  block_freed(block);
  return true;
}

std::size_t Segment::reclaim_dead_slots(bool exec_check) noexcept {
  std::size_t freed = 0;
  for (int s = 0; s < static_cast<int>(kSlotCount); ++s) {
    if (s == slot_) continue;
    const std::uint64_t owner = WordRef(*slot_ptr(s)).load(std::memory_order_acquire);
    if (owner == 0) continue;
    // A live holder always maps the segment (it takes its slot after mapping, and gives it
    // back before unmapping): one that does not exec'd, and its holds are void.
    if (slot_owner_alive(owner)) {
      const auto pid = static_cast<pid_t>(owner >> 32);
      if (!exec_check || inode_ == 0 || process_maps_file(pid, device_, inode_) ||
          process_maps_file(pid, device_, inode_))
        continue;
    }
    // Gone. Take the slot first (as claim_slot's takeover does), so that one process alone
    // clears its bits, and nobody can take it and set bits we would then clear; free it after.
    const std::uint64_t me = current_slot_owner();
    std::uint64_t expected = owner;
    if (!WordRef(*slot_ptr(s)).compare_exchange_strong(expected, me, std::memory_order_acq_rel))
      continue;
    freed += clear_slot_bits(s);
    expected = me;
    WordRef(*slot_ptr(s)).compare_exchange_strong(expected, 0, std::memory_order_acq_rel);
  }
  return freed;
}

void Segment::reset_after_fork(bool take_slot) noexcept {
  // The parent's slot stays the parent's: the child must neither clear its bits nor free it.
  slot_ = -1;
  slot_owner_ = 0;
  own_.store(false, std::memory_order_relaxed);
  if (take_slot) claim_slot(/*creator=*/false);
}

void Segment::add_fork_count(std::uint32_t block) noexcept {
  WordRef(*word_ptr(block)).fetch_add(kCountUnit, std::memory_order_relaxed);
}

void Segment::take_back_fork_count(std::uint32_t block) noexcept {
  // The parent still holds the block, so this cannot free it.
  WordRef(*word_ptr(block)).fetch_sub(kCountUnit, std::memory_order_relaxed);
}

void Segment::convert_fork_hold(std::uint32_t block, bool* counted) noexcept {
  // The count the parent added for us is exactly a message's count: adopt it.
  if (!adopt_block_in_flight(block, counted)) *counted = true;
}

}  // namespace shmtensor::internal
