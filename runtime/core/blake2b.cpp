// BLAKE2b per RFC 7693, unkeyed, written from the RFC (sections 2 and 3).
// See blake2b.hpp for the block-key scheme built on it.
#include "blake2b.hpp"

#include <cstring>
#include <stdexcept>

namespace kvtier {

namespace {

// RFC 7693 section 2.6: the SHA-512 initialisation vector.
constexpr uint64_t kIV[8] = {
    0x6a09e667f3bcc908ULL, 0xbb67ae8584caa73bULL, 0x3c6ef372fe94f82bULL,
    0xa54ff53a5f1d36f1ULL, 0x510e527fade682d1ULL, 0x9b05688c2b3e6c1fULL,
    0x1f83d9abfb41bd6bULL, 0x5be0cd19137e2179ULL,
};

constexpr size_t kBlockBytes = 128;

// Little-endian loads and stores: a plain copy where the host is known to be
// little-endian, byte shifts anywhere else.
#if defined(__BYTE_ORDER__) && __BYTE_ORDER__ == __ORDER_LITTLE_ENDIAN__
#define KVTIER_HOST_LE 1
#else
#define KVTIER_HOST_LE 0
#endif

inline uint64_t load64_le(const uint8_t* p) {
#if KVTIER_HOST_LE
  uint64_t v;
  std::memcpy(&v, p, 8);
  return v;
#else
  uint64_t v = 0;
  for (int i = 0; i < 8; ++i) v |= static_cast<uint64_t>(p[i]) << (8 * i);
  return v;
#endif
}

inline void store64_le(uint8_t* p, uint64_t v) {
#if KVTIER_HOST_LE
  std::memcpy(p, &v, 8);
#else
  for (int i = 0; i < 8; ++i) p[i] = static_cast<uint8_t>(v >> (8 * i));
#endif
}

inline uint64_t rotr64(uint64_t x, unsigned n) { return (x >> n) | (x << (64 - n)); }

}  // namespace

Blake2b::Blake2b(size_t digest_bytes) : digest_bytes_(digest_bytes) {
  if (digest_bytes < 1 || digest_bytes > 64)
    throw std::invalid_argument("BLAKE2b digest length must be 1..64 bytes");
  for (int i = 0; i < 8; ++i) h_[i] = kIV[i];
  // Parameter block word 0: digest length, key length 0, fanout 1, depth 1;
  // every other parameter (leaf length, node offset, salt, personal) is 0.
  h_[0] ^= 0x01010000ULL ^ static_cast<uint64_t>(digest_bytes);
  std::memset(block_, 0, sizeof block_);
}

// RFC 7693 section 3.2, function F. `last` sets the final-block flag (v[14]
// inverted); the caller has already added this block's bytes to t_.
void Blake2b::compress(const uint8_t* block, bool last) {
  uint64_t m[16];
  for (int i = 0; i < 16; ++i) m[i] = load64_le(block + 8 * i);

  uint64_t v0 = h_[0], v1 = h_[1], v2 = h_[2], v3 = h_[3];
  uint64_t v4 = h_[4], v5 = h_[5], v6 = h_[6], v7 = h_[7];
  uint64_t v8 = kIV[0], v9 = kIV[1], v10 = kIV[2], v11 = kIV[3];
  uint64_t v12 = kIV[4] ^ t_[0], v13 = kIV[5] ^ t_[1];
  uint64_t v14 = last ? ~kIV[6] : kIV[6], v15 = kIV[7];

  // The mixing function G (section 3.1) with rotations 32, 24, 16, 63, and
  // one round (section 3.2): four column steps, then four diagonal steps, on
  // message words chosen by the round's row of SIGMA (section 2.7). The
  // rounds are written out so every SIGMA index is a compile-time constant.
#define KVTIER_G(a, b, c, d, x, y)   \
  do {                               \
    a = a + b + (x);                 \
    d = rotr64(d ^ a, 32);           \
    c = c + d;                       \
    b = rotr64(b ^ c, 24);           \
    a = a + b + (y);                 \
    d = rotr64(d ^ a, 16);           \
    c = c + d;                       \
    b = rotr64(b ^ c, 63);           \
  } while (0)
#define KVTIER_ROUND(s0, s1, s2, s3, s4, s5, s6, s7, s8, s9, s10, s11, s12, s13, s14, s15) \
  do {                                                                                     \
    KVTIER_G(v0, v4, v8, v12, m[s0], m[s1]);                                               \
    KVTIER_G(v1, v5, v9, v13, m[s2], m[s3]);                                               \
    KVTIER_G(v2, v6, v10, v14, m[s4], m[s5]);                                              \
    KVTIER_G(v3, v7, v11, v15, m[s6], m[s7]);                                              \
    KVTIER_G(v0, v5, v10, v15, m[s8], m[s9]);                                              \
    KVTIER_G(v1, v6, v11, v12, m[s10], m[s11]);                                            \
    KVTIER_G(v2, v7, v8, v13, m[s12], m[s13]);                                             \
    KVTIER_G(v3, v4, v9, v14, m[s14], m[s15]);                                             \
  } while (0)

  // Twelve rounds; rounds 10 and 11 reuse SIGMA rows 0 and 1.
  KVTIER_ROUND(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
  KVTIER_ROUND(14, 10, 4, 8, 9, 15, 13, 6, 1, 12, 0, 2, 11, 7, 5, 3);
  KVTIER_ROUND(11, 8, 12, 0, 5, 2, 15, 13, 10, 14, 3, 6, 7, 1, 9, 4);
  KVTIER_ROUND(7, 9, 3, 1, 13, 12, 11, 14, 2, 6, 5, 10, 4, 0, 15, 8);
  KVTIER_ROUND(9, 0, 5, 7, 2, 4, 10, 15, 14, 1, 11, 12, 6, 8, 3, 13);
  KVTIER_ROUND(2, 12, 6, 10, 0, 11, 8, 3, 4, 13, 7, 5, 15, 14, 1, 9);
  KVTIER_ROUND(12, 5, 1, 15, 14, 13, 4, 10, 0, 7, 6, 3, 9, 2, 8, 11);
  KVTIER_ROUND(13, 11, 7, 14, 12, 1, 3, 9, 5, 0, 15, 4, 8, 6, 2, 10);
  KVTIER_ROUND(6, 15, 14, 9, 11, 3, 0, 8, 12, 2, 13, 7, 1, 4, 10, 5);
  KVTIER_ROUND(10, 2, 8, 4, 7, 6, 1, 5, 15, 11, 9, 14, 3, 12, 13, 0);
  KVTIER_ROUND(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
  KVTIER_ROUND(14, 10, 4, 8, 9, 15, 13, 6, 1, 12, 0, 2, 11, 7, 5, 3);

#undef KVTIER_ROUND
#undef KVTIER_G

  h_[0] ^= v0 ^ v8;
  h_[1] ^= v1 ^ v9;
  h_[2] ^= v2 ^ v10;
  h_[3] ^= v3 ^ v11;
  h_[4] ^= v4 ^ v12;
  h_[5] ^= v5 ^ v13;
  h_[6] ^= v6 ^ v14;
  h_[7] ^= v7 ^ v15;
}

namespace {

// Adds n bytes to the 128-bit byte counter t.
inline void add_count(uint64_t t[2], uint64_t n) {
  t[0] += n;
  if (t[0] < n) ++t[1];
}

}  // namespace

void Blake2b::update(const void* data, size_t len) {
  if (len == 0) return;  // data may be null then; memcpy must not see it
  const uint8_t* in = static_cast<const uint8_t*>(data);

  // A block is compressed only once more input follows it, because the last
  // block must be compressed in finish() with the final flag set.
  if (buffered_ + len <= kBlockBytes) {
    std::memcpy(block_ + buffered_, in, len);
    buffered_ += len;
    return;
  }
  // More than one block's worth: top up and compress the buffered block.
  if (buffered_ > 0) {
    const size_t fill = kBlockBytes - buffered_;
    std::memcpy(block_ + buffered_, in, fill);
    in += fill;
    len -= fill;
    add_count(t_, kBlockBytes);
    compress(block_, false);
    buffered_ = 0;
  }
  // Whole blocks straight from the input, keeping at least one byte back
  // (len > 0 here, since buffered_ + len exceeded a block).
  while (len > kBlockBytes) {
    add_count(t_, kBlockBytes);
    compress(in, false);
    in += kBlockBytes;
    len -= kBlockBytes;
  }
  std::memcpy(block_, in, len);
  buffered_ = len;
}

void Blake2b::finish(uint8_t* out) {
  std::memset(block_ + buffered_, 0, kBlockBytes - buffered_);
  add_count(t_, buffered_);
  compress(block_, true);

  uint8_t digest[64];
  for (int i = 0; i < 8; ++i) store64_le(digest + 8 * i, h_[i]);
  std::memcpy(out, digest, digest_bytes_);
  buffered_ = 0;
}

void chain_block_keys(const int64_t* tokens, size_t n_tokens, size_t tokens_per_block,
                      const uint8_t* salt, size_t salt_len,
                      const uint8_t* parent, size_t parent_len, uint8_t* out) {
  if (tokens_per_block == 0) return;  // no full blocks (Python would divide by zero)
  const size_t n_blocks = n_tokens / tokens_per_block;
  const uint8_t* prev = parent;
  size_t prev_len = parent_len;
  for (size_t b = 0; b < n_blocks; ++b) {
    Blake2b h(16);
    h.update(prev, prev_len);
    const int64_t* block = tokens + b * tokens_per_block;
#if KVTIER_HOST_LE
    // The tokens' bytes in memory already are their little-endian encoding.
    h.update(block, tokens_per_block * sizeof(int64_t));
#else
    // Re-encode as little-endian int64 through a small stack buffer.
    uint8_t le[256];
    for (size_t i = 0; i < tokens_per_block;) {
      size_t k = 0;
      for (; k < sizeof le / 8 && i < tokens_per_block; ++k, ++i) {
        store64_le(le + 8 * k, static_cast<uint64_t>(block[i]));
      }
      h.update(le, 8 * k);
    }
#endif
    h.update(salt, salt_len);
    uint8_t* key = out + 16 * b;
    h.finish(key);
    prev = key;
    prev_len = 16;
  }
}

}  // namespace kvtier

#undef KVTIER_HOST_LE
