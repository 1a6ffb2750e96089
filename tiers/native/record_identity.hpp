// The identity of a disk journal record: a 64-bit mix of what the page is (block key and its
// form, life cycle) and the directory's layout fingerprint. A record's checksum field holds
// the page bytes' XXH64 XOR this identity, so a record that names another page's slot fails
// the check on read even though the bytes are intact (tiers/journal.py, `identity`).
//
// Layout: one record is 64 little-endian bytes, tiers.journal.RECORD; the offsets below must
// match its fields (journal.py asserts them at import).
#pragma once

#include <cstddef>
#include <cstdint>

namespace kvtier {

constexpr size_t kRecordBytes = 64;
constexpr size_t kRecordKtag = 1;     // u1: the block key's form
constexpr size_t kRecordLc = 4;       // <u2: life cycle
constexpr size_t kRecordKeyLo = 32;   // <u8
constexpr size_t kRecordKeyHi = 40;   // <u8

// splitmix64's finalizer (wrapping arithmetic).
inline uint64_t splitmix64_mix(uint64_t x) {
  x ^= x >> 30;
  x *= 0xBF58476D1CE4E5B9ULL;
  x ^= x >> 27;
  x *= 0x94D049BB133111EBULL;
  return x ^ (x >> 31);
}

// A little-endian unsigned field of `n` bytes at `p`, whatever the host's byte order.
inline uint64_t load_le(const unsigned char* p, int n) {
  uint64_t v = 0;
  for (int i = n - 1; i >= 0; --i) v = (v << 8) | p[i];
  return v;
}

// The identity of the record at `rec` (kRecordBytes bytes) under fingerprint hash `fp`.
inline uint64_t record_identity(const unsigned char* rec, uint64_t fp) {
  const uint64_t lc = load_le(rec + kRecordLc, 2);
  const uint64_t lo = load_le(rec + kRecordKeyLo, 8);
  const uint64_t hi = load_le(rec + kRecordKeyHi, 8);
  const uint64_t tags = uint64_t(rec[kRecordKtag]) | (lc << 8);
  uint64_t x = splitmix64_mix(tags ^ fp);
  x = splitmix64_mix(x ^ hi);
  return splitmix64_mix(x ^ lo);
}

}  // namespace kvtier
