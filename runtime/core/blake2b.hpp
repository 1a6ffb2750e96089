// BLAKE2b (RFC 7693) and the chained block keys built on it.
//
// A block key is key[i] = BLAKE2b-128(key[i-1] || tokens of block i || salt),
// with key[-1] = the parent key (empty for a sequence's first block) and each
// token as a little-endian int64. This is exactly what
//   hashlib.blake2b(prev, digest_size=16); update(tokens); update(salt)
// computes, so keys written by earlier (pure-Python) versions stay valid.
#pragma once

#include <cstddef>
#include <cstdint>

namespace kvtier {

// Incremental BLAKE2b without a key. Invariant: `buffered_` <= 128 bytes are
// held in `block` and not yet compressed; the last block is compressed only
// in finish(), with the final flag set.
class Blake2b {
 public:
  explicit Blake2b(size_t digest_bytes);       // 1..64
  void update(const void* data, size_t len);
  void finish(uint8_t* out);                   // writes digest_bytes bytes; the object is spent

 private:
  void compress(const uint8_t* block, bool last);
  uint64_t h_[8];
  uint64_t t_[2] = {0, 0};                     // bytes compressed so far (128-bit counter)
  uint8_t block_[128];
  size_t buffered_ = 0;
  size_t digest_bytes_;
};

// Keys of every full block of `tokens` (n_tokens / tokens_per_block of them),
// 16 bytes each, into `out`. `parent` (parent_len bytes, may be 0) chains the
// first block to an earlier one.
void chain_block_keys(const int64_t* tokens, size_t n_tokens, size_t tokens_per_block,
                      const uint8_t* salt, size_t salt_len,
                      const uint8_t* parent, size_t parent_len, uint8_t* out);

}  // namespace kvtier
