// tiers._native: the data plane's native kernels (nanobind): page checksums, row copies and row I/O,
// and the disk tier's slot-table bookkeeping (slot_table.hpp). Each call works on a whole batch,
// so that disk I/O threads do not hold the interpreter per page. The file I/O calls always
// release the GIL (a syscall may block); the compute kernels release it only for batches of at
// least the calling thread's threshold (t_keep_gil_below, below) or kReleaseElements elements.
#include <nanobind/nanobind.h>
#include <nanobind/ndarray.h>
#include <nanobind/stl/optional.h>
#include <nanobind/stl/vector.h>
#include <sys/mman.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cerrno>
#include <cstdint>
#include <numeric>
#include <cstring>
#include <optional>
#include <string>
#include <vector>

#include "copy_worker.hpp"
#include "record_identity.hpp"
#include "row_io.hpp"
#include "slot_table.hpp"
#include "xxh64.hpp"

namespace nb = nanobind;
using namespace nb::literals;

namespace {

using Rows = nb::ndarray<const uint8_t, nb::ndim<2>, nb::device::cpu>;
using Index = nb::ndarray<const int64_t, nb::ndim<1>, nb::device::cpu>;
using U64 = nb::ndarray<uint64_t, nb::ndim<1>, nb::device::cpu, nb::c_contig>;

// A checksum or a copy of fewer bytes than the calling thread's threshold keeps the GIL. Giving
// it up costs the caller a handoff: another thread takes the GIL and this one waits for it back,
// up to the interpreter's switch interval (5 ms) while that thread runs Python. On the event
// loop's thread that wait cost more than its small inline copies (~256 KiB, tens of
// microseconds): in a three-tier replay the loop's copies spent 1.0 s waiting for the GIL against
// 0.7 s copying. So the loop's thread keeps it below 1 MiB (keep_gil_below, called by the Store
// on the loop); other threads keep it only below 64 KiB, so that the loop can run while a
// worker copies or checksums a batch.
thread_local size_t t_keep_gil_below = size_t(64) << 10;

// Sorting more elements than this gives up the GIL (a few hundred microseconds of work).
constexpr size_t kReleaseElements = size_t(1) << 14;

// Releases the GIL for its lifetime when `release` is true, as nb::gil_scoped_release does.
// A plain thread-state pointer, not std::optional<gil_scoped_release>: GCC at -O2 (a
// RelWithDebInfo build) wrongly reports the optional's member maybe-uninitialized, an error
// under -Werror. Invariant: state_ is null exactly when the GIL was not released.
class MaybeNoGil {
 public:
  explicit MaybeNoGil(bool release) : state_(release ? PyEval_SaveThread() : nullptr) {}
  ~MaybeNoGil() {
    if (state_) PyEval_RestoreThread(state_);
  }
  MaybeNoGil(const MaybeNoGil&) = delete;
  MaybeNoGil& operator=(const MaybeNoGil&) = delete;

