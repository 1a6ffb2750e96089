// A thread that copies rows between host arrays for the event loop, without the interpreter.
//
// A copy handed to a Python worker thread waits for the GIL to start and again to finish
// (up to the switch interval, 5 ms, behind a busy loop), and copied on the loop it stalls
// the loop. This thread never touches Python: the loop queues a job (pointers, strides and
// row indices, checked and copied at submit), the thread copies and appends the job's id to
// the done list, and a byte on a pipe wakes the loop, which takes the ids (take_done) and
// completes their events there.
//
// Invariants: queue_ and done_ are guarded by mu_; a job's arrays stay alive until its id is
// taken from done_ (the caller holds them); one wake byte is written when done_ goes from empty
// to non-empty, and take_done drains the pipe before taking done_, so a byte is never lost
// nor the loop woken for nothing more than once.
#pragma once

#include <fcntl.h>
#include <sys/resource.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <cerrno>
#include <condition_variable>
#include <cstdint>
#include <cstring>
#include <deque>
#include <mutex>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

namespace kvtier {

struct CopyJob {
  uint64_t id = 0;
  const uint8_t* src = nullptr;
  int64_t src_stride = 0;
  uint8_t* dst = nullptr;
  int64_t dst_stride = 0;
  size_t width = 0;
  std::vector<int64_t> src_rows, dst_rows;     // one per row copied
};

class CopyWorker {
 public:
  static constexpr int kNice = 5;      // tiers.streams.WORKER_NICE

  CopyWorker() {
    if (::pipe(pipe_) != 0) throw std::runtime_error(std::string("copy worker: pipe: ") + std::strerror(errno));
    for (int fd : pipe_) {
      ::fcntl(fd, F_SETFL, ::fcntl(fd, F_GETFL) | O_NONBLOCK);
      ::fcntl(fd, F_SETFD, FD_CLOEXEC);
    }
    thread_ = std::thread([this] { run(); });
  }
  CopyWorker(const CopyWorker&) = delete;
  CopyWorker& operator=(const CopyWorker&) = delete;
  ~CopyWorker() {
    close();
    for (int fd : pipe_)
      if (fd >= 0) ::close(fd);
  }

  int fd() const { return pipe_[0]; }

  // Queue a job; returns its id. Throws std::logic_error after close().
  uint64_t submit(CopyJob job) {
    std::lock_guard<std::mutex> lock(mu_);
    if (stopping_) throw std::logic_error("copy worker is closed");
    job.id = ++last_id_;
    queue_.push_back(std::move(job));
    cv_.notify_one();
    return last_id_;
  }

  // The ids of the jobs done since the last call (the loop's side, on the pipe's wake).
  std::vector<uint64_t> take_done() {
    char buf[64];
    while (::read(pipe_[0], buf, sizeof buf) > 0) {
    }
    std::lock_guard<std::mutex> lock(mu_);
    std::vector<uint64_t> out;
    out.swap(done_);
    return out;
  }

  // Finish the queued jobs and stop the thread (their ids stay to be taken). Idempotent.
  void close() {
    {
      std::lock_guard<std::mutex> lock(mu_);
      stopping_ = true;
      cv_.notify_one();
    }
    if (thread_.joinable()) thread_.join();
  }

 private:
  void run() {
#ifdef SYS_gettid
    // below the event loop, as the Python workers are (tiers/streams.py, _lower_priority): on a
    // machine with few cores a copy must not take the loop's core for a whole time slice
    int tid = int(::syscall(SYS_gettid));
    errno = 0;
    int nice = ::getpriority(PRIO_PROCESS, id_t(tid));
    if (errno == 0) ::setpriority(PRIO_PROCESS, id_t(tid), nice + kNice);
#endif
    for (;;) {
      CopyJob job;
      {
        std::unique_lock<std::mutex> lock(mu_);
        cv_.wait(lock, [this] { return stopping_ || !queue_.empty(); });
        if (queue_.empty()) return;            // stopping, and nothing left
        job = std::move(queue_.front());
        queue_.pop_front();
      }
      for (size_t i = 0; i < job.src_rows.size(); ++i)
        std::memmove(job.dst + job.dst_rows[i] * job.dst_stride, job.src + job.src_rows[i] * job.src_stride, job.width);
      bool wake;
      {
        std::lock_guard<std::mutex> lock(mu_);
        wake = done_.empty();
        done_.push_back(job.id);
      }
      if (wake) {
        char one = 1;
        while (::write(pipe_[1], &one, 1) < 0 && errno == EINTR) {
        }
      }
    }
  }

  int pipe_[2] = {-1, -1};
  std::mutex mu_;
  std::condition_variable cv_;
  std::deque<CopyJob> queue_;
  std::vector<uint64_t> done_;
  uint64_t last_id_ = 0;
  bool stopping_ = false;
  std::thread thread_;                 // last: started once everything above is built
};

}  // namespace kvtier
