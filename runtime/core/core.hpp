// The core: kvtier's page table, prefix index, slot allocators and
// prioritised LRU queues, and every decision made over them.
//
// It does no I/O, no waiting and no locking: the event-loop thread calls it,
// one call per request operation or migration batch, and Python does what
// waits (copies, events, futures). What Python must act on after a call it
// takes from two drains: disk slots to forget (take_disk_frees) and pages
// published while resting on disk whose journal records need their keys
// (take_relabels). Claims (in-flight operations) and events are Python's
// objects named by int ids here; 0 is "none".
//
// Invariants the core keeps (check() asserts them):
// - every live page owns exactly one slot of one (tier, group), recorded in
//   `owners`, and that slot is allocated;
// - a page with a claim is in no queue; a queue holds exactly the pages that
//   may be evicted from its (tier, group): unlocked, unclaimed, live, and in
//   the last tier also published and unheld;
// - every prefix-critical page of an indexed block is present (dropping one
//   drops the block's subtree), so a match only checks the other pages;
// - each sequence row cell that names a page counts once in its holders;
// - clean copies (write-through, see below): a copy is a host or disk page of a
//   block whose index page (the primary) lives in a warmer tier. The primary and
//   its copies form a chain through copy_of_, each link in a strictly colder tier
//   than the one before (so at most one copy per tier); only a published, live
//   primary has copies.
#pragma once

#include <cstddef>
#include <cstdint>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

#include "allocator.hpp"
#include "index.hpp"
#include "keys.hpp"
#include "kv_event_codec.hpp"
#include "kv_events.hpp"
#include "lru.hpp"
#include "page_table.hpp"
#include "policy.hpp"

namespace kvtier {

using Ids = std::vector<int32_t>;

// The most pages whose table entries a new core writes up front (Core::Core: the GPU and host
// tiers' pages; 88 MiB with one life cycle). Past it, the tables' memory is written as they fill.
constexpr size_t kPrefaultPages = size_t(1) << 20;

struct Seq {
  std::vector<Key> keys;
  Ids blocks;                   // block per position (matched, then extended)
  Ids pages;                    // blocks.size() * n_lcs: the sequence's page per (block, lc), -1 none
  std::vector<uint8_t> recompute;   // same shape: the page holds no cached data (caller recomputes)
  Ids locked;                   // exactly the pages this sequence's acquire locked
  std::vector<int32_t> tokens;  // KV events on: tokens of key positions [0, tokens.size() / tpb)
  int32_t committed = 0;
  uint8_t priority = 35;
  bool acquired = false;
  bool in_use = false;

  // Back to a free row, keeping the arrays' room for the next sequence opened in it (a
  // request would otherwise regrow each one from nothing); rows past kKeepCells let go.
  void reset() {
    static constexpr size_t kKeepCells = 1 << 12;
    if (pages.capacity() > kKeepCells || keys.capacity() > kKeepCells || locked.capacity() > kKeepCells ||
        tokens.capacity() > kKeepCells) {
      *this = Seq();
      return;
    }
    keys.clear();
    blocks.clear();
    pages.clear();
    recompute.clear();
    locked.clear();
    tokens.clear();
    committed = 0;
    priority = 35;
    acquired = false;
    in_use = false;
  }
};

// The outcome of a batch of moves or drops: claims to settle, slots handed over.
struct Settled {
  Ids claims;                   // claim ids whose operations ended (settle their futures)
  Ids slots;                    // source slots handed to the caller (handoff), or freed by drops
};

struct OpenResult {
  int32_t seq;
  int32_t matched;
  int64_t by_tier[4];           // matched blocks by their coldest page's tier; [3]: no page
};

struct BatchSpec {
  int8_t src_tier;
  int32_t src_group;
  int32_t dst_group;
  Ids pages;                    // sorted by source slot
};

struct Counters {
  int64_t hits[kTiers] = {0, 0, 0};
  int64_t lookup_blocks = 0;
  int64_t drops = 0;
  int64_t recovered = 0;
  int64_t orphaned = 0;     // recovery: well-formed pages unreachable (an ancestor's page never reached the disk)
  int64_t discarded = 0;    // recovery: records that do not fit the layout or the tree (bad, duplicate)
  // clean copies (write-through), per tier of the copy
  int64_t copies_made[kTiers] = {0, 0, 0};     // copies landed by land_copies
  int64_t copies_kept[kTiers] = {0, 0, 0};     // cold slots kept as copies when their page was promoted
  int64_t copy_swaps[kTiers] = {0, 0, 0};      // demotions onto a copy: no bytes moved
  int64_t copies_evicted[kTiers] = {0, 0, 0};  // copies dropped by their tier's eviction (the primary stays)
  int64_t copies[kTiers] = {0, 0, 0};          // live copy records now
};

struct RecoveredRecord {
  Key key;
  Key parent;
  bool has_parent;
  bool anonymous;
  int32_t depth;
  int32_t lc;
  int32_t group;
  int32_t slot;
  int32_t priority;
  int64_t generation;
};

class CoreError : public std::logic_error {
 public:
  using std::logic_error::logic_error;
};

class Core {
 public:
  // group_of[tier][lc]: the life cycle's pool group in each tier (-1: tier absent);
  // capacity[tier][group]: slots per group (an absent tier has no groups); the page and block
  // tables' memory is written up front for min(GPU and host slots, prefault_pages) pages.
  Core(int32_t tokens_per_block, std::vector<LifeCycle> lcs, std::vector<std::vector<int32_t>> group_of,
       std::vector<std::vector<int32_t>> capacity, size_t prefault_pages = kPrefaultPages);

