// Python bindings of the native core (nanobind): runtime.core._core.
//
// Page lists cross the boundary as `Pages`, an opaque array of page ids that
// Python passes back without looking inside; slot lists, fences and claim ids
// as plain lists (Python consumes them). Keys arrive as Python ints or bytes
// and are converted here (see keys.hpp for the stored form).
#include <nanobind/nanobind.h>
#include <nanobind/ndarray.h>
#include <nanobind/stl/optional.h>
#include <nanobind/stl/pair.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/tuple.h>
#include <nanobind/stl/vector.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <string>

#include "blake2b.hpp"
#include "core.hpp"
#include "disk_record.hpp"

namespace nb = nanobind;
using namespace nb::literals;
using kvtier::Core;
using kvtier::Ids;
using kvtier::Key;

namespace {

constexpr int32_t kCommitPastBlocks = -2;      // commit's answers (model.py: COMMIT_PAST_*)
constexpr int32_t kCommitPastKeys = -3;
constexpr bool kLittleEndian = __BYTE_ORDER__ == __ORDER_LITTLE_ENDIAN__;

struct Pages {
  Ids ids;
};

// A caller's key (int or non-empty bytes) in the core's form; raises
// ValueError / TypeError naming the problem.
Key to_key(PyObject* o) {
  Key k{};
  if (PyLong_Check(o) && !PyBool_Check(o)) {
    int overflow = 0;
    long long v = PyLong_AsLongLongAndOverflow(o, &overflow);
    if (!overflow) {
      if (v == -1 && PyErr_Occurred()) throw nb::python_error();
      uint64_t lo = uint64_t(v), hi = v < 0 ? ~uint64_t(0) : 0;
      std::memcpy(k.bytes, &lo, 8);
      std::memcpy(k.bytes + 8, &hi, 8);
    } else {
      nb::object b;
      try {
        b = nb::borrow(o).attr("to_bytes")(16, "little", "signed"_a = true);
      } catch (nb::python_error&) {
        throw nb::value_error("an int block key must fit in 128 bits (-2**127 <= key < 2**127)");
      }
      std::memcpy(k.bytes, PyBytes_AsString(b.ptr()), 16);
    }
    k.tag = 0;
    return k;
  }
  if (PyBytes_Check(o)) {
    Py_ssize_t n = PyBytes_GET_SIZE(o);
    const char* p = PyBytes_AS_STRING(o);
    if (n == 0) throw nb::value_error("block key b'' is reserved (the disk tier's mark for uncommitted pages)");
    if (n <= 16) {
      std::memcpy(k.bytes, p, size_t(n));
      k.tag = uint8_t(n);
    } else {
      kvtier::Blake2b h(16);
      h.update(p, size_t(n));
      h.finish(k.bytes);
      k.tag = 16;
    }
    return k;
  }
  throw nb::type_error("a block key must be an int or bytes");
}

std::vector<Key> to_keys(nb::handle seq) {
  nb::object fast = nb::steal(PySequence_Fast(seq.ptr(), "block keys must be a sequence"));
  if (!fast.is_valid()) throw nb::python_error();
  Py_ssize_t n = PySequence_Fast_GET_SIZE(fast.ptr());
  PyObject** items = PySequence_Fast_ITEMS(fast.ptr());
  std::vector<Key> out(static_cast<size_t>(n));
  for (Py_ssize_t i = 0; i < n; ++i) {
    out[size_t(i)] = to_key(items[i]);
    if (i && (out[size_t(i)].tag == 0) != (out[0].tag == 0)) throw nb::value_error("block_keys mixes int and bytes keys");
  }
  return out;
}

nb::object from_key(const Key& k) {
  if (k.tag != 0) return nb::steal(PyBytes_FromStringAndSize(reinterpret_cast<const char*>(k.bytes), k.tag));
  int64_t lo;
  uint64_t hi;
  std::memcpy(&lo, k.bytes, 8);
  std::memcpy(&hi, k.bytes + 8, 8);
  if (hi == (lo < 0 ? ~uint64_t(0) : 0)) return nb::steal(PyLong_FromLongLong(lo));
  nb::bytes raw(reinterpret_cast<const char*>(k.bytes), 16);
  return nb::module_::import_("builtins").attr("int").attr("from_bytes")(raw, "little", "signed"_a = true);
}

// {group: [slots]} (or a list indexed by group) as the core's per-group vectors.
std::vector<Ids> slots_by_group(const Core& c, int tier, nb::handle slots) {
  std::vector<Ids> out(size_t(c.n_groups(tier)));
  nb::dict d = nb::cast<nb::dict>(slots);
  for (auto [g, v] : d) {
    int gi = nb::cast<int>(g);
    if (gi < 0 || gi >= c.n_groups(tier)) throw nb::value_error("slots for a pool group that does not exist");
    out[size_t(gi)] = nb::cast<Ids>(v);
  }
  return out;
}

// Page ids Python hands back: the core's own, but a tool can build any.
const Ids& ids(const Core& c, const Pages& p) {
  for (int32_t id : p.ids)
    if (!c.valid_page(id)) throw nb::index_error("no such page");
  return p.ids;
}

// A journal record's key in the core's form: a bytes key's padding past its
// length is zeroed, so that a record with junk there names the same block as
// the key it spells (Key compares all 16 bytes).
Key record_key(const uint8_t (&bytes)[16], uint8_t tag) {
  Key k{};
  std::memcpy(k.bytes, bytes, tag >= 1 && tag < 16 ? tag : 16);
  k.tag = tag;
  return k;
}

void check_tier_group(const Core& c, int tier, int group) {
  if (tier < 0 || tier >= kvtier::kTiers || group < 0 || group >= c.n_groups(tier))
    throw nb::index_error("no such tier and pool group");
}

}  // namespace

