// matmul: rows of the weight matrix spread over the thread pool. One token streams each row once
// through dot_tile. Several tokens go to the kernel set's matmul_block when it has one (each
// weight byte read once per call and reused, converted, for every token); otherwise a block of
// rows small enough to stay in L1/L2 is applied to every token, a few rows and tokens per
// dot_tile call. The integer-path formats (uses_int_path) quantise each token's activations once
// per call and hand row ranges to the set's qdot. Each (row, token) result comes from the same
// reduction whatever the path (kernel_set.h). matmul_many, matmul_glu and matmul_add do several
// matrices, or a matrix and its element-wise epilogue, in one parallel pass: one wake-up of the
// pool and one quantisation of x instead of one per matrix, and the epilogue threaded with the
// rows it reads.
#include <algorithm>
#include <optional>
#include <span>
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
                              int64_t n_tokens, int64_t n, int64_t group) {
  thread_local ActScratch scratch[2];  // group 32, group 256: a call may need both
  ActScratch& s = scratch[group == 256 ? 1 : 0];
  const auto total = static_cast<size_t>(n_tokens * n);
  if (s.q.size() < total) {
    s.q.resize(total);
    s.d.resize(total / kQK);
    s.sum16.resize(total / 16);
    s.sum32.resize(total / kQK);
  }
  set.quantize_acts(x, x_stride, n_tokens, n, group, s.q.data(), s.d.data(), s.sum16.data(),
                    s.sum32.data());
  return {s.q.data(), s.d.data(), s.sum16.data(), s.sum32.data(), n, group};
}

}  // namespace detail

namespace {

// Below this many multiply-adds a parallel_for costs more than it saves.
constexpr int64_t kMinMacsPerChunk = 32 * 1024;
// Bytes of weight rows kept hot while every token of the batch passes over them.
constexpr uint64_t kRowBlockBytes = 32 * 1024;

// x quantised once per call for each activation group its integer-path matrices need
// (kernel_group: 32 for the legacy formats, 256 for the K-quants).
struct CallActs {
  std::optional<detail::QuantActs> g32, g256;
  const detail::QuantActs* of(DType t) const {
    return detail::kernel_group(t) == 256 ? &*g256 : &*g32;
  }
};

// Rows of one matrix for one call: run(r0, r1) computes y for rows [r0, r1) and every token, by
// the same reduction whatever the range (kernel_set.h). `acts` is the call's quantised x, needed
// by the integer path only.
class Rows {
 public:
  Rows(const detail::KernelSet& set, const TensorView& w, const float* x, int64_t in_stride,
       int64_t n_tokens, float* y, int64_t out_stride, const CallActs* acts)
      : set_(set), w_(w), x_(x), in_stride_(in_stride), n_tokens_(n_tokens), y_(y),
        out_stride_(out_stride),
        acts_(acts != nullptr && uses_int_path(w.dtype) ? acts->of(w.dtype) : nullptr),
        row_bytes_(*dtype_row_bytes(w.dtype, static_cast<uint64_t>(w.cols()))),
        int_path_(uses_int_path(w.dtype)),
        dot_tile_(set.dot_tile[static_cast<size_t>(w.dtype)]),
        matvec_(n_tokens != 1 || int_path_ ? nullptr : set.matvec[static_cast<size_t>(w.dtype)]),
        matmul_block_(n_tokens == 1 || int_path_
                          ? nullptr
                          : set.matmul_block[static_cast<size_t>(w.dtype)]) {}

  int64_t rows() const { return w_.rows(); }

  // Rows per parallel chunk: enough work to pay for the chunk, in multiples of the kernels' row
  // tiles (16 rows for the block kernels).
  int64_t grain(int64_t matrices_per_row = 1) const {
    const int64_t macs_per_row = std::max<int64_t>(1, w_.cols() * n_tokens_ * matrices_per_row);
    const int64_t grain = (kMinMacsPerChunk + macs_per_row - 1) / macs_per_row;
    const int64_t align = int_path_ ? 4 : matmul_block_ != nullptr ? 16 : detail::kMaxTileRows;
    return (grain + align - 1) / align * align;
  }

  void run(int64_t r_begin, int64_t r_end) const {
    const std::byte* w = w_.data + static_cast<uint64_t>(r_begin) * row_bytes_;
    if (int_path_) {
      set_.qdot(w_.dtype, w, row_bytes_, r_end - r_begin, *acts_, n_tokens_, y_ + r_begin,
                out_stride_);
      return;
    }
    const int64_t n = w_.cols();
    if (matmul_block_ != nullptr) {
      matmul_block_(w, row_bytes_, r_end - r_begin, x_, in_stride_, n_tokens_, n, y_ + r_begin,
                    out_stride_);
      return;
    }
    if (matvec_ != nullptr) {
      matvec_(w, row_bytes_, r_end - r_begin, x_, n, y_ + r_begin);
      return;
    }
    constexpr int kTileRows = detail::kMaxTileRows;
    const int tile_tokens = n_tokens_ == 1 ? 1 : 3;
    // One token: a single pass over the rows, streaming each once. Several: a block of rows
    // small enough to stay in L1/L2 is applied to every token.
    const int64_t block_rows = std::max<int64_t>(
        kTileRows,
        static_cast<int64_t>(kRowBlockBytes / std::max<uint64_t>(row_bytes_, 1)) / kTileRows *
            kTileRows);
    const int64_t step = n_tokens_ == 1 ? r_end - r_begin : block_rows;
    for (int64_t rb = r_begin; rb < r_end; rb += step) {
      const int64_t rb_end = std::min(r_end, rb + step);
      for (int64_t t = 0; t < n_tokens_; t += tile_tokens) {
        const int nt = static_cast<int>(std::min<int64_t>(tile_tokens, n_tokens_ - t));
        for (int64_t r = rb; r < rb_end; r += kTileRows) {
          const int nr = static_cast<int>(std::min<int64_t>(kTileRows, rb_end - r));
          dot_tile_(w_.data + static_cast<uint64_t>(r) * row_bytes_, row_bytes_, nr,
                    x_ + t * in_stride_, in_stride_, nt, n, y_ + t * out_stride_ + r,
                    out_stride_);
        }
      }
    }
  }