  // -- sequences --------------------------------------------------------------------
  OpenResult open_seq(std::vector<Key> keys, int priority);
  void append_keys(int32_t s, const std::vector<Key>& keys);
  void close_seq(int32_t s);
  const Seq& seq(int32_t s) const {
    if (s < 0 || size_t(s) >= seqs_.size() || !seqs_[s].in_use) throw CoreError("no such sequence");
    return seqs_[s];
  }
  size_t page_count() const { return pt_.pages.size(); }
  bool valid_page(int32_t id) const { return id >= 0 && size_t(id) < pt_.pages.size(); }

  // Extension: `slots[g]` holds the new pages' slots of GPU group g (popped from
  // the back, as the Python model does). Returns the slots' fences.
  Ids place_extension(int32_t s, int32_t n, std::vector<Ids>& slots);
  // The common case in one call: every GPU group has the free slots for n
  // more blocks. Allocates and places them and returns their fences; false
  // (nothing changed) if some group is short.
  bool extend_now(int32_t s, int32_t n, Ids& fences);
  void undo_extend(int32_t s, int32_t n);

  bool acquire_now(int32_t s);
  // What an acquire waits for first: holes (flattened (block, lc) pairs with no
  // live page) or claims (moves of needed pages still in flight). Both empty: ready.
  void acquire_scan(int32_t s, Ids& holes, Ids& claims);
  Ids fill_holes(int32_t s, const Ids& holes, std::vector<Ids>& slots);
  Ids lock_needed(int32_t s);                     // locks and unqueues the needed pages
  void finish_acquire(int32_t s, const Ids& pages);
  void undo_acquire(int32_t s, const Ids& pages);
  void unlock(const Ids& pages);
  void release(int32_t s, int32_t event);        // event 0: no fence from the caller's stream
  Ids ready_events(int32_t s);                    // distinct ready events of the needed pages
  Ids prefetch_pages(int32_t s);                  // needed, live, cold, unclaimed

  // Pages fetched from outside the store (the remote tier) into host slots the caller
  // allocated: blocks [first, first + n) of sequence s, continuing its match (block
  // first - 1 is indexed), life cycle lc's page at slots[lc][i] (PRIVATE life cycles
  // ignored). Creates the blocks the index lacks and publishes the pages, queued as
  // evictable. A page not fetched (slot -1) that the match can do without (OPTIONAL, a
  // window's outside its sinks: not prefix-critical) leaves its block without it. Stops at
  // the first block it cannot take (a prefix-critical page not fetched, no page fetched at
  // all, a block already holding one, a key indexed elsewhere): returns how many it took;
  // the slots of the rest are the caller's to give back. The sequence must be opened again
  // to match the new blocks.
  int32_t import_pages(int32_t s, int32_t first, int32_t n, int tier, const std::vector<Ids>& slots);

