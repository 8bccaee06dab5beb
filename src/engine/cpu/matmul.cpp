// matmul: rows of the weight matrix spread over the thread pool. One token streams each row once
// through dot_tile. Several tokens go to the kernel set's matmul_block when it has one (each
// weight byte read once per call and reused, converted, for every token); otherwise a block of
// rows small enough to stay in L1/L2 is applied to every token, a few rows and tokens per
// dot_tile call. The integer-path formats (uses_int_path) quantise each token's activations once
// per call and hand row ranges to the set's qdot. Each (row, token) result comes from the same
// reduction whatever the path (kernel_set.h).
#include <algorithm>
#include <vector>

#include "cleave/engine/cpu_kernels.h"
#include "cleave/model/quants.h"
#include "kernel_set.h"

namespace cleave::cpu {
namespace detail {

namespace {
// The calling thread's quantised activations (the pool's threads only read them).
struct ActScratch {
  std::vector<int8_t> q;
  std::vector<float> d;
  std::vector<int16_t> sum16;
  std::vector<float> sum32;
};
}  // namespace

QuantActs quantize_to_scratch(const KernelSet& set, const float* x, int64_t x_stride,
                              int64_t n_tokens, int64_t n) {
  thread_local ActScratch s;
  const auto total = static_cast<size_t>(n_tokens * n);
  if (s.q.size() < total) {
    s.q.resize(total);
    s.d.resize(total / kQK);
    s.sum16.resize(total / 16);
    s.sum32.resize(total / kQK);
  }
  set.quantize_acts(x, x_stride, n_tokens, n, s.q.data(), s.d.data(), s.sum16.data(),
                    s.sum32.data());
  return {s.q.data(), s.d.data(), s.sum16.data(), s.sum32.data(), n};
}

}  // namespace detail

namespace {

// Below this many multiply-adds a parallel_for costs more than it saves.
constexpr int64_t kMinMacsPerChunk = 32 * 1024;
// Bytes of weight rows kept hot while every token of the batch passes over them.
constexpr uint64_t kRowBlockBytes = 32 * 1024;

void matmul_int(ThreadPool& pool, const detail::KernelSet& set, const TensorView& w,
                const float* x, int64_t in_stride, int64_t n_tokens, float* y,
                int64_t out_stride) {
  const int64_t rows = w.rows();
  const int64_t n = w.cols();
  const uint64_t row_bytes = *dtype_row_bytes(w.dtype, static_cast<uint64_t>(n));
  const detail::QuantActs acts = detail::quantize_to_scratch(set, x, in_stride, n_tokens, n);
  auto run_rows = [&](int64_t r_begin, int64_t r_end) {
    set.qdot(w.dtype, w.data + static_cast<uint64_t>(r_begin) * row_bytes, row_bytes,
             r_end - r_begin, acts, n_tokens, y + r_begin, out_stride);
  };
  const int64_t macs_per_row = std::max<int64_t>(1, n * n_tokens);
  int64_t grain = (kMinMacsPerChunk + macs_per_row - 1) / macs_per_row;
  grain = (grain + 3) / 4 * 4;
  pool.parallel_for(rows, run_rows, grain);
}

}  // namespace

void matmul(ThreadPool& pool, const TensorView& w, const float* x, int64_t in_stride,
            int64_t n_tokens, float* y, int64_t out_stride) {
  const int64_t rows = w.rows();
  const int64_t n = w.cols();
  if (rows <= 0 || n_tokens <= 0) return;
  const detail::KernelSet& set = detail::active_kernels();
  if (uses_int_path(w.dtype)) return matmul_int(pool, set, w, x, in_stride, n_tokens, y, out_stride);
  const uint64_t row_bytes = *dtype_row_bytes(w.dtype, static_cast<uint64_t>(n));
  const detail::DotTileFn dot_tile = set.dot_tile[static_cast<size_t>(w.dtype)];
  const detail::MatmulBlockFn matmul_block =
      n_tokens == 1 ? nullptr : set.matmul_block[static_cast<size_t>(w.dtype)];
  constexpr int kTileRows = detail::kMaxTileRows;
  const int tile_tokens = n_tokens == 1 ? 1 : 3;
  const int64_t block_rows = std::max<int64_t>(
      kTileRows, static_cast<int64_t>(kRowBlockBytes / std::max<uint64_t>(row_bytes, 1)) /
                     kTileRows * kTileRows);

  auto run_rows = [&](int64_t r_begin, int64_t r_end) {
    if (matmul_block != nullptr) {
      matmul_block(w.data + static_cast<uint64_t>(r_begin) * row_bytes, row_bytes,
                   r_end - r_begin, x, in_stride, n_tokens, n, y + r_begin, out_stride);
      return;
    }
    // One token: a single pass over the rows, streaming each once.
    const int64_t step = n_tokens == 1 ? r_end - r_begin : block_rows;
    for (int64_t rb = r_begin; rb < r_end; rb += step) {
      const int64_t rb_end = std::min(r_end, rb + step);
      for (int64_t t = 0; t < n_tokens; t += tile_tokens) {
        const int nt = static_cast<int>(std::min<int64_t>(tile_tokens, n_tokens - t));
        for (int64_t r = rb; r < rb_end; r += kTileRows) {
          const int nr = static_cast<int>(std::min<int64_t>(kTileRows, rb_end - r));
          dot_tile(w.data + static_cast<uint64_t>(r) * row_bytes, row_bytes, nr,
                   x + t * in_stride, in_stride, nt, n, y + t * out_stride + r, out_stride);
        }
      }
    }
  };

  const int64_t macs_per_row = std::max<int64_t>(1, n * n_tokens);
  int64_t grain = (kMinMacsPerChunk + macs_per_row - 1) / macs_per_row;
  // Multiples of 16 rows: the block kernels work on 16 rows at a time.
  const int64_t grain_align = matmul_block != nullptr ? 16 : kTileRows;
  grain = (grain + grain_align - 1) / grain_align * grain_align;
  pool.parallel_for(rows, run_rows, grain);
}

}  // namespace cleave::cpu
