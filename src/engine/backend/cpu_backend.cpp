// The CPU backend: the Backend operations over cpu_kernels.h, threaded over a ThreadPool.
#include <algorithm>
#include <cmath>
#include <cstring>
#include <deque>
#include <vector>

#include "../cpu/kv_convert.h"
#include "cleave/engine/backend.h"
#include "cleave/engine/cpu_kernels.h"
#include "fmt/format.h"

namespace cleave {
namespace {

// Below this many multiply-adds an operation runs on the calling thread: waking the pool costs
// more than it saves. Results do not depend on this choice (each output has one owner).
constexpr int64_t kParallelMinWork = 1 << 15;

// Attention scratch holds the scores of this many heads at the longest context, and at least
// kMinScores floats (1 MiB), so that a prompt's queries can be taken kQueryBlock at a time:
// a block of consecutive queries of one sequence reads each K and V row once for all of them
// (the scores of a 1024-token prompt cost a K and V pass per 16 queries instead of per query).
constexpr int64_t kHeadsPerPass = 8;
constexpr int64_t kMinScores = int64_t{1} << 18;
constexpr int64_t kQueryBlock = 16;
// V rows of an f16/bf16 pool are converted to f32 this many at a time (a longer KV block goes in
// pieces: axpy_rows adds rows in key order either way, so the pieces give the same bits).
constexpr int64_t kConvertRows = 64;

// A pool slot's attention scratch, sized by reserve_attention().
struct AttentionScratch {
  std::vector<float> scores;     // a pass's scores, `capacity` floats
  std::vector<int64_t> keys;     // each softmax row's key count: up to kQueryBlock * n_heads rows
  std::vector<float> converted;  // kConvertRows V rows of one head, converted to f32
};

class CpuBackend final : public Backend {
 public:
  explicit CpuBackend(ThreadPool& pool)
      : pool_(pool),
        scratch_(static_cast<size_t>(pool.size())),
        bounds_(static_cast<size_t>(pool.size()) + 1, 0) {}

  const char* name() const override { return "cpu"; }
  int threads() const override { return pool_.size(); }
  int device() const override { return -1; }

  Result<float*> alloc(int64_t n) override {
    if (n < 0) return InvalidArgument(fmt::format("alloc of {} floats", n));
    buffers_.emplace_back(static_cast<size_t>(n), 0.0f);
    return buffers_.back().data();
  }
  Result<const float*> upload(std::span<const float> host) override {
    buffers_.emplace_back(host.begin(), host.end());
    return buffers_.back().data();
  }
  // The kernels read every file dtype in place (the mmapped file is the weights' memory).
  Status prepare_weights(std::span<const TensorView* const>) override { return Status::Ok(); }
  Result<std::unique_ptr<KvStorage>> make_kv_storage(uint64_t bytes) override {
    return make_host_kv_storage(bytes);
  }
  Result<std::unique_ptr<KvStaging>> make_kv_staging(KvStorage&) override {
    return FailedPrecondition("the cpu backend's KV pool is in host memory: it needs no staging");
  }
  // Synchronous: every operation is done when it returns, and reads its arguments' host arrays.
  void begin_batch(const TokenBatch&, std::span<const int32_t>) override {}
  void mark_kv_written(int64_t) override {}
  bool kv_written(int64_t, bool) override { return true; }
  const float* to_host(const float* src, int64_t) override { return src; }
  Status check() override { return Status::Ok(); }

  void reserve_attention(const AttentionLimits& limits) override {
    limits_ = limits;
    capacity_ = std::max(kMinScores, kHeadsPerPass * std::max<int64_t>(limits.max_context, 1));
    for (AttentionScratch& s : scratch_) {
      s.scores.assign(static_cast<size_t>(capacity_), 0.0f);
      s.keys.assign(static_cast<size_t>(kQueryBlock * std::max<int64_t>(limits.n_heads, 1)), 0);
      s.converted.assign(static_cast<size_t>(kConvertRows * std::max<int64_t>(limits.head_dim, 1)),
                         0.0f);
    }
    blocks_.reserve(static_cast<size_t>(std::max<int64_t>(limits.max_tokens, 1) + 1));
  }

