// The CPU backend: the Backend operations over cpu_kernels.h, threaded over a ThreadPool.
#include <algorithm>
#include <cmath>
#include <vector>

#include "cleave/engine/backend.h"
#include "cleave/engine/cpu_kernels.h"

namespace cleave {
namespace {

// Below this many multiply-adds an operation runs on the calling thread: waking the pool costs
// more than it saves. Results do not depend on this choice (each output has one owner).
constexpr int64_t kParallelMinWork = 1 << 15;

class CpuBackend final : public Backend {
 public:
  explicit CpuBackend(ThreadPool& pool) : pool_(pool), scores_(static_cast<size_t>(pool.size())) {}

  const char* name() const override { return "cpu"; }
  int threads() const override { return pool_.size(); }

  void reserve_attention(int64_t max_context) override {
    for (auto& s : scores_) s.assign(static_cast<size_t>(std::max<int64_t>(max_context, 1)), 0.0f);
  }

  void matmul(const TensorView& w, const float* x, int64_t n_tokens, float* y) override {
    cpu::matmul(pool_, w, x, w.cols(), n_tokens, y, w.rows());
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
      const float pos = static_cast<float>(a.start_pos + t);
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

  void attention(const AttentionArgs& a) override {
    const int64_t items = a.n_tokens * a.n_heads;
    const int64_t keys = a.start_pos + a.n_tokens;
    const int64_t work = items * keys * a.head_dim * 2;
    const int slots = (work < kParallelMinWork || pool_.size() == 1)
                          ? 1
                          : static_cast<int>(std::min<int64_t>(pool_.size(), items));
    if (slots == 1) {
      attend_items(a, 0, items, scores_[0].data());
      return;
    }
    // One chunk of items per slot; slot s owns scores_[s] (parallel_for gives each index of
    // [0, slots) to exactly one thread). One captured pointer keeps std::function from
    // allocating.
    struct Job {
      const AttentionArgs* args;
      std::vector<std::vector<float>>* scores;
      int64_t items;
      int64_t slots;
    } job{&a, &scores_, items, slots};
    const Job* j = &job;
    pool_.parallel_for(slots, [j](int64_t b, int64_t e) {
      for (int64_t s = b; s < e; ++s) {
        const int64_t i0 = j->items * s / j->slots;
        const int64_t i1 = j->items * (s + 1) / j->slots;
        attend_items(*j->args, i0, i1, (*j->scores)[static_cast<size_t>(s)].data());
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
  // reduces over keys 0..p in key order, whatever the chunk: scores by the fixed-order dot,
  // a softmax over exactly p + 1 scores, V accumulated in key order.
  static void attend_items(const AttentionArgs& a, int64_t i0, int64_t i1, float* scores) {
    const int64_t hd = a.head_dim;
    const int64_t q_stride = a.n_heads * hd;
    const int64_t kv_stride = a.n_kv_heads * hd;
    const int64_t group = a.n_heads / a.n_kv_heads;
    const float scale_div = std::sqrt(static_cast<float>(hd));
    for (int64_t item = i0; item < i1; ++item) {
      const int64_t t = item / a.n_heads;
      const int64_t h = item % a.n_heads;
      const int64_t n_keys = a.start_pos + t + 1;
      const float* q = a.q + t * q_stride + h * hd;
      const int64_t kv_off = (h / group) * hd;
      for (int64_t j = 0; j < n_keys; ++j) {
        scores[j] = cpu::dot_f32(q, a.k + j * kv_stride + kv_off, hd) / scale_div;
      }
      cpu::softmax(scores, n_keys);
      float* out = a.out + t * q_stride + h * hd;
      std::fill(out, out + hd, 0.0f);
      for (int64_t j = 0; j < n_keys; ++j) cpu::axpy(out, scores[j], a.v + j * kv_stride + kv_off, hd);
    }
  }

  ThreadPool& pool_;
  std::vector<std::vector<float>> scores_;  // one per pool slot
};

}  // namespace

std::unique_ptr<Backend> make_cpu_backend(ThreadPool& pool) {
  return std::make_unique<CpuBackend>(pool);
}

}  // namespace cleave
