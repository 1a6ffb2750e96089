// Block keys as the core stores them: 16 bytes and a tag.
//
// A caller's key is an int or non-empty bytes (tokens hash to 16-byte
// BLAKE2b digests). The core keeps one fixed-size form:
//   tag 0      an int in [-2**127, 2**127), 16 bytes little-endian two's complement;
//   tag 1..16  bytes of that length, zero-padded to 16.
// Longer bytes keys are digested to 16 bytes (BLAKE2b-128) by the bindings
// and then stored as tag 16, so their digest is the key recovery writes and
// reads back: both spellings meet in one block.
#pragma once

#include <cstddef>
#include <cstdint>
#include <cstring>

namespace kvtier {

struct Key {
  uint8_t bytes[16];
  uint8_t tag;

  bool operator==(const Key& o) const { return tag == o.tag && std::memcmp(bytes, o.bytes, 16) == 0; }
  bool operator!=(const Key& o) const { return !(*this == o); }

  uint64_t hash() const {
    uint64_t a, b;
    std::memcpy(&a, bytes, 8);
    std::memcpy(&b, bytes + 8, 8);
    uint64_t x = a ^ (b * 0x9E3779B97F4A7C15ULL) ^ (uint64_t(tag) << 56);
    x ^= x >> 30; x *= 0xBF58476D1CE4E5B9ULL;        // splitmix64's finalizer: small ints spread too
    x ^= x >> 27; x *= 0x94D049BB133111EBULL;
    x ^= x >> 31;
    return x;
  }
};

}  // namespace kvtier
