// load_model over GGUF files and Hugging Face directories, and the GGUF → HF export round trip.
#include <cmath>
#include <filesystem>
#include <fstream>

#include "model/loader/loaders.h"
#include "cleave/model/gguf.h"
#include "cleave/model/hf_export.h"
#include "cleave/model/model_file.h"
#include "cleave/model/safetensors.h"
#include "cleave/model/synth.h"
#include "cleave/model/tokenizer_json.h"
#include "fmt/format.h"
#include "gtest/gtest.h"
#include "modelfiles_test_util.h"
#include "nlohmann/json.hpp"

namespace cleave {
namespace {

namespace fs = std::filesystem;
using testing::Bytes;
using testing::TempDir;

SynthOptions tiny(DType dt = DType::kF32) {
  SynthOptions o;
  o.layers = 2;
  o.dim = 64;
  o.heads = 4;
  o.kv_heads = 2;
  o.ffn = 96;
  o.vocab = 300;
  o.dtype = dt;
  o.seed = 7;
  o.context = 512;
  return o;
}

std::unique_ptr<ModelFile> load_ok(const std::string& path) {
  auto m = load_model(path);
  EXPECT_TRUE(m.ok()) << m.status().to_string();
  return m.ok() ? std::move(*m) : nullptr;
}

void expect_error(const std::string& path, std::string_view substring) {
  auto m = load_model(path);
  ASSERT_FALSE(m.ok()) << "expected an error mentioning '" << substring << "'";
  EXPECT_NE(m.status().message().find(substring), std::string::npos) << m.status().to_string();
}

void expect_same_weights(const ModelFile& a, const ModelFile& b) {
  ASSERT_EQ(a.tensors().size(), b.tensors().size());
  for (const auto& [name, t] : a.tensors()) {
    const TensorView* u = b.tensor(name);
    ASSERT_NE(u, nullptr) << name;
    EXPECT_EQ(t.dtype, u->dtype) << name;
    EXPECT_EQ(t.shape, u->shape) << name;
    ASSERT_EQ(t.nbytes, u->nbytes) << name;
    EXPECT_EQ(std::memcmp(t.data, u->data, t.nbytes), 0) << name << " bytes differ";
  }
}

void expect_same_config(const ModelConfig& a, const ModelConfig& b) {
  EXPECT_EQ(a.arch, b.arch);
  EXPECT_EQ(a.n_layers, b.n_layers);
  EXPECT_EQ(a.dim, b.dim);
  EXPECT_EQ(a.n_heads, b.n_heads);
  EXPECT_EQ(a.n_kv_heads, b.n_kv_heads);
  EXPECT_EQ(a.head_dim, b.head_dim);
  EXPECT_EQ(a.ffn_dim, b.ffn_dim);
  EXPECT_EQ(a.vocab_size, b.vocab_size);
  EXPECT_EQ(a.context_length, b.context_length);
  EXPECT_EQ(a.rms_eps, b.rms_eps);
  EXPECT_EQ(a.rope_theta, b.rope_theta);
  EXPECT_EQ(a.rope_style, b.rope_style);
  EXPECT_EQ(a.rope_scaling.type, b.rope_scaling.type);
  EXPECT_EQ(a.rope_scaling.factor, b.rope_scaling.factor);
  EXPECT_EQ(a.rope_scaling.low_freq_factor, b.rope_scaling.low_freq_factor);
  EXPECT_EQ(a.rope_scaling.high_freq_factor, b.rope_scaling.high_freq_factor);
  EXPECT_EQ(a.rope_scaling.original_context, b.rope_scaling.original_context);
  EXPECT_EQ(a.tied_embeddings, b.tied_embeddings);
  EXPECT_EQ(a.qkv_bias, b.qkv_bias);
}

void write_text(const std::string& path, const std::string& text) { std::ofstream(path) << text; }

TEST(LoaderTest, Stories260KHasTheDocumentedGeometry) {
  const std::string path = testing::shared_dir() + "/models/stories260K.gguf";
  if (!fs::exists(path)) GTEST_SKIP() << "../shared/models/stories260K.gguf is absent";
  auto m = load_ok(path);
  ASSERT_NE(m, nullptr);
  const ModelConfig& c = m->config();
  EXPECT_EQ(c.arch, "llama");
  EXPECT_EQ(c.dim, 64);
  EXPECT_EQ(c.ffn_dim, 172);
  EXPECT_EQ(c.n_layers, 5);
  EXPECT_EQ(c.n_heads, 8);
  EXPECT_EQ(c.n_kv_heads, 4);
  EXPECT_EQ(c.head_dim, 8);
  EXPECT_FLOAT_EQ(c.rms_eps, 1e-5f);
  EXPECT_EQ(c.vocab_size, 512);
  EXPECT_EQ(c.context_length, 2048);
  EXPECT_FALSE(c.tied_embeddings);
  EXPECT_EQ(c.rope_style, RopeStyle::kNormal);
  EXPECT_EQ(m->tensor("output.weight")->dtype, DType::kF32);
  EXPECT_EQ(m->tokenizer().model, "llama");
  EXPECT_EQ(m->tokenizer().tokens.size(), 512u);
  EXPECT_EQ(m->tokenizer().bos_id, 1);
  EXPECT_EQ(m->tokenizer().eos_id, 2);
  EXPECT_EQ(m->fingerprint(), load_ok(path)->fingerprint());
}

TEST(LoaderTest, Stories260KSurvivesConversionToHfBitForBit) {
  const std::string path = testing::shared_dir() + "/models/stories260K.gguf";
  if (!fs::exists(path)) GTEST_SKIP() << "../shared/models/stories260K.gguf is absent";
  auto g = load_ok(path);
  ASSERT_NE(g, nullptr);
  TempDir dir("s260");
  ASSERT_TRUE(export_hf_model(*g, dir.file("hf"), {}).ok());
  auto h = load_ok(dir.file("hf"));
  ASSERT_NE(h, nullptr);
  expect_same_config(g->config(), h->config());
  expect_same_weights(*g, *h);
  EXPECT_EQ(g->fingerprint(), h->fingerprint());
  EXPECT_EQ(h->tokenizer().tokens, g->tokenizer().tokens);
}

TEST(LoaderTest, RopePermutationMatchesLlamaCpp) {
  // convert_hf_to_gguf.py permute(): reshape(n_head, 2, hd/2, ...).swapaxes(1, 2).
  Bytes rows(8);
  for (int i = 0; i < 8; ++i) rows[i] = std::byte(i);
  Bytes p = detail::permute_rope_rows(rows, 8, 1, 2, false);
  const int want[] = {0, 2, 1, 3, 4, 6, 5, 7};
  for (int i = 0; i < 8; ++i) EXPECT_EQ(static_cast<int>(p[i]), want[i]) << i;
  Bytes rows12(12 * 3);
  for (size_t i = 0; i < rows12.size(); ++i) rows12[i] = std::byte(i);
  Bytes q = detail::permute_rope_rows(rows12, 12, 3, 1, false);  // one head of 12: 0 6 1 7 ...
  EXPECT_EQ(static_cast<int>(q[3]), 18);
  EXPECT_EQ(detail::permute_rope_rows(q, 12, 3, 1, true), rows12);
}

TEST(LoaderTest, GgufToHfAndBackGivesTheSameConfigAndWeights) {
  for (bool tied : {false, true}) {
    TempDir dir("conv");
    SynthOptions o = tiny();
    o.tied_embeddings = tied;
    ASSERT_TRUE(write_synth_model(o, dir.file("m.gguf")).ok());
    auto g = load_ok(dir.file("m.gguf"));
    ASSERT_NE(g, nullptr);
    ASSERT_TRUE(export_hf_model(*g, dir.file("hf"), {}).ok());
    EXPECT_TRUE(fs::exists(dir.file("hf/config.json")));
    EXPECT_TRUE(fs::exists(dir.file("hf/model.safetensors")));
    auto h = load_ok(dir.file("hf"));
    ASSERT_NE(h, nullptr);
    expect_same_config(g->config(), h->config());
    expect_same_weights(*g, *h);
    EXPECT_EQ(g->fingerprint(), h->fingerprint());
    EXPECT_EQ(h->tokenizer().tokens, g->tokenizer().tokens);
    // The file itself holds HF's rotate-half layout: q_proj differs from the GGUF bytes.
    auto st = SafetensorsFile::open(dir.file("hf/model.safetensors"));
    ASSERT_TRUE(st.ok());
    const auto* q = st->find("model.layers.0.self_attn.q_proj.weight");
    ASSERT_NE(q, nullptr);
    EXPECT_NE(std::memcmp(q->data, g->tensor("blk.0.attn_q.weight")->data, q->nbytes), 0);
    EXPECT_EQ(st->find("lm_head.weight") == nullptr, tied);
  }
}

TEST(LoaderTest, ShardedSafetensorsWithIndexLoad) {
  TempDir dir("shard");
  ASSERT_TRUE(write_synth_model(tiny(), dir.file("m.gguf")).ok());
  auto g = load_ok(dir.file("m.gguf"));
  ASSERT_NE(g, nullptr);
  HfExportOptions opts;
  opts.max_shard_bytes = 64 << 10;
  ASSERT_TRUE(export_hf_model(*g, dir.file("hf"), opts).ok());
  EXPECT_TRUE(fs::exists(dir.file("hf/model.safetensors.index.json")));
  EXPECT_FALSE(fs::exists(dir.file("hf/model.safetensors")));
  int shards = 0;
  for (const auto& e : fs::directory_iterator(dir.file("hf")))
    shards += e.path().filename().string().starts_with("model-");
  EXPECT_GE(shards, 3);
  auto h = load_ok(dir.file("hf"));
  ASSERT_NE(h, nullptr);
  expect_same_weights(*g, *h);
  EXPECT_EQ(g->fingerprint(), h->fingerprint());

  // An index that lies: a shard outside the directory, a tensor placed in the wrong shard, a
  // promised tensor that no shard holds, no weight_map at all.
  std::ifstream in(dir.file("hf/model.safetensors.index.json"));
  const auto index = nlohmann::json::parse(in);
  const std::string norm = "model.norm.weight";
  const std::string home = index["weight_map"][norm];
  const std::string other = home == "model-00001-of-00009.safetensors"
                                ? "model-00002-of-00009.safetensors"
                                : "model-00001-of-00009.safetensors";
  auto with = [&](const std::string& name, const std::string& file) {
    auto j = index;
    j["weight_map"][name] = file;
    write_text(dir.file("hf/model.safetensors.index.json"), j.dump());
  };
  with(norm, "../" + home);
  expect_error(dir.file("hf"), "not a plain file name");
  with(norm, other);
  expect_error(dir.file("hf"), "does not place there");
  with("model.layers.0.mlp.up_proj.bias", home);
  expect_error(dir.file("hf"), "model.layers.0.mlp.up_proj.bias");
  with("model.layers.1.mlp.up_proj.weight", home);
  expect_error(dir.file("hf"), "model.layers.1.mlp.up_proj.weight");
  write_text(dir.file("hf/model.safetensors.index.json"), "{\"weight_map\": 3}");
  expect_error(dir.file("hf"), "weight_map");
}

TEST(LoaderTest, Q8ModelsAreDequantisedOrRefused) {
  TempDir dir("q8");
  SynthOptions o = tiny(DType::kQ8_0);
  o.ffn = 128;
  ASSERT_TRUE(write_synth_model(o, dir.file("m.gguf")).ok());
  auto g = load_ok(dir.file("m.gguf"));
  ASSERT_NE(g, nullptr);
  HfExportOptions strict;
  strict.dequantize = false;
  auto refused = export_hf_model(*g, dir.file("strict"), strict);
  ASSERT_FALSE(refused.ok());
  EXPECT_NE(refused.message().find("q8_0"), std::string::npos);
  ASSERT_TRUE(export_hf_model(*g, dir.file("hf"), {}).ok());
  auto h = load_ok(dir.file("hf"));
  ASSERT_NE(h, nullptr);
  const TensorView* q8 = g->tensor("blk.1.ffn_down.weight");
  const TensorView* f32 = h->tensor("blk.1.ffn_down.weight");
  ASSERT_EQ(f32->dtype, DType::kF32);
  ASSERT_EQ(f32->shape, q8->shape);
  BlockQ8_0 blk;
  std::memcpy(&blk, q8->data + sizeof(BlockQ8_0) * 3, sizeof blk);
  float x;
  std::memcpy(&x, f32->data + 4 * (3 * 32 + 5), 4);
  EXPECT_EQ(x, f16_to_f32(blk.scale) * blk.q[5]);
}

// Writes an HF directory by hand: config.json, model.safetensors from `tensors`, tokenizer.
void write_hf_dir(const std::string& dir, const std::string& config,
                  const std::vector<std::pair<std::string, std::vector<float>>>& tensors,
                  const std::vector<std::vector<int64_t>>& shapes) {
  fs::create_directories(dir);
  write_text(dir + "/config.json", config);
  SafetensorsWriter w;
  for (size_t i = 0; i < tensors.size(); ++i)
    ASSERT_TRUE(w.add_tensor(tensors[i].first, DType::kF32, shapes[i],
                             testing::floats_to_bytes(tensors[i].second)).ok());
  ASSERT_TRUE(w.write(dir + "/model.safetensors").ok());
  auto spec = synth_tokenizer(300);
  ASSERT_TRUE(spec.ok());
  ASSERT_TRUE(write_hf_tokenizer(*spec, dir).ok());
}

// A one-layer HF model with dim 8, 2 heads of 4, 1 KV head, ffn 16, vocab 300.
void tiny_hf_model(const std::string& dir, const std::string& arch, bool bias,
                   const std::string& extra = "") {
  const std::string config = fmt::format(
      R"({{"architectures": ["{}"], "hidden_size": 8, "num_hidden_layers": 1,
          "num_attention_heads": 2, "num_key_value_heads": 1, "intermediate_size": 16,
          "vocab_size": 300, "max_position_embeddings": 128, "rms_norm_eps": 1e-6,
          "rope_theta": 1000000.0, "tie_word_embeddings": true{}}})", arch, extra);
  std::vector<std::pair<std::string, std::vector<float>>> t;
  std::vector<std::vector<int64_t>> s;
  auto add = [&](std::string name, std::vector<int64_t> shape) {
    int64_t n = 1;
    for (auto d : shape) n *= d;
    std::vector<float> v(static_cast<size_t>(n));
    for (size_t i = 0; i < v.size(); ++i) v[i] = static_cast<float>(i % 97) * 0.01f;
    t.emplace_back(std::move(name), std::move(v));
    s.push_back(std::move(shape));
  };
  add("model.embed_tokens.weight", {300, 8});
  add("model.norm.weight", {8});
  const std::string l = "model.layers.0.";
  add(l + "input_layernorm.weight", {8});
  add(l + "post_attention_layernorm.weight", {8});
  add(l + "self_attn.q_proj.weight", {8, 8});
  add(l + "self_attn.k_proj.weight", {4, 8});
  add(l + "self_attn.v_proj.weight", {4, 8});
  add(l + "self_attn.o_proj.weight", {8, 8});
  if (bias) {
    add(l + "self_attn.q_proj.bias", {8});
    add(l + "self_attn.k_proj.bias", {4});
    add(l + "self_attn.v_proj.bias", {4});
  }
  add(l + "mlp.gate_proj.weight", {16, 8});
  add(l + "mlp.up_proj.weight", {16, 8});
  add(l + "mlp.down_proj.weight", {8, 16});
  add(l + "self_attn.rotary_emb.inv_freq", {2});  // old checkpoints carry it; ignored
  write_hf_dir(dir, config, t, s);
}

