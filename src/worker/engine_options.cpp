#include "cleave/worker/engine_loop.h"

namespace cleave {

EngineLoopOptions engine_loop_options(const EngineSettings& s) {
  EngineLoopOptions o;
  o.block_size = s.block_size;
  o.num_blocks = s.kv_blocks;
  o.kv_cache_bytes = static_cast<uint64_t>(s.kv_cache_bytes);
  o.kv_dtype = parse_dtype(s.kv_dtype).value_or(DType::kF32);
  o.scheduler.max_tokens_per_step = s.max_tokens_per_step;
  o.scheduler.max_num_seqs = s.max_num_seqs;
  o.scheduler.prefix_caching = s.prefix_caching;
  return o;
}

}  // namespace cleave
