// Life cycles and the stale-block arithmetic (the C++ twin of
// tiers.layers.LifeCycle; tests hold the two to the same answers).
#pragma once

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <vector>

namespace kvtier {

enum Reuse : uint8_t { REQUIRED = 0, SINK_REQUIRED_ONLY = 1, OPTIONAL = 2, PRIVATE = 3 };

struct LifeCycle {
  bool ssm = false;
  int64_t window = 0;           // tokens; 0: full attention
  int64_t sinks = 0;            // tokens
  Reuse reuse = REQUIRED;

  int64_t sink_blocks(int64_t tpb) const { return (sinks + tpb - 1) / tpb; }

  // Blocks whose pages the next token (position h) reads, ascending.
  void needed_blocks(int64_t h, int64_t tpb, std::vector<int32_t>& out) const {
    out.clear();
    if (h <= 0) return;
    int64_t last = (h - 1) / tpb;
    if (ssm) {
      out.push_back(int32_t(last));
      return;
    }
    if (window == 0) {
      for (int64_t b = 0; b <= last; ++b) out.push_back(int32_t(b));
      return;
    }
    int64_t lo_tok = std::max<int64_t>(0, h + 1 - window);
    int64_t n_sinks = std::min(sink_blocks(tpb), last + 1);
    int64_t lo = lo_tok <= h - 1 ? lo_tok / tpb : last + 1;     // first window block (none: past last)
    for (int64_t b = 0; b < n_sinks && b < lo; ++b) out.push_back(int32_t(b));
    for (int64_t b = lo; b <= last; ++b) out.push_back(int32_t(b));
  }

  // Blocks that must be present for a prefix of h tokens to match.
  void required_blocks(int64_t h, int64_t tpb, std::vector<int32_t>& out) const {
    out.clear();
    if (reuse == REQUIRED) {
      needed_blocks(h, tpb, out);
    } else if (reuse == SINK_REQUIRED_ONLY && h > 0) {
      int64_t n = std::min(sink_blocks(tpb), (h - 1) / tpb + 1);
      for (int64_t b = 0; b < n; ++b) out.push_back(int32_t(b));
    }
  }

  // True when every longer prefix needs this block's page.
  bool prefix_critical(int64_t block, int64_t tpb) const {
    if ((reuse != REQUIRED && reuse != SINK_REQUIRED_ONLY) || ssm) return false;
    if (window == 0) return reuse == REQUIRED;
    return block < sink_blocks(tpb);
  }

  // Only these life cycles can make a match shorter than the indexed path
  // (a full-attention REQUIRED page is prefix-critical: always present).
  bool limits_match() const { return reuse == REQUIRED && (window != 0 || ssm); }
};

}  // namespace kvtier
