// Batch kernels over the disk tier's slot table (tiers/disk_group.py, DiskGroup): its per-slot flags
// (live, pending, forgotten, journaled: one byte per slot, numpy bool) and its journal records
// (tiers.journal.RECORD rows, 64 bytes each).
//
// Why native: the disk tier's threads keep this table while the event loop runs Python, and
// numpy gives the GIL up for most operations on more than 500 elements (ufuncs, reductions, fancy
// indexing, casts, concatenation). Each time, the thread waits to get it back, up to the
// interpreter's switch interval (5 ms) behind a busy loop: a write of 600 pages went through
// about twenty such waits, and a disk thread that kept pace alone wrote 10x slower beside a
// thread running Python. These loops are microseconds for a batch; the bindings keep the GIL
// (module.cpp), giving it up once only for batches of tens of thousands.
//
// Preconditions (the bindings check them): every slot index is within the flags' length, and
// a record row is kRecordBytes long.
#pragma once

#include <cstddef>
#include <cstdint>
#include <cstring>

#include "record_identity.hpp"

namespace kvtier::slot_table {

// RECORD's fields these kernels touch (journal.py asserts the layout at import).
constexpr size_t kKind = 0;        // u1: 0 write, 1 free
constexpr size_t kPtag = 2;        // u1
constexpr size_t kPriority = 3;    // u1
constexpr size_t kSlot = 8;        // <u4
constexpr size_t kGen = 16;        // <u8
constexpr size_t kCsum = 24;       // <u8

constexpr uint8_t kWrite = 0, kFree = 1;
constexpr uint8_t kMaxKeyBytes = 16;      // ktag / ptag 1..16: a bytes key of that length
constexpr uint8_t kTagAnonymous = 255;    // ktag of an uncommitted page
constexpr uint8_t kTagNone = 254;         // ptag of a first block
constexpr uint8_t kMaxPriority = 100;

inline void store_le(uint8_t* p, uint64_t v, int n) {
  for (int i = 0; i < n; ++i, v >>= 8) p[i] = uint8_t(v);
}

// A batch's slot list: slots[i * stride], i < n (a numpy int64 array, any stride).
struct Slots {
  const int64_t* data;
  int64_t stride;
  size_t n;
  int64_t operator[](size_t i) const { return data[int64_t(i) * stride]; }
};

inline bool any_set(const uint8_t* flags, Slots s) {
  for (size_t i = 0; i < s.n; ++i)
    if (flags[s[i]]) return true;
  return false;
}

inline void set_all(uint8_t* flags, Slots s, bool value) {
  for (size_t i = 0; i < s.n; ++i) flags[s[i]] = value;
}

// The slots whose flag is `value`, in the batch's order, to `out`; returns how many.
inline size_t select(const uint8_t* flags, Slots s, bool value, int64_t* out) {
  size_t k = 0;
  for (size_t i = 0; i < s.n; ++i)
    if (bool(flags[s[i]]) == value) out[k++] = s[i];
  return k;
}

// The first position whose slot has neither flag set, or -1.
inline int64_t first_neither(const uint8_t* a, const uint8_t* b, Slots s) {
  for (size_t i = 0; i < s.n; ++i)
    if (!a[s[i]] && !b[s[i]]) return int64_t(i);
  return -1;
}

// journal.malformed for one record: an unknown key form or parent form, a priority above 100;
// with `stored` (a record read back, not a caller's write) also a kind other than write or
// free, and a generation of 0 or above max_gen.
inline bool malformed(const uint8_t* rec, bool stored, uint64_t max_gen) {
  const uint8_t ktag = rec[kRecordKtag], ptag = rec[kPtag];
  const bool bad = (ktag > kMaxKeyBytes && ktag != kTagAnonymous) || (ptag > kMaxKeyBytes && ptag != kTagNone) ||
                   rec[kPriority] > kMaxPriority;
  if (!stored) return bad;
  const uint8_t kind = rec[kKind];
  const uint64_t gen = load_le(rec + kGen, 8);
  return (kind == kWrite && bad) || kind > kFree || gen == 0 || gen > max_gen;
}

// A caller's write record made the journal's: kind write, its slot, its generation, and its
// checksum (the bytes' XXH64 XOR the record's identity under fingerprint `fp`).
inline void stamp_write(uint8_t* rec, uint32_t slot, uint64_t gen, uint64_t bytes_hash, uint64_t fp) {
  rec[kKind] = kWrite;
  store_le(rec + kSlot, slot, 4);
  store_le(rec + kGen, gen, 8);
  store_le(rec + kCsum, bytes_hash ^ record_identity(rec, fp), 8);
}

// A free record: kind free, its slot and generation (the rest as the caller zeroed it).
inline void stamp_free(uint8_t* rec, uint32_t slot, uint64_t gen) {
  rec[kKind] = kFree;
  store_le(rec + kSlot, slot, 4);
  store_le(rec + kGen, gen, 8);
}

// A queued record is current while its slot holds a live page whose record (meta, the slot
// table's copy) has the same generation: a later free, write or relabel supersedes it.
inline uint32_t slot_of(const uint8_t* rec) { return uint32_t(load_le(rec + kSlot, 4)); }
inline uint64_t gen_of(const uint8_t* rec) { return load_le(rec + kGen, 8); }

}  // namespace kvtier::slot_table
