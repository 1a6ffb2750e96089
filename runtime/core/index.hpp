// The prefix index: blocks in a flat array, children in intrusive sibling
// lists, and an open-addressing map from key to indexed block.
//
// A block is indexed (reusable by later requests) or sequence-local (a
// sequence's block before its commit, or after its prefix was dropped).
// Invariants:
// - `map` holds exactly the indexed blocks, each under its key;
// - an indexed block's parent is indexed and lists it among its children;
//   an unindexed block has no children;
// - a block's id is recycled once `refs` reaches 0, where refs counts its
//   sequence rows, the live pages that name it, and 1 while indexed.
#pragma once

#include <algorithm>
#include <cassert>
#include <stdexcept>
#include <cstddef>
#include <cstdint>
#include <vector>

#include "keys.hpp"

namespace kvtier {

// 44 bytes.
struct Block {
  Key key{};
  bool indexed = false;
  bool has_key = false;         // a block extended before its tokens were known has none yet
  bool in_use = false;
  int32_t parent = -1;
  int32_t first_child = -1;     // newest child first
  int32_t next_sibling = -1;    // the siblings form a doubly linked list: unlinking is O(1)
  int32_t prev_sibling = -1;
  int32_t depth = 0;            // index of the block in its sequence
  int32_t refs = 0;
};
static_assert(sizeof(Block) == 44, "the block record grew");

class BlockIndex {
 public:
  explicit BlockIndex(int n_lcs) : n_lcs_(n_lcs) { rehash(1024); }

  std::vector<Block> blocks;
  std::vector<int32_t> pages;   // blocks.size() * n_lcs: the block's page per life cycle (-1: none)

  int n_lcs() const { return n_lcs_; }
  size_t indexed_count() const { return count_; }
  int32_t& page(int32_t b, int lc) { return pages[size_t(b) * n_lcs_ + lc]; }
  int32_t page(int32_t b, int lc) const { return pages[size_t(b) * n_lcs_ + lc]; }

  int32_t create(int32_t parent, int32_t depth) {
    int32_t id;
    if (!free_.empty()) {
      id = free_.back();
      free_.pop_back();
      blocks[id] = Block();
      for (int lc = 0; lc < n_lcs_; ++lc) page(id, lc) = -1;
    } else {
      if (blocks.size() >= kMaxBlocks) throw std::length_error("the prefix index is full (2**26 blocks)");
      id = int32_t(blocks.size());
      blocks.emplace_back();
      pages.insert(pages.end(), n_lcs_, -1);
    }
    Block& b = blocks[id];
    b.parent = parent;
    b.depth = depth;
    b.in_use = true;
    return id;
  }

  void ref(int32_t b) { ++blocks[b].refs; }
  void unref(int32_t b) {
    Block& x = blocks[b];
    assert(x.refs > 0);
    if (--x.refs == 0) {
      assert(!x.indexed);
      x.in_use = false;
      free_.push_back(b);
    }
  }

  int32_t find(const Key& k) const {
    uint64_t h = k.hash();
    uint32_t fp = fingerprint(h);
    size_t mask = table_.size() - 1;
    for (size_t i = h & mask;; i = (i + 1) & mask) {
      uint32_t e = table_[i];
      if (e == kEmpty) return -1;
      if ((e >> kIdBits) == fp && blocks[e & kIdMask].key == k) return int32_t(e & kIdMask);
    }
  }

  // Index block `b` (its key set, not indexed yet) under its parent.
  void insert(int32_t b) {
    Block& x = blocks[b];
    assert(!x.indexed && x.has_key && find(x.key) < 0);     // (debug builds: the caller's promise)
    x.indexed = true;
    ++x.refs;
    if ((count_ + 1) * 4 > table_.size() * 3) rehash(table_.size() * 2);
    place(b, x.key.hash());
    ++count_;
    if (x.parent >= 0) {
      Block& p = blocks[x.parent];
      x.next_sibling = p.first_child;
      x.prev_sibling = -1;
      if (p.first_child >= 0) blocks[p.first_child].prev_sibling = b;
      p.first_child = b;
    }
  }

