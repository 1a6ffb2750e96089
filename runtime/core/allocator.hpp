// Slot allocation for one (tier, pool group): all-or-nothing, ready slots first.
//
// Memory tiers: a stack, the last freed first (a slot just freed is likely
// still in a cache), then the slots never handed out, lowest first. The
// disk: a queue, the longest free first. A disk slot's free is journaled by
// the tier's next group commit, and a write over a slot whose free is not
// yet journaled must append and sync that free first; taking the slot free
// longest makes that rare. The queue holds kQueueWindow slots while
// never-used ones remain (topped up lowest first), so a freed slot waits
// behind that many others, and the segment, which grows to the highest slot
// written and never shrinks, stays within the live pages plus the window.
//
// A freed slot keeps the fence (event id) of the last copy that touched it;
// its next owner waits on that event before writing. Event ids are the
// caller's (Python's event table): 0 means "no fence" (none, or already passed).
#pragma once

#include <algorithm>
#include <cassert>
#include <cstddef>
#include <cstdint>
#include <deque>
#include <stdexcept>
#include <string>
#include <vector>

namespace kvtier {

class SlotAllocator {
 public:
  static constexpr size_t kQueueWindow = 1024;     // two 512-page spill batches

  explicit SlotAllocator(int32_t capacity = 0, bool queue = false)
      : capacity_(capacity), queue_(queue), is_free_(capacity, 1), fence_(capacity, 0) {
    fresh_.reserve(capacity);
    for (int32_t s = capacity - 1; s >= 0; --s) fresh_.push_back(s);     // slot 0 goes first
    top_up();
  }

  bool queue_order() const { return queue_; }

  int32_t capacity() const { return capacity_; }
  int32_t free() const { return int32_t(ready_.size() + fresh_.size() + fenced_.size()); }
  int32_t used() const { return capacity_ - free(); }
  bool is_free(int32_t s) const { return is_free_[s] != 0; }
  int32_t fence(int32_t s) const { return fence_[s]; }

  // `n` slots appended to `out` (ready ones in the allocator's order, then
  // never-used ones lowest first, then the oldest fenced), or false with
  // nothing taken if fewer are free.
  bool allocate(int32_t n, std::vector<int32_t>& out) {
    if (n < 0 || n > free()) return false;
    for (int32_t i = 0; i < n; ++i) {
      top_up();
      if (!ready_.empty()) {
        out.push_back(queue_ ? ready_.front() : ready_.back());
        if (queue_) ready_.pop_front(); else ready_.pop_back();
      } else if (!fresh_.empty()) {
        out.push_back(fresh_.back());
        fresh_.pop_back();
      } else {
        out.push_back(fenced_.front());
        fenced_.pop_front();
      }
      is_free_[out.back()] = 0;
    }
    return true;
  }

  // Give slots back; `fence` (0: none) marks the last copy that touched them.
  // Throws std::invalid_argument, with nothing changed, on a slot that is
  // out of range, already free or repeated.
  void release(const int32_t* slots, size_t n, int32_t fence) {
    for (size_t i = 0; i < n; ++i) {
      int32_t s = slots[i];
      if (s < 0 || s >= capacity_ || is_free_[s]) bad(s, slots, i);
      is_free_[s] = 1;                                       // marks repeats within this call
    }
    for (size_t i = 0; i < n; ++i) {
      fence_[slots[i]] = fence;
      if (fence == 0) ready_.push_back(slots[i]); else fenced_.push_back(slots[i]);
    }
  }

  // An allocated slot handed to a new owner by the copy (or drop) that read
  // it last: the new owner waits on `fence` before writing.
  void set_fence(int32_t s, int32_t fence) {
    assert(!is_free_[s]);
    fence_[s] = fence;
  }

  // Give one slot back with the fence it already carries (a slot taken and
  // never used: its next owner still waits on the copy before).
  void give_back(int32_t s) { release(&s, 1, fence_[s]); }

  // Recovery: take exactly the slots not in `keep` out of the free pool order
  // so that the lowest free slots go first. `keep[s]` != 0: in use.
  void reset_used(const std::vector<uint8_t>& keep) {
    ready_.clear();
    fenced_.clear();
    fresh_.clear();
    for (int32_t s = capacity_ - 1; s >= 0; --s) {
      is_free_[s] = keep[s] ? 0 : 1;
      fence_[s] = 0;
      if (!keep[s]) fresh_.push_back(s);
    }
    top_up();
  }

 private:
  // The queue: at least kQueueWindow ready while never-used slots remain.
  void top_up() {
    while (queue_ && ready_.size() < kQueueWindow && !fresh_.empty()) {
      ready_.push_back(fresh_.back());
      fresh_.pop_back();
    }
  }

  [[noreturn]] void bad(int32_t s, const int32_t* slots, size_t upto) {
    for (size_t j = 0; j < upto; ++j) is_free_[slots[j]] = 0;   // undo the marks: nothing changed
    throw std::invalid_argument("slot " + std::to_string(s) + " released twice or never allocated");
  }

  int32_t capacity_;
  bool queue_;                        // ready_ order: true, a queue (front next); false, a stack (back next)
  // Invariant: every slot is in exactly one of ready_, fresh_, fenced_ or in
  // use; is_free_[s] == 1 exactly for the first three.
  std::deque<int32_t> ready_;         // fence passed or none; freed slots join at the back
  std::vector<int32_t> fresh_;        // never handed out (nor queued) since built or recovered: descending
  std::deque<int32_t> fenced_;        // FIFO: fenced by a copy that may still run
  std::vector<uint8_t> is_free_;
  std::vector<int32_t> fence_;        // per slot: the event its next owner waits on (0: none)
};

}  // namespace kvtier