  void matmul(const TensorView& w, const float* x, int64_t n_tokens, float* y) override {
    cpu::matmul(pool_, w, x, w.cols(), n_tokens, y, w.rows());
  }

  void matmul_many(std::span<const TensorView* const> ws, const float* x, int64_t n_tokens,
                   std::span<float* const> ys) override {
    cpu::matmul_many(pool_, ws, x, n_tokens, ys);
  }

  void matmul_add(const TensorView& w, const float* x, int64_t n_tokens, float* y,
                  float* scratch) override {
    cpu::matmul_add(pool_, w, x, n_tokens, y, scratch);
  }

  void matmul_glu(const TensorView& gate, const TensorView& up, const float* x, int64_t n_tokens,
                  float* out, float* scratch) override {
    cpu::matmul_glu(pool_, gate, up, x, n_tokens, out, scratch);
  }

  void embedding(const TensorView& table, std::span<const int32_t> tokens, float* out) override {
    const int64_t cols = table.cols();
    for (size_t t = 0; t < tokens.size(); ++t) {
      cpu::row_to_f32(table, tokens[t], out + static_cast<int64_t>(t) * cols);
    }
  }

  void rmsnorm(const float* x, const float* weight, float eps, int64_t n_tokens, int64_t dim,
               float* out) override {
    for_tokens(n_tokens, dim, [&](int64_t t) {
      cpu::rmsnorm(x + t * dim, weight, eps, dim, out + t * dim);
    });
  }

  void rope(const RopeArgs& a) override {
    const int64_t half = a.head_dim / 2;
    for_tokens(a.n_tokens, a.n_heads * a.head_dim * 4, [&](int64_t t) {
      float* row = a.x + t * a.row_stride;
      const float pos = static_cast<float>(a.positions[t]);
      for (int64_t j = 0; j < half; ++j) {
        const float angle = pos * a.inv_freq[j];
        const float c = std::cos(angle);
        const float s = std::sin(angle);
        for (int64_t h = 0; h < a.n_heads; ++h) {
          float* head = row + h * a.head_dim;
          float* p0 = a.style == RopeStyle::kNormal ? head + 2 * j : head + j;
          float* p1 = a.style == RopeStyle::kNormal ? head + 2 * j + 1 : head + j + half;
          const float v0 = *p0;
          const float v1 = *p1;
          *p0 = v0 * c - v1 * s;
          *p1 = v0 * s + v1 * c;
        }
      }
    });
  }

  void write_kv(const KvWriteArgs& a) override {
    const TokenBatch& b = *a.batch;
    const int64_t kv_dim = a.kv.kv_dim, bs = a.kv.block_size, row = a.kv.row_bytes();
    for (int64_t t = 0; t < b.n_tokens; ++t) {
      const int64_t slot = b.kv_slots[t];
      std::byte* k = a.kv.k(a.layer, static_cast<BlockId>(slot / bs)) + (slot % bs) * row;
      cpu::kv_store(a.kv.dtype, a.k + t * kv_dim, k, kv_dim);
      cpu::kv_store(a.kv.dtype, a.v + t * kv_dim, k + bs * row, kv_dim);
    }
  }