 private:
  const detail::KernelSet& set_;
  const TensorView& w_;
  const float* x_;
  int64_t in_stride_, n_tokens_;
  float* y_;
  int64_t out_stride_;
  const detail::QuantActs* acts_;
  uint64_t row_bytes_;
  bool int_path_;
  detail::DotTileFn dot_tile_;
  detail::MatvecFn matvec_;
  detail::MatmulBlockFn matmul_block_;
};

// x quantised for every integer-path matrix of a call, once per group size they need.
CallActs quantize_for(const detail::KernelSet& set, std::span<const TensorView* const> ws,
                      const float* x, int64_t in_stride, int64_t n_tokens) {
  CallActs a;
  for (const TensorView* w : ws) {
    if (!uses_int_path(w->dtype)) continue;
    const int64_t g = detail::kernel_group(w->dtype);
    std::optional<detail::QuantActs>& slot = g == 256 ? a.g256 : a.g32;
    if (!slot) slot = detail::quantize_to_scratch(set, x, in_stride, n_tokens, w->cols(), g);
  }
  return a;
}

// pool.parallel_for over [0, n) with a body that is one pointer (std::function keeps it without
// allocating).
template <typename Body>
void parallel_rows(ThreadPool& pool, int64_t n, int64_t grain, const Body& body) {
  const Body* b = &body;
  pool.parallel_for(n, [b](int64_t r0, int64_t r1) { (*b)(r0, r1); }, grain);
}

}  // namespace

void matmul(ThreadPool& pool, const TensorView& w, const float* x, int64_t in_stride,
            int64_t n_tokens, float* y, int64_t out_stride) {
  if (w.rows() <= 0 || n_tokens <= 0) return;
  const detail::KernelSet& set = detail::active_kernels();
  const TensorView* ws[] = {&w};
  const auto acts = quantize_for(set, ws, x, in_stride, n_tokens);
  const Rows rows(set, w, x, in_stride, n_tokens, y, out_stride, &acts);
  parallel_rows(pool, rows.rows(), rows.grain(),
                [&rows](int64_t r0, int64_t r1) { rows.run(r0, r1); });
}

void matmul_many(ThreadPool& pool, std::span<const TensorView* const> ws, const float* x,
                 int64_t n_tokens, std::span<float* const> ys) {
  if (ws.empty() || n_tokens <= 0) return;
  const detail::KernelSet& set = detail::active_kernels();
  const int64_t in_stride = ws[0]->cols();
  const auto acts = quantize_for(set, ws, x, in_stride, n_tokens);
  std::vector<Rows> parts;
  parts.reserve(ws.size());
  int64_t total = 0, grain = 1;
  for (size_t i = 0; i < ws.size(); ++i) {
    parts.emplace_back(set, *ws[i], x, in_stride, n_tokens, ys[i], ws[i]->rows(),
                       &acts);
    total += parts.back().rows();
    grain = std::max(grain, parts.back().grain());
  }
  // The matrices' rows one after another: a chunk runs its part of each matrix it overlaps.
  parallel_rows(pool, total, grain, [&parts](int64_t r0, int64_t r1) {
    int64_t first = 0;
    for (const Rows& p : parts) {
      const int64_t b = std::max(r0, first), e = std::min(r1, first + p.rows());
      if (b < e) p.run(b - first, e - first);
      first += p.rows();
    }
  });
}

void matmul_glu(ThreadPool& pool, const TensorView& gate, const TensorView& up, const float* x,
                int64_t n_tokens, float* out, float* scratch) {
  const int64_t rows = gate.rows();
  if (rows <= 0 || n_tokens <= 0) return;
  const detail::KernelSet& set = detail::active_kernels();
  const TensorView* ws[] = {&gate, &up};
  const auto acts = quantize_for(set, ws, x, gate.cols(), n_tokens);
  const Rows g(set, gate, x, gate.cols(), n_tokens, out, rows, &acts);
  const Rows u(set, up, x, up.cols(), n_tokens, scratch, rows, &acts);
  parallel_rows(pool, rows, std::max(g.grain(2), u.grain(2)),
                [&](int64_t r0, int64_t r1) {
                  g.run(r0, r1);
                  u.run(r0, r1);
                  for (int64_t t = 0; t < n_tokens; ++t) {
                    float* o = out + t * rows + r0;
                    silu_mul(o, scratch + t * rows + r0, r1 - r0, o);
                  }
                });
}

void matmul_add(ThreadPool& pool, const TensorView& w, const float* x, int64_t n_tokens,
                float* y, float* scratch) {
  const int64_t rows = w.rows();
  if (rows <= 0 || n_tokens <= 0) return;
  const detail::KernelSet& set = detail::active_kernels();
  const TensorView* ws[] = {&w};
  const auto acts = quantize_for(set, ws, x, w.cols(), n_tokens);
  const Rows m(set, w, x, w.cols(), n_tokens, scratch, rows, &acts);
  parallel_rows(pool, rows, m.grain(), [&](int64_t r0, int64_t r1) {
    m.run(r0, r1);
    for (int64_t t = 0; t < n_tokens; ++t) {
      add_inplace(y + t * rows + r0, scratch + t * rows + r0, r1 - r0);
    }
  });
}

}  // namespace cleave::cpu
