// Shared harness of the engine loop tests: model fixtures (stories260K from ../shared, a small
// synthetic model written to a temp file), reference runs with Generator, and an event sink that
// collects each request's stream.
#pragma once

#include <gtest/gtest.h>

#include <chrono>
#include <unistd.h>

#include <condition_variable>
#include <filesystem>
#include <map>
#include <mutex>
#include <random>
#include <string>
#include <vector>

#include "cleave/engine/generator.h"
#include "fmt/format.h"
#include "cleave/model/model_file.h"
#include "cleave/model/synth.h"
#include "cleave/model/tokenizer.h"
#include "cleave/worker/engine_loop.h"

namespace cleave::testing_engine {

namespace fs = std::filesystem;

inline std::string stories_path() {
  return std::string(CLEAVE_SOURCE_DIR) + "/../shared/models/stories260K.gguf";
}

// A small synthetic Llama (GQA, f16), written once per process.
inline std::string synth_path() {
  static const std::string path = [] {
    const fs::path dir = fs::temp_directory_path() / fmt::format("cleave-worker-test-{}", ::getpid());
    fs::create_directories(dir);
    const std::string p = (dir / "synth.gguf").string();
    SynthOptions o;
    o.layers = 2;
    o.dim = 64;
    o.heads = 4;
    o.kv_heads = 2;
    o.ffn = 128;
    o.vocab = 512;
    o.context = 512;
    o.seed = 7;
    const Status st = write_synth_model(o, p);
    EXPECT_TRUE(st.ok()) << st.to_string();
    return p;
  }();
  return path;
}

inline void remove_synth_dir() {
  std::error_code ec;
  fs::remove_all(fs::temp_directory_path() / fmt::format("cleave-worker-test-{}", ::getpid()), ec);
}

struct ModelUnderTest {
  std::shared_ptr<const ModelFile> file;
  std::shared_ptr<const Tokenizer> tok;

  // Empty `file` when the model is absent (the caller skips).
  static ModelUnderTest load(const std::string& path) {
    ModelUnderTest m;
    if (!fs::exists(path)) return m;
    auto f = load_model(path);
    EXPECT_TRUE(f.ok()) << f.status().to_string();
    if (!f.ok()) return m;
    m.file = std::shared_ptr<const ModelFile>(std::move(*f));
    auto t = Tokenizer::create(m.file->tokenizer());
    EXPECT_TRUE(t.ok()) << t.status().to_string();
    if (t.ok()) m.tok = std::shared_ptr<const Tokenizer>(std::move(*t));
    return m;
  }
  std::unique_ptr<LlamaModel> model(int threads = 2) const {
    EngineOptions o;
    o.threads = threads;
    auto m = LlamaModel::create(file, o);
    EXPECT_TRUE(m.ok()) << m.status().to_string();
    return m.ok() ? std::move(*m) : nullptr;
  }
  std::unique_ptr<EngineLoop> engine(const EngineLoopOptions& opts) const {
    auto e = EngineLoop::create(model(), tok, opts);
    EXPECT_TRUE(e.ok()) << e.status().to_string();
    return e.ok() ? std::move(*e) : nullptr;
  }
};

struct Stream {
  std::vector<int32_t> tokens;
  std::string text;
  std::vector<SampleResult> logprobs;
  int events = 0;
  bool finished = false;
  FinishReason reason = FinishReason::kLength;
  std::string stop_string;
  Status error;
  int64_t cached_prompt_tokens = 0;
  int64_t generated_tokens = 0;
  int32_t preemptions = 0;
  double queue_seconds = -1;           // as the first token's event reported it
  int events_with_queue_seconds = 0;   // events that carried queue_seconds >= 0
  std::chrono::steady_clock::time_point finished_at{};
};

// Collects events of many requests (called on the engine thread).
class EventSink {
 public:
  EngineEventCallback callback() {
    return [this](const EngineEvent& ev) {
      std::lock_guard<std::mutex> lk(mu_);
      Stream& s = streams_[ev.id];
      EXPECT_FALSE(s.finished) << "event after the finished event of request " << ev.id;
      ++s.events;
      if (ev.has_token) {
        if (s.tokens.empty()) s.queue_seconds = ev.queue_seconds;
        s.tokens.push_back(ev.token);
        s.logprobs.push_back(ev.sample);
      }
      if (ev.queue_seconds >= 0) ++s.events_with_queue_seconds;
      s.text += ev.text;
      if (ev.finished) {
        s.finished_at = std::chrono::steady_clock::now();
        s.finished = true;
        s.reason = ev.finish_reason;
        s.stop_string = ev.stop_string;
        s.error = ev.error;
        s.cached_prompt_tokens = ev.cached_prompt_tokens;
        s.generated_tokens = ev.generated_tokens;
        s.preemptions = ev.preemptions;
        EXPECT_EQ(ev.generated_tokens, static_cast<int64_t>(s.tokens.size()));
      }
    };
  }
  Stream get(RequestId id) {
    std::lock_guard<std::mutex> lk(mu_);
    return streams_[id];
  }

