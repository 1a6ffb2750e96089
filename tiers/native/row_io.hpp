// Page rows to and from a segment file: one preadv / pwritev per run of
// adjacent slots, the whole batch in one call with no interpreter in between.
//
// A batch names n pages. Page i is row `rows[i]` of a caller's array (`width`
// bytes at `base + rows[i] * row_stride`) and lives at file offset
// `offsets[i]`. Offsets ascend; where offsets[i + 1] == offsets[i] + stride the
// two pages are one run, moved by one call of at most IOV_MAX vectors. Each
// page is followed on disk by `stride - width` pad bytes: written from `pad`
// (zeros), read into `pad` (thrown away).
//
// Invariant kept for the caller: on return, `moved[i]` is the number of page
// i's `width` bytes that were transferred (all of them unless a read hit the
// end of the file, or an error stopped the batch).
//
// A `nowait` read takes only what the page cache holds (preadv2 with
// RWF_NOWAIT): where it would have to wait for the device or a lock it stops
// with EAGAIN, so a caller that must not block (the event loop) can hand the
// batch to a thread instead. Without RWF_NOWAIT it always stops with EAGAIN.
#pragma once

#include <sys/uio.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <climits>
#include <cstddef>
#include <cstdint>
#include <vector>

namespace kvtier {

struct RowIo {
  uint8_t* base;                // the rows' array (only read when writing)
  int64_t row_stride;           // bytes from one row of the array to the next
  size_t width;                 // a page's bytes
  size_t stride;                // a slot's bytes on disk (>= width)
  const int64_t* rows;          // [n] row of each page
  const int64_t* offsets;       // [n] file offset of each page, ascending
  size_t n;
  uint8_t* pad;                 // stride - width bytes (zeros for writes)
};

// Moves every page; returns 0, or the errno that stopped it (moved[] says how
// far each page got). A read that reaches the end of the file ends its run
// there (its pages stay short) and goes on with the next run.
inline ssize_t read_nowait(int fd, const iovec* iov, int cnt, off_t off) {
#ifdef RWF_NOWAIT
  return ::preadv2(fd, iov, cnt, off, RWF_NOWAIT);
#else
  (void)fd, (void)iov, (void)cnt, (void)off;
  errno = EAGAIN;
  return -1;
#endif
}

inline int move_rows(const RowIo& io, int fd, bool write, int64_t* moved, bool nowait = false) {
  const size_t pad_len = io.stride - io.width;
  const size_t per_page = pad_len ? 2 : 1;
#ifdef IOV_MAX
  const size_t iov_max = IOV_MAX;
#else
  const size_t iov_max = 1024;
#endif
  const size_t pages_per_call = std::max<size_t>(1, iov_max / per_page);
  std::vector<iovec> iov;
  for (size_t i = 0; i < io.n; ++i) moved[i] = 0;
  size_t a = 0;
  while (a < io.n) {
    size_t b = a + 1;       // [a, b): adjacent on disk, one call's worth of vectors
    while (b < io.n && b - a < pages_per_call && io.offsets[b] == io.offsets[b - 1] + int64_t(io.stride)) ++b;
    iov.clear();
    for (size_t i = a; i < b; ++i) {
      iov.push_back({io.base + io.rows[i] * io.row_stride, io.width});
      if (pad_len) iov.push_back({io.pad, pad_len});
    }
    off_t off = io.offsets[a];
    size_t v = 0;           // first vector not yet done
    size_t done_in_run = 0; // bytes of the run moved so far
    while (v < iov.size()) {
      int cnt = int(std::min<size_t>(iov.size() - v, iov_max));
      ssize_t k = write    ? ::pwritev(fd, &iov[v], cnt, off)
                  : nowait ? read_nowait(fd, &iov[v], cnt, off)
                           : ::preadv(fd, &iov[v], cnt, off);
      if (k < 0) {
        if (errno == EINTR) continue;
        int err = errno;
        size_t per = io.stride;         // credit what finished before the error
        for (size_t i = a; i < b; ++i) {
          size_t start = (i - a) * per;
          moved[i] = int64_t(std::min(io.width, done_in_run > start ? done_in_run - start : 0));
        }
        return err;
      }
      if (k == 0) {
        if (write) return EIO;          // a write that moves nothing would loop forever
        break;                          // end of file: the rest of the run stays short
      }
      off += k;
      done_in_run += size_t(k);
      size_t left = size_t(k);
      while (v < iov.size() && left >= iov[v].iov_len) {
        left -= iov[v].iov_len;
        ++v;
      }
      if (left) {                       // a short transfer inside a vector: resume there
        iov[v].iov_base = static_cast<uint8_t*>(iov[v].iov_base) + left;
        iov[v].iov_len -= left;
      }
    }
    for (size_t i = a; i < b; ++i) {
      size_t start = (i - a) * io.stride;
      moved[i] = int64_t(std::min(io.width, done_in_run > start ? done_in_run - start : 0));
    }
    a = b;
  }
  return 0;
}

}  // namespace kvtier