  // Publishes blocks [0, n). Returns -1, or (nothing changed) the first
  // position whose key is already indexed at another position or repeated.
  int32_t commit(int32_t s, int32_t n);

  Ids page_indices(int32_t s, int lc) const;
  Ids locked_slots(int32_t s, int lc) const;      // GPU slot per block of the pages this sequence locked, else -1
  Ids recompute_blocks(int32_t s, int lc) const;

  // -- slots ------------------------------------------------------------------------
  bool allocate(int tier, int group, int32_t n, Ids& out);
  void release_slots(int tier, int group, const Ids& slots, int32_t fence);
  void give_back(int tier, int group, const Ids& slots);
  Ids slot_fences(int tier, int group, const Ids& slots) const;
  const SlotAllocator& allocator(int tier, int group) const { return allocs_[tier][group]; }
  size_t queue_len(int tier, int group) const { return queues_[tier][group].size(); }
  int n_groups(int tier) const { return int(allocs_[tier].size()); }

  // -- claims, eviction and moves ---------------------------------------------------
  // Marks pages as moving to `to_tier` (-1: dropped). One claim per batch the
  // move will run (source tier and group, destination group); returns the new ids.
  Ids claim(const Ids& pages, int to_tier, bool one_queue);
  Ids claims_of(const Ids& pages) const;          // distinct claims, in page order
  Ids cold_pages(const Ids& pages) const;         // those not on the GPU
  // (group, count) per destination group of `tier`, in order of first appearance.
  std::vector<std::pair<int32_t, int32_t>> group_counts(const Ids& pages, int tier) const;
  // Ends the claims on `pages` after a failure or give-up: settles them,
  // frees the slots of pages that died meanwhile, requeues the rest.
  Ids unclaim(const Ids& pages);
  // Claims up to need + extra victims of (tier, group); false (nothing taken) if fewer than need.
  bool pick_victims(int tier, int group, int32_t need, int32_t extra, Ids& victims, Ids& claims);
  bool droppable(const Ids& pages) const;         // all published and unheld
  Settled drop_victims(int tier, const Ids& victims);
  std::vector<BatchSpec> split_batches(const Ids& pages, int dst_tier) const;
  // A batch that moved into (dst_tier, dst_group) at dst_slots, with `event`. With
  // write-through on, a published page promoted from the disk (no handoff) keeps its
  // disk slot as its clean copy; a page that lands on the disk loses its copy. `fence`: the
  // event the source slots' next writer waits for, when not `event` (-1): 0 for a batch whose
  // source rows were copied out before it landed (a spill written behind from a staging copy).
  Settled land(const Ids& batch, int dst_tier, int dst_group, const Ids& dst_slots, int32_t event, bool handoff,
               int32_t fence = -1);
  // Disk pages found corrupt (at these source slots) are dropped, clean copies among them only
  // freed (their primaries stay); returns their depths.
  Ids discard_corrupt(const Ids& batch, const Ids& bad_slots);
  // A spill that landed before its write, and the write failed (its slots hold nothing): the
  // pages of `batch` still on the disk with `event` as their ready event and not claimed are
  // dropped as discard_corrupt drops them (a claimed one fails its read, which discards it).
  Ids discard_unwritten(const Ids& batch, int32_t event);