  void attention(const AttentionArgs& a) override {
    const TokenBatch& b = *a.batch;
    int64_t total_keys = 0, max_keys = 0;
    for (int64_t t = 0; t < b.n_tokens; ++t) {
      total_keys += b.positions[t] + 1;
      max_keys = std::max(max_keys, b.positions[t] + 1);
    }
    // A call past the reserved limits (not one the model makes) grows the scratch first.
    if (b.n_tokens > limits_.max_tokens || max_keys > limits_.max_context ||
        a.n_heads > limits_.n_heads || a.head_dim > limits_.head_dim) {
      reserve_attention({.max_context = std::max(limits_.max_context, max_keys),
                         .max_tokens = std::max(limits_.max_tokens, b.n_tokens),
                         .n_heads = std::max(limits_.n_heads, a.n_heads),
                         .head_dim = std::max(limits_.head_dim, a.head_dim)});
    }
    // Query blocks: runs of at most kQueryBlock tokens of one sequence at consecutive positions
    // (a prompt chunk gives full blocks, a decode step one token each). An item is a block's
    // head; blocks_ holds each block's first token, then n_tokens.
    blocks_.clear();
    for (int64_t t = 0; t < b.n_tokens; ++t) {
      if (t == 0 || t - blocks_.back() == kQueryBlock || b.seq[t] != b.seq[t - 1] ||
          b.positions[t] != b.positions[t - 1] + 1)
        blocks_.push_back(t);
    }
    const int64_t n_blocks = static_cast<int64_t>(blocks_.size());
    blocks_.push_back(b.n_tokens);
    const int64_t items = n_blocks * a.n_heads;
    // Work of an item is proportional to its key count (a block's: its queries' counts added);
    // slots get equal shares of it.
    auto block_keys = [&](int64_t blk) {
      int64_t keys = 0;
      for (int64_t t = blocks_[blk]; t < blocks_[blk + 1]; ++t) keys += b.positions[t] + 1;
      return keys;
    };
    const int64_t work = total_keys * a.n_heads * a.head_dim * 2;
    const int slots = (work < kParallelMinWork || pool_.size() == 1)
                          ? 1
                          : static_cast<int>(std::min<int64_t>(pool_.size(), items));
    if (slots == 1) {
      attend_items(a, blocks_.data(), 0, items, scratch_[0], capacity_);
      return;
    }
    // Slot s takes the items from the one where the running key count reaches total * s / slots.
    // Any split gives the same results (items are independent).
    bounds_[0] = 0;
    int64_t seen = 0;
    int next = 1;
    for (int64_t blk = 0; blk < n_blocks && next < slots; ++blk) {
      const int64_t keys = block_keys(blk);
      for (int64_t h = 0; h < a.n_heads && next < slots; ++h) {
        seen += keys;
        while (next < slots && seen * slots >= total_keys * a.n_heads * next) {
          bounds_[static_cast<size_t>(next++)] = blk * a.n_heads + h + 1;
        }
      }
    }
    while (next <= slots) bounds_[static_cast<size_t>(next++)] = items;
    bounds_[static_cast<size_t>(slots)] = items;
    // Slot s owns scratch_[s] (parallel_for gives each index of [0, slots) to exactly one
    // thread). One captured pointer keeps std::function from allocating.
    struct Job {
      const AttentionArgs* args;
      const int64_t* blocks;
      AttentionScratch* scratch;
      const int64_t* bounds;
      int64_t capacity;
    } job{&a, blocks_.data(), scratch_.data(), bounds_.data(), capacity_};
    const Job* j = &job;
    pool_.parallel_for(slots, [j](int64_t b0, int64_t e0) {
      for (int64_t s = b0; s < e0; ++s) {
        attend_items(*j->args, j->blocks, j->bounds[s], j->bounds[s + 1], j->scratch[s],
                     j->capacity);
      }
    });
  }

  void silu_mul(const float* gate, const float* up, int64_t n, float* out) override {
    cpu::silu_mul(gate, up, n, out);
  }

  void add(float* y, const float* x, int64_t n) override { cpu::add_inplace(y, x, n); }

  void add_bias(float* y, const float* bias, int64_t n_tokens, int64_t dim) override {
    for (int64_t t = 0; t < n_tokens; ++t) cpu::add_inplace(y + t * dim, bias, dim);
  }

 private:
  // Runs fn(t) for every token, threaded over tokens when there is enough work.
  template <typename Fn>
  void for_tokens(int64_t n_tokens, int64_t work_per_token, const Fn& fn) {
    if (n_tokens == 1 || n_tokens * work_per_token < kParallelMinWork || pool_.size() == 1) {
      for (int64_t t = 0; t < n_tokens; ++t) fn(t);
      return;
    }
    const Fn* f = &fn;
    pool_.parallel_for(n_tokens, [f](int64_t b, int64_t e) {
      for (int64_t t = b; t < e; ++t) (*f)(t);
    });
  }

