// The page table: one record per (block, life cycle) page, in a flat array.
//
// A page id indexes `pages`. Ids are recycled through a free list once a page
// is dead and nothing refers to it any more: no sequence row (holders), no
// lock and no claim. That is what lets sequence rows and in-flight batches
// hold bare ids across awaits.
#pragma once

#include <algorithm>
#include <cassert>
#include <cstddef>
#include <cstdint>
#include <vector>

namespace kvtier {

enum Tier : int8_t { GPU = 0, HOST = 1, DISK = 2, NO_TIER = -1 };
constexpr int kTiers = 3;

// A page shared by this many sequences is not matched by one more (its
// counters are 16 bits): the newcomer's match stops before that block.
constexpr uint16_t kMaxHolders = 65535;

enum Queued : uint8_t { NOT_QUEUED = 0, IN_ORDER = 1, LATE = 2 };

// 40 bytes: the page table is most of the core's memory per page.
struct Page {
  int64_t stamp = 0;        // recency: a rising clock, larger = more recent
  int32_t block = -1;       // the block it belongs to (-1: none)
  int32_t slot = -1;        // its slot in (tier, group)
  int32_t prev = -1;        // LRU links while IN_ORDER in its queue
  int32_t next = -1;
  int32_t claim = 0;        // the in-flight operation holding it (0: none) = "moving"
  int32_t ready = 0;        // event of the last copy that wrote it (0: none)
  uint16_t locks = 0;       // active sequences that need it on the GPU (LOCKED); locks <= holders
  uint16_t holders = 0;     // sequence rows that refer to it (HELD); at most kMaxHolders
  uint8_t lc : 7;           // life cycle, 0..126
  bool copy_ready : 1;      // write-through: its bytes are final (published unlocked, or released since)
  uint8_t group = 0;
  uint8_t priority : 7;     // 0..100
  bool copy : 1;            // a clean copy (write-through): the index names another page of its block, the
                            // primary; never held, locked or published; it is in the disk queue unless claimed
  int8_t tier : 3;          // GPU, HOST, DISK; NO_TIER while the id is on the free list
  uint8_t queued : 2;       // NOT_QUEUED, IN_ORDER, LATE
  bool published : 1;       // indexed for reuse
  bool dead : 1;            // left the store; its slot is freed once no claim holds it
  bool relabel : 1;         // published while claimed: relabel its journal record if it ends on disk
  Page() : lc(0), copy_ready(false), priority(0), copy(false), tier(NO_TIER), queued(NOT_QUEUED), published(false), dead(false), relabel(false) {}
  bool in_use() const { return tier != NO_TIER; }
};
static_assert(sizeof(Page) == 40, "the page record grew");

class PageTable {
 public:
  std::vector<Page> pages;

  int32_t create() {
    int32_t id;
    if (!free_.empty()) {
      id = free_.back();
      free_.pop_back();
      pages[id] = Page();
    } else {
      id = int32_t(pages.size());
      pages.emplace_back();
    }
    ++live_;
    return id;
  }

  // Invariant: only a dead page with no holders, locks or claim is recycled.
  bool recyclable(int32_t id) const {
    const Page& p = pages[id];
    return p.in_use() && p.dead && p.holders == 0 && p.locks == 0 && p.claim == 0;
  }

  void recycle(int32_t id) {
    pages[id].tier = NO_TIER;
    free_.push_back(id);
    --live_;
  }

  void reserve(size_t n) { pages.reserve(n); free_.reserve(n / 8); }

  // Writes the first n reserved entries once (at construction, before any page exists), so that
  // the requests that fill the table do not take the page faults: a first write to fresh memory
  // faults once per 4 KiB, several microseconds each on a VM, which made an extend of 24 blocks
  // 3x slower in a fresh store than in one whose memory was reused.
  void prefault(size_t n) {
    assert(pages.empty());
    pages.resize(std::min(n, pages.capacity()));
    pages.clear();          // the capacity, and the memory written, stay
  }
  size_t live() const { return live_; }

  Page& operator[](int32_t id) { return pages[id]; }
  const Page& operator[](int32_t id) const { return pages[id]; }

 private:
  std::vector<int32_t> free_;
  size_t live_ = 0;
};

}  // namespace kvtier