  // Take `b` out of the index (and out of its parent's children); it keeps
  // its parent link, loses its children links. The caller unrefs it after.
  void erase(int32_t b) {
    Block& x = blocks[b];
    assert(x.indexed);
    x.indexed = false;
    size_t mask = table_.size() - 1;
    size_t i = x.key.hash() & mask;
    while ((table_[i] & kIdMask) != uint32_t(b) || table_[i] == kEmpty) {
      assert(table_[i] != kEmpty);
      i = (i + 1) & mask;
    }
    // backward-shift deletion: no tombstones, probes stay short
    size_t j = i;
    for (;;) {
      j = (j + 1) & mask;
      uint32_t c = table_[j];
      if (c == kEmpty) break;
      size_t home = blocks[c & kIdMask].key.hash() & mask;
      bool movable = (j > i) ? (home <= i || home > j) : (home <= i && home > j);
      if (movable) {
        table_[i] = c;
        i = j;
      }
    }
    table_[i] = kEmpty;
    --count_;
    if (x.parent >= 0 && blocks[x.parent].indexed) {   // an unindexed parent has let go of its children
      if (x.prev_sibling >= 0) blocks[x.prev_sibling].next_sibling = x.next_sibling;
      else blocks[x.parent].first_child = x.next_sibling;
      if (x.next_sibling >= 0) blocks[x.next_sibling].prev_sibling = x.prev_sibling;
    }
    x.next_sibling = x.prev_sibling = -1;
    x.first_child = -1;
  }

  template <class F>
  void for_each_indexed(F f) const {
    for (uint32_t e : table_)
      if (e != kEmpty) f(int32_t(e & kIdMask));
  }

  size_t table_bytes() const { return table_.capacity() * sizeof(uint32_t); }

  // Room for n blocks without reallocating (address space only, but see prefault).
  void reserve(size_t n) {
    blocks.reserve(n);
    pages.reserve(n * size_t(n_lcs_));
  }

  // PageTable::prefault for the block tables: the first n blocks' entries (and their pages per
  // life cycle) written once, before any block exists.
  void prefault(size_t n) {
    assert(blocks.empty() && pages.empty());
    blocks.resize(std::min(n, blocks.capacity()));
    blocks.clear();
    pages.resize(std::min(n * size_t(n_lcs_), pages.capacity()));
    pages.clear();
  }

  // A map that holds n keys without rehashing (4 bytes per entry, touched now): growing
  // by doubling would rehash every key on the way, each a cache miss on its block.
  void presize(size_t n) {
    size_t want = table_.size();
    while (n * 4 > want * 3) want *= 2;
    if (want > table_.size()) rehash(want);
  }

 private:
  // A map entry: the block id in the low kIdBits, 6 bits of its key's hash
  // above (not the bits that pick the bucket), so a probe rarely reads a
  // block's key that cannot match (each such read is a cache miss).
  static constexpr int kIdBits = 26;
  static constexpr uint32_t kIdMask = (uint32_t(1) << kIdBits) - 1;
  static constexpr uint32_t kEmpty = ~uint32_t(0);
  static constexpr size_t kMaxBlocks = kIdMask;        // kIdMask itself would read as empty with fp 63

  static uint32_t fingerprint(uint64_t h) { return uint32_t(h >> 58); }

  void place(int32_t b, uint64_t h) {
    size_t mask = table_.size() - 1;
    size_t i = h & mask;
    while (table_[i] != kEmpty) i = (i + 1) & mask;
    table_[i] = uint32_t(b) | (fingerprint(h) << kIdBits);
  }

  void rehash(size_t n) {
    std::vector<uint32_t> old;
    old.swap(table_);
    table_.assign(n, kEmpty);
    for (uint32_t e : old)
      if (e != kEmpty) place(int32_t(e & kIdMask), blocks[e & kIdMask].key.hash());
  }

  int n_lcs_;
  std::vector<uint32_t> table_;  // open addressing, linear probing; kEmpty or (fingerprint, id); load <= 3/4
  size_t count_ = 0;
  std::vector<int32_t> free_;
};

}  // namespace kvtier