  // -- clean copies (write-through to the host or the disk) -------------------------
  // With write-through on for a cold tier (HOST or DISK), every page published in a
  // warmer tier is queued for a copy in it once its bytes are final: at publish if
  // no sequence holds it locked, else when one releases it. take_copies claims up
  // to max_pages of the tier's queued pages that are not moving (locked ones too:
  // readers only read them), in queue order, with copy claims: negative ids, which
  // an acquire of a GPU page does not wait for (the page stays in place). Moving
  // ones go to the back of the queue; gone ones (dead, moved to that tier or
  // colder, unpublished, with a copy there already) leave.
  void set_write_through(int tier, bool on);
  bool write_through(int tier) const { return cold_tier(tier) && wt_[tier].on; }
  Ids take_copies(int tier, int32_t max_pages, Ids& claims);
  size_t copies_pending(int tier) const;
  // The claimed batch was written to (tier, group) at slots: each page still the
  // live, published primary of its block, warmer than the tier and without a copy
  // there, gets its copy there; the other slots are freed. Ends the batch's claims.
  Ids land_copies(const Ids& batch, int tier, int32_t group, const Ids& slots, int32_t event);
  // Victims claimed for a move to dst_tier: a victim that is itself a copy leaves
  // (its primary stays: a clean copy is dropped, never moved down), and one whose
  // chain has an unclaimed copy in dst_tier takes over that copy's slot (no bytes
  // move; its copies warmer than dst_tier go). Their source slots go to the caller
  // (out.slots, fenced as drop_victims does); the claims that no remaining victim
  // holds end (out.claims). Returns the victims still to move.
  Ids swap_to_copies(const Ids& victims, int dst_tier, Settled& out);
  // The next link of id's chain (its copy, or a copy's colder copy); -1: none.
  int32_t copy_of(int32_t id) const { return size_t(id) < copy_of_.size() ? copy_of_[size_t(id)] : -1; }

  // -- the disk tier across restarts ----------------------------------------------
  // Published pages not on disk (nor with a copy there), unclaimed and unlocked,
  // most recent first, per disk group, at most `capacity` each; only pages whose
  // blocks reach the disk (reaches_disk), checked before and after the cut.
  std::vector<Ids> persist_candidates() const;
  Ids still_persistable(const Ids& pages, int32_t group) const;   // still the index's pages, bound for group
  // Evictable disk pages of the ancestors of `candidates` (persist_candidates' answer; under
  // write-through, of every disk page too): the caller claims them while it persists (by id, ascending).
  Ids persist_anchors(const std::vector<Ids>& candidates) const;
  // Rebuild the index from recovered records; returns slots to forget per group
  // (not recoverable or unreachable). Counters: recovered, orphaned, discarded.
  std::vector<Ids> recover(std::vector<RecoveredRecord>& records);
  std::vector<RecoveredRecord>& pending_records() { return pending_records_; }   // filled in chunks by the bindings

  // -- KV events (kv_events.hpp) ----------------------------------------------------
  void set_kv_events(bool on) { kv_events_.on = on; kv_events_.tpb = tpb_; }
  int32_t tokens_per_block() const { return tpb_; }
  // Tokens of the sequence's key positions [first, first + n) (n * tokens_per_block),
  // given to the blocks that commit publishes for their STORED entries; a no-op while
  // events are off. Positions after a gap in what was given get none.
  void set_tokens(int32_t s, int32_t first, const int32_t* tokens, int32_t n);
  KvEventLog& kv_events() { return kv_events_; }
  KvEventFormat& kv_event_format() { return kv_format_; }

  // -- drains -----------------------------------------------------------------------
  std::vector<std::pair<int32_t, Ids>> take_disk_frees();
  std::vector<std::pair<int32_t, Ids>> take_relabels();     // (disk group, pages)

  // -- tools and tests --------------------------------------------------------------
  Ids tier_pages(int tier, int group) const;      // the pages owning slots of (tier, group), by slot
  // For a scrub: claims, one claim for all (its id in claim_out, 0 when none), the pages owning
  // slots [lo, hi) of (tier, group) that are live and unclaimed, clean copies too, by slot.
  // Claimed (and off their queue), they neither move nor go until unclaim: their bytes hold still
  // while read.
  Ids claim_resident(int tier, int group, int32_t lo, int32_t hi, int32_t& claim_out);
  void drop_page(int32_t id);                     // drop a published page as the last tier's eviction would

