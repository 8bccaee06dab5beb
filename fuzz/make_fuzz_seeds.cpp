// Writes seed corpora for the fuzz targets: `make_fuzz_seeds OUTDIR` creates OUTDIR/gguf and
// OUTDIR/safetensors with small valid files (every metadata type, every tensor dtype, a tiny
// synthetic Llama) and a few near-misses, so that a bounded fuzzing run starts deep in the parsers.
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <string>
#include <vector>

#include "cleave/model/gguf_writer.h"
#include "cleave/model/quants.h"
#include "cleave/model/safetensors.h"
#include "cleave/model/synth.h"

namespace {

using Bytes = std::vector<std::byte>;

bool save(const std::filesystem::path& p, const Bytes& b) {
  std::ofstream out(p, std::ios::binary | std::ios::trunc);
  out.write(reinterpret_cast<const char*>(b.data()), static_cast<std::streamsize>(b.size()));
  return static_cast<bool>(out);
}

Bytes f32s(std::initializer_list<float> v) {
  Bytes b(v.size() * 4);
  std::memcpy(b.data(), std::data(v), b.size());
  return b;
}

}  // namespace

int main(int argc, char** argv) {
  if (argc != 2) {
    std::fprintf(stderr, "usage: %s OUTDIR\n", argv[0]);
    return 2;
  }
  namespace fs = std::filesystem;
  const fs::path out = argv[1];
  fs::create_directories(out / "gguf");
  fs::create_directories(out / "safetensors");
  int n = 0;
  auto gguf = [&](const std::string& name, const cleave::GgufWriter& w) {
    auto b = w.to_bytes();
    if (!b.ok() || !save(out / "gguf" / name, *b)) {
      std::fprintf(stderr, "make_fuzz_seeds: %s failed\n", name.c_str());
      std::exit(1);
    }
    ++n;
  };
  {
    cleave::GgufWriter w;
    w.set_u8("a.u8", 1); w.set_i8("a.i8", -1); w.set_u16("a.u16", 2); w.set_i16("a.i16", -2);
    w.set_u32("a.u32", 3); w.set_i32("a.i32", -3); w.set_u64("a.u64", 4); w.set_i64("a.i64", -4);
    w.set_f32("a.f32", 0.5f); w.set_f64("a.f64", 0.25); w.set_bool("a.bool", true);
    w.set_string("a.str", "text");
    w.set_string_array("a.strs", {"x", "yy"});
    w.set_int_array("a.ints", cleave::GgufType::kInt32, {1, 2, 3});
    w.set_float_array("a.floats", cleave::GgufType::kFloat32, {1.5, 2.5});
    gguf("metadata.gguf", w);
  }
  {
    cleave::GgufWriter w;
    w.add_tensor("f32", cleave::DType::kF32, {2, 2}, f32s({1, 2, 3, 4}));
    w.add_tensor("f16", cleave::DType::kF16, {4}, Bytes(8, std::byte{0x3c}));
    w.add_tensor("bf16", cleave::DType::kBF16, {1, 4}, Bytes(8, std::byte{0x3f}));
    w.add_tensor("q8", cleave::DType::kQ8_0, {32}, Bytes(34, std::byte{1}));
    // One tensor of every other block format: a row of one block (legacy) or super-block (K).
    for (int i = 0; i < cleave::kNumDTypes; ++i) {
      const auto t = static_cast<cleave::DType>(i);
      if (!cleave::dtype_is_quantized(t) || t == cleave::DType::kQ8_0) continue;
      const auto& info = cleave::dtype_info(t);
      w.add_tensor(std::string(info.name), t, {info.block_elems},
                   Bytes(static_cast<size_t>(info.block_bytes), std::byte{0x11}));
    }
    gguf("tensors.gguf", w);
    cleave::GgufWriter w64(64);
    w64.add_tensor("a", cleave::DType::kF32, {1}, f32s({1}));
    w64.add_tensor("b", cleave::DType::kF32, {1}, f32s({2}));
    gguf("align64.gguf", w64);
  }
  {
    cleave::SynthOptions o;
    o.layers = 1; o.dim = 32; o.heads = 2; o.kv_heads = 1; o.ffn = 32; o.vocab = 264;
    o.dtype = cleave::DType::kF16;
    auto w = cleave::synth_gguf(o);
    if (!w.ok()) return 1;
    gguf("synth.gguf", *w);
  }
  auto st = [&](const std::string& name, const cleave::SafetensorsWriter& w) {
    auto b = w.to_bytes();
    if (!b.ok() || !save(out / "safetensors" / name, *b)) std::exit(1);
    ++n;
  };
  {
    cleave::SafetensorsWriter w;
    w.set_metadata("format", "pt");
    (void)w.add_tensor("model.embed_tokens.weight", cleave::DType::kF32, {2, 2}, f32s({1, 2, 3, 4}));
    (void)w.add_tensor("h", cleave::DType::kF16, {3}, Bytes(6, std::byte{0x3c}));
    (void)w.add_tensor("b", cleave::DType::kBF16, {1, 1}, Bytes(2, std::byte{0x3f}));
    (void)w.add_tensor("s", cleave::DType::kF32, {}, f32s({7}));
    st("mixed.safetensors", w);
    cleave::SafetensorsWriter empty;
    st("empty.safetensors", empty);
  }
  // OpenAI request bodies (openai_request_fuzz feeds each input to both request parsers).
  fs::create_directories(out / "openai_request");
  const char* requests[] = {
      R"({"model":"m","prompt":"Once upon a time","max_tokens":16,"temperature":0})",
      R"({"prompt":[[1,2,3],[4,5]],"n":2,"logprobs":3,"stop":["\n","end"],"seed":-7,"echo":false})",
      R"({"prompt":["a","b"],"stream":true,"stream_options":{"include_usage":true},"top_k":5,"top_p":0.9,"min_p":0.1})",
      R"({"model":"m","messages":[{"role":"system","content":"Be brief."},{"role":"user","content":"Hi"}],"max_completion_tokens":8})",
      R"({"messages":[{"role":"user","content":[{"type":"text","text":"x"},{"type":"text","text":"y"}]},{"role":"assistant","content":null}],"logprobs":true,"top_logprobs":2,"stream":true})",
      R"({"messages":[{"role":"user","content":"q"}],"stop_token_ids":[2],"ignore_eos":true,"min_tokens":1,"repetition_penalty":1.1,"presence_penalty":0.5,"frequency_penalty":-0.5,"user":"u","chat_template_kwargs":{"k":1}})",
  };
  int k = 0;
  for (const char* r : requests) {
    const std::string text(r);
    Bytes b(text.size());
    std::memcpy(b.data(), text.data(), text.size());
    if (!save(out / "openai_request" / ("request" + std::to_string(k++) + ".json"), b)) std::exit(1);
    ++n;
  }
  std::fprintf(stderr, "make_fuzz_seeds: wrote %d seeds under %s\n", n, out.c_str());
  return 0;
}
