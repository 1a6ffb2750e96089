// Slot allocation for one (tier, pool group): all-or-nothing.
//
// Memory tiers: a stack, the last freed first (a slot just freed is likely
// still in a cache), then the slots never handed out, lowest first, then the
// fenced ones, oldest first.
//
// The disk: a sweep. Free slots go out in address order from a cursor that
// moves forward and wraps, so that one spill's pages land in a few runs of
// adjacent slots: one pwritev and one sequential device write each, where
// slots taken in the order they were freed (a queue, until session 16) made
// runs of 15 pages scattered over the whole file, and the three-tier replay
// wrote at the device's random-write speed. In a full disk the pages evicted
// (least recently used) are mostly those spilled one lap earlier, just ahead
// of the cursor.
//   A disk slot's free is journaled by the tier's next group commit, and a
// write over a slot whose free is not yet journaled must append and sync that
// free first. So a first pass skips the slots freed within the last `window`
// frees (half the free slots, at most kWindow: what a queue kept ahead of
// them); when the rest falls short, the slots it skipped go, in its order.
// A scan skips blocks of kBlock slots with none free, so a sweep costs the
// free slots it passes plus capacity / kBlock.
//   The sweep covers the extent, the slots below the highest one handed out
// since the pool was built or recovered. Past its end the sweep wraps to
// slot 0 while an eighth of the extent is free, else grows the extent with
// never-used slots: the segment, preallocated to the highest slot written
// and never shrunk, stays within the live pages plus an eighth (and kWindow).
//
// A freed slot keeps the fence (event id) of the last copy that touched it;
// its next owner waits on that event before writing. Event ids are the
// caller's (Python's event table): 0 means "no fence" (none, or already passed).
#pragma once

#include <algorithm>
#include <cassert>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <deque>
#include <stdexcept>
#include <string>
#include <vector>

namespace kvtier {

class SlotAllocator {
 public:
  static constexpr uint32_t kWindow = 1024;     // two 512-page spill batches
  static constexpr int32_t kBlock = 4096;       // the sweep counts free slots per block of this many

  explicit SlotAllocator(int32_t capacity = 0, bool sweep = false)
      : capacity_(capacity), sweep_(sweep), is_free_(capacity, 1), fence_(capacity, 0) {
    if (sweep_) {
      freed_at_.assign(capacity, 0);
      block_free_.assign(size_t(capacity / kBlock) + 1, 0);
      for (int32_t b = 0; b * kBlock < capacity; ++b) block_free_[size_t(b)] = std::min(kBlock, capacity - b * kBlock);
      n_free_ = capacity;
      return;
    }
    fresh_.reserve(capacity);
    for (int32_t s = capacity - 1; s >= 0; --s) fresh_.push_back(s);     // slot 0 goes first
  }

  bool sweep_order() const { return sweep_; }

  int32_t capacity() const { return capacity_; }
  int32_t free() const { return sweep_ ? n_free_ : int32_t(ready_.size() + fresh_.size() + fenced_.size()); }
  int32_t used() const { return capacity_ - free(); }
  bool is_free(int32_t s) const { return is_free_[s] != 0; }
  int32_t fence(int32_t s) const { return fence_[s]; }

