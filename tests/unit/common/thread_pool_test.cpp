#include "cleave/common/thread_pool.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <mutex>
#include <thread>
#include <utility>
#include <vector>

namespace cleave {
namespace {

// Records the chunks one parallel_for hands out.
std::vector<std::pair<int64_t, int64_t>> chunks_of(ThreadPool& pool, int64_t n, int64_t grain) {
  std::mutex mu;
  std::vector<std::pair<int64_t, int64_t>> chunks;
  pool.parallel_for(
      n,
      [&](int64_t b, int64_t e) {
        std::lock_guard<std::mutex> lk(mu);
        chunks.emplace_back(b, e);
      },
      grain);
  std::sort(chunks.begin(), chunks.end());
  return chunks;
}

TEST(ThreadPoolTest, CoversEveryIndexExactlyOnce) {
  for (int threads : {1, 2, 3, 5}) {
    ThreadPool pool(threads);
    EXPECT_EQ(pool.size(), threads);
    for (int64_t n : {1, 2, 3, 7, 64, 1000}) {
      for (int64_t grain : {1, 4, 16}) {
        std::vector<std::atomic<int>> hits(static_cast<size_t>(n));
        pool.parallel_for(
            n,
            [&](int64_t b, int64_t e) {
              for (int64_t i = b; i < e; ++i) hits[static_cast<size_t>(i)].fetch_add(1);
            },
            grain);
        for (int64_t i = 0; i < n; ++i)
          ASSERT_EQ(hits[static_cast<size_t>(i)].load(), 1)
              << "threads=" << threads << " n=" << n << " grain=" << grain << " i=" << i;
      }
    }
  }
}

TEST(ThreadPoolTest, ChunksAreWholeGrainsGuidedAndDeterministic) {
  ThreadPool pool(3);
  const auto first = chunks_of(pool, 103, 4);
  // 26 grains, 3 threads: each chunk takes 1/6 of the grains left (at least one), so the sizes
  // shrink from 4 grains to 1 and the last chunks are one grain each.
  const std::vector<int64_t> grains = {4, 3, 3, 2, 2, 2, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1};
  ASSERT_EQ(first.size(), grains.size());
  int64_t at = 0;
  for (size_t i = 0; i < first.size(); ++i) {
    EXPECT_EQ(first[i].first, at) << i;
    EXPECT_EQ(first[i].second, std::min<int64_t>(103, at + 4 * grains[i])) << i;
    at = first[i].second;
  }
  EXPECT_EQ(at, 103);
  for (int i = 0; i < 20; ++i) EXPECT_EQ(chunks_of(pool, 103, 4), first);
  // Fewer grains than threads: one chunk per grain.
  EXPECT_EQ(chunks_of(pool, 10, 4).size(), 3u);
  // A large loop: few chunks for its size (about d x ln(grains / d), d = 2 x threads, then d
  // chunks of one grain), the first a sixth of it, the last one grain.
  const auto big = chunks_of(pool, 100000, 1);
  EXPECT_LT(big.size(), 100u);
  EXPECT_EQ(big.back().second - big.back().first, 1);
  EXPECT_GT(big.front().second - big.front().first, 100000 / 7);
}

// A worker the OS does not schedule must not hold the loop up: the caller takes its chunks.
// Here the worker stalls (up to 2 s) inside the first chunk it gets; with a static split the
// caller would run only its own share.
TEST(ThreadPoolTest, CallerTakesChunksOfAStalledWorker) {
  ThreadPool pool(2);
  const int n_chunks = static_cast<int>(chunks_of(pool, 8, 1).size());  // 7: 2, then 1 grain each
  ASSERT_EQ(n_chunks, 7);
  const std::thread::id caller = std::this_thread::get_id();
  std::atomic<bool> release{false};
  std::atomic<int> by_caller{0}, by_worker{0};
  pool.parallel_for(8, [&](int64_t, int64_t) {
    if (std::this_thread::get_id() == caller) {
      if (by_caller.fetch_add(1) + 1 >= n_chunks - 1) release.store(true);
      return;
    }
    if (by_worker.fetch_add(1) == 0) {
      const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(2);
      while (!release.load() && std::chrono::steady_clock::now() < deadline)
        std::this_thread::sleep_for(std::chrono::microseconds(50));
    }
  });
  EXPECT_EQ(by_caller.load() + by_worker.load(), n_chunks);
  EXPECT_GE(by_caller.load(), n_chunks - 1);
}

TEST(ThreadPoolTest, SmallWorkRunsInlineOnTheCaller) {
  ThreadPool pool(4);
  std::thread::id ran_on;
  pool.parallel_for(8, [&](int64_t b, int64_t e) {
    EXPECT_EQ(b, 0);
    EXPECT_EQ(e, 8);
    ran_on = std::this_thread::get_id();
  }, 8);
  EXPECT_EQ(ran_on, std::this_thread::get_id());
  pool.parallel_for(0, [&](int64_t, int64_t) { FAIL() << "called for n = 0"; });
}

// While the caller is busy in one chunk, a worker thread takes the other.
TEST(ThreadPoolTest, UsesItsWorkerThreads) {
  ThreadPool pool(2);
  const std::thread::id caller = std::this_thread::get_id();
  std::atomic<bool> worker_ran{false};
  pool.parallel_for(2, [&](int64_t, int64_t) {
    if (std::this_thread::get_id() != caller) {
      worker_ran.store(true);
      return;
    }
    const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(2);
    while (!worker_ran.load() && std::chrono::steady_clock::now() < deadline)
      std::this_thread::sleep_for(std::chrono::microseconds(50));
  });
  EXPECT_TRUE(worker_ran.load());
}

// Many back-to-back loops, alternating between spinning hand-offs and sleeping ones, must never
// lose a wake-up or let a loop return before every chunk is done.
TEST(ThreadPoolTest, RapidLoopsWithAndWithoutSpinning) {
  for (int spin_us : {100, 0}) {
    ThreadPool pool(3);
    pool.set_spin_microseconds(spin_us);
    EXPECT_EQ(pool.spin_microseconds(), spin_us);
    std::atomic<int64_t> sum{0};
    for (int iter = 0; iter < 5000; ++iter) {
      pool.parallel_for(30, [&](int64_t b, int64_t e) {
        int64_t s = 0;
        for (int64_t i = b; i < e; ++i) s += i;
        sum.fetch_add(s);
      });
      ASSERT_EQ(sum.load(), static_cast<int64_t>(iter + 1) * 435) << "spin=" << spin_us;
    }
  }
}

// Loops of changing size back to back, with more threads than this machine's cores (so that a
// worker is often preempted between reading a claim and claiming): every index of every loop
// runs exactly once, and every loop returns. A worker pairing a claim of one loop with the
// chunk count of the next once made a loop count a chunk too many and its caller wait forever.
TEST(ThreadPoolTest, BackToBackLoopsOfChangingSizeNeverMixTheirChunks) {
  const int64_t sizes[] = {2, 9, 64, 3, 17, 40, 1000, 5};
  for (int spin_us : {0, 20}) {
    ThreadPool pool(std::max(4, 2 * hardware_threads()));
    pool.set_spin_microseconds(spin_us);
    std::vector<std::atomic<int>> hits(1000);
    for (int iter = 0; iter < 20000; ++iter) {
      const int64_t n = sizes[iter % 8];
      pool.parallel_for(n, [&](int64_t b, int64_t e) {
        for (int64_t i = b; i < e; ++i) hits[static_cast<size_t>(i)].fetch_add(1);
      });
      for (int64_t i = 0; i < n; ++i) {
        ASSERT_EQ(hits[static_cast<size_t>(i)].exchange(0), 1)
            << "iteration " << iter << " n=" << n << " i=" << i << " spin=" << spin_us;
      }
    }
  }
}

TEST(ThreadPoolTest, WakesSleepingWorkersAfterIdlePeriods) {
  ThreadPool pool(2);
  pool.set_spin_microseconds(50);
  for (int i = 0; i < 3; ++i) {
    std::this_thread::sleep_for(std::chrono::milliseconds(5));  // workers are asleep by now
    std::atomic<int> calls{0};
    pool.parallel_for(2, [&](int64_t, int64_t) { calls.fetch_add(1); });
    EXPECT_EQ(calls.load(), 2);
  }
}

TEST(ThreadPoolTest, DestroysCleanlyWhileWorkersSpinOrSleep) {
  for (int spin_us : {1000000, 0}) {
    ThreadPool pool(3);
    pool.set_spin_microseconds(spin_us);
    pool.parallel_for(3, [](int64_t, int64_t) {});
  }
  ThreadPool never_used(4);
}

TEST(ThreadPoolTest, DefaultSizeIsHardwareThreads) {
  ThreadPool pool(0);
  EXPECT_EQ(pool.size(), hardware_threads());
  EXPECT_GE(hardware_threads(), 1);
}

}  // namespace
}  // namespace cleave