  // Attention for items [i0, i1) (item = query block * n_heads + head; `blocks` as blocks_). The
  // query at position p reduces over keys 0..p of its sequence in key order, block by block
  // through the block table: scores by the fixed-order dot, a softmax over exactly p + 1 scores,
  // V accumulated in key order. A block's items are taken together, as many heads and queries
  // per pass as the scores scratch (`capacity` floats) holds, so that a pass streams each K and V
  // row once, contiguously, for all of them; each (query, head)'s arithmetic is the same whatever
  // the grouping.
  static void attend_items(const AttentionArgs& a, const int64_t* blocks, int64_t i0, int64_t i1,
                           AttentionScratch& scratch, int64_t capacity) {
    const TokenBatch& b = *a.batch;
    for (int64_t item = i0; item < i1;) {
      const int64_t blk = item / a.n_heads;
      const int64_t t0 = blocks[blk], t1 = blocks[blk + 1];
      const int64_t h0 = item % a.n_heads;
      const int64_t h_end = std::min(a.n_heads, h0 + (i1 - item));
      const int64_t max_keys = b.positions[t1 - 1] + 1;
      // Queries first: the heads of one KV group share their K and V rows, so a pass takes as
      // many queries as the scratch holds for one group, then as many whole groups as fit at
      // that (a long context keeps its blocks of queries, fewer heads a pass).
      const int64_t group = a.n_heads / a.n_kv_heads;
      const int64_t queries =
          std::clamp<int64_t>(capacity / (std::min(group, h_end - h0) * max_keys), 1, t1 - t0);
      int64_t heads = std::max<int64_t>(1, capacity / (queries * max_keys));
      if (heads >= group) heads = heads / group * group;
      for (int64_t q0 = t0; q0 < t1; q0 += queries) {
        for (int64_t hb = h0; hb < h_end;) {
          // A pass of whole groups ends on a group's end.
          const int64_t he =
              std::min(h_end, heads >= group ? hb / group * group + heads : hb + heads);
          attend_heads(a, q0, std::min(t1, q0 + queries), hb, he, scratch);
          hb = he;
        }
      }
      item += h_end - h0;
    }
  }

