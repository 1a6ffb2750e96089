// KV events as vLLM's msgpack bytes, encoded from the core's log without a
// Python object per block (runtime/events.py wraps them into batches).
//
// The encoding is msgpack-python's for the same values: every int in its
// shortest form, str as fixstr/str8, maps and arrays with the shortest
// header. A run of log entries of one kind, tier and life cycle (for STORED:
// one chain, parent before child, with tokens known throughout or nowhere)
// becomes one event; runtime/events.py documents the fields.
#pragma once

#include <cstdint>
#include <cstring>
#include <string>
#include <vector>

#include "kv_events.hpp"

namespace kvtier {

class MsgpackWriter {
 public:
  explicit MsgpackWriter(std::string& out) : out_(out) {}

  void nil() { out_.push_back(char(0xc0)); }
  void uint(uint64_t v) {
    if (v < 128) {
      out_.push_back(char(v));
    } else if (v <= 0xff) {
      out_.push_back(char(0xcc));
      out_.push_back(char(v));
    } else if (v <= 0xffff) {
      out_.push_back(char(0xcd));
      be(v, 2);
    } else if (v <= 0xffffffffULL) {
      out_.push_back(char(0xce));
      be(v, 4);
    } else {
      out_.push_back(char(0xcf));
      be(v, 8);
    }
  }
  void sint(int64_t v) {
    if (v >= 0) return uint(uint64_t(v));
    if (v >= -32) {
      out_.push_back(char(int8_t(v)));
    } else if (v >= INT8_MIN) {
      out_.push_back(char(0xd0));
      out_.push_back(char(int8_t(v)));
    } else if (v >= INT16_MIN) {
      out_.push_back(char(0xd1));
      be(uint64_t(v), 2);
    } else if (v >= INT32_MIN) {
      out_.push_back(char(0xd2));
      be(uint64_t(v), 4);
    } else {
      out_.push_back(char(0xd3));
      be(uint64_t(v), 8);
    }
  }
  void str(const char* s) { str(s, std::strlen(s)); }
  void str(const std::string& s) { str(s.data(), s.size()); }
  void str(const char* s, size_t n) {
    if (n < 32) {
      out_.push_back(char(0xa0 | n));
    } else if (n <= 0xff) {
      out_.push_back(char(0xd9));
      out_.push_back(char(n));
    } else {
      out_.push_back(char(0xda));
      be(n, 2);                           // names here are short; longer ones are refused at setup
    }
    out_.append(s, n);
  }
  void array(size_t n) { header(n, 0x90, 0xdc, 0xdd); }
  void map(size_t n) { header(n, 0x80, 0xde, 0xdf); }

 private:
  void be(uint64_t v, int bytes) {
    for (int i = bytes - 1; i >= 0; --i) out_.push_back(char(v >> (8 * i)));
  }
  void header(size_t n, int fix, int b16, int b32) {
    if (n < 16) {
      out_.push_back(char(fix | int(n)));
    } else if (n <= 0xffff) {
      out_.push_back(char(b16));
      be(n, 2);
    } else {
      out_.push_back(char(b32));
      be(n, 4);
    }
  }
  std::string& out_;
};

// How events are spelled: per life cycle, vLLM's cache spec kind and window.
struct KvEventFormat {
  bool positional = false;                 // arrays in the older layout, not maps
  std::vector<std::string> medium;         // per tier
  std::vector<std::string> spec_kind;      // per life cycle
  std::vector<int64_t> window;             // per life cycle; < 0: none (field omitted)
};

// Encodes log entries [from, to) as consecutive msgpack events appended to `out`;
// returns how many events.
inline size_t encode_kv_events(const KvEventLog& log, size_t from, size_t to, const KvEventFormat& f,
                               std::string& out) {
  MsgpackWriter w(out);
  const std::vector<KvEvent>& ev = log.events;
  size_t n_events = 0;
  for (size_t a = from; a < to;) {
    const KvEvent& head = ev[a];
    size_t b = a + 1;
    while (b < to) {
      const KvEvent& e = ev[b];
      if (e.kind != head.kind || e.tier != head.tier || e.lc != head.lc) break;
      if (head.kind == KV_STORED && !(e.has_parent && e.parent_hash == ev[b - 1].hash &&
                                       (e.token_at >= 0) == (head.token_at >= 0)))
        break;
      ++b;
    }
    const std::string& medium = f.medium[size_t(head.tier)];
    auto hashes = [&] {
      w.array(b - a);
      for (size_t i = a; i < b; ++i) w.uint(ev[i].hash);
    };
    if (head.kind == KV_REMOVED) {
      if (f.positional) {
        w.array(3);
        w.str("BlockRemoved");
        hashes();
        w.str(medium);
      } else {
        w.map(4);
        w.str("type");
        w.str("BlockRemoved");
        w.str("block_hashes");
        hashes();
        w.str("medium");
        w.str(medium);
        w.str("group_idx");
        w.uint(head.lc);
      }
    } else {
      auto parent = [&] { if (head.has_parent) w.uint(head.parent_hash); else w.nil(); };
      auto tokens = [&] {
        if (head.token_at < 0) return w.array(0);
        size_t first = size_t(head.token_at), n = (b - a) * size_t(log.tpb);
        w.array(n);
        for (size_t i = 0; i < n; ++i) w.sint(log.tokens[first + i]);
      };
      if (f.positional) {
        w.array(7);
        w.str("BlockStored");
        hashes();
        parent();
        tokens();
        w.uint(uint64_t(log.tpb));
        w.nil();
        w.str(medium);
      } else {
        int64_t window = f.window[head.lc];
        w.map(window >= 0 ? 11 : 10);
        w.str("type");
        w.str("BlockStored");
        w.str("block_hashes");
        hashes();
        w.str("parent_block_hash");
        parent();
        w.str("token_ids");
        tokens();
        w.str("block_size");
        w.uint(uint64_t(log.tpb));
        w.str("lora_id");
        w.nil();
        w.str("medium");
        w.str(medium);
        w.str("lora_name");
        w.nil();
        w.str("group_idx");
        w.uint(head.lc);
        w.str("kv_cache_spec_kind");
        w.str(f.spec_kind[head.lc]);
        if (window >= 0) {
          w.str("kv_cache_spec_sliding_window");
          w.uint(uint64_t(window));
        }
      }
    }
    ++n_events;
    a = b;
  }
  return n_events;
}

}  // namespace kvtier