 private:
  PyThreadState* state_;
};

// Results are numpy arrays made first (numpy owns their memory), then filled through data_of.
nb::object np_empty(nb::handle shape, const char* dtype) {
  return nb::module_::import_("numpy").attr("empty")(shape, "dtype"_a = dtype);
}

template <class T>
T* data_of(nb::object& a) {
  return nb::cast<nb::ndarray<T, nb::device::cpu, nb::c_contig>>(a).data();
}

// A new int64 numpy array holding v[0:k].
nb::object int64_array(const std::vector<int64_t>& v, size_t k) {
  nb::object out = np_empty(nb::int_(k), "int64");
  if (k) std::memcpy(data_of<int64_t>(out), v.data(), k * sizeof(int64_t));
  return out;
}

// XXH64 of rows[index[i]] (or of every row when index is None), each row's
// bytes contiguous; rows may have any row stride.
nb::object xxh64_rows(Rows rows, std::optional<Index> index, uint64_t seed) {
  if (rows.shape(1) && rows.stride(1) != 1) throw nb::value_error("xxh64_rows: each row's bytes must be contiguous");
  const size_t n_rows = rows.shape(0), width = rows.shape(1);
  const int64_t row_stride = rows.stride(0);
  const size_t n = index ? index->shape(0) : n_rows;
  const int64_t idx_stride = index ? index->stride(0) : 0;
  if (index)
    for (size_t i = 0; i < n; ++i) {
      int64_t r = index->data()[int64_t(i) * idx_stride];
      if (r < 0 || size_t(r) >= n_rows) throw nb::index_error("xxh64_rows: row index out of range");
    }
  nb::object out = np_empty(nb::int_(n), "uint64");
  uint64_t* dst = data_of<uint64_t>(out);
  {
    MaybeNoGil nogil(n * width >= t_keep_gil_below);
    const uint8_t* base = rows.data();
    for (size_t i = 0; i < n; ++i) {
      int64_t r = index ? index->data()[int64_t(i) * idx_stride] : int64_t(i);
      dst[i] = kvtier::xxh64(base + r * row_stride, width, seed);
    }
  }
  return out;
}

// record_identity of each of `records` (rows of kRecordBytes: a journal.RECORD array viewed as
// bytes) as a uint64 numpy array. A few hundred records take microseconds: the GIL is kept.
nb::object record_identities(Rows records, uint64_t fp) {
  if (records.shape(0) && (records.shape(1) != kvtier::kRecordBytes || records.stride(1) != 1))
    throw nb::value_error("record_identities: rows must be 64 contiguous bytes (journal records)");
  const size_t n = records.shape(0);
  nb::object out = np_empty(nb::int_(n), "uint64");
  uint64_t* dst = data_of<uint64_t>(out);
  const uint8_t* base = records.data();
  const int64_t stride = records.stride(0);
  for (size_t i = 0; i < n; ++i) dst[i] = kvtier::record_identity(base + int64_t(i) * stride, fp);
  return out;
}

// The stable ascending order of `a` (int64), and whether two elements are equal. numpy's
// argsort gives up the GIL for any size: under a busy event loop each of the disk tier's
// small sorts then waited milliseconds for it back.
nb::tuple argsort_i64(Index a) {
  const size_t n = a.shape(0);
  const int64_t* v = a.data();
  const int64_t st = a.stride(0);
  nb::object out = np_empty(nb::int_(n), "int64");
  int64_t* order = data_of<int64_t>(out);
  bool dup = false;
  {
    MaybeNoGil nogil(n >= kReleaseElements);
    std::iota(order, order + n, int64_t(0));
    std::stable_sort(order, order + n, [&](int64_t x, int64_t y) { return v[x * st] < v[y * st]; });
    for (size_t i = 1; i < n && !dup; ++i) dup = v[order[i] * st] == v[order[i - 1] * st];
  }
  return nb::make_tuple(out, dup);
}

// (min, max) of a non-empty int64 array (ValueError for an empty one): numpy's reductions give
// the GIL up past 500 elements.
nb::tuple bounds_i64(Index a) {
  const size_t n = a.shape(0);
  if (!n) throw nb::value_error("bounds_i64: an empty array has no bounds");
  const int64_t st = a.stride(0);
  int64_t lo = a.data()[0], hi = lo;
  {
    MaybeNoGil nogil(n >= kReleaseElements);
    for (size_t i = 1; i < n; ++i) {
      const int64_t v = a.data()[int64_t(i) * st];
      lo = std::min(lo, v);
      hi = std::max(hi, v);
    }
  }
  return nb::make_tuple(lo, hi);
}

using MutRows = nb::ndarray<uint8_t, nb::ndim<2>, nb::device::cpu>;

// Row index i of an optional index array (the identity when absent), checked against n_rows.
struct RowIndex {
  const int64_t* data = nullptr;
  int64_t stride = 0;
  size_t size = 0;

