#include "cleave/engine/engine_settings.h"

namespace cleave {

void register_engine_settings(EngineSettings& e, SettingsRegistry& r) {
  r.add_string("engine.device", &e.device,
               "Compute backend: cpu, cuda (GPU 0) or cuda:N. On a GPU the weights, activations "
               "and the KV pool live in that GPU's memory.",
               "--device");
  r.add_int("engine.threads", &e.threads,
            "Compute threads per engine; 0 = one per online CPU.", 0, 1024, "--threads");
  r.add_int("engine.max_context", &e.max_context,
            "Longest sequence (prompt + output) in tokens; 0 = the model's context length.", 0,
            1 << 24, "--max-context");
  r.add_int("engine.block_size", &e.block_size, "Tokens per KV block.", 1, 4096,
            "--block-size");
  r.add_int("engine.kv_blocks", &e.kv_blocks,
            "KV pool size in blocks; 0 = sized from engine.kv_cache_bytes.", 0, 1 << 30,
            "--kv-blocks");
  r.add_int("engine.kv_cache_bytes", &e.kv_cache_bytes,
            "KV pool memory budget in bytes (used when engine.kv_blocks is 0).", 1 << 20,
            int64_t{1} << 50, "--kv-cache-bytes");
  r.add_enum("engine.kv_dtype", &e.kv_dtype, {"f32", "f16", "bf16"},
             "Element type of K and V in the KV pool (f16 and bf16 halve its memory and "
             "attention's reads; prefill and decode workers must agree).",
             "--kv-dtype");
  r.add_int("engine.max_tokens_per_step", &e.max_tokens_per_step,
            "Token budget of one engine step: decode tokens plus prefill chunks.", 1, 1 << 20,
            "--max-tokens-per-step");
  r.add_int("engine.max_num_seqs", &e.max_num_seqs,
            "Most sequences running at once.", 1, 1 << 16, "--max-num-seqs");
  r.add_bool("engine.prefix_caching", &e.prefix_caching,
             "Reuse cached full KV blocks of earlier prompts (prefix cache).");
}

}  // namespace cleave