TEST(LoaderTest, Qwen2DirectoryHasNeoxRopeBiasesAndNoPermutation) {
  TempDir dir("qwen");
  tiny_hf_model(dir.file("hf"), "Qwen2ForCausalLM", true);
  auto m = load_ok(dir.file("hf"));
  ASSERT_NE(m, nullptr);
  const ModelConfig& c = m->config();
  EXPECT_EQ(c.arch, "qwen2");
  EXPECT_EQ(c.rope_style, RopeStyle::kNeox);
  EXPECT_TRUE(c.qkv_bias);
  EXPECT_TRUE(c.tied_embeddings);
  EXPECT_EQ(c.head_dim, 4);
  EXPECT_FLOAT_EQ(c.rope_theta, 1e6f);
  EXPECT_EQ(m->tensor("output.weight"), nullptr);
  ASSERT_NE(m->tensor("blk.0.attn_k.bias"), nullptr);
  auto st = SafetensorsFile::open(dir.file("hf/model.safetensors"));
  const auto* q = st->find("model.layers.0.self_attn.q_proj.weight");
  EXPECT_EQ(std::memcmp(q->data, m->tensor("blk.0.attn_q.weight")->data, q->nbytes), 0);
  // Export and reload keeps everything.
  ASSERT_TRUE(export_hf_model(*m, dir.file("again"), {}).ok());
  auto again = load_ok(dir.file("again"));
  ASSERT_NE(again, nullptr);
  expect_same_config(c, again->config());
  expect_same_weights(*m, *again);
}