  RowIndex(const std::optional<Index>& idx, size_t n, size_t n_rows, const char* what) {
    if (idx) {
      data = idx->data();
      stride = idx->stride(0);
      size = idx->shape(0);
      for (size_t i = 0; i < size; ++i) {
        int64_t r = data[int64_t(i) * stride];
        if (r < 0 || size_t(r) >= n_rows) throw nb::index_error(what);
      }
    } else {
      size = n;
      if (n > n_rows) throw nb::index_error(what);
    }
  }
  int64_t operator[](size_t i) const { return data ? data[int64_t(i) * stride] : int64_t(i); }
};

// dst[dst_index[i]] = src[src_index[i]] for every i, in order: one memmove per row, the GIL
// released for batches of at least the thread's threshold. The host side of page moves (host slabs, the emulated GPU, staging), where
// numpy's fancy indexing made two passes (gather into a temporary, then scatter) and held
// the GIL. src and dst may be views of one buffer (memmove); dst's own rows may not overlap
// each other, or a row written would change another.
// The checked arguments of copy_rows (and of a CopyWorker job): rows of equal width, each
// contiguous, indices in range, destination rows not overlapping each other.
struct RowCopy {
  RowIndex si, di;
  size_t width;

  RowCopy(const Rows& src, const std::optional<Index>& src_index, const MutRows& dst,
          const std::optional<Index>& dst_index, const char* what)
      : si(src_index, count(src, src_index, dst_index), src.shape(0), (std::string(what) + ": source row out of range").c_str()),
        di(dst_index, count(src, src_index, dst_index), dst.shape(0),
           (std::string(what) + ": destination row out of range").c_str()),
        width(src.shape(1)) {
    const std::string w(what);
    if (src.shape(1) != dst.shape(1)) throw nb::value_error((w + ": rows of different widths").c_str());
    if ((src.shape(1) && src.stride(1) != 1) || (dst.shape(1) && dst.stride(1) != 1))
      throw nb::value_error((w + ": each row's bytes must be contiguous").c_str());
    if (si.size != di.size) throw nb::value_error((w + ": source and destination row counts differ").c_str());
    const int64_t dst_step = dst.stride(0) < 0 ? -dst.stride(0) : dst.stride(0);
    if (dst.shape(0) > 1 && width && size_t(dst_step) < width)
      throw nb::value_error((w + ": the destination's rows overlap each other").c_str());
  }

  static size_t count(const Rows& src, const std::optional<Index>& si, const std::optional<Index>& di) {
    return si ? si->shape(0) : di ? di->shape(0) : src.shape(0);
  }
};

void copy_rows(Rows src, std::optional<Index> src_index, MutRows dst, std::optional<Index> dst_index,
               std::optional<size_t> keep_gil_below) {
  RowCopy c(src, src_index, dst, dst_index, "copy_rows");
  const uint8_t* s = src.data();
  uint8_t* d = dst.data();
  const int64_t ss = src.stride(0), ds = dst.stride(0);
  MaybeNoGil nogil(c.si.size * c.width >= keep_gil_below.value_or(t_keep_gil_below));
  for (size_t i = 0; i < c.si.size; ++i) std::memmove(d + c.di[i] * ds, s + c.si[i] * ss, c.width);
}

// CopyWorker.submit: a copy_rows for the worker thread, checked here (nothing is queued if it
// fails); the caller keeps src and dst alive until the job's id comes back from take_done.
uint64_t submit_copy(kvtier::CopyWorker& w, Rows src, std::optional<Index> src_index, MutRows dst,
                     std::optional<Index> dst_index) {
  RowCopy c(src, src_index, dst, dst_index, "CopyWorker.submit");
  kvtier::CopyJob job;
  job.src = src.data();
  job.src_stride = src.stride(0);
  job.dst = dst.data();
  job.dst_stride = dst.stride(0);
  job.width = c.width;
  job.src_rows.resize(c.si.size);
  job.dst_rows.resize(c.si.size);
  for (size_t i = 0; i < c.si.size; ++i) {
    job.src_rows[i] = c.si[i];
    job.dst_rows[i] = c.di[i];
  }
  try {
    return w.submit(std::move(job));
  } catch (const std::logic_error& e) {
    throw nb::value_error(e.what());
  }
}

// The checked arguments of pread_rows / pwrite_rows as a RowIo (rows and offsets copied to
// contiguous vectors, so the GIL-free loop reads plain arrays).
struct RowIoArgs {
  kvtier::RowIo io{};
  std::vector<int64_t> rows, offsets;
  std::vector<uint8_t> pad;

