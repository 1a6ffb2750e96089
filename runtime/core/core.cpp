// The core's decisions. Each one mirrors the pure-Python model
// (runtime/model.py) step for step: the differential tests hold the two to
// identical slots, stamps, victims and drops.
#include "core.hpp"

#include <algorithm>
#include <climits>
#include <cstring>
#include <unordered_map>
#include <unordered_set>

namespace kvtier {

namespace {
constexpr int32_t kNoSole = INT32_MIN;

void require(bool ok, const char* what) {
  if (!ok) throw CoreError(what);
}
}  // namespace

Core::Core(int32_t tokens_per_block, std::vector<LifeCycle> lcs, std::vector<std::vector<int32_t>> group_of,
           std::vector<std::vector<int32_t>> capacity, size_t prefault_pages)
    : tpb_(tokens_per_block), lcs_(std::move(lcs)), group_of_(std::move(group_of)), index_(int(lcs_.size())) {
  require(tpb_ > 0, "tokens_per_block must be positive");
  require(!lcs_.empty() && lcs_.size() < 128, "1..127 life cycles");
  require(group_of_.size() == kTiers && capacity.size() == kTiers, "group_of and capacity need a row per tier");
  require(!capacity[GPU].empty(), "the GPU tier needs a pool group");
  int prev = -1;
  size_t total_slots = 0, warm_slots = 0;     // all tiers'; the GPU and host tiers'
  for (int t = 0; t < kTiers; ++t) {
    require(group_of_[t].size() == lcs_.size(), "group_of needs a group per life cycle");
    require(capacity[t].size() < 256, "at most 255 pool groups per tier");
    allocs_.emplace_back();
    queues_.emplace_back();
    owners_.emplace_back();
    hit_pages_.emplace_back(capacity[t].size(), 0);
    for (size_t g = 0; g < capacity[t].size(); ++g) {
      require(capacity[t][g] >= 0, "a capacity must not be negative");
      allocs_[t].emplace_back(capacity[t][g], t == DISK);    // disk: a sweep (allocator.hpp)
      queues_[t].emplace_back(int8_t(t), uint8_t(g));
      owners_[t].emplace_back(size_t(capacity[t][g]), -1);
      total_slots += size_t(capacity[t][g]);
      if (t != DISK) warm_slots += size_t(capacity[t][g]);
    }
    if (!capacity[t].empty()) {
      for (int32_t g : group_of_[t]) require(g >= 0 && size_t(g) < capacity[t].size(), "group out of range");
      if (prev >= 0) next_tier_[prev] = t;
      prev = t;
      last_tier_ = t;
    }
    int32_t sole = group_of_[t][0];
    for (int32_t g : group_of_[t])
      if (g != sole) sole = kNoSole;
    sole_group_.push_back(sole);
  }
  bool all_private = true;
  for (size_t i = 0; i < lcs_.size(); ++i) {
    const LifeCycle& lc = lcs_[i];
    if (lc.ssm || lc.window) reads_all_ = false;
    if (lc.reuse != PRIVATE) all_private = false;
    if (lc.limits_match()) limiting_lcs_.push_back(int(i));
  }
  shares_nothing_ = all_private;
  // Every page owns a slot, and every indexed block a page: room for them all up front, so the
  // tables never reallocate (a doubling copy would leave the old copy in the heap).
  pt_.reserve(std::min<size_t>(total_slots, size_t(1) << 26));
  index_.reserve(std::min<size_t>(total_slots, size_t(1) << 26));
  index_.presize(std::min<size_t>(total_slots, size_t(1) << 21));       // at most a 16 MiB map up front
  // and the tables' memory written now for the GPU and host tiers' pages (up to prefault_pages;
  // 88 bytes a page with one life cycle): those tiers fill within seconds of traffic, and a
  // request that grew the tables into fresh memory took the page faults (PageTable::prefault).
  // The disk's pages, which may be many more and fill slowly, are written as they come.
  const size_t warm = std::min(warm_slots, prefault_pages);
  pt_.prefault(warm);
  index_.prefault((warm + lcs_.size() - 1) / lcs_.size());      // a block holds a page per life cycle
}

Seq& Core::live_seq(int32_t s) {
  if (s < 0 || size_t(s) >= seqs_.size() || !seqs_[s].in_use) throw CoreError("no such sequence");
  return seqs_[s];
}

int32_t Core::next_claim() {
  claim_counter_ = claim_counter_ == INT32_MAX ? 1 : claim_counter_ + 1;
  return claim_counter_;
}

// -- page bookkeeping ---------------------------------------------------------------

void Core::set_block(int32_t id, int32_t b) {
  Page& p = pt_[id];
  if (p.block == b) return;
  if (b >= 0) index_.ref(b);
  if (p.block >= 0) index_.unref(p.block);
  p.block = b;
}

int32_t Core::new_page(int32_t block, int lc, int tier, int group, int32_t slot, int priority) {
  int32_t id = pt_.create();
  Page& p = pt_[id];
  p.lc = uint8_t(lc);
  p.tier = int8_t(tier);
  p.group = uint8_t(group);
  p.slot = slot;
  p.priority = uint8_t(priority);
  set_block(id, block);
  owners_[tier][group][slot] = id;
  if (any_write_through() && copy_of_.size() < pt_.pages.size()) copy_of_.resize(pt_.pages.size(), -1);
  return id;
}

void Core::touch(int32_t id) {
  Page& p = pt_[id];
  p.stamp = ++clock_;
  if (p.queued) queues_[p.tier][p.group].touch(pt_, id);
  // a copy is as recent as its primary: the cold tiers keep hot prefixes
  for (int32_t c = copy_of(id); c >= 0; c = copy_of(c)) {
    Page& cp = pt_[c];
    cp.stamp = p.stamp;
    if (cp.queued) queues_[cp.tier][cp.group].touch(pt_, c);
  }
}

void Core::requeue(int32_t id) {
  Page& p = pt_[id];
  bool ev = evictable(p);
  if (p.queued) {
    if (!ev) queues_[p.tier][p.group].remove(pt_, id);
  } else if (ev) {
    queues_[p.tier][p.group].push(pt_, id);
  }
}

void Core::queue_all(const Ids& pages) {
  for (int32_t id : pages) {
    Page& p = pt_[id];
    if (!p.queued && evictable(p)) queues_[p.tier][p.group].push(pt_, id);
  }
}

void Core::release_slot(int tier, int group, int32_t slot, int32_t fence) {
  owners_[tier][group][slot] = -1;
  allocs_[tier][group].release(&slot, 1, fence);
  if (tier == DISK) disk_frees_.push_back({group, Ids{slot}});
}

void Core::note(KvEventKind kind, int32_t id) {
  const Page& p = pt_[id];
  if (p.block < 0) return;
  const Block& x = index_.blocks[p.block];
  if (!x.has_key) return;
  // a REMOVED entry names its block alone (BlockRemoved has no parent): no look at the parent,
  // another block's cache line, for half the entries of a store that moves pages
  const Key* parent = kind == KV_STORED && x.parent >= 0 ? &index_.blocks[x.parent].key : nullptr;
  kv_events_.push(kind, p.tier, p.lc, p.block, x.key, parent);
}

void Core::note_arrivals(const Ids& batch) {
  // Pages of one chain that arrive together are logged parent before child, each followed by
  // a child of its in the batch when it has one, so that routers get one BlockStored per
  // chain rather than one per page (the encoder merges a run of entries each the parent of the
  // next). A table of the batch's (block, lc) finds each page's parent among the batch; each
  // page whose parent is not in it starts a chain, walked depth first through its children.
  // O(batch), scratch arrays kept between calls: this runs for every landed batch.
  const size_t n = batch.size();
  size_t cap = 16;
  while (cap < 2 * n) cap <<= 1;
  const size_t mask = cap - 1;
  auto slot_of = [mask](int32_t block, int lc) {
    uint64_t k = (uint64_t(uint32_t(block)) << 8 | uint64_t(lc)) * 0x9E3779B97F4A7C15ULL;
    return size_t(k >> 32) & mask;
  };
  auto& table = arrival_table_;
  table.assign(cap, -1);
  arrival_child_.assign(n, -1);
  arrival_sibling_.assign(n, -1);
  arrival_has_parent_.assign(n, 0);
  auto logged = [&](const Page& p) { return (p.published || p.copy) && p.block >= 0; };
  for (size_t i = 0; i < n; ++i) {
    const Page& p = pt_[batch[i]];
    if (!logged(p)) continue;
    size_t h = slot_of(p.block, p.lc);
    while (table[h] >= 0) h = (h + 1) & mask;      // linear probing: the table is at least twice the batch
    table[h] = int32_t(i);
  }
  for (size_t i = n; i-- > 0;) {                   // backwards: children listed in batch order
    const Page& p = pt_[batch[i]];
    if (!logged(p)) continue;
    int32_t parent = index_.blocks[p.block].parent;
    if (parent < 0) continue;
    for (size_t h = slot_of(parent, p.lc); table[h] >= 0; h = (h + 1) & mask) {
      const Page& q = pt_[batch[size_t(table[h])]];
      if (q.block == parent && q.lc == p.lc) {
        arrival_sibling_[i] = arrival_child_[size_t(table[h])];
        arrival_child_[size_t(table[h])] = int32_t(i);
        arrival_has_parent_[i] = 1;
        break;
      }
    }
  }
  auto& stack = arrival_stack_;
  for (size_t i = 0; i < n; ++i) {
    if (arrival_has_parent_[i] || !logged(pt_[batch[i]])) continue;
    stack.assign(1, int32_t(i));
    while (!stack.empty()) {
      int32_t at = stack.back();
      stack.pop_back();
      note(KV_STORED, batch[size_t(at)]);
      // the first child next (the chain goes on), its siblings after its subtree
      int32_t c = arrival_child_[size_t(at)];
      size_t mark = stack.size();
      for (; c >= 0; c = arrival_sibling_[size_t(c)]) stack.push_back(c);
      std::reverse(stack.begin() + std::ptrdiff_t(mark), stack.end());
    }
  }
}

void Core::set_tokens(int32_t s, int32_t first, const int32_t* tokens, int32_t n) {
  if (!kv_events_.on) return;
  Seq& q = live_seq(s);
  size_t have = q.tokens.size() / size_t(tpb_);
  if (first < 0 || n < 0 || size_t(first) + size_t(n) > q.keys.size())
    throw CoreError("set_tokens: positions beyond the sequence's keys");
  if (size_t(first) > have) return;       // after a gap (tokens not kept before): none kept from here
  q.tokens.resize(std::max(have, size_t(first) + size_t(n)) * size_t(tpb_));
  std::copy(tokens, tokens + size_t(n) * size_t(tpb_), q.tokens.begin() + std::ptrdiff_t(size_t(first) * size_t(tpb_)));
  // Matched blocks that lack tokens (recovered from disk) get them now, before an acquire
  // moves them: their next STORED entry then carries them.
  for (int32_t i = first; i < first + n && size_t(i) < q.blocks.size(); ++i)
    if (index_.blocks[q.blocks[size_t(i)]].indexed) give_tokens(q, i, q.blocks[size_t(i)]);
}

void Core::free_page(int32_t id, bool release) {
  Page& p = pt_[id];
  if (p.dead) return;
  p.dead = true;
  unqueue(id);
  if (p.block >= 0 && index_.page(p.block, p.lc) == id) index_.page(p.block, p.lc) = -1;
  if (!p.claim && release) release_slot(p.tier, p.group, p.slot, p.ready);
  maybe_recycle(id);
}

void Core::drop(int32_t id, bool release) {
  Page& p = pt_[id];
  if (!p.dead) ++counters_.drops;
  int32_t b = p.block;
  int lc = p.lc;
  unpublish(id);
  if (b < 0) {
    free_page(id, release);
    return;
  }
  index_.ref(b);                      // keep the block while the page (maybe recycled) lets go of it
  free_page(id, release);
  const Block& blk = index_.blocks[b];
  if (blk.indexed && lcs_[lc].prefix_critical(blk.depth, tpb_)) {
    drop_subtree(b);
  } else if (blk.indexed && blk.first_child < 0) {
    bool empty = true;
    for (int l = 0; l < n_lcs(); ++l) empty = empty && index_.page(b, l) < 0;
    if (empty) unindex(b);
  }
  index_.unref(b);
}

void Core::drop_subtree(int32_t root) {
  Ids stack{root};
  Ids kids;
  index_.ref(root);
  Ids pinned{root};
  while (!stack.empty()) {
    int32_t node = stack.back();
    stack.pop_back();
    kids.clear();
    for (int32_t c = index_.blocks[node].first_child; c >= 0; c = index_.blocks[c].next_sibling) kids.push_back(c);
    for (auto it = kids.rbegin(); it != kids.rend(); ++it) {   // oldest first: the newest is popped first
      stack.push_back(*it);
      index_.ref(*it);
      pinned.push_back(*it);
    }
    for (int lc = 0; lc < n_lcs(); ++lc) {
      int32_t q = index_.page(node, lc);
      if (q < 0 || pt_[q].dead) continue;
      unpublish(q);
      if (pt_[q].holders) requeue(q);          // a live sequence keeps it; freed when it closes
      else free_page(q);
    }
    unindex(node);
  }
  for (int32_t b : pinned) index_.unref(b);
}

void Core::unindex(int32_t b) {
  Block& x = index_.blocks[b];
  if (!x.indexed) return;
  // children are unindexed by the caller's traversal (drop_subtree) or there are none
  for (int32_t c = x.first_child; c >= 0;) {
    int32_t nxt = index_.blocks[c].next_sibling;
    index_.blocks[c].next_sibling = index_.blocks[c].prev_sibling = -1;
    c = nxt;
  }
  x.first_child = -1;
  index_.erase(b);
  index_.unref(b);
}

// -- sequences -----------------------------------------------------------------------

OpenResult Core::open_seq(std::vector<Key> keys, int priority) {
  if (priority < 0 || priority >= kPriorities) throw std::invalid_argument("priority must be in 0..100");
  int32_t s;
  if (!free_seqs_.empty()) {
    s = free_seqs_.back();
    free_seqs_.pop_back();
  } else {
    s = int32_t(seqs_.size());
    seqs_.emplace_back();
  }
  Seq& q = seqs_[s];
  q.in_use = true;
  q.priority = uint8_t(priority);
  OpenResult r{s, 0, {0, 0, 0, 0}};
  counters_.lookup_blocks += int64_t(keys.size());
  if (!shares_nothing_) {
    Ids& path = open_path_;
    path.clear();
    int32_t parent = -1;
    for (size_t i = 0; i < keys.size(); ++i) {
      int32_t b = index_.find(keys[i]);
      if (b < 0 || index_.blocks[b].parent != parent || index_.blocks[b].depth != int32_t(i)) break;
      bool saturated = false;
      for (int lc = 0; lc < n_lcs(); ++lc) {
        int32_t id = index_.page(b, lc);
        saturated = saturated || (id >= 0 && pt_[id].holders >= kMaxHolders);
      }
      if (saturated) break;
      path.push_back(b);
      parent = b;
    }
    int32_t k = int32_t(path.size());
    while (k > 0 && !reusable(path, k)) --k;
    path.resize(size_t(k));
    Ids& held = open_held_;
    held.clear();
    int n = n_lcs();
    q.blocks.reserve(keys.size());
    q.pages.reserve(keys.size() * size_t(n));
    q.recompute.reserve(keys.size() * size_t(n));
    for (int32_t b : path) {
      q.blocks.push_back(b);
      index_.ref(b);
      int coldest = -1;
      for (int lc = 0; lc < n; ++lc) {
        int32_t id = index_.page(b, lc);
        if (id >= 0 && (pt_[id].dead || !pt_[id].published)) id = -1;
        q.pages.push_back(id);
        q.recompute.push_back(0);
        if (id < 0) continue;
        Page& p = pt_[id];
        ++p.holders;
        ++hit_pages_[size_t(p.tier)][size_t(p.group)];
        if (p.tier == last_tier_) requeue(id);      // a held page leaves the last tier's drop queue
        held.push_back(id);
        coldest = std::max(coldest, int(p.tier));
      }
      ++r.by_tier[coldest < 0 ? 3 : coldest];
    }
    q.committed = k;
    r.matched = k;
    for (auto it = held.rbegin(); it != held.rend(); ++it) touch(*it);
  }
  for (int t = 0; t < kTiers; ++t) counters_.hits[t] += r.by_tier[t];
  q.keys = std::move(keys);
  return r;
}

bool Core::reusable(const Ids& path, int32_t k) const {
  int64_t h = int64_t(k) * tpb_;
  std::vector<int32_t>& req = scratch_;
  for (int lc : limiting_lcs_) {
    lcs_[lc].required_blocks(h, tpb_, req);
    for (int32_t b : req) {
      int32_t id = index_.page(path[b], lc);
      if (id < 0 || pt_[id].dead) return false;
    }
  }
  return true;
}

void Core::append_keys(int32_t s, const std::vector<Key>& keys) {
  Seq& q = live_seq(s);
  q.keys.insert(q.keys.end(), keys.begin(), keys.end());
}

void Core::close_seq(int32_t s) {
  Seq& q = live_seq(s);
  release(s, 0);
  int n = n_lcs();
  Ids unheld;
  for (size_t i = q.blocks.size(); i-- > 0;) {            // deepest (oldest stamp) first
    for (int lc = 0; lc < n; ++lc) {
      int32_t id = q.pages[i * n + lc];
      if (id < 0) continue;
      Page& p = pt_[id];
      --p.holders;
      if (p.dead) {
        maybe_recycle(id);
      } else if (!p.published) {
        if (!p.holders) free_page(id);                     // else another sequence still holds it
      } else if (p.tier == last_tier_) {                  // holders only gate the last tier's queue
        unheld.push_back(id);
      }
    }
  }
  queue_all(unheld);
  for (int32_t b : q.blocks) index_.unref(b);
  q.reset();
  free_seqs_.push_back(s);
}

Ids Core::place_extension(int32_t s, int32_t n, std::vector<Ids>& slots) {
  Seq& q = live_seq(s);
  int nl = n_lcs();
  int32_t start = int32_t(q.blocks.size());
  uint16_t locks = q.acquired ? 1 : 0;
  int64_t stamp = clock_ + int64_t(n) * nl;      // stamped as a touch of the new blocks deepest first would
  clock_ = stamp;
  Ids fences;
  int32_t parent = start ? q.blocks[start - 1] : -1;
  size_t first_cell = q.pages.size();
  for (int32_t i = start; i < start + n; ++i) {
    int32_t b = index_.create(parent, i);
    kv_events_.forget(b);
    Block& blk = index_.blocks[b];
    if (size_t(i) < q.keys.size()) {
      blk.key = q.keys[i];
      blk.has_key = true;
    }
    index_.ref(b);                                // the sequence's row
    q.blocks.push_back(b);
    stamp -= nl;
    for (int lc = 0; lc < nl; ++lc) {
      int32_t g = group_of_[GPU][lc];
      Ids& mine = slots[g];
      require(!mine.empty(), "place_extension: too few slots");
      int32_t slot = mine.back();
      mine.pop_back();
      require(slot >= 0 && slot < allocs_[GPU][g].capacity() && !allocs_[GPU][g].is_free(slot) &&
                  owners_[GPU][g][slot] < 0,
              "place_extension: a slot that is not allocated, or owned");
      int32_t f = allocs_[GPU][g].fence(slot);
      if (f) fences.push_back(f);
      int32_t id = new_page(b, lc, GPU, g, slot, q.priority);
      Page& p = pt_[id];
      p.holders = 1;
      p.locks = locks;
      p.stamp = stamp + lc + 1;
      index_.page(b, lc) = id;
      q.pages.push_back(id);
      q.recompute.push_back(0);
    }
    parent = b;
  }
  if (locks) {
    q.locked.insert(q.locked.end(), q.pages.begin() + first_cell, q.pages.end());
  } else {                                        // oldest stamp first: the queue's cheap path
    Ids fresh;
    for (size_t i = q.pages.size(); i > first_cell; i -= nl)
      for (int lc = 0; lc < nl; ++lc) fresh.push_back(q.pages[i - nl + lc]);
    queue_all(fresh);
  }
  std::sort(fences.begin(), fences.end());
  fences.erase(std::unique(fences.begin(), fences.end()), fences.end());
  return fences;
}

bool Core::extend_now(int32_t s, int32_t n, Ids& fences) {
  live_seq(s);
  std::vector<int32_t>& need = ext_need_;
  need.assign(allocs_[GPU].size(), 0);
  for (int lc = 0; lc < n_lcs(); ++lc) need[group_of_[GPU][lc]] += n;
  for (size_t g = 0; g < need.size(); ++g)
    if (need[g] > allocs_[GPU][g].free()) return false;
  std::vector<Ids>& slots = ext_slots_;
  slots.resize(need.size());
  for (size_t g = 0; g < need.size(); ++g) {
    slots[g].clear();
    if (need[g]) allocs_[GPU][g].allocate(need[g], slots[g]);
  }
  fences = place_extension(s, n, slots);
  return true;
}

void Core::undo_extend(int32_t s, int32_t n) {
  Seq& q = live_seq(s);
  int nl = n_lcs();
  int32_t k = std::min<int32_t>(n, int32_t(q.blocks.size()) - q.committed);
  for (int32_t j = 0; j < k; ++j) {
    size_t i = q.blocks.size() - 1;
    for (int lc = 0; lc < nl; ++lc) {
      int32_t id = q.pages[i * nl + lc];
      if (id < 0) continue;
      --pt_[id].holders;
      if (pt_[id].dead) maybe_recycle(id);
      else if (!pt_[id].holders) free_page(id);
    }
    q.pages.resize(i * nl);
    q.recompute.resize(i * nl);
    index_.unref(q.blocks.back());
    q.blocks.pop_back();
  }
}

void Core::needed(const Seq& q, std::vector<std::pair<int32_t, int32_t>>& out) const {
  out.clear();
  int32_t n = int32_t(q.blocks.size());
  int nl = n_lcs();
  if (reads_all_) {
    for (int32_t b = n - 1; b >= 0; --b)
      for (int lc = nl - 1; lc >= 0; --lc) out.push_back({b, lc});
    return;
  }
  int64_t h = int64_t(n) * tpb_;
  std::vector<int32_t>& bl = scratch_;
  for (int lc = 0; lc < nl; ++lc) {
    lcs_[lc].needed_blocks(h, tpb_, bl);
    for (int32_t b : bl) out.push_back({b, lc});
    for (int32_t b = q.committed; b < n; ++b) out.push_back({b, lc});
  }
  std::sort(out.begin(), out.end(), std::greater<>());
  out.erase(std::unique(out.begin(), out.end()), out.end());
}

bool Core::acquire_now(int32_t s) {
  Seq& q = live_seq(s);
  require(!q.acquired, "sequence is already acquired");
  Ids pages = needed_pages(q);
  for (int32_t id : pages)
    if (id < 0 || pt_[id].dead || pt_[id].tier != GPU || pt_[id].claim > 0) return false;
  lock(pages);
  for (int32_t id : pages) touch(id);
  q.acquired = true;
  q.locked = std::move(pages);
  return true;
}

void Core::acquire_scan(int32_t s, Ids& holes, Ids& claims) {
  Seq& q = live_seq(s);
  require(!q.acquired, "sequence is already acquired");
  std::vector<std::pair<int32_t, int32_t>> need;
  needed(q, need);
  int nl = n_lcs();
  holes.clear();
  claims.clear();
  for (auto [b, lc] : need) {
    int32_t id = q.pages[size_t(b) * nl + lc];
    if (id < 0 || pt_[id].dead) {
      holes.push_back(b);
      holes.push_back(lc);
    }
  }
  if (!holes.empty()) return;
  for (auto [b, lc] : need) {
    const Page& p = pt_[q.pages[size_t(b) * nl + lc]];
    int32_t c = p.claim;
    if (c < 0 && p.tier == GPU) continue;       // a copy reads it in place: it can be locked meanwhile
    if (c && std::find(claims.begin(), claims.end(), c) == claims.end()) claims.push_back(c);
  }
}

Ids Core::fill_holes(int32_t s, const Ids& holes, std::vector<Ids>& slots) {
  Seq& q = live_seq(s);
  int nl = n_lcs();
  Ids fences;
  int32_t first_critical = INT32_MAX;      // the first refilled block whose page the prefix needed
  for (size_t i = 0; i + 1 < holes.size(); i += 2) {
    int32_t b = holes[i], lc = holes[i + 1];
    require(b >= 0 && size_t(b) < q.blocks.size() && lc >= 0 && lc < nl, "fill_holes: bad hole");
    if (lcs_[lc].prefix_critical(b, tpb_)) first_critical = std::min(first_critical, b);
    int32_t g = group_of_[GPU][lc];
    require(!slots[g].empty(), "fill_holes: too few slots");
    int32_t slot = slots[g].back();
    slots[g].pop_back();
    require(slot >= 0 && slot < allocs_[GPU][g].capacity() && !allocs_[GPU][g].is_free(slot) &&
                owners_[GPU][g][slot] < 0,
            "fill_holes: a slot that is not allocated, or owned");
    fences.push_back(allocs_[GPU][g].fence(slot));
    size_t cell = size_t(b) * nl + lc;
    int32_t old = q.pages[cell];
    int32_t id = new_page(q.blocks[b], lc, GPU, g, slot, q.priority);
    pt_[id].holders = 1;
    requeue(id);
    q.pages[cell] = id;
    q.recompute[cell] = 1;
    if (old >= 0) {                       // a dead page the row still named
      --pt_[old].holders;
      maybe_recycle(old);
    }
  }
  // An engine recomputes a suffix: from a lost prefix-critical page on, every matched block's pages
  // are rewritten (their bytes stay valid meanwhile), as after a failed load in vLLM's connector.
  for (int32_t b = first_critical; b < q.committed; ++b)
    for (int lc = 0; lc < nl; ++lc)
      if (q.pages[size_t(b) * nl + lc] >= 0) q.recompute[size_t(b) * nl + lc] = 1;
  std::sort(fences.begin(), fences.end());
  fences.erase(std::unique(fences.begin(), fences.end()), fences.end());
  if (!fences.empty() && fences.front() == 0) fences.erase(fences.begin());
  return fences;
}

Ids Core::lock_needed(int32_t s) {
  Ids pages = needed_pages(live_seq(s));
  for (int32_t id : pages) require(id >= 0 && !pt_[id].dead, "lock_needed: a needed page is missing");
  lock(pages);
  return pages;
}

void Core::lock(const Ids& pages) {
  for (int32_t id : pages) {
    ++pt_[id].locks;
    unqueue(id);
  }
}

void Core::finish_acquire(int32_t s, const Ids& pages) {
  Seq& q = live_seq(s);
  for (int32_t id : pages) touch(id);
  q.acquired = true;
  q.locked = pages;
}

void Core::unlock(const Ids& pages) {
  for (int32_t id : pages) {
    Page& p = pt_[id];
    --p.locks;
    if (!p.dead) requeue(id); else maybe_recycle(id);
  }
}

void Core::undo_acquire(int32_t s, const Ids& pages) {
  Seq& q = live_seq(s);
  q.acquired = false;
  q.locked.clear();
  unlock(pages);
}

void Core::release(int32_t s, int32_t event) {
  Seq& q = live_seq(s);
  if (!q.acquired) return;
  q.acquired = false;
  Ids& locked = q.locked;                 // emptied at the end (keeping its room)
  auto older = [&](int32_t a, int32_t b) { return pt_[a].stamp < pt_[b].stamp; };
  if (locked.size() <= 64) {              // stable, and without stable_sort's buffer allocation
    for (size_t i = 1; i < locked.size(); ++i) {
      int32_t id = locked[i];
      size_t j = i;
      for (; j > 0 && older(id, locked[j - 1]); --j) locked[j] = locked[j - 1];
      locked[j] = id;
    }
  } else {
    std::stable_sort(locked.begin(), locked.end(), older);
  }
  for (int32_t id : locked) {
    Page& p = pt_[id];
    if (event && p.tier == GPU) p.ready = event;
    --p.locks;
    // write-through: a published page's bytes are final once a sequence that held it releases it
    if (any_write_through() && p.published && !p.dead) {
      p.copy_ready = true;
      queue_copy(id);
    }
  }
  queue_all(locked);
  for (int32_t id : locked) maybe_recycle(id);
  locked.clear();
}

Ids Core::needed_pages(const Seq& q) const {
  std::vector<std::pair<int32_t, int32_t>> need;
  needed(q, need);
  Ids out;
  out.reserve(need.size());
  int nl = n_lcs();
  for (auto [b, lc] : need) out.push_back(q.pages[size_t(b) * nl + lc]);
  return out;
}

Ids Core::ready_events(int32_t s) {
  Ids out;
  for (int32_t id : needed_pages(live_seq(s)))
    if (id >= 0 && pt_[id].ready) out.push_back(pt_[id].ready);
  std::sort(out.begin(), out.end());
  out.erase(std::unique(out.begin(), out.end()), out.end());
  return out;
}

Ids Core::prefetch_pages(int32_t s) {
  Ids out;
  for (int32_t id : needed_pages(live_seq(s)))
    if (id >= 0 && !pt_[id].dead && pt_[id].tier != GPU && !pt_[id].claim) out.push_back(id);
  return out;
}

// -- commit ------------------------------------------------------------------------------

int32_t Core::commit_conflict(int32_t s, int32_t n, bool& all_new) {
  Seq& q = live_seq(s);
  require(n <= int32_t(q.blocks.size()) && n <= int32_t(q.keys.size()), "commit past the sequence's blocks or keys");
  all_new = false;
  if (n <= q.committed) return -1;
  // the common case: every key new, none repeated (equal hashes take the exact walk below)
  bool known = false;
  for (int32_t i = q.committed; i < n && !known; ++i) known = index_.find(q.keys[i]) >= 0;
  if (!known) {
    std::vector<uint64_t>& hashes = commit_hashes_;
    hashes.clear();
    for (int32_t i = q.committed; i < n; ++i) hashes.push_back(q.keys[i].hash());
    std::sort(hashes.begin(), hashes.end());
    if (std::adjacent_find(hashes.begin(), hashes.end()) == hashes.end()) {
      all_new = true;
      return -1;
    }
  }
  struct KeyHash {
    size_t operator()(const Key& k) const { return size_t(k.hash()); }
  };
  int32_t parent = q.committed ? q.blocks[q.committed - 1] : -1;
  std::unordered_set<Key, KeyHash> new_keys;
  std::unordered_set<int32_t> new_blocks;
  for (int32_t i = q.committed; i < n; ++i) {
    if (parent >= 0 && !index_.blocks[parent].indexed && !new_blocks.count(parent)) return -1;   // the commit stops there
    const Key& key = q.keys[i];
    int32_t node = index_.find(key);
    if (new_keys.count(key) || (node >= 0 && (index_.blocks[node].parent != parent || index_.blocks[node].depth != i)))
      return i;
    if (node < 0) {
      parent = q.blocks[i];
      new_keys.insert(key);
      new_blocks.insert(parent);
    } else {
      parent = node;
    }
  }
  return -1;
}

void Core::published_cold(int32_t id) {
  Page& p = pt_[id];
  if (p.claim) p.relabel = true;
  else if (p.tier == DISK) relabels_.push_back(id);
}

void Core::adopt(int32_t node, int32_t s, int32_t i) {
  Seq& q = seqs_[s];
  int nl = n_lcs();
  for (int lc = 0; lc < nl; ++lc) {
    size_t cell = size_t(i) * nl + lc;
    int32_t id = q.pages[cell];
    if (id < 0) continue;
    Page& p = pt_[id];
    if (p.dead || p.published || lcs_[lc].reuse == PRIVATE) continue;
    if (q.recompute[cell] && lcs_[lc].reuse != OPTIONAL) continue;
    int32_t theirs = index_.page(node, lc);
    if (theirs >= 0 && !pt_[theirs].dead) {
      Page& t = pt_[theirs];
      if (t.holders || t.locks || t.claim || t.tier <= p.tier) continue;
      unpublish(theirs);
      index_.page(node, lc) = -1;
      free_page(theirs);
    }
    set_block(id, node);
    publish(id);
    index_.page(node, lc) = id;
    requeue(id);
    published_cold(id);
  }
}

int32_t Core::import_pages(int32_t s, int32_t first, int32_t n, int tier, const std::vector<Ids>& slots) {
  Seq& q = live_seq(s);
  require(tier == HOST && !allocs_[HOST].empty(), "import_pages: pages are imported into the host tier");
  require(first >= 0 && n >= 0 && size_t(first) + size_t(n) <= q.keys.size() && size_t(first) <= q.blocks.size(),
          "import_pages: blocks beyond the sequence's keys, or after a gap in its blocks");
  require(int(slots.size()) == n_lcs(), "import_pages: one slot list per life cycle");
  for (int lc = 0; lc < n_lcs(); ++lc) {
    require(slots[size_t(lc)].size() >= size_t(n), "import_pages: a slot per block and life cycle");
    for (int32_t i = 0; i < n; ++i) {
      int32_t slot = slots[size_t(lc)][size_t(i)];
      if (slot < 0 || lcs_[lc].reuse == PRIVATE) continue;
      int32_t g = group_of_[HOST][lc];
      require(slot < allocs_[HOST][g].capacity() && !allocs_[HOST][g].is_free(slot) && owners_[HOST][g][slot] < 0,
              "import_pages: a slot that is not allocated, or owned");
    }
  }
  {
    std::vector<std::pair<int32_t, int32_t>> seen;     // (group, slot): a slot given twice would have two owners
    for (int lc = 0; lc < n_lcs(); ++lc)
      for (int32_t i = 0; i < n; ++i)
        if (slots[size_t(lc)][size_t(i)] >= 0 && lcs_[lc].reuse != PRIVATE)
          seen.push_back({group_of_[HOST][lc], slots[size_t(lc)][size_t(i)]});
    std::sort(seen.begin(), seen.end());
    require(std::adjacent_find(seen.begin(), seen.end()) == seen.end(), "import_pages: a slot given twice");
  }
  int32_t parent = first ? q.blocks[size_t(first) - 1] : -1;
  if (parent >= 0 && !index_.blocks[parent].indexed) return 0;
  for (int32_t i = 0; i < n; ++i) {
    int32_t pos = first + i;
    const Key& key = q.keys[size_t(pos)];
    int32_t node = index_.find(key);
    if (node >= 0 && (index_.blocks[node].parent != parent || index_.blocks[node].depth != pos)) return i;
    int fetched = 0;
    for (int lc = 0; lc < n_lcs(); ++lc) {
      if (lcs_[lc].reuse == PRIVATE) continue;
      if (node >= 0 && index_.page(node, lc) >= 0) return i;               // held already: nothing to import
      if (slots[size_t(lc)][size_t(i)] >= 0) ++fetched;
      else if (lcs_[lc].prefix_critical(pos, tpb_)) return i;             // not fetched, and every longer prefix needs it
    }
    if (!fetched) return i;          // an OPTIONAL or window page missing only costs its recompute; none at all ends the run
    if (node < 0) {
      node = index_.create(parent, pos);
      kv_events_.forget(node);
      Block& b = index_.blocks[node];
      b.key = key;
      b.has_key = true;
      index_.insert(node);
      give_tokens(q, pos, node);
    }
    for (int lc = 0; lc < n_lcs(); ++lc) {
      if (lcs_[lc].reuse == PRIVATE || slots[size_t(lc)][size_t(i)] < 0) continue;
      int32_t id = new_page(node, lc, HOST, group_of_[HOST][lc], slots[size_t(lc)][size_t(i)], q.priority);
      index_.page(node, lc) = id;
      pt_[id].stamp = ++clock_;
      publish(id);
      requeue(id);
    }
    parent = node;
  }
  return n;
}

int32_t Core::commit(int32_t s, int32_t n) {
  Seq& q = live_seq(s);
  bool all_new;                   // no key from committed to n is indexed or repeated: no lookups below
  int32_t bad = commit_conflict(s, n, all_new);
  if (bad >= 0) return bad;
  int32_t start = q.committed;
  int nl = n_lcs();
  if (shares_nothing_) {
    q.committed = std::max(q.committed, n);
  } else {
    for (int32_t i = 0; i < n; ++i) {
      int32_t b = q.blocks[i];
      if (i < q.committed) {
        if (index_.blocks[b].indexed) {
          give_tokens(q, i, b);
          adopt(b, s, i);
        }
        continue;
      }
      int32_t parent = i ? q.blocks[i - 1] : -1;
      if (parent >= 0 && !index_.blocks[parent].indexed) break;   // an ancestor was dropped meanwhile
      const Key& key = q.keys[i];
      int32_t node = all_new ? -1 : index_.find(key);
      if (node < 0) {
        Block& blk = index_.blocks[b];
        blk.key = key;
        blk.has_key = true;
        blk.parent = parent;
        index_.insert(b);
        give_tokens(q, i, b);
        for (int lc = 0; lc < nl; ++lc) {
          int32_t id = q.pages[size_t(i) * nl + lc];
          if (id < 0) continue;
          Page& p = pt_[id];
          if (lcs_[lc].reuse == PRIVATE || p.dead) {
            index_.page(b, lc) = -1;              // the sequence keeps it; the index never sees it
          } else {
            set_block(id, b);                     // a page refilled in the row (fill_holes) becomes the block's
            index_.page(b, lc) = id;
            publish(id);
            if (!p.locks) requeue(id);
            published_cold(id);
          }
        }
      } else {
        index_.ref(node);
        q.blocks[i] = node;
        index_.unref(b);
        give_tokens(q, i, node);
        adopt(node, s, i);
      }
      q.committed = std::max(q.committed, i + 1);
    }
  }
  if (q.committed > start)
    for (size_t c = size_t(start) * nl; c < size_t(q.committed) * nl; ++c) q.recompute[c] = 0;
  for (int32_t i = n; i-- > 0;)
    for (int lc = 0; lc < nl; ++lc) {
      int32_t id = q.pages[size_t(i) * nl + lc];
      if (id >= 0) touch(id);
    }
  return -1;
}

Ids Core::page_indices(int32_t s, int lc) const {
  const Seq& q = seq(s);
  require(lc >= 0 && lc < n_lcs(), "no such life cycle");
  int nl = n_lcs();
  Ids out(q.blocks.size(), -1);
  for (size_t b = 0; b < q.blocks.size(); ++b) {
    int32_t id = q.pages[b * nl + lc];
    if (id >= 0 && pt_[id].tier == GPU && !pt_[id].dead) out[b] = pt_[id].slot;
  }
  return out;
}

Ids Core::locked_slots(int32_t s, int lc) const {
  const Seq& q = seq(s);
  require(lc >= 0 && lc < n_lcs(), "no such life cycle");
  int nl = n_lcs();
  Ids out(q.blocks.size(), -1);
  if (!q.acquired) return out;
  std::unordered_set<int32_t> locked(q.locked.begin(), q.locked.end());
  for (size_t b = 0; b < q.blocks.size(); ++b) {
    int32_t id = q.pages[b * nl + lc];
    if (id >= 0 && locked.count(id) && pt_[id].tier == GPU && !pt_[id].dead) out[b] = pt_[id].slot;
  }
  return out;
}

Ids Core::recompute_blocks(int32_t s, int lc) const {
  const Seq& q = seq(s);
  require(lc >= 0 && lc < n_lcs(), "no such life cycle");
  int nl = n_lcs();
  Ids out;
  for (size_t b = 0; b < q.blocks.size(); ++b)
    if (q.recompute[b * nl + lc]) out.push_back(int32_t(b));
  return out;
}

// -- slots -------------------------------------------------------------------------------

bool Core::allocate(int tier, int group, int32_t n, Ids& out) { return allocs_[tier][group].allocate(n, out); }

void Core::release_slots(int tier, int group, const Ids& slots, int32_t fence) {
  allocs_[tier][group].release(slots.data(), slots.size(), fence);
}

void Core::give_back(int tier, int group, const Ids& slots) {
  for (int32_t s : slots) allocs_[tier][group].give_back(s);
}

Ids Core::slot_fences(int tier, int group, const Ids& slots) const {
  Ids out;
  for (int32_t s : slots) {
    int32_t f = allocs_[tier][group].fence(s);
    if (f) out.push_back(f);
  }
  std::sort(out.begin(), out.end());
  out.erase(std::unique(out.begin(), out.end()), out.end());
  return out;
}

// -- claims, eviction and moves -------------------------------------------------------

Ids Core::claim(const Ids& pages, int to_tier, bool one_queue) {
  Ids fresh;
  int dst_row = to_tier < 0 ? DISK : to_tier;    // drops key by the disk's groups: any stable key does
  const std::vector<int32_t>& dst_group = group_of_[dst_row];
  if (one_queue && sole_group_[dst_row] != kNoSole) {
    int32_t c = next_claim();
    fresh.push_back(c);
    for (int32_t id : pages) pt_[id].claim = c;
    return fresh;
  }
  return claim_batches(pages, dst_group, false);
}

Ids Core::claim_batches(const Ids& pages, const std::vector<int32_t>& dst_group, bool copy) {
  Ids fresh;
  struct K {
    int8_t tier;
    int32_t group, dst;
    int32_t claim;
  };
  std::vector<K> keys;
  int32_t cur = 0;
  int8_t kt = -2;
  int32_t kg = -1, kd = -1;
  for (int32_t id : pages) {
    Page& p = pt_[id];
    require(!p.dead, "claiming a freed page");
    require(!p.claim, "claiming a page already claimed");
    int32_t d = dst_group[p.lc];
    if (p.tier != kt || p.group != kg || d != kd) {
      kt = p.tier, kg = p.group, kd = d;
      cur = 0;
      for (const K& k : keys)
        if (k.tier == kt && k.group == kg && k.dst == kd) cur = k.claim;
      if (!cur) {
        cur = copy ? next_copy_claim() : next_claim();
        keys.push_back({kt, kg, kd, cur});
        fresh.push_back(cur);
      }
    }
    p.claim = cur;
    unqueue(id);
  }
  return fresh;
}

Ids Core::claims_of(const Ids& pages) const {
  Ids out;
  for (int32_t id : pages) {
    int32_t c = pt_[id].claim;
    if (c && std::find(out.begin(), out.end(), c) == out.end()) out.push_back(c);
  }
  return out;
}

Ids Core::cold_pages(const Ids& pages) const {
  Ids out;
  for (int32_t id : pages)
    if (pt_[id].tier != GPU) out.push_back(id);
  return out;
}

std::vector<std::pair<int32_t, int32_t>> Core::group_counts(const Ids& pages, int tier) const {
  std::vector<std::pair<int32_t, int32_t>> out;
  if (sole_group_[tier] != kNoSole) {
    if (!pages.empty()) out.push_back({sole_group_[tier], int32_t(pages.size())});
    return out;
  }
  for (int32_t id : pages) {
    int32_t g = group_of_[tier][pt_[id].lc];
    auto it = std::find_if(out.begin(), out.end(), [g](auto& e) { return e.first == g; });
    if (it == out.end()) out.push_back({g, 1}); else ++it->second;
  }
  return out;
}

Ids Core::end_claims(const Ids& pages, Ids& live) {
  Ids order(pages);
  std::stable_sort(order.begin(), order.end(), [&](int32_t a, int32_t b) { return pt_[a].stamp < pt_[b].stamp; });
  Ids settled;
  int32_t cur = 0;                     // 0: no claim; -1 is a copy claim
  for (int32_t id : order) {
    Page& p = pt_[id];
    if (p.claim != cur) {
      cur = p.claim;
      if (cur && std::find(settled.begin(), settled.end(), cur) == settled.end()) settled.push_back(cur);
    }
    p.claim = 0;
    if (p.dead) {
      release_slot(p.tier, p.group, p.slot, p.ready);
      maybe_recycle(id);
    } else {
      live.push_back(id);
    }
  }
  return settled;
}

void Core::relabel_later(const Ids& pages) {
  for (int32_t id : pages) {
    Page& p = pt_[id];
    if (p.in_use() && p.relabel) {
      p.relabel = false;
      relabels_.push_back(id);
    }
  }
}

Ids Core::unclaim(const Ids& pages) {
  if (any_write_through())                         // a copy that failed is tried again later
    for (int32_t id : pages)
      if (pt_[id].claim < 0) queue_copy(id);
  Ids live;
  Ids settled = end_claims(pages, live);
  queue_all(live);
  relabel_later(live);
  return settled;
}

bool Core::pick_victims(int tier, int group, int32_t need, int32_t extra, Ids& victims, Ids& claims) {
  LruQueue& q = queues_[tier][group];
  victims.clear();
  q.pop_many(pt_, size_t(need) + size_t(extra), victims);
  if (int32_t(victims.size()) < need) {
    for (int32_t id : victims) q.push(pt_, id);
    return false;
  }
  int nxt = next_tier_[tier];
  claims = claim(victims, nxt, true);
  return true;
}

bool Core::droppable(const Ids& pages) const {
  for (int32_t id : pages)
    if (!pt_[id].copy && (!pt_[id].published || pt_[id].holders)) return false;
  return true;
}

Settled Core::drop_victims(int tier, const Ids& victims) {
  Settled out;
  Ids order(victims);
  std::stable_sort(order.begin(), order.end(), [&](int32_t a, int32_t b) {
    return index_.blocks[pt_[a].block].depth > index_.blocks[pt_[b].block].depth;
  });
  for (int32_t id : order) pt_[id].relabel = false;
  int32_t group = victims.empty() ? 0 : pt_[victims[0]].group;
  for (int32_t id : order) {
    Page& p = pt_[id];
    int32_t c = p.claim;
    if (c && std::find(out.claims.begin(), out.claims.end(), c) == out.claims.end()) out.claims.push_back(c);
    p.claim = 0;
    owners_[p.tier][p.group][p.slot] = -1;
    allocs_[p.tier][p.group].set_fence(p.slot, p.ready);   // its next owner waits on the page's last copy
    out.slots.push_back(p.slot);
    // a page already freed by an ancestor's subtree drop keeps its slot for the caller too
    if (p.dead) {
      maybe_recycle(id);
    } else if (p.copy) {                           // its primary stays: only the copy leaves
      unlink_copy(id);
      ++counters_.copies_evicted[p.tier];
      p.dead = true;
      maybe_recycle(id);
    } else {
      drop(id, false);
    }
  }
  if (tier == DISK && !out.slots.empty()) disk_frees_.push_back({group, out.slots});
  return out;
}

std::vector<BatchSpec> Core::split_batches(const Ids& pages, int dst_tier) const {
  auto by_slot = [&](int32_t a, int32_t b) { return pt_[a].slot < pt_[b].slot; };
  Ids order(pages);
  // By source slot (runs of adjacent slots copy as one), except host rows into the disk
  // (copied row by row anyway): there the caller's order (victims, least recently used
  // first) meets the ascending destination slots of the sweep (allocator.hpp), so later
  // evictions, in the same order, free runs of them.
  if (dst_tier != DISK) std::stable_sort(order.begin(), order.end(), by_slot);
  std::vector<BatchSpec> out;
  for (int32_t id : order) {
    const Page& p = pt_[id];
    int32_t d = group_of_[dst_tier][p.lc];
    auto it = std::find_if(out.begin(), out.end(), [&](const BatchSpec& b) {
      return b.src_tier == p.tier && b.src_group == p.group && b.dst_group == d;
    });
    if (it == out.end()) {
      out.push_back({p.tier, p.group, d, {}});
      it = out.end() - 1;
    }
    it->pages.push_back(id);
  }
  if (dst_tier == DISK)
    for (BatchSpec& b : out)
      if (b.src_tier != HOST) std::stable_sort(b.pages.begin(), b.pages.end(), by_slot);
  return out;
}

Settled Core::land(const Ids& batch, int dst_tier, int dst_group, const Ids& dst_slots, int32_t event, bool handoff,
                   int32_t fence) {
  require(batch.size() == dst_slots.size() && !batch.empty(), "land: one slot per page");
  if (fence < 0) fence = event;
  for (size_t i = 0; i < batch.size(); ++i) {
    int32_t s = dst_slots[i];
    require(s >= 0 && s < allocs_[dst_tier][dst_group].capacity() && !allocs_[dst_tier][dst_group].is_free(s) &&
                owners_[dst_tier][dst_group][s] < 0,
            "land: a destination slot that is not allocated, or owned");
    require(pt_[batch[i]].claim != 0, "land: a page that is not claimed");
    require(!pt_[batch[i]].copy, "land: a clean copy moves nowhere (swap_to_copies sheds it)");
  }
  Settled out;
  int src_tier = pt_[batch[0]].tier, src_group = pt_[batch[0]].group;
  Ids freed;
  freed.reserve(batch.size());
  Ids& src_owners = owners_[src_tier][src_group];
  Ids& dst_owners = owners_[dst_tier][dst_group];
  // write-through: a published page promoted from a cold tier keeps its slot there as a clean copy
  bool keep = write_through(src_tier) && dst_tier < src_tier && !handoff;
  Ids kept;
  for (size_t i = 0; i < batch.size(); ++i) {
    // a page that lands where (or colder than) its chain has a copy (one claimed by a drop in flight,
    // or not swapped onto) needs it no more: it goes, as the chain must only grow colder
    if (has_copy(batch[i]) && pt_[copy_of_[size_t(batch[i])]].tier <= dst_tier) free_copies(batch[i], dst_tier);
    Page& p = pt_[batch[i]];
    src_owners[p.slot] = -1;
    // (not one published while claimed: its disk record is still anonymous, a copy recovery would forget)
    if (keep && !p.dead && p.published && !p.relabel && p.block >= 0 && index_.page(p.block, p.lc) == batch[i]) {
      kept.push_back(batch[i]);
      kept.push_back(p.slot);
    } else {
      freed.push_back(p.slot);
      // (a kept page's source tier goes on holding its block, through the copy: no event)
      if (kv_events_.on && p.published) note(KV_REMOVED, batch[i]);
    }
    p.tier = int8_t(dst_tier);
    p.group = uint8_t(dst_group);
    p.slot = dst_slots[i];
    p.ready = event;
    dst_owners[dst_slots[i]] = batch[i];
  }
  if (kv_events_.on) note_arrivals(batch);
  for (size_t i = 0; i < kept.size(); i += 2) {
    int32_t id = kept[i];
    int32_t block = pt_[id].block, lc = pt_[id].lc, prio = pt_[id].priority;
    int32_t c = new_page(block, lc, src_tier, src_group, kept[i + 1], prio);
    Page& cp = pt_[c];
    cp.copy = true;
    cp.stamp = pt_[id].stamp;
    cp.ready = event;                              // the slot's last reader: this move
    link_copy(id, c);
    ++counters_.copies_kept[src_tier];
    queues_[src_tier][src_group].push(pt_, c);
  }
  if (src_tier == DISK && !freed.empty()) disk_frees_.push_back({src_group, freed});
  if (handoff) {                                   // the caller's next writer waits on this batch's reads
    for (int32_t slot : freed) allocs_[src_tier][src_group].set_fence(slot, fence);
    out.slots = freed;
  }
  else allocs_[src_tier][src_group].release(freed.data(), freed.size(), fence);
  Ids live;
  out.claims = end_claims(batch, live);
  for (int32_t id : live) {
    Page& p = pt_[id];
    if (!p.queued && evictable(p)) queues_[dst_tier][dst_group].push(pt_, id);
  }
  relabel_later(live);
  return out;
}

// -- clean copies ------------------------------------------------------------------------

void Core::set_write_through(int tier, bool on) {
  require(cold_tier(tier), "write-through is for the host or the disk tier");
  require(!on || !allocs_[tier].empty(), "write-through needs the tier");
  if (!on) require(counters_.copies[tier] == 0, "write-through cannot be turned off while copies exist");
  WriteThroughQueue& w = wt_[tier];
  w.on = on;
  if (!on) {
    w.pending.clear();
    w.head = 0;
  }
  if (on && copy_of_.size() < pt_.pages.size()) copy_of_.resize(pt_.pages.size(), -1);
}

size_t Core::copies_pending(int tier) const {
  require(cold_tier(tier), "write-through is for the host or the disk tier");
  return wt_[tier].pending.size() - wt_[tier].head;
}

int32_t Core::next_copy_claim() {
  copy_claim_counter_ = copy_claim_counter_ <= INT32_MIN + 1 ? -1 : copy_claim_counter_ - 1;
  return copy_claim_counter_;
}

int32_t Core::copy_in(int32_t primary, int tier) const {
  for (int32_t c = copy_of(primary); c >= 0; c = copy_of(c))
    if (pt_[c].tier == tier) return c;
  return -1;
}

void Core::link_copy(int32_t primary, int32_t c) {
  int32_t prev = primary;
  while (copy_of(prev) >= 0 && pt_[copy_of_[size_t(prev)]].tier < pt_[c].tier) prev = copy_of_[size_t(prev)];
  copy_of_[size_t(c)] = copy_of_[size_t(prev)];
  copy_of_[size_t(prev)] = c;
  ++counters_.copies[pt_[c].tier];
}

void Core::unlink_copy(int32_t c, bool removed) {
  if (removed && kv_events_.on) note(KV_REMOVED, c);
  int32_t prev = index_.page(pt_[c].block, pt_[c].lc);
  while (prev >= 0 && copy_of_[size_t(prev)] != c) prev = copy_of(prev);
  require(prev >= 0, "unlink_copy: a copy that is in no chain");
  copy_of_[size_t(prev)] = copy_of_[size_t(c)];
  copy_of_[size_t(c)] = -1;
  --counters_.copies[pt_[c].tier];
}

void Core::free_copies(int32_t primary, int tier) {
  int32_t c = copy_of(primary);
  while (c >= 0 && pt_[c].tier <= tier) {
    int32_t next = copy_of_[size_t(c)];
    unlink_copy(c);
    free_page(c);                      // a copy claimed by a drop in flight keeps its slot for that drop
    c = next;
  }
}

void Core::queue_copy(int32_t id) {
  for (int t : {int(HOST), int(DISK)})
    if (wt_[t].on && pt_[id].tier < t && copy_in(id, t) < 0) wt_[t].pending.push_back(id);
}

Ids Core::take_copies(int tier, int32_t max_pages, Ids& claims) {
  require(write_through(tier), "take_copies: write-through is off for that tier");
  claims.clear();
  Ids taken;
  WriteThroughQueue& w = wt_[tier];
  // A FIFO from w.head: each entry is looked at once per call at most (a busy one goes to the
  // back), so taking everything costs what is pending, not its square.
  for (size_t budget = w.pending.size() - w.head; budget > 0 && int32_t(taken.size()) < max_pages; --budget) {
    int32_t id = w.pending[w.head++];
    if (!valid_page(id)) continue;
    Page& p = pt_[id];
    // gone, or in the tier (or colder) already, or copied there; or not copy_ready: a stale entry
    // whose id was recycled into a page its writer may still be filling (queued when released)
    if (!p.in_use() || p.dead || !p.published || p.copy || !p.copy_ready || p.tier >= tier ||
        copy_in(id, tier) >= 0 || p.block < 0 || index_.page(p.block, p.lc) != id)
      continue;
    if (p.claim) {                                 // moving: try again later
      w.pending.push_back(id);
      continue;
    }
    taken.push_back(id);
    p.claim = -1;                                  // a placeholder: a duplicate entry now reads as busy
  }
  if (w.head >= 1024 && 2 * w.head >= w.pending.size()) {
    w.pending.erase(w.pending.begin(), w.pending.begin() + std::ptrdiff_t(w.head));
    w.head = 0;
  }
  for (int32_t id : taken) pt_[id].claim = 0;     // the placeholders go: real copy claims, as claim() makes them
  claims = claim_batches(taken, group_of_[tier], true);
  return taken;
}

int64_t Core::tier_stamp(int32_t b, int lc, int tier) const {
  if (b < 0) return INT64_MAX;
  int32_t id = index_.page(b, lc);
  if (id < 0) return INT64_MAX;
  if (pt_[id].tier == tier) return pt_[id].stamp;
  int32_t c = copy_in(id, tier);
  return c >= 0 ? pt_[c].stamp : INT64_MAX;
}

Ids Core::land_copies(const Ids& batch, int tier, int32_t group, const Ids& slots, int32_t event) {
  require(batch.size() == slots.size(), "land_copies: one slot per page");
  require(cold_tier(tier) && group >= 0 && group < n_groups(tier), "land_copies: no such cold tier and group");
  for (size_t i = 0; i < batch.size(); ++i) {
    int32_t s = slots[i];
    require(s >= 0 && s < allocs_[tier][group].capacity() && !allocs_[tier][group].is_free(s) &&
                owners_[tier][group][s] < 0,
            "land_copies: a slot that is not allocated, or owned");
    require(pt_[batch[i]].claim < 0, "land_copies: a page without a copy claim");
  }
  Ids made;                                        // the new copies (KV events on)
  for (size_t i = 0; i < batch.size(); ++i) {
    int32_t id = batch[i];
    const Page& p = pt_[id];
    if (!p.dead && p.published && p.tier < tier && p.block >= 0 && index_.page(p.block, p.lc) == id &&
        copy_in(id, tier) < 0 && group_of_[tier][p.lc] == group) {
      int32_t block = p.block, lc = p.lc, prio = p.priority;
      // never newer than what its parent has in the tier: the tier evicts a child's copy before
      // its parent's (a new block is stamped after its matched prefix until that is touched again)
      int64_t stamp = std::min(p.stamp, tier_stamp(index_.blocks[block].parent, lc, tier));
      int32_t c = new_page(block, lc, tier, group, slots[i], prio);
      Page& cp = pt_[c];
      cp.copy = true;
      cp.stamp = stamp;
      cp.ready = event;
      link_copy(id, c);
      ++counters_.copies_made[tier];
      queues_[tier][group].push(pt_, c);
      if (kv_events_.on) made.push_back(c);
    } else {
      release_slot(tier, group, slots[i], event);
    }
  }
  if (!made.empty()) note_arrivals(made);            // the tier holds these blocks now, through their copies
  Ids live;
  Ids settled = end_claims(batch, live);
  queue_all(live);
  relabel_later(live);
  return settled;
}

Ids Core::swap_to_copies(const Ids& victims, int dst_tier, Settled& out) {
  require(dst_tier >= 0 && dst_tier < kTiers, "swap_to_copies: no such tier");
  out.claims.clear();
  out.slots.clear();
  Ids rest, done;                                   // done: victims swapped onto a copy, or copies shed
  Ids shed_disk;                                    // slots of disk copies shed
  int32_t disk_group = -1;
  for (int32_t id : victims) {
    Page& p = pt_[id];
    int32_t c = -1;                                 // the copy a primary swaps onto
    if (!p.dead && !p.copy && p.tier < dst_tier) {
      c = copy_in(id, dst_tier);
      if (c >= 0 && pt_[c].claim) c = -1;
    }
    // a copy leaves even if it died since it was claimed (freed with its chain, its slot kept for
    // this claim): moved down, it would be written under its block's key
    if (!p.copy && (p.dead || c < 0)) {
      rest.push_back(id);
      continue;
    }
    require(p.claim > 0, "swap_to_copies: a victim that is not claimed");
    owners_[p.tier][p.group][p.slot] = -1;
    allocs_[p.tier][p.group].set_fence(p.slot, p.ready);   // its next owner waits on the page's last copy
    out.slots.push_back(p.slot);
    done.push_back(id);
    if (p.copy) {                                   // a clean copy leaves; its primary stays
      if (!p.dead) {
        unlink_copy(id);
        ++counters_.copies_evicted[p.tier];
      }
      if (p.tier == DISK) {                         // the disk forgets it, as drop_victims has it
        shed_disk.push_back(p.slot);
        disk_group = p.group;
      }
      continue;
    }
    // the page leaves its tier; the copy's tier held the block already (its copy was reported)
    if (kv_events_.on && p.published) note(KV_REMOVED, id);
    Page& cp = pt_[c];
    unqueue(c);
    unlink_copy(c, false);
    free_copies(id, dst_tier);                      // copies warmer than its new tier (skipped to the disk)
    p.tier = cp.tier;
    p.group = cp.group;
    p.slot = cp.slot;
    p.ready = cp.ready;
    owners_[p.tier][p.group][p.slot] = id;
    cp.dead = true;
    set_block(c, -1);
    pt_.recycle(c);
    ++counters_.copy_swaps[p.tier];
  }
  if (done.empty()) return rest;
  if (!shed_disk.empty()) disk_frees_.push_back({disk_group, shed_disk});
  Ids still;                                        // claims a victim still to move holds stay open
  for (int32_t id : rest)
    if (pt_[id].claim && std::find(still.begin(), still.end(), pt_[id].claim) == still.end()) still.push_back(pt_[id].claim);
  Ids order(done);
  std::stable_sort(order.begin(), order.end(), [&](int32_t a, int32_t b) { return pt_[a].stamp < pt_[b].stamp; });
  Ids moved;
  for (int32_t id : order) {
    Page& p = pt_[id];
    if (std::find(still.begin(), still.end(), p.claim) == still.end() &&
        std::find(out.claims.begin(), out.claims.end(), p.claim) == out.claims.end())
      out.claims.push_back(p.claim);
    p.claim = 0;
    if (p.copy) {
      p.dead = true;
      maybe_recycle(id);
      continue;
    }
    moved.push_back(id);
    if (!p.queued && evictable(p)) queues_[p.tier][p.group].push(pt_, id);
  }
  relabel_later(moved);
  return rest;
}

Ids Core::discard_corrupt(const Ids& batch, const Ids& bad_slots) {
  Ids depths;
  for (int32_t id : batch) {
    Page& p = pt_[id];
    if (!p.in_use() || p.dead || p.tier != DISK) continue;
    if (std::find(bad_slots.begin(), bad_slots.end(), p.slot) == bad_slots.end()) continue;
    depths.push_back(discard_page(id));
  }
  return depths;
}

int32_t Core::discard_page(int32_t id) {
  Page& p = pt_[id];   // not counted in counters_.discarded: the disk tier counts the pages it found bad
  int32_t depth = p.block >= 0 ? index_.blocks[p.block].depth : -1;
  if (p.copy) {                        // a bad clean copy: its primary stays, the tier no longer holds the block
    unlink_copy(id);
    free_page(id);
  } else if (p.published) {
    drop(id);
  } else {
    free_page(id);
  }
  return depth;
}

Ids Core::discard_unwritten(const Ids& batch, int32_t event) {
  require(event > 0, "discard_unwritten: an event id > 0");
  Ids depths;
  for (int32_t id : batch) {
    Page& p = pt_[id];
    if (!p.in_use() || p.dead || p.tier != DISK || p.ready != event || p.claim != 0) continue;
    depths.push_back(discard_page(id));
  }
  return depths;
}

// -- the disk tier across restarts -----------------------------------------------------

bool Core::reaches_disk(int32_t b, const std::vector<uint8_t>& chosen, std::vector<int8_t>& memo) const {
  // A block reaches the disk when one of its pages does and every prefix-critical one does, and so
  // does its parent: recovery needs the parent's key to attach a record. memo: -1 unknown, 0, 1.
  Ids path;
  int32_t x = b;
  while (x >= 0 && memo[size_t(x)] < 0) {
    path.push_back(x);
    x = index_.blocks[x].parent;
  }
  bool ok = x < 0 || memo[size_t(x)] == 1;
  for (auto it = path.rbegin(); it != path.rend(); ++it) {
    const Block& blk = index_.blocks[*it];
    bool any = false, critical = true;
    for (int lc = 0; lc < n_lcs(); ++lc) {
      int32_t id = index_.page(*it, lc);
      if (id < 0) continue;
      const Page& p = pt_[id];
      bool there = !p.dead && (p.tier == DISK || copy_in(id, DISK) >= 0 || chosen[size_t(id)]);
      any = any || there;
      if (!there && lcs_[lc].prefix_critical(blk.depth, tpb_)) critical = false;
    }
    ok = ok && any && critical;
    memo[size_t(*it)] = ok ? 1 : 0;
  }
  return ok;
}

std::vector<Ids> Core::persist_candidates() const {
  std::vector<Ids> out(allocs_[DISK].size());
  if (out.empty()) return out;
  Ids pending;
  std::vector<uint8_t> chosen(pt_.pages.size(), 0);
  // The index's pages off the disk are the pages owning GPU and host slots that their block names:
  // a scan of those slots, not of a (much larger) index that is mostly on disk.
  for (int t = 0; t < kTiers; ++t) {
    if (t == DISK) continue;
    for (const Ids& slots : owners_[t])
      for (int32_t id : slots) {
        if (id < 0) continue;
        const Page& p = pt_[id];
        if (p.block < 0 || !index_.blocks[p.block].indexed || index_.page(p.block, p.lc) != id) continue;
        if (!p.dead && p.published && !p.claim && !p.locks && copy_in(id, DISK) < 0) {
          pending.push_back(id);
          chosen[size_t(id)] = 1;
        }
      }
  }
  // Only pages whose ancestors reach the disk too: a page persisted under an ancestor that stays
  // behind (locked by a running request, or cut by the capacity) is unreachable after a restart.
  std::vector<int8_t> memo(index_.blocks.size(), -1);
  auto keep_reachable = [&](Ids& pages) {
    std::fill(memo.begin(), memo.end(), int8_t(-1));
    Ids kept;
    for (int32_t id : pages)
      if (reaches_disk(pt_[id].block, chosen, memo)) kept.push_back(id);
      else chosen[size_t(id)] = 0;
    pages.swap(kept);
  };
  keep_reachable(pending);
  std::sort(pending.begin(), pending.end(), [&](int32_t a, int32_t b) {      // most recent first; ties by id
    return pt_[a].stamp != pt_[b].stamp ? pt_[a].stamp > pt_[b].stamp : a < b;
  });
  Ids capped;
  std::vector<int32_t> room(out.size());
  for (size_t g = 0; g < out.size(); ++g) room[g] = allocs_[DISK][g].capacity();
  for (int32_t id : pending) {
    int32_t g = group_of_[DISK][pt_[id].lc];
    if (room[size_t(g)] > 0) {
      --room[size_t(g)];
      capped.push_back(id);
    } else {
      chosen[size_t(id)] = 0;
    }
  }
  keep_reachable(capped);
  for (int32_t id : capped) out[size_t(group_of_[DISK][pt_[id].lc])].push_back(id);
  return out;
}

Ids Core::persist_anchors(const std::vector<Ids>& candidates) const {
  // The disk pages (primaries there, and copies) of every block above a page persisting will
  // write. Pinned while persisting, the evictions that make room cannot take them: an evicted
  // ancestor would leave the persisted page unreachable after a restart.
  std::vector<uint8_t> seen(index_.blocks.size(), 0);
  Ids out;
  auto climb = [&](int32_t b) {
    for (int32_t x = index_.blocks[b].parent; x >= 0 && !seen[size_t(x)]; x = index_.blocks[x].parent) {
      seen[size_t(x)] = 1;
      for (int lc = 0; lc < n_lcs(); ++lc) {
        int32_t q = index_.page(x, lc);
        if (q < 0 || pt_[q].dead) continue;
        int32_t d = pt_[q].tier == DISK ? q : copy_in(q, DISK);
        if (d >= 0 && pt_[d].queued) out.push_back(d);
      }
    }
  };
  for (const Ids& g : candidates)
    for (int32_t id : g)
      if (valid_page(id) && pt_[id].in_use() && pt_[id].block >= 0) climb(pt_[id].block);
  // Under write-through the disk also holds copies of hot pages, interleaved in recency with the
  // rest: the ancestors of every disk page are pinned too, so that making room takes leaves.
  if (wt_[DISK].on)
    for (const Ids& o : owners_[DISK])
      for (int32_t id : o)
        if (id >= 0 && pt_[id].block >= 0) climb(pt_[id].block);
  std::sort(out.begin(), out.end());
  out.erase(std::unique(out.begin(), out.end()), out.end());
  return out;
}

Ids Core::still_persistable(const Ids& pages, int32_t group) const {
  Ids out;
  for (int32_t id : pages) {
    if (id < 0 || size_t(id) >= pt_.pages.size()) continue;
    const Page& p = pt_[id];
    // the id may have been recycled since the candidates were taken: still the index's page?
    if (p.in_use() && !p.dead && !p.claim && p.tier != DISK && p.published && p.block >= 0 &&
        index_.page(p.block, p.lc) == id && group_of_[DISK][p.lc] == group && copy_in(id, DISK) < 0)
      out.push_back(id);
  }
  return out;
}

std::vector<Ids> Core::recover(std::vector<RecoveredRecord>& records) {
  size_t ng = allocs_[DISK].size();
  std::vector<Ids> forget(ng);
  std::vector<std::vector<uint8_t>> taken(ng);
  for (size_t g = 0; g < ng; ++g) taken[g].assign(size_t(allocs_[DISK][g].capacity()), 0);
  // Parents before children: by depth, then in the order given (write order). Sorted as packed
  // 64-bit keys (depth, position): a record is 80 bytes, and comparing through them missed the cache.
  int64_t unreachable = 0;           // records whose parent is not on disk: orphaned, not bad
  Ids recovered;                     // KV events on: the pages published, for their STORED entries
  std::vector<uint64_t> by_depth(records.size());
  for (size_t i = 0; i < records.size(); ++i)
    by_depth[i] = uint64_t(uint32_t(records[i].depth) + 1u) << 32 | uint64_t(i);   // depth -1 (bad) first
  std::sort(by_depth.begin(), by_depth.end());
  for (uint64_t packed : by_depth) {
    const RecoveredRecord& r = records[size_t(packed & 0xFFFFFFFFu)];
    if (r.group < 0 || size_t(r.group) >= ng) continue;      // no such group: nothing to forget either
    bool in_range = r.slot >= 0 && r.slot < allocs_[DISK][r.group].capacity();
    if (r.anonymous) {                                       // a page no index knew: nothing to recover
      if (in_range) forget[r.group].push_back(r.slot);
      continue;
    }
    bool ok = in_range && r.lc >= 0 && r.lc < n_lcs() && group_of_[DISK][r.lc] == r.group && r.depth >= 0 &&
              !taken[r.group][r.slot];
    int32_t parent = (ok && r.has_parent) ? index_.find(r.parent) : -1;
    if (ok && r.depth > 0 && r.has_parent && parent < 0) {     // well formed, but its parent never reached the disk
      ++unreachable;
      if (!taken[r.group][r.slot]) forget[r.group].push_back(r.slot);
      continue;
    }
    if (ok && r.depth > 0 && (parent < 0 || index_.blocks[parent].depth != r.depth - 1)) ok = false;
    if (ok && r.depth == 0 && r.has_parent) ok = false;
    int32_t node = ok ? index_.find(r.key) : -1;
    if (ok && node >= 0 && (index_.blocks[node].parent != parent || index_.page(node, r.lc) >= 0)) ok = false;
    if (!ok) {
      ++counters_.discarded;
      if (in_range && !taken[r.group][r.slot]) forget[r.group].push_back(r.slot);
      continue;
    }
    if (node < 0) {
      node = index_.create(parent, r.depth);
      kv_events_.forget(node);
      index_.blocks[node].key = r.key;
      index_.blocks[node].has_key = true;
      index_.insert(node);
    }
    int32_t id = pt_.create();
    Page& p = pt_[id];
    p.lc = uint8_t(r.lc);
    p.tier = DISK;
    p.group = uint8_t(r.group);
    p.slot = r.slot;
    p.priority = uint8_t(std::clamp(r.priority, 0, 100));
    set_block(id, node);
    pt_[id].published = true;
    if (kv_events_.on) recovered.push_back(id);
    index_.page(node, r.lc) = id;
    owners_[DISK][r.group][r.slot] = id;
    taken[r.group][r.slot] = 1;
  }
  note_arrivals(recovered);          // before the drops below, which report their removals
  for (size_t g = 0; g < ng; ++g) allocs_[DISK][g].reset_used(taken[g]);
  // blocks missing a prefix-critical page can never match: drop them with their subtrees
  auto count_disk = [&]() {
    int64_t n = 0;
    for (auto& o : owners_[DISK])
      for (int32_t id : o) n += id >= 0;
    return n;
  };
  int64_t before = count_disk();
  std::vector<uint64_t> nodes;         // (depth, block id) packed: by depth, then in indexing order
  index_.for_each_indexed([&](int32_t b) { nodes.push_back(uint64_t(uint32_t(index_.blocks[b].depth)) << 32 | uint32_t(b)); });
  std::sort(nodes.begin(), nodes.end());
  for (uint64_t packed : nodes) {
    int32_t b = int32_t(packed & 0xFFFFFFFFu);
    if (!index_.blocks[b].in_use || !index_.blocks[b].indexed) continue;
    for (int lc = 0; lc < n_lcs(); ++lc)
      if (lcs_[lc].prefix_critical(index_.blocks[b].depth, tpb_) && index_.page(b, lc) < 0) {
        drop_subtree(b);
        break;
      }
  }
  counters_.orphaned = unreachable + before - count_disk();
  // Recency is not journaled. Deepest first, then in write order: a block is never older than
  // its descendants, and shallow blocks, which more requests share, go last.
  std::vector<std::vector<int64_t>> gen(ng);      // per disk slot: its record's generation
  for (size_t g = 0; g < ng; ++g) gen[g].assign(size_t(allocs_[DISK][g].capacity()), 0);
  for (const RecoveredRecord& r : records)
    if (r.group >= 0 && size_t(r.group) < ng && r.slot >= 0 && r.slot < allocs_[DISK][r.group].capacity())
      gen[r.group][r.slot] = r.generation;
  struct Order {
    int32_t depth;
    int64_t gen;
    int32_t id;
  };
  std::vector<Order> order;
  for (auto& o : owners_[DISK])
    for (int32_t id : o)
      if (id >= 0) order.push_back({index_.blocks[pt_[id].block].depth, gen[pt_[id].group][pt_[id].slot], id});
  std::stable_sort(order.begin(), order.end(), [](const Order& a, const Order& b) {
    return a.depth != b.depth ? a.depth > b.depth : a.gen < b.gen;
  });
  Ids pages;
  pages.reserve(order.size());
  for (const Order& o : order) pages.push_back(o.id);
  for (int32_t id : pages) {
    pt_[id].stamp = ++clock_;
    requeue(id);
  }
  counters_.recovered = int64_t(pages.size());
  for (auto& [g, slots] : disk_frees_) forget[g].insert(forget[g].end(), slots.begin(), slots.end());
  disk_frees_.clear();
  return forget;
}

// -- tools and tests ----------------------------------------------------------------------

Ids Core::tier_pages(int tier, int group) const {
  Ids out;
  for (int32_t id : owners_[tier][group])
    if (id >= 0) out.push_back(id);
  return out;
}

Ids Core::claim_resident(int tier, int group, int32_t lo, int32_t hi, int32_t& claim_out) {
  Ids out;
  claim_out = 0;
  const Ids& own = owners_[tier][group];
  hi = std::min(hi, int32_t(own.size()));
  for (int32_t s = std::max(lo, 0); s < hi; ++s) {
    int32_t id = own[size_t(s)];
    if (id < 0) continue;
    Page& p = pt_[id];
    assert(p.tier == tier && p.group == group && p.slot == s);
    if (p.dead || p.claim) continue;
    if (!claim_out) claim_out = next_claim();
    p.claim = claim_out;
    unqueue(id);                                // claimed pages are no eviction's victims (unclaim requeues)
    out.push_back(id);
  }
  return out;
}

void Core::drop_page(int32_t id) {
  require(id >= 0 && size_t(id) < pt_.pages.size() && pt_[id].in_use() && !pt_[id].dead && pt_[id].published &&
              !pt_[id].claim,
          "drop_page: not a live, published, unclaimed page");
  drop(id);
}

// -- drains and queries -----------------------------------------------------------------

std::vector<std::pair<int32_t, Ids>> Core::take_disk_frees() {
  std::vector<std::pair<int32_t, Ids>> out;
  for (auto& [g, slots] : disk_frees_) {      // merge runs for the same group, keeping order
    if (!out.empty() && out.back().first == g) out.back().second.insert(out.back().second.end(), slots.begin(), slots.end());
    else out.push_back({g, std::move(slots)});
  }
  disk_frees_.clear();
  return out;
}

std::vector<std::pair<int32_t, Ids>> Core::take_relabels() {
  std::vector<std::pair<int32_t, Ids>> out;
  for (int32_t id : relabels_) {
    const Page& p = pt_[id];
    if (!p.in_use() || p.dead || p.tier != DISK || !p.published) continue;
    auto it = std::find_if(out.begin(), out.end(), [&](auto& e) { return e.first == p.group; });
    if (it == out.end()) out.push_back({p.group, Ids{id}}); else it->second.push_back(id);
  }
  relabels_.clear();
  return out;
}

size_t Core::live_blocks() const {
  size_t n = 0;
  for (const Block& b : index_.blocks) n += b.in_use;
  return n;
}

size_t Core::memory_bytes() const {
  size_t n = pt_.pages.capacity() * sizeof(Page) + index_.blocks.capacity() * sizeof(Block) +
             index_.pages.capacity() * sizeof(int32_t) + index_.table_bytes() + kv_events_.memory_bytes() +
             (copy_of_.capacity() + wt_[HOST].pending.capacity() + wt_[DISK].pending.capacity()) * sizeof(int32_t);
  for (auto& t : owners_)
    for (auto& o : t) n += o.capacity() * sizeof(int32_t);
  return n;
}

std::vector<std::vector<std::vector<int64_t>>> Core::state_counts() const {
  std::vector<std::vector<std::vector<int64_t>>> out(kTiers);
  for (int t = 0; t < kTiers; ++t)
    for (const Ids& o : owners_[t]) {
      std::vector<int64_t> c(3, 0);
      for (int32_t id : o) {
        if (id < 0) continue;
        const Page& p = pt_[id];
        ++c[p.locks ? 0 : p.copy ? 2 : (p.holders || !p.published) ? 1 : 2];
      }
      out[t].push_back(c);
    }
  return out;
}

void Core::check() const {
  int64_t copies[kTiers] = {0, 0, 0};
  for (int t = 0; t < kTiers; ++t)
    for (size_t g = 0; g < allocs_[t].size(); ++g) {
      const SlotAllocator& a = allocs_[t][g];
      int32_t used = 0;
      int64_t copies_here = 0;
      size_t queued = 0;
      for (int32_t s = 0; s < a.capacity(); ++s) {
        int32_t id = owners_[t][g][s];
        if (id < 0) continue;
        ++used;
        const Page& p = pt_[id];
        require(p.in_use() && !p.dead, "a dead page owns a slot");
        require(!a.is_free(s), "a slot is owned and free");
        require(p.tier == t && p.group == int(g) && p.slot == s, "a page is misfiled");
        require((p.queued != NOT_QUEUED) == evictable(p), "queue membership differs from evictability");
        if (p.copy) {
          ++copies_here;
          require(cold_tier(t) && !p.published && !p.holders && !p.locks, "a copy outside the cold tiers, or held");
          require(p.block >= 0 && index_.blocks[p.block].indexed, "a copy of a block that is not indexed");
          int32_t primary = index_.page(p.block, p.lc);
          require(primary >= 0 && copy_in(primary, t) == id, "a copy its block's chain does not name");
        }
        queued += p.queued != NOT_QUEUED;
      }
      require(used == a.used(), "owned slots differ from allocated slots");
      copies[t] += copies_here;
      std::string broken = a.check();
      require(broken.empty(), ("a slot allocator: " + broken).c_str());
      require(queued == queues_[t][g].size(), "a queue's length differs from its members");
    }
  size_t indexed = 0;
  for (size_t b = 0; b < index_.blocks.size(); ++b) {
    const Block& x = index_.blocks[b];
    if (!x.in_use || !x.indexed) continue;
    ++indexed;
    require(index_.find(x.key) == int32_t(b), "an indexed block is not found under its key");
    require(x.parent < 0 || index_.blocks[x.parent].indexed, "an indexed block's parent is not indexed");
    for (int lc = 0; lc < n_lcs(); ++lc) {
      int32_t id = index_.page(int32_t(b), lc);
      if (id < 0) continue;
      const Page& p = pt_[id];
      require(p.in_use() && p.published && !p.dead && !p.copy, "an index page is unpublished, dead or a copy");
      int copies = 0;
      for (int32_t prev = id, c = copy_of(id); c >= 0; prev = c, c = copy_of(c), ++copies) {
        const Page& cp = pt_[c];
        require(cp.in_use() && cp.copy && !cp.dead, "a chain names no live copy");
        require(cp.block == int32_t(b) && cp.lc == lc, "a chain's copy of another block");
        require(cp.tier > pt_[prev].tier, "a chain that does not grow colder");
      }
      require(copies < kTiers, "a chain longer than the tiers");
      require(owners_[p.tier][p.group][p.slot] == id, "an index page does not own its slot");
    }
  }
  require(indexed == index_.indexed_count(), "the key map's size differs from the indexed blocks");
  for (int t = 0; t < kTiers; ++t) require(copies[t] == counters_.copies[t], "the copy count differs from the copies");
  // every link names a live copy from a live page of its chain (a recycled id's entry is -1)
  for (size_t id = 0; id < copy_of_.size(); ++id) {
    int32_t c = copy_of_[id];
    if (c < 0) continue;
    const Page& p = pt_[int32_t(id)];
    require(p.in_use() && !p.dead && (p.copy || (p.block >= 0 && index_.page(p.block, p.lc) == int32_t(id))),
            "a copy link from a page that is neither a primary nor a copy");
    require(pt_[c].in_use() && pt_[c].copy && !pt_[c].dead && pt_[c].block == p.block, "a link to no live copy");
  }
}

}  // namespace kvtier