TEST(LoaderTest, LlamaDirectoryIsPermutedIntoGgufLayout) {
  TempDir dir("llama");
  tiny_hf_model(dir.file("hf"), "MistralForCausalLM", false);
  auto m = load_ok(dir.file("hf"));
  ASSERT_NE(m, nullptr);
  EXPECT_EQ(m->config().arch, "llama");
  EXPECT_EQ(m->config().rope_style, RopeStyle::kNormal);
  EXPECT_FALSE(m->config().qkv_bias);
  auto st = SafetensorsFile::open(dir.file("hf/model.safetensors"));
  const auto* k = st->find("model.layers.0.self_attn.k_proj.weight");  // 1 head of 4 rows
  const TensorView* kk = m->tensor("blk.0.attn_k.weight");
  // HF rows 0 1 2 3 become 0 2 1 3.
  EXPECT_EQ(std::memcmp(kk->data + 32 * 1, k->data + 32 * 2, 32), 0);
  EXPECT_EQ(std::memcmp(kk->data + 32 * 2, k->data + 32 * 1, 32), 0);
}

TEST(LoaderTest, Llama3RopeScalingFromConfigAndFromRopeFreqs) {
  TempDir dir("rope");
  tiny_hf_model(dir.file("hf"), "LlamaForCausalLM", false,
                R"(, "rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                   "high_freq_factor": 4.0, "original_max_position_embeddings": 64})");
  auto m = load_ok(dir.file("hf"));
  ASSERT_NE(m, nullptr);
  const RopeScaling& r = m->config().rope_scaling;
  EXPECT_EQ(r.type, RopeScaling::Type::kLlama3);
  EXPECT_EQ(r.factor, 8.0f);
  EXPECT_EQ(r.original_context, 64);

  // The same as llama.cpp writes it: a rope_freqs tensor computed by convert_hf_to_gguf.py.
  auto w = synth_gguf(tiny());
  ASSERT_TRUE(w.ok());
  const int64_t hd = 16;
  const double theta = 10000, factor = 8, lo = 1, hi = 4, orig = 64;
  std::vector<float> freqs;
  for (int64_t i = 0; i < hd / 2; ++i) {
    const double f = 1.0 / std::pow(theta, static_cast<double>(2 * i) / hd);
    const double wl = 2 * M_PI / f;
    if (wl < orig / hi) freqs.push_back(1.0f);
    else if (wl > orig / lo) freqs.push_back(static_cast<float>(factor));
    else {
      const double smooth = (orig / wl - lo) / (hi - lo);
      freqs.push_back(static_cast<float>(1 / ((1 - smooth) / factor + smooth)));
    }
  }
  w->add_tensor("rope_freqs.weight", DType::kF32, {hd / 2}, testing::floats_to_bytes(freqs));
  w->set_u32("llama.rope.scaling.original_context_length", 64);
  ASSERT_TRUE(w->write(dir.file("m.gguf")).ok());
  auto g = load_ok(dir.file("m.gguf"));
  ASSERT_NE(g, nullptr);
  EXPECT_EQ(g->config().rope_scaling.type, RopeScaling::Type::kLlama3);
  EXPECT_EQ(g->config().rope_scaling.factor, 8.0f);
  EXPECT_EQ(g->config().rope_scaling.original_context, 64);
  EXPECT_NE(g->tensor("rope_freqs.weight"), nullptr);

  freqs[1] = 3.0f;  // no longer Llama-3's curve
  w->add_tensor("rope_freqs.weight", DType::kF32, {hd / 2}, testing::floats_to_bytes(freqs));
  ASSERT_TRUE(w->write(dir.file("bad.gguf")).ok());
  expect_error(dir.file("bad.gguf"), "rope_freqs.weight");
}