  // Attention of queries [t0, t1) (consecutive positions of one sequence) for heads [h0, h1);
  // the scores of head h and query t0 + i go to scratch.scores + ((h - h0) * (t1 - t0) + i) *
  // n_keys, n_keys being the last query's key count. The heads that share a KV head are taken
  // together, a block of keys at a time: dot_rows gives the scores of every (head, query) for
  // every key of the block (each the fixed-order dot of one query and one key row, f16/bf16 rows
  // converted exactly inside the kernel; a query's scores past its own position are made and
  // never read), axpy_rows adds the block's V rows into the outputs in key order, each output over its own
  // keys only (each row loaded once for all the outputs that take it). Each (head, query, key)
  // value is the one a dot_f32 or axpy call per key gives, so the grouping never changes a bit.
  static void attend_heads(const AttentionArgs& a, int64_t t0, int64_t t1, int64_t h0, int64_t h1,
                           AttentionScratch& scratch) {
    const TokenBatch& b = *a.batch;
    const int64_t hd = a.head_dim;
    const int64_t kv_dim = a.kv.kv_dim;
    const int64_t bs = a.kv.block_size;
    const int64_t group = a.n_heads / a.n_kv_heads;
    const float scale_div = std::sqrt(static_cast<float>(hd));
    const int64_t nq = t1 - t0;
    const int64_t n_keys = b.positions[t1 - 1] + 1;
    const BlockId* table = b.block_ids + b.seq_blocks[b.seq[t0]];
    const int64_t q_stride = a.n_heads * hd;
    const float* q = a.q + t0 * q_stride;
    float* out = a.out + t0 * q_stride;
    const uint64_t row_bytes = a.kv.row_bytes();
    const uint64_t elem = row_bytes / static_cast<uint64_t>(kv_dim);
    const bool f32 = a.kv.dtype == DType::kF32;
    float* const scores = scratch.scores.data();
    int64_t* const keys = scratch.keys.data();
    for (int64_t g0 = h0; g0 < h1;) {
      const int64_t kvh = g0 / group;
      const int64_t g1 = std::min(h1, (kvh + 1) * group);  // heads [g0, g1) read KV head kvh
      const int64_t seg = kvh * hd;
      float* sc = scores + (g0 - h0) * nq * n_keys;
      auto scores_of = [&](int64_t h, int64_t t) { return sc + ((h - g0) * nq + t) * n_keys; };
      for (int64_t j0 = 0, blk = 0; j0 < n_keys; j0 += bs, ++blk) {
        const std::byte* k = a.kv.k(a.layer, table[blk]) + static_cast<uint64_t>(seg) * elem;
        const int64_t n = std::min(bs, n_keys - j0);
        if (nq == 1) {
          cpu::dot_rows(a.kv.dtype, k, row_bytes, n, q + g0 * hd, hd, g1 - g0, hd, sc + j0, n_keys);
        } else {
          for (int64_t h = g0; h < g1; ++h)
            cpu::dot_rows(a.kv.dtype, k, row_bytes, n, q + h * hd, q_stride, nq, hd,
                          scores_of(h, 0) + j0, n_keys);
        }
      }
      // Row (h - g0) * nq + t of sc is head h's scores of query t.
      for (int64_t h = g0; h < g1; ++h) {
        for (int64_t t = 0; t < nq; ++t) {
          keys[(h - g0) * nq + t] = b.positions[t0 + t] + 1;
          std::fill_n(out + t * q_stride + h * hd, hd, 0.0f);
        }
      }
      cpu::softmax_rows(sc, n_keys, keys, (g1 - g0) * nq, scale_div);
      // V rows [j0, j0 + n): a whole KV block of an f32 pool, up to kConvertRows rows of one
      // block otherwise.
      for (int64_t j0 = 0, n = 0; j0 < n_keys; j0 += n) {
        const int64_t off = j0 % bs;
        n = std::min({f32 ? bs : kConvertRows, bs - off, n_keys - j0});
        const std::byte* v = a.kv.k(a.layer, table[j0 / bs]) +
                             static_cast<uint64_t>(bs + off) * row_bytes +
                             static_cast<uint64_t>(seg) * elem;
        const float* rows = reinterpret_cast<const float*>(v);
        int64_t stride = static_cast<int64_t>(row_bytes / sizeof(float));
        if (!f32) {
          float* converted = scratch.converted.data();
          for (int64_t j = 0; j < n; ++j)
            cpu::kv_load(a.kv.dtype, v + j * row_bytes, converted + j * hd, hd);
          rows = converted;
          stride = hd;
        }
        if (nq == 1) {
          cpu::axpy_rows(out + g0 * hd, hd, sc + j0, n_keys, g1 - g0, rows, stride, n, hd);
          continue;
        }
        // Queries [full, nq) take all n rows (one call for the group's heads and those queries);
        // each earlier one its first `own` rows.
        int64_t full = nq;
        while (full > 0 && b.positions[t0 + full - 1] + 1 >= j0 + n) --full;
        for (int64_t h = g0; h < g1; ++h) {
          if (full < nq)
            cpu::axpy_rows(out + full * q_stride + h * hd, q_stride, scores_of(h, full) + j0,
                           n_keys, nq - full, rows, stride, n, hd);
          for (int64_t t = 0; t < full; ++t) {
            const int64_t own = b.positions[t0 + t] + 1 - j0;
            if (own > 0)
              cpu::axpy_rows(out + t * q_stride + h * hd, 0, scores_of(h, t) + j0, 0, 1, rows,
                             stride, own, hd);
          }
        }
      }
      g0 = g1;
    }
  }

  ThreadPool& pool_;
  std::deque<std::vector<float>> buffers_;  // alloc() and upload() (a deque never moves them)
  AttentionLimits limits_;                  // what reserve_attention() sized the scratch for
  int64_t capacity_ = 0;                    // floats in each slot's scores
  std::vector<AttentionScratch> scratch_;   // one per pool slot
  std::vector<int64_t> bounds_;             // attention: first item of each slot, then the end
  std::vector<int64_t> blocks_;             // attention: each query block's first token, then end
};

}  // namespace

std::unique_ptr<Backend> make_cpu_backend(ThreadPool& pool) {
  return std::make_unique<CpuBackend>(pool);
}

}  // namespace cleave
