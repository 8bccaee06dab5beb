// A fixed pool of named worker threads for data-parallel loops inside one engine step.
//
// parallel_for splits [0, n) into contiguous chunks, one per thread, deterministically (the
// split depends only on n and the thread count). Work items must be independent: each output
// element is computed by exactly one thread, so results never depend on the thread count.
// Not re-entrant: one parallel_for at a time per pool (the engine thread owns the pool).
#pragma once

#include <condition_variable>
#include <cstdint>
#include <functional>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

namespace cleave {

class ThreadPool {
 public:
  // n_threads <= 0: one per online CPU. The calling thread takes part as worker 0, so
  // n_threads - 1 threads are started, named "<name>-<i>".
  explicit ThreadPool(int n_threads, std::string name = "compute");
  ~ThreadPool();
  ThreadPool(const ThreadPool&) = delete;
  ThreadPool& operator=(const ThreadPool&) = delete;

  int size() const { return n_threads_; }
  // fn(begin, end) over contiguous chunks of [0, n); chunk boundaries are multiples of `grain`
  // (except the end). Returns when all chunks are done.
  void parallel_for(int64_t n, const std::function<void(int64_t, int64_t)>& fn, int64_t grain = 1);

 private:
  void worker(int index);
  void run_chunk(int index);

  int n_threads_;
  std::vector<std::thread> threads_;
  std::mutex mu_;
  std::condition_variable cv_start_;
  std::condition_variable cv_done_;
  uint64_t generation_ = 0;
  int pending_ = 0;
  bool stop_ = false;
  const std::function<void(int64_t, int64_t)>* fn_ = nullptr;
  int64_t n_ = 0;
  int64_t grain_ = 1;
};

// Online CPU count (at least 1).
int hardware_threads();
// Names the calling thread (shown by top -H, gdb); truncated to 15 characters.
void set_thread_name(const std::string& name);

}  // namespace cleave
