// Memory bandwidth references, measured the same way by every bench (kernel_bench,
// engine_bench, batch_bench), so that kernel and engine rates can be stated as a fraction of
// what the memory allows on this machine, in the same run.
//
// Two figures, both best-of-N over a buffer far larger than the last-level cache, split over the
// pool's threads:
//  - copy bandwidth: bytes COPIED per second by memcpy (each byte is read once and written once;
//    STREAM would count 2x this as traffic). This is the reference for the decode floor.
//  - read bandwidth: bytes per second of a read-only streaming sum, the stricter reference for a
//    kernel that only reads its weights (decode matvec); typically above the copy figure.
#pragma once

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstring>
#include <memory>
#include <vector>

#include "cleave/common/thread_pool.h"

namespace cleave::bench {

struct Bandwidth {
  double copy_bytes_per_s = 0;  // bytes copied per second (memcpy throughput)
  double read_bytes_per_s = 0;  // bytes read per second (streaming sum)
  uint64_t buffer_bytes = 0;
  int threads = 1;
};

inline Bandwidth measure_bandwidth(ThreadPool& pool, uint64_t buffer_bytes = uint64_t{512} << 20,
                                   int rounds = 7) {
  const uint64_t chunk = 1 << 20;
  buffer_bytes = std::max<uint64_t>(chunk, buffer_bytes / chunk * chunk);
  std::unique_ptr<std::byte[]> src(new std::byte[buffer_bytes]);
  std::unique_ptr<std::byte[]> dst(new std::byte[buffer_bytes]);
  const int64_t chunks = static_cast<int64_t>(buffer_bytes / chunk);
  // First touch on the threads that will use the pages (page faults out of the timed rounds).
  pool.parallel_for(chunks, [&](int64_t b, int64_t e) {
    std::memset(src.get() + b * chunk, 1, (e - b) * chunk);
    std::memset(dst.get() + b * chunk, 0, (e - b) * chunk);
  });
  Bandwidth bw;
  bw.buffer_bytes = buffer_bytes;
  bw.threads = pool.size();
  for (int r = 0; r < rounds; ++r) {
    const auto t0 = std::chrono::steady_clock::now();
    pool.parallel_for(chunks, [&](int64_t b, int64_t e) {
      std::memcpy(dst.get() + b * chunk, src.get() + b * chunk, (e - b) * chunk);
    });
    const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    bw.copy_bytes_per_s = std::max(bw.copy_bytes_per_s, static_cast<double>(buffer_bytes) / s);
  }
  std::vector<uint64_t> sums(static_cast<size_t>(chunks));
  for (int r = 0; r < rounds; ++r) {
    const auto t0 = std::chrono::steady_clock::now();
    pool.parallel_for(chunks, [&](int64_t b, int64_t e) {
      for (int64_t c = b; c < e; ++c) {
        const auto* p = reinterpret_cast<const uint64_t*>(src.get() + c * chunk);
        uint64_t a0 = 0, a1 = 0, a2 = 0, a3 = 0;  // independent chains: vectorised, not latency-bound
        for (uint64_t i = 0; i < chunk / 8; i += 4) {
          a0 += p[i];
          a1 += p[i + 1];
          a2 += p[i + 2];
          a3 += p[i + 3];
        }
        sums[static_cast<size_t>(c)] = a0 + a1 + a2 + a3;
      }
    });
    const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    bw.read_bytes_per_s = std::max(bw.read_bytes_per_s, static_cast<double>(buffer_bytes) / s);
  }
  // Keeps the copies and sums observable so that they cannot be elided.
  volatile std::byte sink = dst[buffer_bytes / 2];
  volatile uint64_t sink2 = sums[0];
  (void)sink;
  (void)sink2;
  return bw;
}

}  // namespace cleave::bench
