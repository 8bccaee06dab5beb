// Memory copy bandwidth, measured the same way by every bench (kernel_bench, engine_bench), so
// that kernel and engine rates can be stated as a fraction of what the memory allows.
//
// Bytes counted STREAM-style: every copied byte is read once and written once, so a copy of B
// bytes in t seconds moves 2B/t. A kernel that only reads (a matrix-vector product streaming its
// weights) therefore reaches at most about this figure.
#pragma once

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstring>
#include <memory>

#include "cleave/common/thread_pool.h"

namespace cleave::bench {

struct CopyBandwidth {
  double bytes_per_s = 0;    // best round, read + written bytes
  uint64_t buffer_bytes = 0;  // size of the copied buffer
  int threads = 1;
};

// Copies a buffer of `buffer_bytes` (choose it far larger than the last-level cache) `rounds`
// times, split evenly over the pool's threads, and keeps the best round.
inline CopyBandwidth measure_copy_bandwidth(ThreadPool& pool,
                                            uint64_t buffer_bytes = uint64_t{512} << 20,
                                            int rounds = 7) {
  const uint64_t chunk = 1 << 20;
  buffer_bytes = std::max<uint64_t>(chunk, buffer_bytes / chunk * chunk);
  std::unique_ptr<std::byte[]> src(new std::byte[buffer_bytes]);
  std::unique_ptr<std::byte[]> dst(new std::byte[buffer_bytes]);
  const int64_t chunks = static_cast<int64_t>(buffer_bytes / chunk);
  // First touch on the threads that will copy (page faults out of the timed rounds).
  pool.parallel_for(chunks, [&](int64_t b, int64_t e) {
    std::memset(src.get() + b * chunk, 1, (e - b) * chunk);
    std::memset(dst.get() + b * chunk, 0, (e - b) * chunk);
  });
  double best = 0;
  for (int r = 0; r < rounds; ++r) {
    const auto t0 = std::chrono::steady_clock::now();
    pool.parallel_for(chunks, [&](int64_t b, int64_t e) {
      std::memcpy(dst.get() + b * chunk, src.get() + b * chunk, (e - b) * chunk);
    });
    const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    best = std::max(best, 2.0 * static_cast<double>(buffer_bytes) / s);
  }
  // Keeps the copies observable so that they cannot be elided.
  volatile std::byte sink = dst[buffer_bytes / 2];
  (void)sink;
  return {best, buffer_bytes, pool.size()};
}

}  // namespace cleave::bench
