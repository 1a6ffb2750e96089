// Prioritised LRU over the page table: lowest priority first, then least
// recently used (lowest stamp).
//
// Each priority (0..100) has an intrusive list in ascending stamp order.
// Touching a page gives it the newest stamp, and a page pushed with the newest
// stamp appends: both O(1). A page pushed with an older stamp (a demoted page
// keeps its recency in the colder tier) goes to the priority's side heap
// instead, and pop takes whichever head is older, so the order stays exact.
// Heap entries are validated lazily (the page is still LATE with that stamp).
#pragma once

#include <algorithm>
#include <cassert>
#include <cstddef>
#include <cstdint>
#include <utility>
#include <vector>

#include "page_table.hpp"

namespace kvtier {

constexpr int kPriorities = 101;

class LruQueue {
 public:
  LruQueue(int8_t tier = NO_TIER, uint8_t group = 0) : tier_(tier), group_(group) {}
  size_t size() const { return live_; }

  void push(PageTable& t, int32_t id) {
    Page& p = t[id];
    assert(p.queued == NOT_QUEUED);
    Class& c = classes_[p.priority];
    if (c.tail < 0 || t[c.tail].stamp <= p.stamp) {
      append(t, c, id);
    } else {
      p.queued = LATE;
      c.late.emplace_back(p.stamp, id);
      std::push_heap(c.late.begin(), c.late.end(), std::greater<>());
      ++c.n_late;
    }
    ++live_;
  }

  // `id` (queued) just got the newest stamp.
  void touch(PageTable& t, int32_t id) {
    Page& p = t[id];
    Class& c = classes_[p.priority];
    if (p.queued == IN_ORDER) {
      unlink(t, c, id);
    } else {
      assert(p.queued == LATE);
      --c.n_late;             // its heap entry goes stale (stamp changed)
    }
    append(t, c, id);
    maybe_compact(t, c);
  }

  void remove(PageTable& t, int32_t id) {
    Page& p = t[id];
    if (p.queued == NOT_QUEUED) return;
    Class& c = classes_[p.priority];
    if (p.queued == IN_ORDER) {
      unlink(t, c, id);
    } else {
      --c.n_late;
      maybe_compact(t, c);
    }
    p.queued = NOT_QUEUED;
    --live_;
  }

  // Up to `n` victims, best first, appended to `out` (and unqueued).
  void pop_many(PageTable& t, size_t n, std::vector<int32_t>& out) {
    size_t want = out.size() + n;
    for (int prio = 0; prio < kPriorities && out.size() < want; ++prio) {
      Class& c = classes_[prio];
      while (out.size() < want) {
        int32_t late = late_head(t, c);
        int32_t first = c.head;
        if (late < 0 && first < 0) break;
        int32_t id;
        if (late < 0 || (first >= 0 && t[first].stamp <= t[late].stamp)) {
          id = first;
          unlink(t, c, id);
        } else {
          id = late;
          std::pop_heap(c.late.begin(), c.late.end(), std::greater<>());
          c.late.pop_back();
          --c.n_late;
        }
        t[id].queued = NOT_QUEUED;
        --live_;
        out.push_back(id);
      }
    }
  }

 private:
  struct Class {
    int32_t head = -1, tail = -1;                       // IN_ORDER list, ascending stamp
    std::vector<std::pair<int64_t, int32_t>> late;      // min-heap of (stamp, page); stale entries allowed
    size_t n_late = 0;                                  // pages LATE in this class (valid entries)
  };

  // A stale entry may name a page that left (or a recycled id now queued
  // elsewhere with the same stamp): valid only if still LATE here, unchanged.
  bool valid(const PageTable& t, const std::pair<int64_t, int32_t>& e, int prio) const {
    const Page& p = t[e.second];
    return p.in_use() && p.queued == LATE && p.stamp == e.first && p.tier == tier_ && p.group == group_ &&
           p.priority == prio;
  }

  int32_t late_head(const PageTable& t, Class& c) {
    int prio = int(&c - classes_);
    while (!c.late.empty() && !valid(t, c.late.front(), prio)) {
      std::pop_heap(c.late.begin(), c.late.end(), std::greater<>());
      c.late.pop_back();
    }
    return c.late.empty() ? -1 : c.late.front().second;
  }

  void maybe_compact(const PageTable& t, Class& c) {
    if (c.late.size() <= 64 || c.late.size() <= 2 * c.n_late) return;
    std::vector<std::pair<int64_t, int32_t>> keep;
    keep.reserve(c.n_late);
    int prio = int(&c - classes_);
    for (auto& e : c.late)
      if (valid(t, e, prio)) keep.push_back(e);
    std::sort(keep.begin(), keep.end());
    keep.erase(std::unique(keep.begin(), keep.end()), keep.end());   // a page re-pushed with one stamp
    std::make_heap(keep.begin(), keep.end(), std::greater<>());
    c.late.swap(keep);
  }

  void append(PageTable& t, Class& c, int32_t id) {
    Page& p = t[id];
    p.queued = IN_ORDER;
    p.prev = c.tail;
    p.next = -1;
    if (c.tail >= 0) t[c.tail].next = id; else c.head = id;
    c.tail = id;
  }

  void unlink(PageTable& t, Class& c, int32_t id) {
    Page& p = t[id];
    if (p.prev >= 0) t[p.prev].next = p.next; else c.head = p.next;
    if (p.next >= 0) t[p.next].prev = p.prev; else c.tail = p.prev;
    p.prev = p.next = -1;
  }

  int8_t tier_;
  uint8_t group_;
  Class classes_[kPriorities];
  size_t live_ = 0;
};

}  // namespace kvtier
