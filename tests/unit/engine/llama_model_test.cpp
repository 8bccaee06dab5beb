// The Llama-family forward pass over the paged KV pool: agreement with a plain reference
// implementation on synthetic models (GQA, RoPE styles and scalings, QKV bias, tied output,
// f32/f16/q8_0 weights), chunk invariance and batch invariance bit for bit (mixed prefill chunks
// and decode tokens, shuffled block tables, block sizes 1/7/16, sub-batches), K/V in the pool
// against the reference, per-layer hooks, GGUF vs HF loaders bit for bit, and errors.
#include "cleave/engine/llama_model.h"

#include <gtest/gtest.h>
#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <filesystem>
#include <map>
#include <numeric>
#include <random>
#include <string>
#include <vector>

#include "cleave/engine/cpu_kernels.h"
#include "cleave/model/hf_export.h"
#include "cleave/model/synth.h"

namespace cleave {
namespace {

namespace fs = std::filesystem;

std::string shared_dir() { return std::string(CLEAVE_SOURCE_DIR) + "/../shared"; }
std::string stories_path() { return shared_dir() + "/models/stories260K.gguf"; }

fs::path temp_dir(const std::string& tag) {
  fs::path p = fs::temp_directory_path() /
               ("cleave_llama_model_test_" + tag + "_" + std::to_string(::getpid()));
  fs::create_directories(p);
  return p;
}

std::shared_ptr<const ModelFile> load_or_fail(const std::string& path) {
  auto m = load_model(path);
  EXPECT_TRUE(m.ok()) << m.status().to_string();
  if (!m.ok()) return nullptr;
  return std::shared_ptr<const ModelFile>(std::move(*m));
}

std::unique_ptr<LlamaModel> make_model(std::shared_ptr<const ModelFile> f, int threads = 2,
                                       int64_t max_batch = 0, int64_t max_context = 0) {
  EngineOptions o;
  o.threads = threads;
  o.max_context = max_context;
  if (max_batch > 0) o.max_batch_tokens = max_batch;
  auto m = LlamaModel::create(std::move(f), o);
  EXPECT_TRUE(m.ok()) << m.status().to_string();
  return m.ok() ? std::move(*m) : nullptr;
}

std::vector<int32_t> test_prompt(int64_t n, int32_t vocab, int32_t first, uint32_t seed) {
  std::mt19937 rng(seed);
  std::vector<int32_t> t{first};
  while (static_cast<int64_t>(t.size()) < n) t.push_back(static_cast<int32_t>(rng() % vocab));
  return t;
}

// One sequence's KV in a pool of its own: `positions` positions in blocks of `block_size`, the
// table either in order or a random permutation of the pool's blocks (seeded).
struct PagedSeq {
  std::unique_ptr<KvBlockPool> kv;
  std::vector<BlockId> table;
};

std::unique_ptr<KvBlockPool> make_pool(const LlamaModel& m, int64_t block_size, int64_t blocks) {
  auto kv = KvBlockPool::create(m.kv_layout(block_size, blocks));
  EXPECT_TRUE(kv.ok()) << kv.status().to_string();
  return kv.ok() ? std::move(*kv) : nullptr;
}

std::vector<BlockId> shuffled_ids(int64_t n, uint32_t seed) {
  std::vector<BlockId> ids(static_cast<size_t>(n));
  std::iota(ids.begin(), ids.end(), 0);
  std::mt19937 rng(seed);
  std::shuffle(ids.begin(), ids.end(), rng);
  return ids;
}

PagedSeq make_seq(const LlamaModel& m, int64_t positions, int64_t block_size = 16,
                  uint32_t shuffle_seed = 0) {
  const int64_t blocks = (positions + block_size - 1) / block_size;
  PagedSeq s;
  // A few spare blocks so that a shuffled table is not simply a permutation of the whole pool.
  const int64_t pool_blocks = blocks + (shuffle_seed != 0 ? 3 : 0);
  s.kv = make_pool(m, block_size, pool_blocks);
  if (shuffle_seed == 0) {
    s.table.resize(static_cast<size_t>(blocks));
    std::iota(s.table.begin(), s.table.end(), 0);
  } else {
    s.table = shuffled_ids(pool_blocks, shuffle_seed);
    s.table.resize(static_cast<size_t>(blocks));
  }
  return s;
}

// K (or V) of positions [0, n) of `layer` read through `table`: [n, kv_dim] floats.
std::vector<float> gather_kv(const KvBlockPool& kv, std::span<const BlockId> table, int64_t layer,
                             int64_t n, bool v) {
  const KvLayout& l = kv.layout();
  std::vector<float> out(static_cast<size_t>(n * l.kv_dim()));
  for (int64_t p = 0; p < n; ++p) {
    const BlockId b = table[static_cast<size_t>(p / l.block_size)];
    const float* src = (v ? kv.v(layer, b) : kv.k(layer, b)) + (p % l.block_size) * l.kv_dim();
    std::memcpy(out.data() + p * l.kv_dim(), src, static_cast<size_t>(l.kv_dim()) * sizeof(float));
  }
  return out;
}

// Runs `tokens` in chunks of `chunk` through forward(); returns the logits after each chunk,
// keyed by the position of the chunk's last token, and leaves the KV in `seq`.
std::map<int64_t, std::vector<float>> run_chunked(LlamaModel& m, const std::vector<int32_t>& tokens,
                                                  int64_t chunk, PagedSeq& seq) {
  std::map<int64_t, std::vector<float>> out;
  const int64_t n = static_cast<int64_t>(tokens.size());
  for (int64_t s = 0; s < n; s += chunk) {
    const int64_t len = std::min(chunk, n - s);
    std::vector<float> logits(static_cast<size_t>(m.config().vocab_size));
    Status st = m.forward(std::span<const int32_t>(tokens).subspan(s, len), s, seq.table, *seq.kv,
                          logits);
    EXPECT_TRUE(st.ok()) << st.to_string();
    out[s + len - 1] = std::move(logits);
  }
  return out;
}

bool bits_equal(const float* a, const float* b, int64_t n) {
  return std::memcmp(a, b, static_cast<size_t>(n) * sizeof(float)) == 0;
}

// K and V of every layer of `a` and `b` (positions [0, n)) are bit-identical.
void expect_same_kv(const PagedSeq& a, const PagedSeq& b, int64_t n) {
  for (int64_t l = 0; l < a.kv->layout().n_layers; ++l) {
    for (bool v : {false, true}) {
      EXPECT_EQ(gather_kv(*a.kv, a.table, l, n, v), gather_kv(*b.kv, b.table, l, n, v))
          << (v ? "V" : "K") << " of layer " << l;
    }
  }
}

// Logits of every chunk end and the whole KV are bit-identical to the token-by-token run, for
// several chunk sizes, thread counts, internal batch sizes, block sizes and block tables.
void expect_chunk_invariant(std::shared_ptr<const ModelFile> file,
                            const std::vector<int32_t>& tokens) {
  const int64_t n = static_cast<int64_t>(tokens.size());
  auto ref_model = make_model(file, 1);
  ASSERT_TRUE(ref_model);
  PagedSeq ref_seq = make_seq(*ref_model, n);
  auto ref = run_chunked(*ref_model, tokens, 1, ref_seq);
  const int64_t vocab = ref_model->config().vocab_size;

  struct Case { int threads; int64_t max_batch; int64_t chunk; int64_t block_size; uint32_t shuffle; };
  for (Case c : {Case{2, 0, 1, 16, 0}, Case{1, 0, 3, 7, 11}, Case{2, 0, 7, 1, 12},
                 Case{2, 0, n, 16, 13}, Case{1, 0, n, 1, 0}, Case{2, 5, n, 7, 14},
                 Case{2, 4, 7, 16, 15}, Case{2, 0, n, n, 0}}) {
    SCOPED_TRACE(testing::Message() << "threads " << c.threads << " max_batch " << c.max_batch
                                    << " chunk " << c.chunk << " block size " << c.block_size
                                    << " shuffle " << c.shuffle);
    auto m = make_model(file, c.threads, c.max_batch);
    ASSERT_TRUE(m);
    PagedSeq seq = make_seq(*m, n, c.block_size, c.shuffle);
    auto got = run_chunked(*m, tokens, c.chunk, seq);
    for (const auto& [pos, logits] : got) {
      EXPECT_TRUE(bits_equal(logits.data(), ref.at(pos).data(), vocab)) << "logits at " << pos;
    }
    expect_same_kv(seq, ref_seq, n);
  }
}

// ---- Batch invariance: many sequences in one forward_batch() against each run alone.

struct SoloRun {
  std::vector<int32_t> tokens;
  std::map<int64_t, std::vector<float>> logits;  // after each position, token by token
  PagedSeq seq;
};

// Sequences of mixed lengths run together, step after step: in each step every unfinished
// sequence (bar a few skipped at random) brings a prefill chunk or a single decode token, in a
// shuffled order, with block tables drawn at random from one shared pool. Every logits vector
// and the final K/V of every sequence must equal the solo run's bit for bit.
void expect_batch_invariant(std::shared_ptr<const ModelFile> file, int n_seqs, uint32_t seed) {
  auto solo_model = make_model(file, 1);
  ASSERT_TRUE(solo_model);
  const auto vocab = static_cast<int32_t>(solo_model->config().vocab_size);
  std::mt19937 rng(seed);
  std::vector<SoloRun> solo(static_cast<size_t>(n_seqs));
  for (int i = 0; i < n_seqs; ++i) {
    const int64_t len = i == 0 ? 1 : 2 + static_cast<int64_t>(rng() % 38);
    solo[i].tokens = test_prompt(len, vocab, 1, seed * 100 + static_cast<uint32_t>(i));
    solo[i].seq = make_seq(*solo_model, len);
    solo[i].logits = run_chunked(*solo_model, solo[i].tokens, 1, solo[i].seq);
  }

  struct Case { int threads; int64_t max_batch; int64_t block_size; };
  for (Case c : {Case{2, 0, 16}, Case{2, 0, 7}, Case{1, 0, 1}, Case{2, 5, 7}, Case{2, 3, 1},
                 Case{2, 16, 16}}) {
    SCOPED_TRACE(testing::Message() << "threads " << c.threads << " max_batch " << c.max_batch
                                    << " block size " << c.block_size);
    auto m = make_model(file, c.threads, c.max_batch);
    ASSERT_TRUE(m);
    // Each sequence's blocks are drawn from a shuffled list of the pool's ids.
    int64_t total_blocks = 0;
    for (const SoloRun& r : solo)
      total_blocks += (static_cast<int64_t>(r.tokens.size()) + c.block_size - 1) / c.block_size;
    auto kv = make_pool(*m, c.block_size, total_blocks + 4);
    ASSERT_TRUE(kv);
    const std::vector<BlockId> ids = shuffled_ids(total_blocks + 4, seed + 1);
    std::vector<std::vector<BlockId>> tables(static_cast<size_t>(n_seqs));
    for (size_t next = 0, i = 0; next < static_cast<size_t>(total_blocks); i = (i + 1) % n_seqs) {
      const auto need = (solo[i].tokens.size() + c.block_size - 1) / c.block_size;
      if (tables[i].size() < need) tables[i].push_back(ids[next++]);  // interleaved
    }

    std::vector<int64_t> done(static_cast<size_t>(n_seqs), 0);
    std::vector<std::vector<float>> logits(static_cast<size_t>(n_seqs),
                                           std::vector<float>(static_cast<size_t>(vocab)));
    int steps = 0, max_seqs_in_step = 0;
    bool mixed_step = false;
    for (;;) {
      std::vector<BatchSequence> batch;
      std::vector<int> who;
      bool any_prefill = false, any_decode = false;
      for (int i = 0; i < n_seqs; ++i) {
        const auto len = static_cast<int64_t>(solo[i].tokens.size());
        if (done[i] == len || (steps > 0 && rng() % 5 == 0)) continue;
        // First step: a prefill chunk; later ones: mostly single decode tokens.
        const int64_t chunk = done[i] == 0 || rng() % 4 == 0
                                  ? 1 + static_cast<int64_t>(rng() % 12)
                                  : 1;
        const int64_t take = std::min(chunk, len - done[i]);
        (take > 1 ? any_prefill : any_decode) = true;
        const bool want_logits = rng() % 6 != 0;
        batch.push_back(BatchSequence{
            .tokens = std::span<const int32_t>(solo[i].tokens).subspan(done[i], take),
            .start_pos = done[i],
            .block_table = tables[i],
            .logits = want_logits ? std::span<float>(logits[i]) : std::span<float>()});
        who.push_back(i);
      }
      if (batch.empty()) {
        if (std::all_of(done.begin(), done.end(), [&, i = 0](int64_t d) mutable {
              return d == static_cast<int64_t>(solo[i++].tokens.size());
            }))
          break;
        continue;
      }
      // Shuffle the batch order (tables and outputs travel with their sequence).
      std::vector<size_t> order(batch.size());
      std::iota(order.begin(), order.end(), 0);
      std::shuffle(order.begin(), order.end(), rng);
      std::vector<BatchSequence> shuffled;
      for (size_t o : order) shuffled.push_back(batch[o]);
      for (int i : who) std::fill(logits[i].begin(), logits[i].end(), -1.0f);
      Status st = m->forward_batch(shuffled, *kv);
      ASSERT_TRUE(st.ok()) << st.to_string();
      for (size_t b = 0; b < batch.size(); ++b) {
        const int i = who[b];
        const int64_t last = batch[b].start_pos + static_cast<int64_t>(batch[b].tokens.size()) - 1;
        if (!batch[b].logits.empty()) {
          EXPECT_TRUE(bits_equal(logits[i].data(), solo[i].logits.at(last).data(), vocab))
              << "sequence " << i << " logits at position " << last << " (step " << steps << ")";
        } else {
          EXPECT_EQ(logits[i][0], -1.0f) << "logits written though none were asked for";
        }
        done[i] = last + 1;
      }
      max_seqs_in_step = std::max(max_seqs_in_step, static_cast<int>(batch.size()));
      mixed_step = mixed_step || (any_prefill && any_decode);
      ++steps;
    }
    EXPECT_GE(max_seqs_in_step, 8);
    EXPECT_TRUE(mixed_step) << "no step mixed prefill chunks with decode tokens";
    for (int i = 0; i < n_seqs; ++i) {
      SCOPED_TRACE(testing::Message() << "sequence " << i);
      const auto len = static_cast<int64_t>(solo[i].tokens.size());
      for (int64_t l = 0; l < m->config().n_layers; ++l) {
        for (bool v : {false, true}) {
          EXPECT_EQ(gather_kv(*kv, tables[i], l, len, v),
                    gather_kv(*solo[i].seq.kv, solo[i].seq.table, l, len, v))
              << (v ? "V" : "K") << " of layer " << l;
        }
      }
    }
  }
}

// ---- A plain reference forward pass (double accumulation, no shared code but dequantising).

struct RefModel {
  const ModelFile& f;
  const ModelConfig& c;