  RowIoArgs(uint8_t* base, size_t n_rows, int64_t row_stride, size_t width, const Index& index,
            const Index& offs, size_t stride, const char* what) {
    if (index.shape(0) != offs.shape(0)) throw nb::value_error((std::string(what) + ": rows and offsets differ in length").c_str());
    if (stride < width || stride == 0) throw nb::value_error((std::string(what) + ": the stride is smaller than a row").c_str());
    size_t n = index.shape(0);
    rows.resize(n);
    offsets.resize(n);
    for (size_t i = 0; i < n; ++i) {
      rows[i] = index.data()[int64_t(i) * index.stride(0)];
      offsets[i] = offs.data()[int64_t(i) * offs.stride(0)];
      if (rows[i] < 0 || size_t(rows[i]) >= n_rows) throw nb::index_error((std::string(what) + ": row out of range").c_str());
      if (offsets[i] < 0) throw nb::value_error((std::string(what) + ": a negative file offset").c_str());
    }
    pad.assign(stride - width, 0);
    io = {base, row_stride, width, stride, rows.data(), offsets.data(), n, pad.data()};
  }
};

[[noreturn]] void raise_errno(int err, const char* what) {
  errno = err;
  PyErr_SetFromErrnoWithFilename(PyExc_OSError, what);
  throw nb::python_error();
}

// out[index[i]] <- the file's `width` bytes at offsets[i]; returns the bytes read per page
// (short only past the end of the file). One preadv per run of adjacent slots, GIL released.
// `nowait`: only from the page cache (OSError EAGAIN where it would wait), GIL kept - the
// caller is the event loop's thread, which would wait behind any busy thread to get it back.
nb::object pread_rows(int fd, MutRows out, Index index, Index offsets, size_t stride, bool nowait) {
  if (out.shape(1) && out.stride(1) != 1) throw nb::value_error("pread_rows: each row's bytes must be contiguous");
  RowIoArgs a(out.data(), out.shape(0), out.stride(0), out.shape(1), index, offsets, stride, "pread_rows");
  nb::object moved = nb::module_::import_("numpy").attr("zeros")(a.io.n, "dtype"_a = "int64");
  int64_t* m = data_of<int64_t>(moved);
  int err;
  {
    std::optional<nb::gil_scoped_release> nogil;
    if (!nowait) nogil.emplace();
    err = kvtier::move_rows(a.io, fd, false, m, nowait);
  }
  if (err) raise_errno(err, "pread_rows");
  return moved;
}

// fdatasync(fd), retried on EINTR; 0 or the errno that stopped it.
int sync_data(int fd) {
  while (::fdatasync(fd) != 0)
    if (errno != EINTR) return errno;
  return 0;
}

// The file's bytes at offsets[i] <- rows[index[i]] (each followed by stride - width zero
// bytes). One pwritev per run of adjacent slots, GIL released; OSError on failure. With
// `hashes` (n uint64), hashes[i] <- XXH64 of page i first; with `sync`, an fdatasync after the
// writes. One GIL release for all three: a disk thread that gave the GIL up three times per
// batch waited for it back three times behind a busy event loop. Returns the seconds spent
// hashing.
double pwrite_rows(int fd, Rows rows, Index index, Index offsets, size_t stride, std::optional<U64> hashes,
                   bool sync) {
  if (rows.shape(1) && rows.stride(1) != 1) throw nb::value_error("pwrite_rows: each row's bytes must be contiguous");
  RowIoArgs a(const_cast<uint8_t*>(rows.data()), rows.shape(0), rows.stride(0), rows.shape(1), index, offsets, stride,
              "pwrite_rows");
  if (hashes && hashes->shape(0) != a.io.n) throw nb::value_error("pwrite_rows: hashes must have one entry per row");
  uint64_t* h = hashes ? hashes->data() : nullptr;
  std::vector<int64_t> moved(a.io.n);
  int err;
  double hash_seconds = 0.0;
  {
    nb::gil_scoped_release nogil;
    if (h) {
      auto t0 = std::chrono::steady_clock::now();
      for (size_t i = 0; i < a.io.n; ++i) h[i] = kvtier::xxh64(a.io.base + a.rows[i] * a.io.row_stride, a.io.width, 0);
      hash_seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    }
    err = kvtier::move_rows(a.io, fd, true, moved.data());
    if (!err && sync) err = sync_data(fd);
  }
  if (err) raise_errno(err, "pwrite_rows");
  return hash_seconds;
}

// The file's bytes at `offset` <- `data`, all of them (short writes continued), then with `sync`
// an fdatasync: one GIL release. OSError (with errno) on failure, the file then as far as it got.
void pwrite_all(int fd, nb::bytes data, int64_t offset, bool sync) {
  // the bytes as one row at one offset: move_rows continues short writes and retries EINTR
  const int64_t row = 0;
  kvtier::RowIo io{reinterpret_cast<uint8_t*>(const_cast<char*>(data.c_str())), 0, data.size(), data.size(), &row,
                   &offset, data.size() ? size_t(1) : size_t(0), nullptr};
  int64_t moved = 0;
  int err;
  {
    nb::gil_scoped_release nogil;
    err = kvtier::move_rows(io, fd, true, &moved);
    if (!err && sync) err = sync_data(fd);
  }
  if (err) raise_errno(err, "pwrite_all");
}

// madvise(MADV_DONTNEED) over the whole pages inside an array's bytes, GIL released: they read as
// zeros after. For an array about to be freed (tiers.native.drop_arrays checks that nothing else
// refers to it): the free that follows, under the GIL, then finds few pages to give back. Freeing
// the 8 MB arrays of a million-page recovery held the GIL for about 3 ms.
void release_pages(nb::ndarray<nb::device::cpu, nb::c_contig> a) {
  const uintptr_t page = uintptr_t(sysconf(_SC_PAGESIZE));
  const uintptr_t p = reinterpret_cast<uintptr_t>(a.data()), n = a.nbytes();
  const uintptr_t lo = (p + page - 1) & ~(page - 1), hi = (p + n) & ~(page - 1);
  if (hi <= lo) return;
  nb::gil_scoped_release nogil;
  ::madvise(reinterpret_cast<void*>(lo), hi - lo, MADV_DONTNEED);   // advice: a failure leaves the work to free()
}

// -- the disk tier's slot table (slot_table.hpp): kernels that keep the GIL --------------------

using Flags = nb::ndarray<const bool, nb::ndim<1>, nb::device::cpu, nb::c_contig>;
using MutFlags = nb::ndarray<bool, nb::ndim<1>, nb::device::cpu, nb::c_contig>;
using ConstU64 = nb::ndarray<const uint64_t, nb::ndim<1>, nb::device::cpu>;

// A batch's slots, each checked to index a table of n entries (IndexError otherwise).
kvtier::slot_table::Slots table_slots(const Index& slots, size_t n, const char* what) {
  kvtier::slot_table::Slots s{slots.data(), slots.stride(0), slots.shape(0)};
  for (size_t i = 0; i < s.n; ++i)
    if (s[i] < 0 || size_t(s[i]) >= n) throw nb::index_error((std::string(what) + ": slot out of range").c_str());
  return s;
}

// Journal records as rows of kRecordBytes, each row's bytes contiguous.
void check_records(const Rows& recs, const char* what) {
  if (recs.shape(0) && (recs.shape(1) != kvtier::kRecordBytes || recs.stride(1) != 1))
    throw nb::value_error((std::string(what) + ": rows must be 64 contiguous bytes (journal records)").c_str());
}

const uint8_t* bytes_of(const Flags& f) { return reinterpret_cast<const uint8_t*>(f.data()); }

bool flags_any(Flags flags, Index slots) {
  auto s = table_slots(slots, flags.shape(0), "flags_any");
  MaybeNoGil nogil(s.n >= kReleaseElements);
  return kvtier::slot_table::any_set(bytes_of(flags), s);
}

void flags_set(MutFlags flags, Index slots, bool value) {
  auto s = table_slots(slots, flags.shape(0), "flags_set");
  MaybeNoGil nogil(s.n >= kReleaseElements);
  kvtier::slot_table::set_all(reinterpret_cast<uint8_t*>(flags.data()), s, value);
}

nb::object flags_select(Flags flags, Index slots, bool value) {
  auto s = table_slots(slots, flags.shape(0), "flags_select");
  std::vector<int64_t> picked(s.n);
  size_t k;
  {
    MaybeNoGil nogil(s.n >= kReleaseElements);
    k = kvtier::slot_table::select(bytes_of(flags), s, value, picked.data());
  }
  return int64_array(picked, k);
}

int64_t flags_first_neither(Flags a, Flags b, Index slots) {
  if (a.shape(0) != b.shape(0)) throw nb::value_error("flags_first_neither: the flags differ in length");
  auto s = table_slots(slots, a.shape(0), "flags_first_neither");
  MaybeNoGil nogil(s.n >= kReleaseElements);
  return kvtier::slot_table::first_neither(bytes_of(a), bytes_of(b), s);
}

nb::object records_malformed(Rows recs, bool stored, uint64_t max_gen) {
  check_records(recs, "records_malformed");
  const size_t n = recs.shape(0);
  nb::object out = np_empty(nb::int_(n), "bool");
  bool* bad = data_of<bool>(out);
  MaybeNoGil nogil(n >= kReleaseElements);
  for (size_t i = 0; i < n; ++i)
    bad[i] = kvtier::slot_table::malformed(recs.data() + int64_t(i) * recs.stride(0), stored, max_gen);
  return out;
}

nb::object records_stamp_writes(Rows recs, Index slots, uint64_t first_gen, ConstU64 hashes, uint64_t fp) {
  check_records(recs, "records_stamp_writes");
  const size_t n = recs.shape(0);
  if (slots.shape(0) != n || hashes.shape(0) != n)
    throw nb::value_error("records_stamp_writes: one slot and one hash per record");
  auto s = table_slots(slots, size_t(UINT32_MAX) + 1, "records_stamp_writes");
  nb::object out = np_empty(nb::make_tuple(n, kvtier::kRecordBytes), "uint8");
  uint8_t* dst = data_of<uint8_t>(out);
  MaybeNoGil nogil(n >= kReleaseElements);
  for (size_t i = 0; i < n; ++i) {
    uint8_t* rec = dst + i * kvtier::kRecordBytes;
    std::memcpy(rec, recs.data() + int64_t(i) * recs.stride(0), kvtier::kRecordBytes);
    kvtier::slot_table::stamp_write(rec, uint32_t(s[i]), first_gen + i, hashes.data()[int64_t(i) * hashes.stride(0)], fp);
  }
  return out;
}

nb::object records_current(Rows recs, Flags live, Rows meta) {
  check_records(recs, "records_current");
  check_records(meta, "records_current");
  if (live.shape(0) != meta.shape(0)) throw nb::value_error("records_current: live and meta differ in length");
  const size_t n = recs.shape(0), n_slots = live.shape(0);
  std::vector<int64_t> keep;
  keep.reserve(n);
  bool bad = false;
  {
    MaybeNoGil nogil(n >= kReleaseElements);
    for (size_t i = 0; i < n; ++i) {
      const uint8_t* rec = recs.data() + int64_t(i) * recs.stride(0);
      const uint32_t s = kvtier::slot_table::slot_of(rec);
      if (s >= n_slots) {                   // never: the tier reserves a slot's table entries before its write
        bad = true;
        break;
      }
      if (live.data()[s] && kvtier::slot_table::gen_of(meta.data() + int64_t(s) * meta.stride(0)) ==
                                kvtier::slot_table::gen_of(rec))
        keep.push_back(int64_t(i));
    }
  }
  if (bad) throw nb::index_error("records_current: a record's slot is beyond the table");
  return int64_array(keep, keep.size());
}

nb::object records_frees(Index slots, ConstU64 gens) {
  const size_t n = slots.shape(0);
  if (gens.shape(0) != n) throw nb::value_error("records_frees: one generation per slot");
  auto s = table_slots(slots, size_t(UINT32_MAX) + 1, "records_frees");
  nb::object out = np_empty(nb::make_tuple(n, kvtier::kRecordBytes), "uint8");
  uint8_t* dst = data_of<uint8_t>(out);
  MaybeNoGil nogil(n >= kReleaseElements);
  std::memset(dst, 0, n * kvtier::kRecordBytes);
  for (size_t i = 0; i < n; ++i)
    kvtier::slot_table::stamp_free(dst + i * kvtier::kRecordBytes, uint32_t(s[i]), gens.data()[int64_t(i) * gens.stride(0)]);
  return out;
}

nb::object records_slots(Rows recs) {
  check_records(recs, "records_slots");
  const size_t n = recs.shape(0);
  nb::object out = np_empty(nb::int_(n), "int64");
  int64_t* dst = data_of<int64_t>(out);
  for (size_t i = 0; i < n; ++i) dst[i] = kvtier::slot_table::slot_of(recs.data() + int64_t(i) * recs.stride(0));
  return out;
}

nb::object iota_u64(uint64_t first, size_t n) {
  nb::object out = np_empty(nb::int_(n), "uint64");
  uint64_t* dst = data_of<uint64_t>(out);
  for (size_t i = 0; i < n; ++i) dst[i] = first + i;
  return out;
}

}  // namespace