TEST(LoaderTest, MissingOrMisshapenTensorsAreNamed) {
  TempDir dir("bad");
  {
    auto w = synth_gguf(tiny());
    ASSERT_TRUE(w->remove_tensor("blk.1.ffn_up.weight"));
    ASSERT_TRUE(w->write(dir.file("a.gguf")).ok());
    expect_error(dir.file("a.gguf"), "'blk.1.ffn_up.weight' is missing");
  }
  {
    auto w = synth_gguf(tiny());
    w->add_tensor("blk.0.attn_k.weight", DType::kF32, {16, 64}, Bytes(16 * 64 * 4));
    ASSERT_TRUE(w->write(dir.file("b.gguf")).ok());
    expect_error(dir.file("b.gguf"), "'blk.0.attn_k.weight' has shape [16, 64], expected [32, 64]");
  }
  {
    auto w = synth_gguf(tiny());
    w->set_u32("llama.attention.head_count_kv", 3);
    ASSERT_TRUE(w->write(dir.file("c.gguf")).ok());
    expect_error(dir.file("c.gguf"), "not a multiple of the KV head count 3");
  }
  {
    auto w = synth_gguf(tiny());
    w->set_string("general.architecture", "gptneox");
    ASSERT_TRUE(w->write(dir.file("d.gguf")).ok());
    expect_error(dir.file("d.gguf"), "'gptneox' is not supported");
  }
  {
    auto w = synth_gguf(tiny());
    w->remove_key("llama.block_count");
    ASSERT_TRUE(w->write(dir.file("e.gguf")).ok());
    expect_error(dir.file("e.gguf"), "llama.block_count");
  }
  {
    auto w = synth_gguf(tiny());
    w->set_u32("llama.block_count", 4000000000u);
    ASSERT_TRUE(w->write(dir.file("f.gguf")).ok());
    expect_error(dir.file("f.gguf"), "layer count");
  }
  expect_error(dir.file("none.gguf"), "does not exist");
  write_text(dir.file("junk.gguf"), "this is not a model");
  expect_error(dir.file("junk.gguf"), "bad magic");
  fs::create_directories(dir.file("empty"));
  expect_error(dir.file("empty"), "config.json");
  tiny_hf_model(dir.file("gpt"), "GPT2LMHeadModel", false);
  expect_error(dir.file("gpt"), "GPT2LMHeadModel");
}

}  // namespace
}  // namespace cleave
