// Single-sequence generation: prompt tokens + SamplingParams -> streamed tokens and text.
//
// The prompt is prefilled in one forward pass, then one token is sampled and decoded per step
// until a stop condition: an end-of-generation token (unless ignore_eos), a stop token id, a stop
// string (cut from the text), max_tokens, the end of the context, or the callback asking to stop.
// The random draw of the token at sequence position p is a pure function of (seed, p).
//
// KV: the Generator owns a small paged KV pool (kvcache/kv_block_pool.h) holding one sequence:
// blocks for prompt + max_tokens positions (capped by the context), allocated for each
// generate() and released when it returns. The pool grows when a request needs more blocks.
//
// Thread-safety: one generate() at a time per Generator (it uses the model's scratch and KV).
#pragma once

#include <cstdint>
#include <functional>
#include <span>
#include <string>
#include <vector>

#include "cleave/common/status.h"
#include "cleave/engine/llama_model.h"
#include "cleave/engine/sampler.h"
#include "cleave/kvcache/kv_block_pool.h"
#include "cleave/model/tokenizer.h"
#include "cleave/request/request.h"

namespace cleave {

// FinishReason and finish_reason_name: request/request.h.

struct GenerationStats {
  int64_t prompt_tokens = 0;
  int64_t generated_tokens = 0;   // tokens sampled, including a final EOS / stop token
  int64_t decode_steps = 0;       // forward passes of one token after the prefill
  double prefill_seconds = 0;     // the prompt's forward pass
  double decode_seconds = 0;      // everything after it: sampling, decode steps, detokenizing
};

// One sampled token as it streams out.
struct GeneratedToken {
  int32_t token = 0;
  std::string text;  // text that became safe to emit with this token (may be empty)
  SampleResult sample;  // logprob and top alternatives (when params.logprobs >= 0)
};

struct GenerationResult {
  std::vector<int32_t> tokens;  // every sampled token, in order (a final EOS / stop token too)
  std::string text;             // the emitted text (stop string and EOS excluded)
  FinishReason finish_reason = FinishReason::kLength;
  std::string stop_string;      // the stop string that matched, if any
  std::vector<SampleResult> logprobs;  // one per token when params.logprobs >= 0
  GenerationStats stats;
};

class Generator {
 public:
  static constexpr int64_t kBlockSize = 16;  // tokens per KV block

  // `model` and `tokenizer` must outlive the Generator. The KV pool is allocated on first use.
  Generator(LlamaModel& model, const Tokenizer& tokenizer);

  // Called once per sampled token, in order; return false to stop (finish reason cancelled).
  using TokenCallback = std::function<bool(const GeneratedToken&)>;

  // InvalidArgument for an empty prompt, an out-of-vocabulary id or bad params; OutOfRange when
  // the prompt does not fit the context; ResourceExhausted when the KV pool cannot be had. The text of the first token after a BOS that ends the
  // prompt loses its leading space (SentencePiece decoding); otherwise text is the continuation
  // as the tokenizer spells it.
  Result<GenerationResult> generate(std::span<const int32_t> prompt, const SamplingParams& params,
                                    const TokenCallback& on_token = {});

 private:
  LlamaModel& model_;
  const Tokenizer& tokenizer_;
  // Makes sure the pool holds at least `blocks` blocks and allocates them into table_.
  Status acquire_blocks(int64_t blocks);

  std::unique_ptr<KvBlockPool> kv_;
  std::vector<BlockId> table_;  // the sequence's blocks while generate() runs
  std::vector<float> logits_;
};

}  // namespace cleave