NB_MODULE(_core, m) {
  m.doc() = "kvtier's native control plane: page table, prefix index, slot allocators, LRU queues, decisions";
  m.attr("COMMIT_PAST_BLOCKS") = kCommitPastBlocks;
  m.attr("COMMIT_PAST_KEYS") = kCommitPastKeys;
  nb::exception<kvtier::CoreError>(m, "CoreError", PyExc_RuntimeError);

  m.def(
      "chain_block_keys",
      [](nb::bytes tokens, size_t tokens_per_block, nb::bytes salt, nb::bytes parent) {
        // tokens: little-endian int64 bytes (numpy's tobytes of an '<i8' array)
        if (tokens_per_block == 0) throw nb::value_error("tokens_per_block must be positive");
        if (tokens.size() % 8) throw nb::value_error("tokens must be whole little-endian int64s (8 bytes each)");
        size_t n_tokens = tokens.size() / 8;
        size_t n_blocks = n_tokens / tokens_per_block;
        std::string out(n_blocks * 16, '\0');
        const unsigned char* raw = reinterpret_cast<const unsigned char*>(tokens.c_str());
        {
          nb::gil_scoped_release nogil;       // the bytes objects stay alive: the caller holds them
          std::vector<int64_t> toks(n_tokens);
          if constexpr (kLittleEndian) {
            if (n_tokens) std::memcpy(toks.data(), raw, n_tokens * 8);
          } else {
            for (size_t i = 0; i < n_tokens; ++i) {
              uint64_t v = 0;
              for (int b = 7; b >= 0; --b) v = (v << 8) | raw[8 * i + size_t(b)];
              toks[i] = int64_t(v);
            }
          }
          kvtier::chain_block_keys(toks.data(), n_tokens, tokens_per_block,
                                   reinterpret_cast<const uint8_t*>(salt.c_str()), salt.size(),
                                   reinterpret_cast<const uint8_t*>(parent.c_str()), parent.size(),
                                   reinterpret_cast<uint8_t*>(out.data()));
        }
        nb::list keys;
        for (size_t i = 0; i < n_blocks; ++i) keys.append(nb::bytes(out.data() + 16 * i, 16));
        return keys;
      },
      "tokens"_a, "tokens_per_block"_a, "salt"_a, "parent"_a,
      "Chained BLAKE2b-128 block keys of every full block of `tokens` (little-endian int64 bytes).");

  nb::class_<Pages>(m, "Pages", "An opaque array of page ids, passed back to the core.")
      .def(nb::init<>())
      .def("__init__", [](Pages* p, Ids ids) { new (p) Pages{std::move(ids)}; })
      .def("__len__", [](const Pages& p) { return p.ids.size(); })
      .def("__bool__", [](const Pages& p) { return !p.ids.empty(); })
      .def("tolist", [](const Pages& p) { return p.ids; })
      .def("slice", [](const Pages& p, size_t a, size_t b) {
        a = std::min(a, p.ids.size());
        b = std::min(std::max(a, b), p.ids.size());
        return Pages{Ids(p.ids.begin() + a, p.ids.begin() + b)};
      });

  nb::class_<Core>(m, "Core")
      .def("__init__",
           [](Core* c, int32_t tpb, std::vector<std::tuple<bool, int64_t, int64_t, int>> lcs,
              std::vector<std::vector<int32_t>> group_of, std::vector<std::vector<int32_t>> capacity,
              std::optional<size_t> prefault_pages) {
             std::vector<kvtier::LifeCycle> v;
             for (auto& [ssm, window, sinks, reuse] : lcs) {
               if (reuse < 0 || reuse > 3) throw nb::value_error("reuse must be 0..3");
               v.push_back({ssm, window, sinks, kvtier::Reuse(reuse)});
             }
             new (c) Core(tpb, std::move(v), std::move(group_of), std::move(capacity),
                          prefault_pages.value_or(kvtier::kPrefaultPages));
           },
           // the per-slot tables of a large disk tier take milliseconds to build: not with the GIL held
           nb::call_guard<nb::gil_scoped_release>(), "tokens_per_block"_a, "life_cycles"_a, "group_of"_a,
           "capacity"_a, "prefault_pages"_a = nb::none())     // None: kPrefaultPages
      // -- sequences
      .def("open", [](Core& c, nb::handle keys, int priority) {
             auto r = c.open_seq(to_keys(keys), priority);
             return nb::make_tuple(r.seq, r.matched, nb::make_tuple(r.by_tier[0], r.by_tier[1], r.by_tier[2], r.by_tier[3]));
           })
      .def("append_keys", [](Core& c, int32_t s, nb::handle keys) { c.append_keys(s, to_keys(keys)); })
      // Returns the blocks the sequence had committed (Python keeps them on the closed sequence).
      .def("close", [](Core& c, int32_t s) {
             int32_t k = c.seq(s).committed;
             c.close_seq(s);
             return k;
           })
      .def("num_blocks", [](const Core& c, int32_t s) { return c.seq(s).blocks.size(); })
      .def("committed", [](const Core& c, int32_t s) { return c.seq(s).committed; })
      .def("acquired", [](const Core& c, int32_t s) { return c.seq(s).acquired; })
      .def("place_extension", [](Core& c, int32_t s, int32_t n, nb::handle slots) {
             auto v = slots_by_group(c, kvtier::GPU, slots);
             return c.place_extension(s, n, v);
           })
      .def("extend_now", [](Core& c, int32_t s, int32_t n) -> nb::object {
             Ids fences;
             if (!c.extend_now(s, n, fences)) return nb::none();
             return nb::cast(fences);
           })
      .def("undo_extend", &Core::undo_extend)
      // 1: locked; 0: not every needed page is on the GPU and still (the slow path); -1: the
      // sequence is already acquired (nothing changed). A code, not an exception: it is the hot path.
      .def("acquire_now", [](Core& c, int32_t s) { return c.seq(s).acquired ? -1 : int(c.acquire_now(s)); })
      .def("acquire_scan", [](Core& c, int32_t s) {
             Ids holes, claims;
             c.acquire_scan(s, holes, claims);
             return nb::make_tuple(holes, claims);
           })
      .def("fill_holes", [](Core& c, int32_t s, const Ids& holes, nb::handle slots) {
             auto v = slots_by_group(c, kvtier::GPU, slots);
             return c.fill_holes(s, holes, v);
           })
      .def("lock_needed", [](Core& c, int32_t s) { return Pages{c.lock_needed(s)}; })
      .def("finish_acquire", [](Core& c, int32_t s, const Pages& p) { c.finish_acquire(s, ids(c, p)); })
      .def("undo_acquire", [](Core& c, int32_t s, const Pages& p) { c.undo_acquire(s, ids(c, p)); })
      .def("unlock", [](Core& c, const Pages& p) { c.unlock(ids(c, p)); })
      .def("release", &Core::release)
      .def("ready_events", &Core::ready_events)
      .def("prefetch_pages", [](Core& c, int32_t s) { return Pages{c.prefetch_pages(s)}; })
      // -1: done; >= 0 (nothing changed): the first position whose key is indexed elsewhere or
      // repeated; kCommitPastBlocks / kCommitPastKeys: n is past the blocks with pages, or with keys.
      .def("commit", [](Core& c, int32_t s, int64_t n) {       // int64: a huge count is past the blocks too
             const kvtier::Seq& q = c.seq(s);
             if (n > int64_t(q.blocks.size())) return kCommitPastBlocks;
             if (n > int64_t(q.keys.size())) return kCommitPastKeys;
             return c.commit(s, int32_t(n));
           })
      .def("page_indices", [](const Core& c, int32_t s, int lc) { return c.page_indices(s, lc); })
      .def("locked_slots", [](const Core& c, int32_t s, int lc) { return c.locked_slots(s, lc); })
      .def("tier_pages", [](const Core& c, int tier, int g) { check_tier_group(c, tier, g); return Pages{c.tier_pages(tier, g)}; })
      .def("drop_page", &Core::drop_page)
      .def("claim_resident", [](Core& c, int tier, int g, int32_t lo, int32_t hi) {
             check_tier_group(c, tier, g);
             int32_t claim = 0;
             Pages got{c.claim_resident(tier, g, lo, hi, claim)};
             return nb::make_tuple(claim, std::move(got));
           })
      .def("recompute_blocks", [](const Core& c, int32_t s, int lc) { return c.recompute_blocks(s, lc); })
      // -- slots
      .def("allocate", [](Core& c, int tier, int g, int32_t n) -> nb::object {
             check_tier_group(c, tier, g);
             Ids out;
             if (!c.allocate(tier, g, n, out)) return nb::none();
             return nb::cast(out);
           })
      .def("release_slots", [](Core& c, int tier, int g, const Ids& slots, int32_t fence) {
             check_tier_group(c, tier, g);
             c.release_slots(tier, g, slots, fence);
           }, "tier"_a, "group"_a, "slots"_a, "fence"_a = 0)
      .def("give_back", [](Core& c, int tier, int g, const Ids& slots) {
             check_tier_group(c, tier, g);
             c.give_back(tier, g, slots);
           })
      .def("slot_fences", [](const Core& c, int tier, int g, const Ids& slots) {
             check_tier_group(c, tier, g);
             return c.slot_fences(tier, g, slots);
           })
      .def("free", [](const Core& c, int tier, int g) { check_tier_group(c, tier, g); return c.allocator(tier, g).free(); })
      .def("capacity", [](const Core& c, int tier, int g) { check_tier_group(c, tier, g); return c.allocator(tier, g).capacity(); })
      .def("used", [](const Core& c, int tier, int g) { check_tier_group(c, tier, g); return c.allocator(tier, g).used(); })
      .def("is_free", [](const Core& c, int tier, int g, int32_t s) {
             check_tier_group(c, tier, g);
             if (s < 0 || s >= c.allocator(tier, g).capacity()) throw nb::index_error("no such slot");
             return c.allocator(tier, g).is_free(s);
           })
      .def("queue_len", [](const Core& c, int tier, int g) { check_tier_group(c, tier, g); return c.queue_len(tier, g); })
      .def("n_groups", &Core::n_groups)
      // -- claims, eviction and moves
      .def("claim", [](Core& c, const Pages& p, int to_tier, bool one_queue) { return c.claim(ids(c, p), to_tier, one_queue); },
           "pages"_a, "to_tier"_a, "one_queue"_a = false)
      .def("claims_of", [](const Core& c, const Pages& p) { return c.claims_of(ids(c, p)); })
      .def("cold_pages", [](const Core& c, const Pages& p) { return Pages{c.cold_pages(ids(c, p))}; })
      .def("group_counts", [](const Core& c, const Pages& p, int tier) { return c.group_counts(ids(c, p), tier); })
      .def("unclaim", [](Core& c, const Pages& p) { return c.unclaim(ids(c, p)); })
      .def("pick_victims", [](Core& c, int tier, int g, int32_t need, int32_t extra) -> nb::object {
             check_tier_group(c, tier, g);
             Ids victims, claims;
             if (!c.pick_victims(tier, g, need, extra, victims, claims)) return nb::none();
             return nb::make_tuple(Pages{std::move(victims)}, claims);
           })
      .def("droppable", [](const Core& c, const Pages& p) { return c.droppable(ids(c, p)); })
      .def("drop_victims", [](Core& c, int tier, const Pages& p) {
             auto r = c.drop_victims(tier, ids(c, p));
             return nb::make_tuple(r.claims, r.slots);
           })
      // -- clean copies (write-through to the host or the disk)
      .def("set_write_through", &Core::set_write_through, "tier"_a, "on"_a)
      .def("write_through", &Core::write_through, "tier"_a)
      .def("copies_pending", &Core::copies_pending, "tier"_a)
      .def("take_copies", [](Core& c, int tier, int32_t max_pages) {
             if (max_pages < 0) throw nb::value_error("max_pages must not be negative");
             Ids claims;
             Ids pages = c.take_copies(tier, max_pages, claims);
             return nb::make_tuple(Pages{std::move(pages)}, claims);
           }, "tier"_a, "max_pages"_a)
      .def("land_copies", [](Core& c, const Pages& p, int tier, int32_t group, const Ids& slots, int32_t event) {
             return c.land_copies(ids(c, p), tier, group, slots, event);
           })
      .def("swap_to_copies", [](Core& c, const Pages& p, int dst_tier) {
             kvtier::Settled out;
             Ids rest = c.swap_to_copies(ids(c, p), dst_tier, out);
             return nb::make_tuple(out.claims, out.slots, Pages{std::move(rest)});
           })
      .def("persist_anchors", [](const Core& c, const std::vector<Pages>& candidates) {
             std::vector<Ids> groups;
             for (const Pages& p : candidates) groups.push_back(ids(c, p));
             return Pages{c.persist_anchors(groups)};
           })
      .def("copy_of", [](const Core& c, int32_t id) { c.page(id); return c.copy_of(id); })
      .def("split_batches", [](const Core& c, const Pages& p, int dst_tier) {
             nb::list out;
             for (auto& b : c.split_batches(ids(c, p), dst_tier))
               out.append(nb::make_tuple(int(b.src_tier), b.src_group, b.dst_group, Pages{b.pages}));
             return out;
           })
      .def("batch_view", [](const Core& c, const Pages& p) {
             // (source tier, source group, source slots, life cycles, distinct ready events)
             Ids slots, lcs, ready;
             for (int32_t id : p.ids) {
               const kvtier::Page& pg = c.page(id);
               slots.push_back(pg.slot);
               lcs.push_back(pg.lc);
               if (pg.ready && std::find(ready.begin(), ready.end(), pg.ready) == ready.end()) ready.push_back(pg.ready);
             }
             int tier = p.ids.empty() ? -1 : c.page(p.ids[0]).tier;
             int group = p.ids.empty() ? -1 : c.page(p.ids[0]).group;
             return nb::make_tuple(tier, group, slots, lcs, ready);
           })
      .def("disk_records", [](const Core& c, const Pages& p) {
             // the journal records (kvtier::DiskRecord, 64 bytes each) of pages moving to disk; the disk
             // tier fills kind, slot, generation and checksum. Unpublished pages get anonymous records.
             const Ids& page_ids = ids(c, p);
             std::string buf(page_ids.size() * sizeof(kvtier::DiskRecord), '\0');
             for (size_t i = 0; i < page_ids.size(); ++i) {
               const kvtier::Page& pg = c.page(page_ids[i]);
               kvtier::DiskRecord r{};
               r.lc = uint16_t(pg.lc);
               r.priority = uint8_t(pg.priority);
               r.ptag = kvtier::DiskRecord::kTagNone;
               if ((pg.published || (pg.copy && !pg.dead)) && pg.block >= 0) {   // a live copy names its block as its primary does
                 const kvtier::Block& b = c.block(pg.block);
                 r.ktag = b.key.tag;
                 std::memcpy(r.key, b.key.bytes, 16);
                 r.depth = uint32_t(b.depth);
                 if (b.parent >= 0) {
                   const Key& pk = c.block(b.parent).key;
                   r.ptag = pk.tag;
                   std::memcpy(r.parent, pk.bytes, 16);
                 }
               } else {
                 r.ktag = kvtier::DiskRecord::kTagAnonymous;
               }
               std::memcpy(&buf[i * sizeof r], &r, sizeof r);
             }
             return nb::bytes(buf.data(), buf.size());
           })
      .def("land", [](Core& c, const Pages& p, int dst_tier, int g, const Ids& dst_slots, int32_t event, bool handoff,
                      std::optional<int32_t> fence) {
             check_tier_group(c, dst_tier, g);
             if (fence && *fence < 0) throw nb::value_error("land: fence must be an event id >= 0 (0: none)");
             auto r = c.land(ids(c, p), dst_tier, g, dst_slots, event, handoff, fence ? *fence : -1);
             return nb::make_tuple(r.claims, r.slots);
           }, "pages"_a, "dst_tier"_a, "dst_group"_a, "dst_slots"_a, "event"_a, "handoff"_a, "fence"_a = nb::none())
      .def("discard_corrupt", [](Core& c, const Pages& p, const Ids& bad) { return c.discard_corrupt(ids(c, p), bad); })
      .def("discard_unwritten", [](Core& c, const Pages& p, int32_t event) {
             return c.discard_unwritten(ids(c, p), event);
           })
      // -- the disk tier across restarts
      .def("persist_candidates", [](const Core& c) {
             nb::list out;
             for (auto& ids : c.persist_candidates()) out.append(Pages{std::move(ids)});
             return out;
           })
      .def("still_persistable", [](const Core& c, const Pages& p, int32_t group) {
             return Pages{c.still_persistable(p.ids, group)};
           })
      .def("recover_add", [](Core& c, nb::ndarray<const uint8_t, nb::ndim<1>, nb::c_contig, nb::device::cpu> records,
                             nb::ndarray<const int32_t, nb::ndim<1>, nb::c_contig, nb::device::cpu> groups) {
             // recovered journal records (DiskRecord bytes, in write order) and the disk group of each;
             // recover() then rebuilds the index from all of them
             size_t n = groups.shape(0);
             if (records.shape(0) != n * sizeof(kvtier::DiskRecord))
               throw nb::value_error("recover_add: records must be 64 bytes per group entry");
             auto& recs = c.pending_records();
             nb::gil_scoped_release nogil;
             // grow geometrically: an exact reserve per chunk copied every record so far each time
             if (recs.capacity() < recs.size() + n) recs.reserve(std::max(recs.size() + n, 2 * recs.capacity()));
             for (size_t i = 0; i < n; ++i) {
               kvtier::DiskRecord d;
               std::memcpy(&d, records.data() + i * sizeof d, sizeof d);
               kvtier::RecoveredRecord r{};
               r.anonymous = d.ktag == kvtier::DiskRecord::kTagAnonymous;
               bool bad = !r.anonymous && d.ktag > 16;
               r.key = record_key(d.key, d.ktag);
               r.has_parent = d.ptag != kvtier::DiskRecord::kTagNone;
               bad = bad || (r.has_parent && d.ptag > 16);
               r.parent = record_key(d.parent, d.ptag);
               // a record the core cannot hold (bad key form, depth past int32) is discarded
               r.depth = bad || d.depth > uint32_t(INT32_MAX) ? -1 : int32_t(d.depth);
               r.lc = d.lc;
               r.group = groups.data()[i];
               r.slot = d.slot > uint32_t(INT32_MAX) ? -1 : int32_t(d.slot);
               r.priority = d.priority;
               r.generation = d.gen > uint64_t(INT64_MAX) ? INT64_MAX : int64_t(d.gen);
               recs.push_back(r);
             }
           })
      .def("recover", [](Core& c) {
             // slots to forget on disk, per group; the GIL is released while the index is rebuilt
             std::vector<Ids> forget;
             {
               nb::gil_scoped_release nogil;
               forget = c.recover(c.pending_records());
               std::vector<kvtier::RecoveredRecord>().swap(c.pending_records());   // a large free: no GIL
             }
             return forget;
           })
      .def("import_pages", &Core::import_pages, "seq"_a, "first"_a, "n"_a, "tier"_a, "slots"_a)
      // -- KV events (kv_events.hpp)
      .def("set_kv_events", &Core::set_kv_events, "on"_a)
      .def("set_tokens", [](Core& c, int32_t s, int32_t first,
                            nb::ndarray<const int32_t, nb::ndim<1>, nb::c_contig, nb::device::cpu> tokens, int32_t tpb) {
             if (tpb != c.tokens_per_block()) throw nb::value_error("set_tokens: tokens_per_block is not the core's");
             if (tokens.shape(0) % size_t(tpb)) throw nb::value_error("set_tokens: not whole blocks of tokens");
             c.set_tokens(s, first, tokens.data(), int32_t(tokens.shape(0) / size_t(tpb)));
           }, "seq"_a, "first"_a, "tokens"_a.noconvert(), "tokens_per_block"_a)
      .def("take_kv_events", [](Core& c) {
             // (pending entries as bytes of KvEvent, tokens as bytes of int32): tests and tools
             kvtier::KvEventLog& log = c.kv_events();
             nb::bytes ev(reinterpret_cast<const char*>(log.events.data() + log.head),
                          log.pending() * sizeof(kvtier::KvEvent));
             nb::bytes tok(reinterpret_cast<const char*>(log.tokens.data()), log.tokens.size() * sizeof(int32_t));
             log.consumed(log.pending());
             return nb::make_tuple(ev, tok);
           })
      .def("set_kv_event_format", [](Core& c, int32_t tpb, bool positional, std::vector<std::string> medium,
                                     std::vector<std::string> spec_kind, std::vector<int64_t> window) {
             if (int(spec_kind.size()) != c.n_lcs() || int(window.size()) != c.n_lcs() || medium.size() < 3)
               throw nb::value_error("set_kv_event_format: one spec kind and window per life cycle, a medium per tier");
             for (auto& m : medium) if (m.size() > 255) throw nb::value_error("set_kv_event_format: a name too long");
             for (auto& k : spec_kind) if (k.size() > 255) throw nb::value_error("set_kv_event_format: a name too long");
             if (tpb != c.tokens_per_block()) throw nb::value_error("set_kv_event_format: tokens_per_block is not the core's");
             kvtier::KvEventFormat& f = c.kv_event_format();
             f.positional = positional;
             f.medium = std::move(medium);
             f.spec_kind = std::move(spec_kind);
             f.window = std::move(window);
           }, "tokens_per_block"_a, "positional"_a, "medium"_a, "spec_kind"_a, "window"_a)
      .def("take_kv_event_payload", [](Core& c, size_t max_entries) {
             // (events, msgpack bytes of that many events back to back) from at most max_entries
             // pending entries (kv_event_codec.hpp). The GIL stays held: a chunk encodes in tens of
             // microseconds, and taking the GIL back could wait a whole switch interval
             kvtier::KvEventLog& log = c.kv_events();
             if (c.kv_event_format().medium.empty()) throw nb::value_error("take_kv_event_payload: no format set");
             size_t n = std::min(max_entries, log.pending());
             std::string out;
             out.reserve(n * 12 + 64);
             size_t events = kvtier::encode_kv_events(log, log.head, log.head + n, c.kv_event_format(), out);
             log.consumed(n);
             return nb::make_tuple(events, nb::bytes(out.data(), out.size()));
           }, "max_entries"_a)
      .def("kv_event_count", [](Core& c) { return c.kv_events().pending(); })
      .def("published_hashes", [](const Core& c) {
             // what each tier holds as routers see it: (hashes u64, tiers i8, lcs u8) as bytes, one per
             // live published page or clean copy (tests compare it with the events; a snapshot for late joiners)
             std::vector<uint64_t> h;
             std::vector<int8_t> t;
             std::vector<uint8_t> l;
             for (size_t id = 0; id < c.page_count(); ++id) {
               const kvtier::Page& p = c.page(int32_t(id));
               if (!p.in_use() || p.dead || !(p.published || p.copy) || p.block < 0 || !c.block(p.block).has_key)
                 continue;
               h.push_back(kvtier::external_hash(c.block(p.block).key));
               t.push_back(p.tier);
               l.push_back(p.lc);
             }
             return nb::make_tuple(nb::bytes(reinterpret_cast<const char*>(h.data()), h.size() * 8),
                                   nb::bytes(reinterpret_cast<const char*>(t.data()), t.size()),
                                   nb::bytes(reinterpret_cast<const char*>(l.data()), l.size()));
           })
      // -- drains
      .def("take_disk_frees", &Core::take_disk_frees)
      .def("take_relabels", [](Core& c) {
             nb::list out;
             for (auto& [g, ids] : c.take_relabels()) {
               Ids slots;
               for (int32_t id : ids) slots.push_back(c.page(id).slot);
               out.append(nb::make_tuple(g, slots, Pages{std::move(ids)}));
             }
             return out;
           })
      // -- queries
      .def("hit_pages", [](const Core& c) { return c.hit_pages(); })
      .def("counters", [](const Core& c) {
             auto& k = c.counters();
             nb::dict d;
             d["hits"] = nb::make_tuple(k.hits[0], k.hits[1], k.hits[2]);
             d["lookup_blocks"] = k.lookup_blocks;
             d["drops"] = k.drops;
             d["recovered"] = k.recovered;
             d["orphaned"] = k.orphaned;
             d["discarded"] = k.discarded;
             // the copy counters per tier of the copy, as hits: (gpu, host, disk)
             d["copies_made"] = nb::make_tuple(k.copies_made[0], k.copies_made[1], k.copies_made[2]);
             d["copies_kept"] = nb::make_tuple(k.copies_kept[0], k.copies_kept[1], k.copies_kept[2]);
             d["copy_swaps"] = nb::make_tuple(k.copy_swaps[0], k.copy_swaps[1], k.copy_swaps[2]);
             d["copies_evicted"] = nb::make_tuple(k.copies_evicted[0], k.copies_evicted[1], k.copies_evicted[2]);
             d["copies"] = nb::make_tuple(k.copies[0], k.copies[1], k.copies[2]);
             return d;
           })
      .def("state_counts", &Core::state_counts)
      .def("indexed_blocks", &Core::indexed_blocks)
      .def("live_pages", &Core::live_pages)
      .def("live_blocks", &Core::live_blocks)
      .def("memory_bytes", &Core::memory_bytes)
      .def_prop_ro("clock", &Core::clock)
      .def("last_tier", &Core::last_tier)
      .def("check", &Core::check)
      .def("page_info", [](const Core& c, int32_t id) {
             const kvtier::Page& p = c.page(id);
             nb::dict d;
             d["tier"] = int(p.tier);
             d["group"] = int(p.group);
             d["slot"] = p.slot;
             d["lc"] = int(p.lc);
             d["locks"] = int(p.locks);
             d["holders"] = int(p.holders);
             d["published"] = bool(p.published);
             d["dead"] = bool(p.dead);
             d["copy"] = bool(p.copy);
             d["claim"] = p.claim;
             d["stamp"] = p.stamp;
             d["priority"] = int(p.priority);
             d["depth"] = p.block >= 0 ? c.block(p.block).depth : -1;
             d["key"] = p.block >= 0 && c.block(p.block).has_key ? from_key(c.block(p.block).key) : nb::none();
             return d;
           })
      .def("seq_pages", [](const Core& c, int32_t s) {
             // per block, per life cycle: page id or -1 (tests and tools)
             const kvtier::Seq& q = c.seq(s);
             return q.pages;
           })
      .def("find", [](const Core& c, nb::handle key) -> nb::object {
             // an indexed block: (depth, parent key or None, [page id per life cycle]) or None
             int32_t b = c.find_block(to_key(key.ptr()));
             if (b < 0) return nb::none();
             const kvtier::Block& x = c.block(b);
             Ids pages;
             for (int lc = 0; lc < c.n_lcs(); ++lc) pages.push_back(c.block_page(b, lc));
             nb::object parent = x.parent >= 0 ? from_key(c.block(x.parent).key) : nb::none();
             return nb::make_tuple(x.depth, parent, pages);
           });
}
