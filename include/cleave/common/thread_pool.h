// A fixed pool of named worker threads for data-parallel loops inside one engine step.
//
// parallel_for splits [0, n) into contiguous chunks of whole grains that shrink as the loop
// goes (guided): chunk c takes 1 / (kGuidedDivisor x threads) of the grains left after chunks
// 0..c-1, at least one. Early chunks are long (a long stream of weight reads), the last ones one
// grain each, so running threads finish within about one grain of each other. The boundaries
// depend only on n, the thread count and the grain. Which thread runs which chunk
// is decided at run time: every thread, the caller included, takes the next unclaimed chunk, so
// a thread that the OS has not scheduled yet never holds the loop up. Work items must therefore
// be independent: each index is handed to exactly one fn call, and results must not depend on
// which thread makes it. Not re-entrant: one parallel_for at a time per pool (the engine thread
// owns the pool).
//
// parallel_for allocates nothing (std::function keeps a one-pointer capture in place).
//
// Latency: a decode step calls parallel_for tens of times, so waking sleeping threads through a
// condition variable each time would dominate for small models. After each loop the workers
// (and the caller, while waiting for them) spin for a bounded time (spin_microseconds) before
// they sleep; they never spin longer than that, and yield the core while they spin.
#pragma once

#include <atomic>
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

  static constexpr int kGuidedDivisor = 2;
  // A claim's chunk index that no loop has (the fence between two loops).
  static constexpr uint64_t kNoChunk = 0xFFFFFFFFull;

  int size() const { return n_threads_; }
  // fn(begin, end) over contiguous chunks of [0, n); chunk boundaries are multiples of `grain`
  // (except the end). Runs on the caller alone when n <= grain or the pool has one thread.
  // Returns when all chunks are done.
  void parallel_for(int64_t n, const std::function<void(int64_t, int64_t)>& fn, int64_t grain = 1);

  // How long idle threads spin before sleeping (default 100 us; 0 = sleep at once).
  void set_spin_microseconds(int us) { spin_us_.store(us < 0 ? 0 : us); }
  int spin_microseconds() const { return spin_us_.load(); }

 private:
  void worker(int index);
  // Claims and runs chunks of generation `gen` until none is left.
  void run_chunks(uint32_t gen);
  // Spins until done() or the spin budget is spent; returns done().
  template <typename Done>
  bool spin_until(Done done) const;

  int n_threads_;
  std::vector<std::thread> threads_;
  std::atomic<int> spin_us_{100};
  std::mutex mu_;
  std::condition_variable cv_start_;
  std::condition_variable cv_done_;
  // High 32 bits: the loop's generation; low 32 bits: the next unclaimed chunk. A claim is a
  // compare-and-swap on both, so a thread that wakes late can never claim a chunk of a newer
  // loop with the state of an older one.
  std::atomic<uint64_t> claim_{0};
  std::atomic<int64_t> chunks_done_{0};
  std::atomic<int> sleeping_workers_{0};
  std::atomic<bool> caller_sleeping_{false};
  std::atomic<bool> stop_{false};
  // The current loop; written by the caller before claim_ publishes a new generation, stable
  // until every chunk of it is done.
  std::atomic<const std::function<void(int64_t, int64_t)>*> fn_{nullptr};
  std::atomic<int64_t> n_{0};
  std::atomic<int64_t> grain_{1};
  std::atomic<int64_t> n_chunks_{0};
  // Chunk c is [bounds_[c], bounds_[c + 1]) in grains.
  std::vector<int64_t> bounds_;
};

// Online CPU count (at least 1).
int hardware_threads();
// Names the calling thread (shown by top -H, gdb); truncated to 15 characters.
void set_thread_name(const std::string& name);

}  // namespace cleave