  std::vector<float> mat(const std::string& name) const {
    const TensorView* t = f.tensor(name);
    EXPECT_NE(t, nullptr) << name;
    std::vector<float> out(static_cast<size_t>(t->elements()));
    if (t->shape.size() == 1) {
      cpu::tensor_to_f32(*t, out.data());
    } else {
      for (int64_t r = 0; r < t->rows(); ++r) cpu::row_to_f32(*t, r, out.data() + r * t->cols());
    }
    return out;
  }
  static std::vector<double> matvec(const std::vector<float>& w, const std::vector<double>& x) {
    const size_t cols = x.size(), rows = w.size() / cols;
    std::vector<double> y(rows, 0.0);
    for (size_t r = 0; r < rows; ++r)
      for (size_t i = 0; i < cols; ++i) y[r] += static_cast<double>(w[r * cols + i]) * x[i];
    return y;
  }
  // What the integer path multiplies a block format's weights with: x (as f32) rounded to 8 bits
  // per 32-element block (cpu_kernels.h).
  static std::vector<double> quantised(const std::vector<double>& x) {
    std::vector<double> out(x.size());
    for (size_t b = 0; b + 32 <= x.size(); b += 32) {
      float amax = 0.0f;
      for (size_t i = 0; i < 32; ++i) amax = std::fmax(amax, std::fabs(static_cast<float>(x[b + i])));
      const float d = amax / 127.0f;
      const float id = d != 0.0f ? 1.0f / d : 0.0f;
      for (size_t i = 0; i < 32; ++i)
        out[b + i] = static_cast<double>(d) * std::nearbyint(static_cast<float>(x[b + i]) * id);
    }
    return out;
  }
  // matvec with the named weight, on the activation its dtype's kernels see.
  std::vector<double> apply(const std::string& name, const std::vector<double>& x) const {
    const bool int_path = cpu::uses_int_path(f.tensor(name)->dtype);
    return matvec(mat(name), int_path ? quantised(x) : x);
  }
  std::vector<double> rmsnorm(const std::vector<double>& x, const std::vector<float>& w) const {
    double ss = 0;
    for (double v : x) ss += v * v;
    const double s = 1.0 / std::sqrt(ss / static_cast<double>(x.size()) + c.rms_eps);
    std::vector<double> y(x.size());
    for (size_t i = 0; i < x.size(); ++i) y[i] = x[i] * s * w[i];
    return y;
  }
  std::vector<double> inv_freq() const {
    const int64_t half = c.head_dim / 2;
    std::vector<double> f(static_cast<size_t>(half));
    for (int64_t j = 0; j < half; ++j) {
      f[j] = std::pow(static_cast<double>(c.rope_theta), -2.0 * j / static_cast<double>(c.head_dim));
      const RopeScaling& s = c.rope_scaling;
      if (s.type == RopeScaling::Type::kLinear) f[j] /= s.factor;
      if (s.type == RopeScaling::Type::kLlama3) {
        const double wl = 2 * M_PI / f[j];
        const double lo_wl = s.original_context / s.low_freq_factor;
        const double hi_wl = s.original_context / s.high_freq_factor;
        if (wl > lo_wl) {
          f[j] /= s.factor;
        } else if (wl >= hi_wl) {
          const double sm = (s.original_context / wl - s.low_freq_factor) /
                            (s.high_freq_factor - s.low_freq_factor);
          f[j] = (1 - sm) * f[j] / s.factor + sm * f[j];
        }
      }
    }
    return f;
  }
  void rope(std::vector<double>& x, int64_t heads, int64_t pos) const {
    const int64_t hd = c.head_dim, half = hd / 2;
    const auto freq = inv_freq();
    for (int64_t h = 0; h < heads; ++h) {
      for (int64_t j = 0; j < half; ++j) {
        const int64_t i0 = h * hd + (c.rope_style == RopeStyle::kNormal ? 2 * j : j);
        const int64_t i1 = c.rope_style == RopeStyle::kNormal ? i0 + 1 : i0 + half;
        const double a = pos * freq[j], v0 = x[i0], v1 = x[i1];
        x[i0] = v0 * std::cos(a) - v1 * std::sin(a);
        x[i1] = v0 * std::sin(a) + v1 * std::cos(a);
      }
    }
  }