  // -- queries ----------------------------------------------------------------------
  const Page& page(int32_t id) const {
    if (!valid_page(id)) throw CoreError("no such page");
    return pt_[id];
  }
  const Block& block(int32_t id) const { return index_.blocks[id]; }
  int32_t find_block(const Key& k) const { return index_.find(k); }
  int32_t block_page(int32_t b, int lc) const { return index_.page(b, lc); }
  size_t indexed_blocks() const { return index_.indexed_count(); }
  size_t live_pages() const { return pt_.live(); }
  size_t live_blocks() const;
  size_t memory_bytes() const;
  const Counters& counters() const { return counters_; }
  // Pages open_sequence matched in each pool group, [tier][group] (Counters.hits counts blocks by tier).
  const std::vector<std::vector<int64_t>>& hit_pages() const { return hit_pages_; }
  int64_t clock() const { return clock_; }
  // Per (tier, group): [locked, held, droppable] page counts.
  std::vector<std::vector<std::vector<int64_t>>> state_counts() const;
  void check() const;           // throws CoreError naming the first broken invariant
  int last_tier() const { return last_tier_; }
  int next_tier(int t) const { return next_tier_[t]; }
  int32_t group_of(int tier, int lc) const { return group_of_[tier][lc]; }
  int n_lcs() const { return int(lcs_.size()); }

 private:
  bool evictable(const Page& p) const {
    return !p.locks && !p.claim && !p.dead && (p.copy || p.tier != last_tier_ || (p.published && !p.holders));
  }
  bool has_copy(int32_t id) const { return copy_of(id) >= 0; }
  static bool cold_tier(int tier) { return tier == HOST || tier == DISK; }
  bool any_write_through() const { return wt_[HOST].on || wt_[DISK].on; }
  int32_t copy_in(int32_t primary, int tier) const;    // the chain's copy in `tier`; -1: none
  void link_copy(int32_t primary, int32_t c);           // c joins the chain in its tier's place
  // c leaves its chain (not freed); `removed`: its tier no longer holds the block (a KV event)
  void unlink_copy(int32_t c, bool removed = true);
  // The chain's copies in `tier` and warmer leave the store (slots freed, or kept by a claim).
  void free_copies(int32_t primary, int tier = DISK);
  void queue_copy(int32_t id);                 // into the pending FIFO of each write-through tier colder than it
  int32_t next_copy_claim();
  // One claim per (source tier, source group, destination group) of `pages`, in order of first
  // appearance; copy claims (negative) when `copy`. Returns the new claim ids.
  Ids claim_batches(const Ids& pages, const std::vector<int32_t>& dst_group, bool copy);
  int64_t tier_stamp(int32_t b, int lc, int tier) const;   // recency of block b's page (lc) in tier; INT64_MAX: none
  bool reaches_disk(int32_t b, const std::vector<uint8_t>& chosen, std::vector<int8_t>& memo) const;
  void note(KvEventKind kind, int32_t id);     // a KV event for the page's block, in its tier
  void note_arrivals(const Ids& batch);        // STORED for a landed batch, chain by chain
  void give_tokens(const Seq& q, int32_t i, int32_t b) {   // KV events: position i's tokens to block b
    if (kv_events_.on && size_t(i + 1) * size_t(tpb_) <= q.tokens.size() && !kv_events_.has_tokens(b))
      kv_events_.set_tokens(b, &q.tokens[size_t(i) * size_t(tpb_)]);
  }
  void publish(int32_t id) {
    pt_[id].published = true;
    if (kv_events_.on) note(KV_STORED, id);
    // write-through: queued now if nobody holds it locked (its bytes are final), else when released
    if (any_write_through() && !pt_[id].locks) {
      pt_[id].copy_ready = true;
      queue_copy(id);
    }
  }
  void unpublish(int32_t id) {
    Page& p = pt_[id];
    if (p.published && kv_events_.on) note(KV_REMOVED, id);
    p.published = false;
    if (has_copy(id)) free_copies(id);
  }
  void requeue(int32_t id);
  void queue_all(const Ids& pages);               // the evictable ones among unqueued pages
  void unqueue(int32_t id) { Page& p = pt_[id]; if (p.queued) queues_[p.tier][p.group].remove(pt_, id); }
  void touch(int32_t id);
  int32_t new_page(int32_t block, int lc, int tier, int group, int32_t slot, int priority);
  void free_page(int32_t id, bool release_slot = true);
  void release_slot(int tier, int group, int32_t slot, int32_t fence);
  // Drop (published), free, or (a clean copy) unlink and free a disk page never served; its depth.
  int32_t discard_page(int32_t id);
  void drop(int32_t id, bool release_slot = true);
  void drop_subtree(int32_t root);
  void unindex(int32_t b);
  void set_block(int32_t page, int32_t block);
  void maybe_recycle(int32_t id) { if (pt_.recyclable(id)) { set_block(id, -1); pt_.recycle(id); } }
  void needed(const Seq& q, std::vector<std::pair<int32_t, int32_t>>& out) const;
  Ids needed_pages(const Seq& q) const;           // the row's page (or -1) of each needed (block, lc)
  void lock(const Ids& pages);                    // LOCKED: out of their queues
  bool reusable(const Ids& path, int32_t k) const;
  int32_t commit_conflict(int32_t s, int32_t n, bool& all_new);
  void adopt(int32_t node, int32_t s, int32_t i);
  void published_cold(int32_t id);
  Ids end_claims(const Ids& pages, Ids& live);
  void relabel_later(const Ids& pages);
  int32_t next_claim();
  Seq& live_seq(int32_t s);

