// The KV event log: what each tier starts and stops holding, for KV-aware
// routers (vLLM's BlockStored / BlockRemoved, see runtime/events.py).
//
// "A tier holds a block's page" means: the page is published (indexed for
// reuse) and lives in that tier, or a clean copy of it does (write-through).
// The core appends one entry whenever that changes: a commit publishes, a
// move lands (removed from the source tier, stored in the destination; a
// promotion that keeps its cold slot as a copy is not removed there), a copy
// lands or leaves, a drop or a subtree drop unpublishes (its copies leave), a
// demotion onto a copy leaves its tier (the copy's tier held the block
// already), recovery publishes on disk. Python drains the log in batches; it
// costs nothing when off (one predictable branch per change).
//
// Invariants:
// - entries are in the order the changes happened; replaying them gives, per
//   (tier, life cycle), exactly the set of block hashes of the published
//   pages and live clean copies there (a block is in one tier or several);
// - a STORED entry's `token_at` indexes `tokens` (tpb tokens) or is -1 when
//   the block's tokens are unknown (a block_keys= sequence, a recovered page);
// - a block id's tokens are "known" only while they were written for it: the
//   id is reset (forget) whenever the index creates it anew.
#pragma once

#include <algorithm>
#include <climits>
#include <cstdint>
#include <cstring>
#include <vector>

#include "keys.hpp"

namespace kvtier {

enum KvEventKind : uint8_t { KV_STORED = 0, KV_REMOVED = 1 };

// 24 bytes, laid out as runtime/events.py's EVENT dtype.
struct KvEvent {
  uint64_t hash;            // the block's external hash (external_hash below)
  uint64_t parent_hash;     // its parent's, when has_parent (STORED entries only)
  int32_t token_at;         // first token in KvEventLog::tokens, or -1
  uint8_t kind;             // KvEventKind
  int8_t tier;
  uint8_t lc;
  uint8_t has_parent;
};
static_assert(sizeof(KvEvent) == 24, "runtime/events.py reads this layout");

// A block key's 64-bit hash as routers see it, the same in every process:
// an int key in [0, 2**64) is its own hash (callers that pass their engine's
// block hashes as block_keys= see them unchanged), any other key is mixed
// (splitmix64's finalizer over both halves and the form tag).
inline uint64_t external_hash(const Key& k) {
  uint64_t lo, hi;
  std::memcpy(&lo, k.bytes, 8);
  std::memcpy(&hi, k.bytes + 8, 8);
  if (k.tag == 0 && hi == 0) return lo;
  uint64_t x = lo ^ (hi * 0x9E3779B97F4A7C15ULL) ^ (uint64_t(k.tag) << 56) ^ 0xD6E8FEB86659FD93ULL;
  x ^= x >> 30; x *= 0xBF58476D1CE4E5B9ULL;
  x ^= x >> 27; x *= 0x94D049BB133111EBULL;
  x ^= x >> 31;
  return x;
}

class KvEventLog {
 public:
  bool on = false;
  int32_t tpb = 0;
  std::vector<KvEvent> events;          // [head, size) not yet taken
  size_t head = 0;
  std::vector<int32_t> tokens;          // tpb per STORED entry that has them, from `token_at`

  void forget(int32_t b) {
    if (on && size_t(b) < has_.size()) has_[size_t(b)] = 0;
  }
  // Block b's tokens. Stored in chunks of kChunk blocks, allocated as ids reach them: the
  // table grows without ever moving (no stall at a doubling), and costs nothing with events off.
  void set_tokens(int32_t b, const int32_t* toks) {
    size_t chunk = size_t(b) / kChunk;
    if (chunks_.size() <= chunk) chunks_.resize(chunk + 1);
    if (chunks_[chunk].empty()) chunks_[chunk].resize(kChunk * size_t(tpb));
    if (has_.size() <= size_t(b)) has_.resize((chunk + 1) * kChunk, 0);
    std::memcpy(&chunks_[chunk][(size_t(b) % kChunk) * size_t(tpb)], toks, sizeof(int32_t) * size_t(tpb));
    has_[size_t(b)] = 1;
  }
  bool has_tokens(int32_t b) const { return size_t(b) < has_.size() && has_[size_t(b)]; }
  const int32_t* block_tokens(int32_t b) const {
    return &chunks_[size_t(b) / kChunk][(size_t(b) % kChunk) * size_t(tpb)];
  }

  size_t pending() const { return events.size() - head; }
  // The first n pending entries were taken. Taken entries (and their tokens) are let go
  // once they are half the log, so a log that never empties stays bounded by what is pending.
  void consumed(size_t n) {
    head += n;
    if (head == events.size()) {
      events.clear();
      tokens.clear();
      head = 0;
    } else if (head >= 4096 && head * 2 >= events.size()) {
      size_t first_token = tokens.size();
      for (size_t i = head; i < events.size(); ++i)
        if (events[i].token_at >= 0) { first_token = size_t(events[i].token_at); break; }
      for (size_t i = head; i < events.size(); ++i)
        if (events[i].token_at >= 0) events[i].token_at -= int32_t(first_token);
      events.erase(events.begin(), events.begin() + std::ptrdiff_t(head));
      tokens.erase(tokens.begin(), tokens.begin() + std::ptrdiff_t(first_token));
      head = 0;
    }
  }
  size_t memory_bytes() const {
    size_t n = events.capacity() * sizeof(KvEvent) + tokens.capacity() * sizeof(int32_t) + has_.capacity();
    for (auto& c : chunks_) n += c.capacity() * sizeof(int32_t);
    return n;
  }

  void push(KvEventKind kind, int tier, int lc, int32_t block, const Key& key, const Key* parent) {
    KvEvent e;
    e.hash = external_hash(key);
    e.parent_hash = parent ? external_hash(*parent) : 0;
    e.has_parent = parent != nullptr;
    e.kind = kind;
    e.tier = int8_t(tier);
    e.lc = uint8_t(lc);
    e.token_at = -1;
    // token_at is 32-bit: with the log compacted as it is taken, pending tokens stay far below 2**31
    if (kind == KV_STORED && has_tokens(block) && tokens.size() + size_t(tpb) <= size_t(INT32_MAX)) {
      e.token_at = int32_t(tokens.size());
      const int32_t* t = block_tokens(block);
      tokens.insert(tokens.end(), t, t + tpb);
    }
    events.push_back(e);
  }

 private:
  static constexpr size_t kChunk = size_t(1) << 16;
  std::vector<std::vector<int32_t>> chunks_;   // block tokens, kChunk blocks per chunk
  std::vector<uint8_t> has_;                   // per block id: its tokens are known
};

}  // namespace kvtier
