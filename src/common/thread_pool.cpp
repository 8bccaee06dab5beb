#include "cleave/common/thread_pool.h"

#include <pthread.h>
#include <unistd.h>

#include <algorithm>

namespace cleave {

int hardware_threads() {
  long n = ::sysconf(_SC_NPROCESSORS_ONLN);
  return n > 0 ? static_cast<int>(n) : 1;
}

void set_thread_name(const std::string& name) {
  ::pthread_setname_np(::pthread_self(), name.substr(0, 15).c_str());
}

ThreadPool::ThreadPool(int n_threads, std::string name)
    : n_threads_(n_threads > 0 ? n_threads : hardware_threads()) {
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
    stop_ = true;
  }
  cv_start_.notify_all();
  for (auto& t : threads_) t.join();
}

void ThreadPool::run_chunk(int index) {
  // Chunks of whole grains, spread as evenly as possible; deterministic in (n, threads, grain).
  const int64_t grains = (n_ + grain_ - 1) / grain_;
  const int64_t per = grains / n_threads_;
  const int64_t extra = grains % n_threads_;
  const int64_t g0 = index * per + std::min<int64_t>(index, extra);
  const int64_t g1 = g0 + per + (index < extra ? 1 : 0);
  const int64_t b = g0 * grain_;
  const int64_t e = std::min(n_, g1 * grain_);
  if (b < e) (*fn_)(b, e);
}

void ThreadPool::worker(int index) {
  uint64_t seen = 0;
  for (;;) {
    {
      std::unique_lock<std::mutex> lk(mu_);
      cv_start_.wait(lk, [&] { return stop_ || generation_ != seen; });
      if (stop_) return;
      seen = generation_;
    }
    run_chunk(index);
    {
      std::lock_guard<std::mutex> lk(mu_);
      if (--pending_ == 0) cv_done_.notify_one();
    }
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
  {
    std::lock_guard<std::mutex> lk(mu_);
    fn_ = &fn;
    n_ = n;
    grain_ = grain;
    pending_ = n_threads_ - 1;
    ++generation_;
  }
  cv_start_.notify_all();
  run_chunk(0);
  std::unique_lock<std::mutex> lk(mu_);
  cv_done_.wait(lk, [&] { return pending_ == 0; });
  fn_ = nullptr;
}

}  // namespace cleave
