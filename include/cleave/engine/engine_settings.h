// The engine's settings (engine.*): plain fields with defaults in code, bound to the settings
// registry (cleave/common/config.h) by register_engine_settings.
#pragma once

#include <cstdint>
#include <string>

#include "cleave/common/config.h"

namespace cleave {

struct EngineSettings {
  std::string device = "cpu";  // the compute backend: cpu | cuda | cuda:N
  int64_t threads = 0;      // compute threads; 0 = one per online CPU
  int64_t max_context = 0;  // 0 = the model's context length
  int64_t block_size = 16;                 // tokens per KV block
  int64_t kv_blocks = 0;                   // > 0: the KV pool's block count (wins over the budget)
  int64_t kv_cache_bytes = 256ll << 20;    // else the KV pool's memory budget
  std::string kv_dtype = "f32";            // K/V element type in the pool: f32 | f16 | bf16
  int64_t max_tokens_per_step = 256;       // token budget of one engine step (chunked prefill)
  int64_t max_num_seqs = 64;               // most sequences running at once
  bool prefix_caching = true;              // reuse cached full KV blocks across requests
};

// Binds engine.* to `registry` (the fields must outlive it).
void register_engine_settings(EngineSettings& settings, SettingsRegistry& registry);

}  // namespace cleave