  // K or V per layer, per position: [layer][pos][kv_dim].
  using KvRows = std::vector<std::vector<std::vector<double>>>;

  // Logits after each token, run one token at a time; K and V of every layer when asked.
  std::vector<std::vector<double>> run(const std::vector<int32_t>& tokens, KvRows* k_out = nullptr,
                                       KvRows* v_out = nullptr) const {
    const int64_t hd = c.head_dim, kvd = c.n_kv_heads * hd;
    const auto embd = mat("token_embd.weight");
    const std::string out_name = f.tensor("output.weight") ? "output.weight" : "token_embd.weight";
    const auto out_norm = mat("output_norm.weight");
    std::vector<std::vector<std::vector<double>>> K(c.n_layers), V(c.n_layers);
    std::vector<std::vector<double>> all;
    for (size_t pos = 0; pos < tokens.size(); ++pos) {
      std::vector<double> x(embd.begin() + tokens[pos] * c.dim, embd.begin() + (tokens[pos] + 1) * c.dim);
      for (int64_t l = 0; l < c.n_layers; ++l) {
        const std::string p = "blk." + std::to_string(l) + ".";
        auto xb = rmsnorm(x, mat(p + "attn_norm.weight"));
        auto q = apply(p + "attn_q.weight", xb);
        auto k = apply(p + "attn_k.weight", xb);
        auto v = apply(p + "attn_v.weight", xb);
        if (c.qkv_bias) {
          auto bq = mat(p + "attn_q.bias"), bk = mat(p + "attn_k.bias"), bv = mat(p + "attn_v.bias");
          for (size_t i = 0; i < q.size(); ++i) q[i] += bq[i];
          for (size_t i = 0; i < k.size(); ++i) k[i] += bk[i], v[i] += bv[i];
        }
        rope(q, c.n_heads, static_cast<int64_t>(pos));
        rope(k, c.n_kv_heads, static_cast<int64_t>(pos));
        K[l].push_back(k);
        V[l].push_back(v);
        std::vector<double> att(static_cast<size_t>(c.n_heads * hd), 0.0);
        for (int64_t h = 0; h < c.n_heads; ++h) {
          const int64_t kvh = h / (c.n_heads / c.n_kv_heads);
          std::vector<double> s(pos + 1);
          double mx = -1e300;
          for (size_t j = 0; j <= pos; ++j) {
            double d = 0;
            for (int64_t i = 0; i < hd; ++i) d += q[h * hd + i] * K[l][j][kvh * hd + i];
            s[j] = d / std::sqrt(static_cast<double>(hd));
            mx = std::max(mx, s[j]);
          }
          double sum = 0;
          for (auto& e : s) sum += (e = std::exp(e - mx));
          for (size_t j = 0; j <= pos; ++j)
            for (int64_t i = 0; i < hd; ++i) att[h * hd + i] += s[j] / sum * V[l][j][kvh * hd + i];
        }
        (void)kvd;
        auto o = apply(p + "attn_output.weight", att);
        for (int64_t i = 0; i < c.dim; ++i) x[i] += o[i];
        xb = rmsnorm(x, mat(p + "ffn_norm.weight"));
        auto g = apply(p + "ffn_gate.weight", xb);
        auto u = apply(p + "ffn_up.weight", xb);
        for (size_t i = 0; i < g.size(); ++i) g[i] = g[i] / (1 + std::exp(-g[i])) * u[i];
        auto d = apply(p + "ffn_down.weight", g);
        for (int64_t i = 0; i < c.dim; ++i) x[i] += d[i];
      }
      all.push_back(apply(out_name, rmsnorm(x, out_norm)));
    }
    if (k_out != nullptr) *k_out = K;
    if (v_out != nullptr) *v_out = V;
    return all;
  }
};

// ---- Synthetic variants written with the synth generator plus architecture edits.

struct Variant {
  std::string name;
  SynthOptions synth;
  std::string arch = "llama";
  bool qkv_bias = false;
  std::string scaling = "none";
};

std::vector<Variant> variants() {
  std::vector<Variant> v;
  Variant a{"llama_f32_gqa", {}};
  a.synth = SynthOptions{.layers = 2, .dim = 32, .heads = 4, .kv_heads = 2, .ffn = 64,
                         .vocab = 300, .dtype = DType::kF32, .seed = 7, .context = 128, .name = "t"};
  v.push_back(a);
  Variant b{"llama3_q8_0_tied", {}};
  b.synth = SynthOptions{.layers = 2, .dim = 64, .heads = 8, .kv_heads = 2, .ffn = 96,
                         .vocab = 300, .dtype = DType::kQ8_0, .seed = 8, .context = 128,
                         .tied_embeddings = true, .name = "t"};
  b.scaling = "llama3";
  v.push_back(b);
  Variant c{"qwen2_f16_bias", {}};
  c.synth = SynthOptions{.layers = 2, .dim = 32, .heads = 4, .kv_heads = 1, .ffn = 64,
                         .vocab = 300, .dtype = DType::kF16, .seed = 9, .context = 128, .name = "t"};
  c.arch = "qwen2";
  c.qkv_bias = true;
  c.scaling = "linear";
  v.push_back(c);
  Variant d{"llama_bf16_mha", {}};
  d.synth = SynthOptions{.layers = 1, .dim = 32, .heads = 2, .kv_heads = 2, .ffn = 48,
                         .vocab = 300, .dtype = DType::kBF16, .seed = 10, .context = 128, .name = "t"};
  v.push_back(d);
  return v;
}

Result<std::string> write_variant(const Variant& v) {
  CLEAVE_ASSIGN_OR_RETURN(GgufWriter w, synth_gguf(v.synth));
  const SynthOptions& s = v.synth;
  const std::string p = v.arch + ".";
  if (v.arch != "llama") {
    w.set_string("general.architecture", v.arch);
    w.set_u32(p + "block_count", static_cast<uint32_t>(s.layers));
    w.set_u32(p + "embedding_length", static_cast<uint32_t>(s.dim));
    w.set_u32(p + "feed_forward_length", static_cast<uint32_t>(s.ffn));
    w.set_u32(p + "attention.head_count", static_cast<uint32_t>(s.heads));
    w.set_u32(p + "attention.head_count_kv", static_cast<uint32_t>(s.kv_heads));
    w.set_u32(p + "context_length", static_cast<uint32_t>(s.context));
    w.set_f32(p + "attention.layer_norm_rms_epsilon", s.rms_eps);
    w.set_f32(p + "rope.freq_base", s.rope_theta);
  }
  if (v.scaling == "linear") {
    w.set_string(p + "rope.scaling.type", "linear");
    w.set_f32(p + "rope.scaling.factor", 2.0f);
  } else if (v.scaling == "llama3") {
    w.set_string(p + "rope.scaling.type", "llama3");
    w.set_f32(p + "rope.scaling.factor", 8.0f);
    w.set_f32(p + "rope.scaling.low_freq_factor", 1.0f);
    w.set_f32(p + "rope.scaling.high_freq_factor", 4.0f);
    w.set_u32(p + "rope.scaling.original_context_length", 64);
  }
  if (v.qkv_bias) {
    const int64_t hd = s.dim / s.heads;
    std::mt19937 rng(static_cast<uint32_t>(s.seed));
    std::uniform_real_distribution<float> dist(-0.5f, 0.5f);
    for (int64_t l = 0; l < s.layers; ++l) {
      for (auto [name, n] : {std::pair{"attn_q", s.heads * hd}, std::pair{"attn_k", s.kv_heads * hd},
                             std::pair{"attn_v", s.kv_heads * hd}}) {
        std::vector<std::byte> bytes(static_cast<size_t>(n) * 4);
        for (int64_t i = 0; i < n; ++i) {
          float x = dist(rng);
          std::memcpy(bytes.data() + i * 4, &x, 4);
        }
        w.add_tensor("blk." + std::to_string(l) + "." + name + ".bias", DType::kF32, {n},
                     std::move(bytes));
      }
    }
  }
  const std::string path = (temp_dir("synth") / (v.name + ".gguf")).string();
  CLEAVE_RETURN_IF_ERROR(w.write(path));
  return path;
}

class SyntheticModelTest : public testing::TestWithParam<Variant> {};

TEST_P(SyntheticModelTest, MatchesReferenceImplementation) {
  auto path = write_variant(GetParam());
  ASSERT_TRUE(path.ok()) << path.status().to_string();
  auto file = load_or_fail(*path);
  ASSERT_TRUE(file);
  const ModelConfig& c = file->config();
  EXPECT_EQ(c.arch, GetParam().arch);
  EXPECT_EQ(c.qkv_bias, GetParam().qkv_bias);
  auto m = make_model(file, 2);
  ASSERT_TRUE(m);
  const auto tokens = test_prompt(24, static_cast<int32_t>(c.vocab_size), 1, 3);
  PagedSeq seq = make_seq(*m, 24, 7, 21);
  auto got = run_chunked(*m, tokens, 1, seq);
  RefModel::KvRows want_k, want_v;
  auto want = RefModel{*file, c}.run(tokens, &want_k, &want_v);
  for (size_t pos = 0; pos < tokens.size(); ++pos) {
    double max_ref = 0, max_err = 0;
    for (int64_t i = 0; i < c.vocab_size; ++i) {
      max_ref = std::max(max_ref, std::fabs(want[pos][i]));
      max_err = std::max(max_err, std::fabs(want[pos][i] - got.at(pos)[i]));
    }
    EXPECT_LT(max_err, 1e-4 * (1 + max_ref)) << "position " << pos;
  }
  // K (after RoPE) and V in the pool, read through the shuffled block table, are the reference's.
  const int64_t kv_dim = c.n_kv_heads * c.head_dim;
  for (int64_t l = 0; l < c.n_layers; ++l) {
    for (bool v : {false, true}) {
      const auto got_kv = gather_kv(*seq.kv, seq.table, l, 24, v);
      const RefModel::KvRows& want_kv = v ? want_v : want_k;
      double max_ref = 0, max_err = 0;
      for (int64_t p = 0; p < 24; ++p) {
        for (int64_t i = 0; i < kv_dim; ++i) {
          max_ref = std::max(max_ref, std::fabs(want_kv[l][p][i]));
          max_err = std::max(max_err, std::fabs(want_kv[l][p][i] - got_kv[p * kv_dim + i]));
        }
      }
      EXPECT_GT(max_ref, 0.0);
      EXPECT_LT(max_err, 1e-4 * (1 + max_ref)) << (v ? "V" : "K") << " of layer " << l;
    }
  }
}

TEST_P(SyntheticModelTest, BatchInvariantBitForBit) {
  auto path = write_variant(GetParam());
  ASSERT_TRUE(path.ok()) << path.status().to_string();
  auto file = load_or_fail(*path);
  ASSERT_TRUE(file);
  expect_batch_invariant(file, 9, 31);
}

TEST_P(SyntheticModelTest, ChunkInvariantBitForBit) {
  auto path = write_variant(GetParam());
  ASSERT_TRUE(path.ok()) << path.status().to_string();
  auto file = load_or_fail(*path);
  ASSERT_TRUE(file);
  expect_chunk_invariant(file, test_prompt(29, static_cast<int32_t>(file->config().vocab_size), 1, 4));
}

INSTANTIATE_TEST_SUITE_P(Variants, SyntheticModelTest, testing::ValuesIn(variants()),
                         [](const auto& info) { return info.param.name; });

// A prompt long enough that a block of 16 queries' scores for all heads outgrow the attention
// scratch (2^18 floats): from about 2,000 keys on, a pass takes one KV group's heads (8 of the
// 16) and fewer queries (13 at 2,400 keys), and the bits must not change.
TEST(SyntheticModel, LongPromptPassesOfFewerQueriesKeepTheBits) {
  Variant v{"long_gqa8", {}};
  v.synth = SynthOptions{.layers = 1, .dim = 64, .heads = 16, .kv_heads = 2, .ffn = 32,
                         .vocab = 300, .dtype = DType::kF32, .seed = 11, .context = 4096,
                         .name = "t"};
  auto path = write_variant(v);
  ASSERT_TRUE(path.ok()) << path.status().to_string();
  auto file = load_or_fail(*path);
  ASSERT_TRUE(file);
  expect_chunk_invariant(file, test_prompt(2400, 300, 1, 5));
}

// The reference check must be able to fail: a different RoPE style gives different logits.
TEST(SyntheticModel, ReferenceDetectsWrongRopeStyle) {
  auto path = write_variant(variants()[0]);
  ASSERT_TRUE(path.ok()) << path.status().to_string();
  auto file = load_or_fail(*path);
  ASSERT_TRUE(file);
  ModelConfig wrong = file->config();
  wrong.rope_style = RopeStyle::kNeox;
  auto m = make_model(file, 1);
  ASSERT_TRUE(m);
  const auto tokens = test_prompt(8, 300, 1, 3);
  PagedSeq seq = make_seq(*m, 8);
  auto got = run_chunked(*m, tokens, 1, seq);
  auto want = RefModel{*file, wrong}.run(tokens);
  double max_err = 0;
  for (int64_t i = 0; i < 300; ++i) max_err = std::max(max_err, std::fabs(want[7][i] - got.at(7)[i]));
  EXPECT_GT(max_err, 1e-4);
}

// ---- stories260K (a real trained model).

class Stories260KTest : public testing::Test {
 protected:
  void SetUp() override {
    if (!fs::exists(stories_path())) GTEST_SKIP() << "../shared/models/stories260K.gguf is absent";
    file_ = load_or_fail(stories_path());
    ASSERT_TRUE(file_);
  }
  std::shared_ptr<const ModelFile> file_;
};

TEST_F(Stories260KTest, GeometryAndWeightBytes) {
  auto m = make_model(file_);
  ASSERT_TRUE(m);
  EXPECT_EQ(m->config().n_layers, 5);
  EXPECT_EQ(m->config().head_dim, 8);
  EXPECT_EQ(m->max_context(), 2048);
  uint64_t want = 0;
  for (const auto& [name, t] : file_->tensors())
    if (name != "token_embd.weight" && name != "rope_freqs.weight") want += t.nbytes;
  EXPECT_EQ(m->weight_bytes_per_token(), want);
  // Every layer matrix, norms and the output matrix: 5 * (4*64*64/2... ) in f32.
  const uint64_t per_layer = 4ull * (64 * 64 + 2 * 32 * 64 + 64 * 64) + 4ull * 3 * 64 * 172 + 4ull * 2 * 64;
  EXPECT_EQ(want, 5 * per_layer + 4ull * 512 * 64 + 4ull * 64);
}

TEST_F(Stories260KTest, ChunkInvariantBitForBit) {
  expect_chunk_invariant(file_, test_prompt(41, 512, 1, 5));
}

TEST_F(Stories260KTest, BatchInvariantBitForBit) { expect_batch_invariant(file_, 10, 41); }

// Every element of the pool is zero (nothing was written).
bool pool_is_zero(const KvBlockPool& kv) {
  const auto* p = reinterpret_cast<const unsigned char*>(kv.data());
  return std::all_of(p, p + kv.size_bytes(), [](unsigned char c) { return c == 0; });
}

TEST_F(Stories260KTest, ForwardBatchRejectsBadInput) {
  auto m = make_model(file_, 1, 0, 16);
  ASSERT_TRUE(m);
  auto kv = make_pool(*m, 4, 6);
  ASSERT_TRUE(kv);
  std::vector<float> logits(512), small(511);
  std::vector<int32_t> ok{1, 2, 3}, bad{1, 512}, neg{-1};
  std::vector<BlockId> table{5, 2, 0, 1}, short_table{5}, out_of_pool{6}, negative_id{-1};
  auto one = [&](std::span<const int32_t> tokens, int64_t start, std::span<const BlockId> t,
                 std::span<float> l) {
    const BatchSequence b{.tokens = tokens, .start_pos = start, .block_table = t, .logits = l};
    return m->forward_batch(std::span<const BatchSequence>(&b, 1), *kv);
  };
  EXPECT_EQ(m->forward_batch({}, *kv).code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(one({}, 0, table, logits).code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(one(bad, 0, table, logits).code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(one(neg, 0, table, logits).code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(one(ok, 0, table, small).code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(one(ok, 14, table, logits).code(), StatusCode::kOutOfRange);   // context is 16
  EXPECT_EQ(one(ok, -1, table, logits).code(), StatusCode::kOutOfRange);
  EXPECT_EQ(one(ok, 2, short_table, logits).code(), StatusCode::kInvalidArgument);  // needs 2
  EXPECT_EQ(one(ok, 0, out_of_pool, logits).code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(one(ok, 0, negative_id, logits).code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(m->forward(ok, 0, table, *kv, small).code(), StatusCode::kInvalidArgument);
  // The message names the sequence and the problem.
  const Status st = one(ok, 0, out_of_pool, logits);
  EXPECT_NE(st.message().find("block id 6"), std::string::npos) << st.to_string();
  // A bad sequence anywhere rejects the whole batch before anything is written.
  const std::vector<BatchSequence> mixed{
      {.tokens = ok, .start_pos = 0, .block_table = table, .logits = logits},
      {.tokens = ok, .start_pos = 2, .block_table = short_table, .logits = {}}};
  const Status second = m->forward_batch(mixed, *kv);
  EXPECT_EQ(second.code(), StatusCode::kInvalidArgument);
  EXPECT_NE(second.message().find("sequence 1"), std::string::npos) << second.to_string();
  EXPECT_TRUE(pool_is_zero(*kv));
  // A pool of another model's geometry.
  ModelConfig other_cfg = m->config();
  other_cfg.n_kv_heads = 2;
  auto other = KvBlockPool::create(KvLayout::for_model(other_cfg, 4, 6));
  ASSERT_TRUE(other.ok()) << other.status().to_string();
  EXPECT_EQ(m->forward(ok, 0, table, **other, logits).code(), StatusCode::kInvalidArgument);
  // In range: the last positions of the context, and table entries past the need are ignored.
  EXPECT_TRUE(one(ok, 13, table, logits).ok());
  EXPECT_TRUE(one(ok, 0, std::vector<BlockId>{5, -7}, {}).ok());
}

// on_layer_done comes once per layer, in order, as soon as that layer's K/V of every token of
// the batch is in the pool (and before the next layer's is), also when the batch runs as
// several sub-batches.
TEST_F(Stories260KTest, LayerHookSeesEachLayersKvInThePool) {
  for (int64_t max_batch : {int64_t{0}, int64_t{4}}) {
    SCOPED_TRACE(testing::Message() << "max_batch " << max_batch);
    auto m = make_model(file_, 2, max_batch);
    ASSERT_TRUE(m);
    const auto a = test_prompt(9, 512, 1, 51), b = test_prompt(3, 512, 1, 52);
    const std::vector<BlockId> ta{3, 0, 6}, tb{5};
    std::vector<float> la(512), lb(512);
    const std::vector<BatchSequence> batch{
        {.tokens = a, .start_pos = 0, .block_table = ta, .logits = la},
        {.tokens = b, .start_pos = 0, .block_table = tb, .logits = lb}};
    auto want = make_pool(*m, 4, 8);
    ASSERT_TRUE(want);
    ASSERT_TRUE(m->forward_batch(batch, *want).ok());

    auto kv = make_pool(*m, 4, 8);
    ASSERT_TRUE(kv);
    std::vector<int64_t> calls;
    ForwardHooks hooks;
    hooks.on_layer_done = [&](int64_t layer) {
      calls.push_back(layer);
      for (bool v : {false, true}) {
        EXPECT_EQ(gather_kv(*kv, ta, layer, 9, v), gather_kv(*want, ta, layer, 9, v)) << layer;
        EXPECT_EQ(gather_kv(*kv, tb, layer, 3, v), gather_kv(*want, tb, layer, 3, v)) << layer;
      }
      if (layer + 1 < m->config().n_layers) {  // the batch's last token is not there yet
        const auto next = gather_kv(*kv, tb, layer + 1, 3, false);
        EXPECT_TRUE(std::all_of(next.end() - m->config().n_kv_heads * m->config().head_dim,
                                next.end(), [](float x) { return x == 0.0f; }))
            << "layer " << layer + 1 << " written before layer " << layer << "'s hook";
      }
    };
    ASSERT_TRUE(m->forward_batch(batch, *kv, hooks).ok());
    std::vector<int64_t> want_calls(static_cast<size_t>(m->config().n_layers));
    std::iota(want_calls.begin(), want_calls.end(), 0);
    EXPECT_EQ(calls, want_calls);
  }
}

// Both loaders give bit-identical logits: stories260K exported as an HF directory and loaded back.
void expect_gguf_and_hf_identical(const std::string& gguf_path, const std::string& tag) {
  auto gguf = load_or_fail(gguf_path);
  ASSERT_TRUE(gguf);
  const fs::path dir = temp_dir("hf_" + tag);
  Status st = export_hf_model(*gguf, dir.string(), HfExportOptions{});
  if (st.code() == StatusCode::kUnimplemented) {
    GTEST_SKIP() << "the safetensors exporter is not available yet: " << st.to_string();
  }
  ASSERT_TRUE(st.ok()) << "export to safetensors failed: " << st.to_string();
  auto hf = load_or_fail(dir.string());
  ASSERT_TRUE(hf);
  auto m1 = make_model(gguf), m2 = make_model(hf);
  ASSERT_TRUE(m1 && m2);
  const auto tokens = test_prompt(33, static_cast<int32_t>(gguf->config().vocab_size), 1, 6);
  PagedSeq s1 = make_seq(*m1, 33), s2 = make_seq(*m2, 33);
  auto l1 = run_chunked(*m1, tokens, 1, s1);
  auto l2 = run_chunked(*m2, tokens, 1, s2);
  for (const auto& [pos, logits] : l1) {
    EXPECT_TRUE(bits_equal(logits.data(), l2.at(pos).data(), gguf->config().vocab_size))
        << "logits at position " << pos;
  }
  fs::remove_all(dir);
}

TEST_F(Stories260KTest, GgufAndHfLoadersGiveIdenticalLogits) {
  expect_gguf_and_hf_identical(stories_path(), "stories");
}

TEST(SyntheticModel, GgufAndHfLoadersGiveIdenticalLogits) {
  for (const Variant& v : variants()) {
    if (v.synth.dtype == DType::kQ8_0) continue;  // exported dequantised: other weights
    SCOPED_TRACE(v.name);
    auto path = write_variant(v);
    ASSERT_TRUE(path.ok()) << path.status().to_string();
    expect_gguf_and_hf_identical(*path, v.name);
  }
}

// Removes the synthetic model files when the tests end.
class TempFilesCleanup : public testing::Environment {
 public:
  void TearDown() override {
    std::error_code ec;
    fs::remove_all(temp_dir("synth"), ec);
  }
};
const testing::Environment* const kCleanup = testing::AddGlobalTestEnvironment(new TempFilesCleanup);

}  // namespace
}  // namespace cleave
