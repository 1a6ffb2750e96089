// The disk tier's journal record, as the core writes and reads it.
//
// The layout is the on-disk format of tiers/journal.py (`RECORD`): 64 bytes,
// little-endian, no padding the compiler chooses. The core fills the fields
// that name a page (keys, depth, life cycle, priority) for a batch moving to
// disk, and reads them back at recovery; the disk tier fills kind, slot,
// generation and checksum. tests/test_journal.py pins the two layouts.
#pragma once

#include <cstddef>
#include <cstdint>
#include <cstring>

#include "keys.hpp"

namespace kvtier {

struct DiskRecord {
  uint8_t kind;          // 0 write, 1 free (the disk tier's)
  uint8_t ktag;          // Key::tag, or kTagAnonymous
  uint8_t ptag;          // the parent's Key::tag, or kTagNone
  uint8_t priority;      // 0..100
  uint16_t lc;
  uint16_t pad;
  uint32_t slot;         // the disk tier's
  uint32_t depth;
  uint64_t gen;          // the disk tier's
  uint64_t csum;         // the disk tier's
  uint8_t key[16];
  uint8_t parent[16];

  static constexpr uint8_t kTagAnonymous = 255;   // an uncommitted page: recovery never serves it
  static constexpr uint8_t kTagNone = 254;        // no parent: the first block of a chain
};

static_assert(sizeof(DiskRecord) == 64, "the journal's records are 64 bytes");
static_assert(offsetof(DiskRecord, lc) == 4 && offsetof(DiskRecord, slot) == 8 && offsetof(DiskRecord, depth) == 12 &&
                  offsetof(DiskRecord, gen) == 16 && offsetof(DiskRecord, csum) == 24 &&
                  offsetof(DiskRecord, key) == 32 && offsetof(DiskRecord, parent) == 48,
              "DiskRecord must match tiers/journal.py's RECORD");
static_assert(__BYTE_ORDER__ == __ORDER_LITTLE_ENDIAN__, "the journal is little-endian; so is every host kvtier runs on");

}  // namespace kvtier