  // `n` slots appended to `out` (see the order above), or false with nothing
  // taken if fewer are free.
  bool allocate(int32_t n, std::vector<int32_t>& out) {
    if (n < 0 || n > free()) return false;
    if (sweep_) {
      sweep(n, out);
      return true;
    }
    for (int32_t i = 0; i < n; ++i) {
      if (!ready_.empty()) {
        out.push_back(ready_.back());
        ready_.pop_back();
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
      if (sweep_) {
        freed_at_[slots[i]] = ++frees_;
        ++block_free_[size_t(slots[i] / kBlock)];
      } else if (fence == 0) ready_.push_back(slots[i]);
      else fenced_.push_back(slots[i]);
    }
    if (sweep_) n_free_ += int32_t(n);
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

  // The invariants below, checked in full (Core::check): "" or what is broken.
  std::string check() const {
    int32_t n = 0;
    for (int32_t s = 0; s < capacity_; ++s) n += is_free_[s];
    if (n != free()) return "the free slots differ from the free count";
    if (!sweep_) return "";
    if (cursor_ < 0 || cursor_ > std::max(extent_, 0) || extent_ > capacity_) return "the cursor or extent is out of range";
    for (int32_t s = extent_; s < capacity_; ++s)
      if (!is_free_[s]) return "a slot past the extent is in use";
    for (size_t b = 0; b < block_free_.size(); ++b) {
      int32_t lo = int32_t(b) * kBlock, hi = std::min(capacity_, lo + kBlock), k = 0;
      for (int32_t s = lo; s < hi; ++s) k += is_free_[s];
      if (k != block_free_[b]) return "a block's free count is wrong";
    }
    return "";
  }

  // Recovery: exactly the slots with `keep[s]` != 0 are in use; the lowest
  // free slots go first.
  void reset_used(const std::vector<uint8_t>& keep) {
    ready_.clear();
    fenced_.clear();
    fresh_.clear();
    n_free_ = 0;
    extent_ = 0;
    std::fill(block_free_.begin(), block_free_.end(), 0);
    for (int32_t s = capacity_ - 1; s >= 0; --s) {
      is_free_[s] = keep[s] ? 0 : 1;
      fence_[s] = 0;
      if (keep[s] && extent_ == 0) extent_ = s + 1;
      if (keep[s]) continue;
      ++n_free_;
      if (sweep_) {
        freed_at_[s] = frees_ - kWindow;                     // free long since
        ++block_free_[size_t(s / kBlock)];
      }
      else fresh_.push_back(s);
    }
    cursor_ = 0;
  }

 private:
  // The disk's order (see the top). Precondition: n <= n_free_.
  void sweep(int32_t n, std::vector<int32_t>& out) {
    const uint32_t window = std::min<uint32_t>(kWindow, uint32_t(n_free_) / 2);
    const int32_t start = cursor_;
    const bool wrap_first = n_free_ - (capacity_ - extent_) >= std::max<int32_t>(kWindow, extent_ / 8);
    skipped_.clear();
    int32_t need = take(start, extent_, n, window, out);     // 1. settled slots, from the cursor on
    if (wrap_first) {
      need = take(0, start, need, window, out);
      need = take(extent_, capacity_, need, 0, out);
    } else {
      need = take(extent_, capacity_, need, 0, out);         // never used: settled
      need = take(0, start, need, window, out);
    }
    // 2. short: the first pass saw every free slot, and skipped these, in its order
    for (size_t i = 0; need > 0; ++i, --need) {
      assert(i < skipped_.size());
      hand_out(skipped_[i], out);
    }
    n_free_ -= n;
  }

  // Free slots of [lo, hi) in order, those freed at least `window` frees ago
  // (0: all), up to `need` of them, handed out; the others seen are noted in
  // skipped_. Returns how many are still needed.
  int32_t take(int32_t lo, int32_t hi, int32_t need, uint32_t window, std::vector<int32_t>& out) {
    const uint8_t* base = is_free_.data();
    int32_t s = lo;
    while (need > 0 && s < hi) {
      int32_t block_end = std::min(hi, (s / kBlock + 1) * kBlock);
      if (block_free_[size_t(s / kBlock)] == 0) {           // a stretch with nothing free
        s = block_end;
        continue;
      }
      const void* hit = std::memchr(base + s, 1, size_t(block_end - s));
      if (hit == nullptr) {
        s = block_end;
        continue;
      }
      s = int32_t(static_cast<const uint8_t*>(hit) - base);
      if (window == 0 || uint32_t(frees_ - freed_at_[s]) >= window) {
        hand_out(s, out);
        --need;
      } else {
        skipped_.push_back(s);
      }
      ++s;
    }
    return need;
  }

  void hand_out(int32_t s, std::vector<int32_t>& out) {
    is_free_[s] = 0;
    --block_free_[size_t(s / kBlock)];
    out.push_back(s);
    cursor_ = s + 1 < capacity_ ? s + 1 : 0;
    extent_ = std::max(extent_, s + 1);
  }

  [[noreturn]] void bad(int32_t s, const int32_t* slots, size_t upto) {
    for (size_t j = 0; j < upto; ++j) is_free_[slots[j]] = 0;   // undo the marks: nothing changed
    throw std::invalid_argument("slot " + std::to_string(s) + " released twice or never allocated");
  }

  int32_t capacity_;
  bool sweep_;                        // the disk's order (a sweep) rather than a stack
  // Invariant: is_free_[s] == 1 exactly for the free slots. A stack keeps each
  // free slot in exactly one of ready_, fresh_ and fenced_; a sweep keeps
  // n_free_ == their count, block_free_[b] == the count in block b, every slot
  // at or past extent_ free, and cursor_ <= extent_. (check() tests them all.)
  std::vector<uint8_t> is_free_;
  std::vector<int32_t> fence_;        // per slot: the event its next owner waits on (0: none)
  // a stack's
  std::vector<int32_t> ready_;        // fence passed or none; the last freed at the back, next out
  std::vector<int32_t> fresh_;        // never handed out since built or recovered: descending
  std::deque<int32_t> fenced_;        // FIFO: fenced by a copy that may still run
  // a sweep's
  std::vector<uint32_t> freed_at_;    // per slot: frees_ when it was freed (wraps after 2^32 frees:
                                      // a slot then looks freed lately, and goes in the second pass)
  uint32_t frees_ = kWindow;          // slots freed so far (from kWindow: a never-used slot is settled)
  std::vector<int32_t> block_free_;   // per kBlock slots: how many are free (a scan skips full blocks)
  std::vector<int32_t> skipped_;      // scratch: the free slots a first pass skipped, in its order
  int32_t n_free_ = 0;
  int32_t cursor_ = 0;                // where the next sweep starts
  int32_t extent_ = 0;                // 1 + the highest slot handed out since built or recovered
};

}  // namespace kvtier
