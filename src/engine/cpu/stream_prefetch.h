// Internal: the software prefetch of the f32/f16/bf16 dot kernels, which in decode stream every
// weight byte once. The AVX-512 set's decode uses it; the AVX2 set's decode reads four long runs
// of rows without it, which measured faster on Zen 3 (dot_avx2.cpp, matvec).
//
// A tile reads R consecutive rows side by side, each from its start to its end, so R streams run
// at once. Each kernel step asks for the bytes a fixed distance ahead of where each row is read,
// into L2 (hint T1). Past the end of a row those bytes are the next tile's: row r + R, at the
// same offset less the row's length, and so on for rows shorter than the distance (SmolLM2's
// 576-column rows are 360-1152 bytes).
// Measured with kernel_bench --tokens 1, 2 threads, on 2-vCPU AMD EPYC (Zen 4) hosts, against
// T0 1 KiB ahead in the same row: on one, F16 matvec 49152x576 went from 16 to 33-36 GB/s (the
// streaming read rate) and SmolLM2 F16 decode from 69 to 102-116 tok/s; on another, F16 4096x4096
// from 24-29 to 28-35 GB/s and decode from 59-65 to 63-70 tok/s. The integer-path kernels
// (qdot_simd.h) keep their short in-row prefetch: there this one, or any far prefetch of the
// right lines, was as slow as none (Q8_0 decode 130 -> 94 tok/s) on the second host, though
// faster on the first.
// Internal linkage: each kernel set includes it under its own target flags.
#pragma once

#include <immintrin.h>

#include <cstddef>
#include <cstdint>

namespace cleave::cpu::detail {
namespace {

constexpr int64_t kPrefetchBytes = 4096;

// Where row 0 of a tile will read kPrefetchBytes from now, moved along with the tile's reads.
// Costs an add and a compare per step.
class StreamPrefetch {
 public:
  StreamPrefetch(const std::byte* tile, uint64_t row_bytes, int rows)
      : row_bytes_(static_cast<int64_t>(row_bytes)), rows_(rows) {
    const char* p = reinterpret_cast<const char*>(tile);
    if (row_bytes_ <= 0) {  // one row given alone: its stream only
      target_ = p + kPrefetchBytes;
      offset_ = 0;
      row_bytes_ = INT64_MAX;
      return;
    }
    target_ = p + kPrefetchBytes / row_bytes_ * rows_ * row_bytes_ + kPrefetchBytes % row_bytes_;
    offset_ = kPrefetchBytes % row_bytes_;
  }

  // Prefetches `lines` cache lines at row r's target.
  void fetch(int r, int lines = 1) const {
    const char* p = target_ + r * row_bytes_;
    for (int l = 0; l < lines; ++l) _mm_prefetch(p + 64 * l, _MM_HINT_T1);
  }

  // The tile's rows have each been read `bytes` further (at most one row's length).
  void advance(int64_t bytes) {
    target_ += bytes;
    offset_ += bytes;
    if (offset_ >= row_bytes_) {
      offset_ -= row_bytes_;
      target_ += (rows_ - 1) * row_bytes_;
    }
  }

 private:
  const char* target_;
  int64_t offset_;
  int64_t row_bytes_;
  int64_t rows_;
};

}  // namespace
}  // namespace cleave::cpu::detail