  int32_t tpb_;
  std::vector<LifeCycle> lcs_;
  std::vector<std::vector<int32_t>> group_of_;    // [tier][lc]
  std::vector<int32_t> sole_group_;               // per tier: the one group every lc maps to, or INT32_MIN
  int last_tier_ = GPU;
  int next_tier_[kTiers] = {-1, -1, -1};
  bool reads_all_ = true;                         // every lc is full attention: an acquire needs every page
  bool shares_nothing_ = false;                   // every lc PRIVATE: nothing is indexed
  std::vector<int> limiting_lcs_;                 // lcs whose pages a match must check

  PageTable pt_;
  BlockIndex index_;
  std::vector<std::vector<SlotAllocator>> allocs_;     // [tier][group]
  std::vector<std::vector<LruQueue>> queues_;          // [tier][group]
  std::vector<std::vector<Ids>> owners_;               // [tier][group][slot] -> page (-1)
  std::vector<Seq> seqs_;
  Ids free_seqs_;
  int64_t clock_ = 0;
  int32_t claim_counter_ = 0;
  int32_t copy_claim_counter_ = 0;                     // copy claims count down from -1
  // Clean copies. copy_of_[page] -> the next (colder) link of its chain (-1: none); sized with
  // the page table while any write-through is on, empty before. Invariant: a recycled id's entry
  // is -1. wt_[t] (t HOST or DISK): on, and the FIFO of pages published warmer than t to copy
  // there (ids may go stale: take_copies filters them); entries before head are done.
  struct WriteThroughQueue {
    bool on = false;
    Ids pending;
    size_t head = 0;
  };
  WriteThroughQueue wt_[kTiers];
  std::vector<int32_t> copy_of_;
  Counters counters_;
  std::vector<std::vector<int64_t>> hit_pages_;        // [tier][group]: pages matched there (open_sequence)
  std::vector<std::pair<int32_t, Ids>> disk_frees_;    // drained by Python after each call
  Ids relabels_;                                       // pages to relabel (filtered at take)
  mutable std::vector<int32_t> scratch_;
  // Per-call scratch of the request path, kept to spare an allocation per call.
  Ids open_path_, open_held_;
  std::vector<int32_t> ext_need_;                      // extend_now: slots needed per GPU group ...
  std::vector<Ids> ext_slots_;                         // ... and the new slots
  std::vector<uint64_t> commit_hashes_;
  std::vector<RecoveredRecord> pending_records_;
  KvEventLog kv_events_;
  KvEventFormat kv_format_;
  // note_arrivals' scratch, per position in the landed batch: an open-addressing table of
  // (block, lc) -> position (-1: empty), each page's first child and next sibling among the
  // batch (-1: none), whether its parent is in the batch, and the walk's stack
  std::vector<int32_t> arrival_table_;
  std::vector<int32_t> arrival_child_, arrival_sibling_, arrival_stack_;
  std::vector<uint8_t> arrival_has_parent_;
};

}  // namespace kvtier