NB_MODULE(_native, m) {
  m.doc() = "kvtier's data-plane kernels: batched page checksums and row copies";
  m.def("xxh64_rows", &xxh64_rows, "rows"_a, "index"_a = nb::none(), "seed"_a = 0,
        "XXH64 of each row (or of rows[index]) as a uint64 numpy array; the GIL is released while hashing "
        "a batch of at least the thread's keep_gil_below.");
  // noconvert: an array of another dtype or layout is an error, never a silent temporary (a
  // converted dst would take the writes and be thrown away).
  m.def("keep_gil_below", [](size_t nbytes) { t_keep_gil_below = nbytes; }, "nbytes"_a,
        "For the calling thread: copy_rows and xxh64_rows keep the GIL for batches smaller than nbytes "
        "(64 KiB unless set; the event loop's thread sets 1 MiB).");
  m.def("record_identities", &record_identities, "records"_a.noconvert(), "fp"_a,
        "The identity (tiers.journal.identity) of each journal record, given as rows of 64 bytes.");
  m.def("release_pages", &release_pages, "a"_a.noconvert(),
        "Give the whole pages under a C-contiguous array back to the kernel (they read as zeros after), the "
        "GIL released. Only for an array about to be freed that nothing else refers to: use "
        "tiers.native.drop_arrays, which checks.");
  m.attr("RECORD_RULES") = nb::make_tuple(kvtier::slot_table::kWrite, kvtier::slot_table::kFree,
                                          kvtier::slot_table::kMaxKeyBytes, kvtier::slot_table::kTagAnonymous,
                                          kvtier::slot_table::kTagNone, kvtier::slot_table::kMaxPriority);
  m.def("bounds_i64", &bounds_i64, "a"_a.noconvert(), "(min, max) of a non-empty int64 array, the GIL kept.");
  m.def("flags_any", &flags_any, "flags"_a.noconvert(), "slots"_a.noconvert(),
        "Whether any of flags[slots] is set (slot_table.hpp: the disk tier's per-slot flags, the GIL kept).");
  m.def("flags_set", &flags_set, "flags"_a.noconvert(), "slots"_a.noconvert(), "value"_a,
        "flags[slots] = value, the GIL kept.");
  m.def("flags_select", &flags_select, "flags"_a.noconvert(), "slots"_a.noconvert(), "value"_a,
        "The slots whose flag is value (int64, in order), the GIL kept.");
  m.def("flags_first_neither", &flags_first_neither, "a"_a.noconvert(), "b"_a.noconvert(), "slots"_a.noconvert(),
        "The first position whose slot has neither flag set, or -1.");
  m.def("records_malformed", &records_malformed, "records"_a.noconvert(), "stored"_a, "max_gen"_a,
        "journal.malformed over records viewed as (n, 64) uint8 rows: a bool array, the GIL kept.");
  m.def("records_stamp_writes", &records_stamp_writes, "records"_a.noconvert(), "slots"_a.noconvert(),
        "first_gen"_a, "hashes"_a.noconvert(), "fp"_a,
        "A copy of write records (n, 64) with kind write, their slots, generations from first_gen and "
        "checksums (hashes XOR identity).");
  m.def("records_current", &records_current, "records"_a.noconvert(), "live"_a.noconvert(), "meta"_a.noconvert(),
        "The positions of the records still their slot's live page (same generation as meta's).");
  m.def("records_frees", &records_frees, "slots"_a.noconvert(), "gens"_a.noconvert(),
        "Free records (n, 64) for slots with generations gens, the other fields zero.");
  m.def("records_slots", &records_slots, "records"_a.noconvert(), "The records' slots as int64.");
  m.def("iota_u64", &iota_u64, "first"_a, "n"_a, "first, first + 1, ... (n of them) as uint64, the GIL kept.");
  m.def("argsort_i64", &argsort_i64, "a"_a.noconvert(),
        "(order, has_duplicates): the stable argsort of an int64 array, and whether any two elements are "
        "equal; the GIL is kept for small arrays (numpy's argsort always gives it up).");
  m.def("copy_rows", &copy_rows, "src"_a.noconvert(), "src_index"_a.noconvert().none(), "dst"_a.noconvert(),
        "dst_index"_a.noconvert().none(), "keep_gil_below"_a = nb::none(),
        "dst[dst_index[i]] = src[src_index[i]] (None: rows in order), one memmove per row; the GIL is released "
        "for a batch of at least keep_gil_below bytes (None: the thread's keep_gil_below).");
  nb::class_<kvtier::CopyWorker>(m, "CopyWorker",
                                 "A thread that runs copy_rows jobs without the GIL (copy_worker.hpp): submit "
                                 "queues one and returns its id; a byte on the pipe `fd` says some are done; "
                                 "take_done returns their ids. The caller keeps each job's arrays alive until then.")
      .def(nb::init<>())
      .def_prop_ro("fd", &kvtier::CopyWorker::fd)
      .def("submit", &submit_copy, "src"_a.noconvert(), "src_index"_a.noconvert().none(), "dst"_a.noconvert(),
           "dst_index"_a.noconvert().none(), "Queue dst[dst_index[i]] = src[src_index[i]]; its id.")
      .def("take_done", &kvtier::CopyWorker::take_done, "The ids of the jobs done since the last call.")
      .def("close", &kvtier::CopyWorker::close, nb::call_guard<nb::gil_scoped_release>(),
           "Run the queued jobs, then stop the thread (idempotent).");
  m.def("pread_rows", &pread_rows, "fd"_a, "out"_a.noconvert(), "index"_a.noconvert(), "offsets"_a.noconvert(),
        "stride"_a, "nowait"_a = false,
        "out[index[i]] <- the row at file offset offsets[i]; bytes read per page (int64 array). One preadv per "
        "run of adjacent offsets (each row then stride - width bytes of pad), GIL released. With nowait, only "
        "what the page cache holds (preadv2 RWF_NOWAIT; OSError EAGAIN where it would wait), GIL kept.");
  m.def("pwrite_rows", &pwrite_rows, "fd"_a, "rows"_a.noconvert(), "index"_a.noconvert(), "offsets"_a.noconvert(),
        "stride"_a, "hashes"_a.noconvert() = nb::none(), "sync"_a = false,
        "The file at offsets[i] <- rows[index[i]] and stride - width zero bytes. One pwritev per run of "
        "adjacent offsets; with hashes, hashes[i] <- XXH64 of rows[index[i]] first; with sync, an fdatasync "
        "after. The GIL released once for all of it; OSError (with errno) on failure. Returns the seconds "
        "spent hashing.");
  m.def("pwrite_all", &pwrite_all, "fd"_a, "data"_a, "offset"_a, "sync"_a = false,
        "The file at offset <- data (short writes continued), then with sync an fdatasync; one GIL release. "
        "OSError (with errno) on failure.");
  m.def("xxh64", [](nb::bytes data, uint64_t seed) { return kvtier::xxh64(data.c_str(), data.size(), seed); },
        "data"_a, "seed"_a = 0, "XXH64 of a bytes object.");
}
