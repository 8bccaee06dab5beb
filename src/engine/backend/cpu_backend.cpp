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

// Attention scratch holds the scores of this many heads at the longest context (more heads per
// pass when their contexts are shorter).
constexpr int64_t kHeadsPerPass = 8;

class CpuBackend final : public Backend {
 public:
  explicit CpuBackend(ThreadPool& pool) : pool_(pool), scores_(static_cast<size_t>(pool.size())),
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

  void reserve_attention(int64_t max_context) override {
    capacity_ = kHeadsPerPass * std::max<int64_t>(max_context, 1);
    for (auto& s : scores_) s.assign(static_cast<size_t>(capacity_), 0.0f);
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
    const int64_t items = b.n_tokens * a.n_heads;
    // Work of an item is proportional to its key count; slots get equal shares of it.
    int64_t total_keys = 0;
    for (int64_t t = 0; t < b.n_tokens; ++t) total_keys += b.positions[t] + 1;
    const int64_t work = total_keys * a.n_heads * a.head_dim * 2;
    const int slots = (work < kParallelMinWork || pool_.size() == 1)
                          ? 1
                          : static_cast<int>(std::min<int64_t>(pool_.size(), items));
    if (slots == 1) {
      attend_items(a, 0, items, scores_[0].data(), capacity_);
      return;
    }
    // Slot s takes the items from the one where the running key count reaches total * s / slots.
    // Any split gives the same results (items are independent).
    bounds_[0] = 0;
    int64_t seen = 0;
    int next = 1;
    for (int64_t t = 0; t < b.n_tokens && next < slots; ++t) {
      const int64_t keys = b.positions[t] + 1;
      for (int64_t h = 0; h < a.n_heads && next < slots; ++h) {
        seen += keys;
        while (next < slots && seen * slots >= total_keys * a.n_heads * next) {
          bounds_[static_cast<size_t>(next++)] = t * a.n_heads + h + 1;
        }
      }
    }
    while (next <= slots) bounds_[static_cast<size_t>(next++)] = items;
    bounds_[static_cast<size_t>(slots)] = items;
    // Slot s owns scores_[s] (parallel_for gives each index of [0, slots) to exactly one
    // thread). One captured pointer keeps std::function from allocating.
    struct Job {
      const AttentionArgs* args;
      std::vector<std::vector<float>>* scores;
      const int64_t* bounds;
      int64_t capacity;
    } job{&a, &scores_, bounds_.data(), capacity_};
    const Job* j = &job;
    pool_.parallel_for(slots, [j](int64_t b0, int64_t e0) {
      for (int64_t s = b0; s < e0; ++s) {
        attend_items(*j->args, j->bounds[s], j->bounds[s + 1],
                     (*j->scores)[static_cast<size_t>(s)].data(), j->capacity);
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

  // Attention for items [i0, i1) (item = token * n_heads + head). The query at position p
  // reduces over keys 0..p of its sequence in key order, block by block through the block table:
  // scores by the fixed-order dot, a softmax over exactly p + 1 scores, V accumulated in key order.
  // The items of one token are taken together, as many heads per pass as `scores` (`capacity`
  // floats) holds, so that a pass streams each K and V row once, contiguously, for all of its
  // heads; each head's arithmetic is the same whatever the grouping.
  static void attend_items(const AttentionArgs& a, int64_t i0, int64_t i1, float* scores,
                           int64_t capacity) {
    const TokenBatch& b = *a.batch;
    for (int64_t item = i0; item < i1;) {
      const int64_t t = item / a.n_heads;
      const int64_t h0 = item % a.n_heads;
      const int64_t h_end = std::min(a.n_heads, h0 + (i1 - item));
      const int64_t n_keys = b.positions[t] + 1;
      const int64_t per_pass = std::max<int64_t>(1, capacity / n_keys);
      for (int64_t hb = h0; hb < h_end; hb += per_pass) {
        attend_heads(a, t, hb, std::min(h_end, hb + per_pass), scores);
      }
      item += h_end - h0;
    }
  }

  // Attention of token t's heads [h0, h1); head h - h0's scores go to scores + (h - h0) * n_keys.
  // The heads that share a KV head are taken together, a block of keys at a time: dot_rows
  // gives their scores for every key of the block (each the fixed-order dot of one query and one
  // key row, f16/bf16 rows converted exactly inside the kernel), axpy_rows adds the block's V
  // rows into each head's output in key order (each row loaded once for the group's heads). Each
  // (head, key) value is the one a dot_f32 or axpy call per key gives, so the grouping never
  // changes a bit.
  static void attend_heads(const AttentionArgs& a, int64_t t, int64_t h0, int64_t h1,
                           float* scores) {
    const TokenBatch& b = *a.batch;
    const int64_t hd = a.head_dim;
    const int64_t kv_dim = a.kv.kv_dim;
    const int64_t bs = a.kv.block_size;
    const int64_t group = a.n_heads / a.n_kv_heads;
    const float scale_div = std::sqrt(static_cast<float>(hd));
    const int64_t n_keys = b.positions[t] + 1;
    const BlockId* table = b.block_ids + b.seq_blocks[b.seq[t]];
    const float* q = a.q + t * a.n_heads * hd;
    float* out = a.out + t * a.n_heads * hd;
    const uint64_t row_bytes = a.kv.row_bytes();
    const uint64_t elem = row_bytes / static_cast<uint64_t>(kv_dim);
    const bool f32 = a.kv.dtype == DType::kF32;
    // V rows of a non-f32 pool, one block's segment at a time, converted (exactly) to f32.
    thread_local std::vector<float> converted;
    if (!f32 && static_cast<int64_t>(converted.size()) < bs * hd)
      converted.resize(static_cast<size_t>(bs * hd));
    for (int64_t g0 = h0; g0 < h1;) {
      const int64_t kvh = g0 / group;
      const int64_t g1 = std::min(h1, (kvh + 1) * group);  // heads [g0, g1) read KV head kvh
      const int64_t seg = kvh * hd;
      float* sc = scores + (g0 - h0) * n_keys;
      for (int64_t j0 = 0, blk = 0; j0 < n_keys; j0 += bs, ++blk) {
        const std::byte* k = a.kv.k(a.layer, table[blk]) + static_cast<uint64_t>(seg) * elem;
        cpu::dot_rows(a.kv.dtype, k, row_bytes, std::min(bs, n_keys - j0), q + g0 * hd, hd,
                      g1 - g0, hd, sc + j0, n_keys);
      }
      for (int64_t i = 0; i < (g1 - g0) * n_keys; ++i) sc[i] /= scale_div;
      for (int64_t h = g0; h < g1; ++h) cpu::softmax(sc + (h - g0) * n_keys, n_keys);
      std::fill(out + g0 * hd, out + g1 * hd, 0.0f);
      for (int64_t j0 = 0, blk = 0; j0 < n_keys; j0 += bs, ++blk) {
        const std::byte* v = a.kv.k(a.layer, table[blk]) + static_cast<uint64_t>(bs) * row_bytes +
                             static_cast<uint64_t>(seg) * elem;
        const int64_t n = std::min(bs, n_keys - j0);
        const float* rows = reinterpret_cast<const float*>(v);
        int64_t stride = static_cast<int64_t>(row_bytes / sizeof(float));
        if (!f32) {
          for (int64_t j = 0; j < n; ++j)
            cpu::kv_load(a.kv.dtype, v + j * row_bytes, converted.data() + j * hd, hd);
          rows = converted.data();
          stride = hd;
        }
        cpu::axpy_rows(out + g0 * hd, hd, sc + j0, n_keys, g1 - g0, rows, stride, n, hd);
      }
      g0 = g1;
    }
  }

  ThreadPool& pool_;
  std::deque<std::vector<float>> buffers_;  // alloc() and upload() (a deque never moves them)
  int64_t capacity_ = 0;                    // floats in each scores_ buffer
  std::vector<std::vector<float>> scores_;  // one per pool slot
  std::vector<int64_t> bounds_;             // attention: first item of each slot, then the end
};

}  // namespace

std::unique_ptr<Backend> make_cpu_backend(ThreadPool& pool) {
  return std::make_unique<CpuBackend>(pool);
}

}  // namespace cleave