 private:
  std::mutex mu_;
  std::map<RequestId, Stream> streams_;
};

inline GenerationResult generate_alone(LlamaModel& model, const Tokenizer& tok,
                                       const std::vector<int32_t>& prompt, const SamplingParams& p) {
  Generator gen(model, tok);
  auto r = gen.generate(prompt, p);
  EXPECT_TRUE(r.ok()) << r.status().to_string();
  return r.ok() ? std::move(*r) : GenerationResult{};
}

inline void expect_same(const Stream& got, const GenerationResult& want, const std::string& what) {
  EXPECT_TRUE(got.finished) << what;
  EXPECT_TRUE(got.error.ok()) << what << ": " << got.error.to_string();
  EXPECT_EQ(got.tokens, want.tokens) << what;
  EXPECT_EQ(got.text, want.text) << what;
  EXPECT_EQ(got.reason, want.finish_reason) << what;
  EXPECT_EQ(got.stop_string, want.stop_string) << what;
  if (!want.logprobs.empty()) {
    ASSERT_EQ(got.logprobs.size(), want.logprobs.size()) << what;
    for (size_t i = 0; i < want.logprobs.size(); ++i) {
      EXPECT_EQ(got.logprobs[i].logprob, want.logprobs[i].logprob) << what << " token " << i;
      ASSERT_EQ(got.logprobs[i].top.size(), want.logprobs[i].top.size()) << what;
      for (size_t k = 0; k < want.logprobs[i].top.size(); ++k) {
        EXPECT_EQ(got.logprobs[i].top[k].token, want.logprobs[i].top[k].token) << what;
        EXPECT_EQ(got.logprobs[i].top[k].logprob, want.logprobs[i].top[k].logprob) << what;
      }
    }
  }
}

inline void expect_all_blocks_back(EngineLoop& engine) {
  ASSERT_TRUE(engine.wait_idle(std::chrono::seconds(30)));
  const EngineStats s = engine.stats();
  EXPECT_EQ(s.blocks_used, 0);
  EXPECT_EQ(s.blocks_free + s.blocks_cached, s.blocks_total);
  EXPECT_EQ(s.running, 0);
  EXPECT_EQ(s.waiting, 0);
}

// Deterministic prompts: BOS, then ids drawn from [first_id, vocab).
inline std::vector<int32_t> random_prompt(std::mt19937& rng, const Tokenizer& tok, int64_t vocab,
                                          int64_t len) {
  std::vector<int32_t> p{tok.bos_id()};
  for (int64_t i = 1; i < len; ++i) {
    int32_t id;
    do {
      id = static_cast<int32_t>(rng() % static_cast<uint32_t>(vocab));
    } while (id == tok.bos_id() || tok.is_end_of_generation(id));
    p.push_back(id);
  }
  return p;
}

}  // namespace cleave::testing_engine
