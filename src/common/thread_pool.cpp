#include "cleave/common/thread_pool.h"

#include <pthread.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <thread>

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#endif

namespace cleave {
namespace {

inline void cpu_relax() {
#if defined(__x86_64__) || defined(__i386__)
  _mm_pause();
#elif defined(__aarch64__)
  asm volatile("yield");
#endif
}

}  // namespace

int hardware_threads() {
  long n = ::sysconf(_SC_NPROCESSORS_ONLN);
  return n > 0 ? static_cast<int>(n) : 1;
}

void set_thread_name(const std::string& name) {
  ::pthread_setname_np(::pthread_self(), name.substr(0, 15).c_str());
}

ThreadPool::ThreadPool(int n_threads, std::string name)
    : n_threads_(n_threads > 0 ? n_threads : hardware_threads()) {
  // parallel_for never allocates: bounds_ holds the chunks of the longest loop (the most grains;
  // a loop of fewer grains never has more chunks), 153 for 2 threads, 5,150 for 64.
  const int64_t divisor = static_cast<int64_t>(n_threads_) * kGuidedDivisor;
  int64_t chunks = 0;
  for (int64_t left = INT64_MAX; left > 0; ++chunks) left -= std::max<int64_t>(1, left / divisor);
  bounds_.reserve(static_cast<size_t>(chunks + 1));
  threads_.reserve(static_cast<size_t>(n_threads_ - 1));
  for (int i = 1; i < n_threads_; ++i) {
    threads_.emplace_back([this, i, name] {
      set_thread_name(name + "-" + std::to_string(i));
      worker(i);
    });
  }
}

ThreadPool::~ThreadPool() {
  {
    std::lock_guard<std::mutex> lk(mu_);
    stop_.store(true);
  }
  cv_start_.notify_all();
  for (auto& t : threads_) t.join();
}

template <typename Done>
bool ThreadPool::spin_until(Done done) const {
  const int us = spin_us_.load(std::memory_order_relaxed);
  if (us <= 0) return done();
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::microseconds(us);
  for (;;) {
    for (int i = 0; i < 64; ++i) {
      if (done()) return true;
      cpu_relax();
    }
    if (std::chrono::steady_clock::now() >= deadline) return done();
    // Lets a thread that shares this core (more threads than cores, other processes) run.
    std::this_thread::yield();
  }
}

namespace {
inline uint32_t generation_of(uint64_t claim) { return static_cast<uint32_t>(claim >> 32); }
inline uint32_t chunk_of(uint64_t claim) { return static_cast<uint32_t>(claim); }
}  // namespace

void ThreadPool::run_chunks(uint32_t gen) {
  for (;;) {
    uint64_t c = claim_.load();
    if (generation_of(c) != gen) return;
    const int64_t n_chunks = n_chunks_.load();
    if (chunk_of(c) >= n_chunks) return;
    if (!claim_.compare_exchange_weak(c, c + 1)) continue;
    // Claimed: this generation's state stays put until its last chunk is done.
    const size_t chunk = chunk_of(c);
    const int64_t n = n_.load(), grain = grain_.load();
    const int64_t b = bounds_[chunk] * grain;
    const int64_t e = std::min(n, bounds_[chunk + 1] * grain);
    if (b < e) (*fn_.load())(b, e);
    if (chunks_done_.fetch_add(1) + 1 == n_chunks && caller_sleeping_.load()) {
      std::lock_guard<std::mutex> lk(mu_);
      cv_done_.notify_one();
    }
  }
}

// Sleep/wake hand-offs use sequentially consistent atomics on both sides (a sleeper publishes
// itself, then re-checks; a waker publishes work, then checks for sleepers), so a wake-up is
// never lost and the mutex is only taken when someone actually sleeps.
void ThreadPool::worker(int /*index*/) {
  uint32_t seen = 0;
  for (;;) {
    auto has_work = [&] { return stop_.load() || generation_of(claim_.load()) != seen; };
    if (!spin_until(has_work)) {
      std::unique_lock<std::mutex> lk(mu_);
      sleeping_workers_.fetch_add(1);
      cv_start_.wait(lk, has_work);
      sleeping_workers_.fetch_sub(1);
    }
    if (stop_.load()) return;
    seen = generation_of(claim_.load());
    run_chunks(seen);
  }
}

void ThreadPool::parallel_for(int64_t n, const std::function<void(int64_t, int64_t)>& fn,
                              int64_t grain) {
  if (n <= 0) return;
  if (grain < 1) grain = 1;
  if (n_threads_ == 1 || n <= grain) {
    fn(0, n);
    return;
  }
  // First a generation with no chunk to claim: a thread that read a claim of the previous loop
  // and is about to read n_chunks_ can no longer win its compare-and-swap, so it never runs a
  // chunk of the old loop counted against (or with the parameters of) this one. Without the
  // fence such a thread could claim a chunk after this loop's chunks_done_ reset, the count
  // would step past n_chunks and the caller would wait forever.
  const uint32_t fence = generation_of(claim_.load()) + 1;
  claim_.store((static_cast<uint64_t>(fence) << 32) | kNoChunk);
  // Guided chunks: each takes 1 / divisor of the grains left, at least one.
  const int64_t divisor = static_cast<int64_t>(n_threads_) * kGuidedDivisor;
  bounds_.clear();
  bounds_.push_back(0);
  for (int64_t left = (n + grain - 1) / grain; left > 0;) {
    const int64_t size = std::max<int64_t>(1, left / divisor);
    bounds_.push_back(bounds_.back() + size);
    left -= size;
  }
  const auto n_chunks = static_cast<int64_t>(bounds_.size()) - 1;
  fn_.store(&fn);
  n_.store(n);
  grain_.store(grain);
  n_chunks_.store(n_chunks);
  chunks_done_.store(0);
  const uint32_t gen = fence + 1;
  claim_.store(static_cast<uint64_t>(gen) << 32);
  if (sleeping_workers_.load() > 0) {
    std::lock_guard<std::mutex> lk(mu_);
    cv_start_.notify_all();
  }
  run_chunks(gen);
  auto all_done = [&] { return chunks_done_.load() == n_chunks; };
  if (!spin_until(all_done)) {
    std::unique_lock<std::mutex> lk(mu_);
    caller_sleeping_.store(true);
    cv_done_.wait(lk, all_done);
    caller_sleeping_.store(false);
  }
}

}  // namespace cleave
