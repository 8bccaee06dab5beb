// How one sequence's sampled tokens become streamed text and when the sequence ends: the one
// implementation the single-sequence Generator and the worker's engine loop share.
//
// A sequence ends with FinishReason::kStop on an end id (an end-of-generation id of the
// tokenizer unless ignore_eos, or one of stop_token_ids) or a stop string (cut from the text,
// not emitted), and with kLength at max_tokens or when the context has no room for the token.
// End ids are suppressed in sampling while fewer than min_tokens have been generated. Text goes
// through a StreamDecoder (incomplete UTF-8 is held back) and a StopMatcher (a possible start of
// a stop string is held back); whatever is still held when the sequence ends is flushed.
//
// Thread-safety: none; one sequence, its tokens pushed in order. The tokenizer outlives it.
#pragma once

#include <cstdint>
#include <span>
#include <string>
#include <vector>

#include "cleave/engine/generator.h"  // FinishReason
#include "cleave/engine/sampler.h"
#include "cleave/model/tokenizer.h"

namespace cleave {

class TokenFinisher {
 public:
  // The ids in [0, vocab_size) (the model's vocabulary) that end generation for `tokenizer`
  // (EOS and end-of-turn ids), ascending; one pass over the vocabulary, so callers with many
  // sequences compute it once.
  static std::vector<int32_t> end_of_generation_ids(const Tokenizer& tokenizer,
                                                    int64_t vocab_size);

  // `eos_ids`: end_of_generation_ids(tokenizer, vocab). `last_prompt_token`: the decoder strips the
  // leading space of its first piece, which is right only after BOS; when the prompt ends with
  // another token the decoder is primed with it, and its own text is not output.
  TokenFinisher(const Tokenizer& tokenizer, const SamplingParams& params,
                std::span<const int32_t> eos_ids, int32_t last_prompt_token);

  // The ids sample_token must not draw for the next token when `n_generated` tokens have been
  // generated: the end ids before min_tokens, none from then on. Valid while this lives.
  std::span<const int32_t> suppressed(int64_t n_generated) const;

  struct Outcome {
    std::string text;  // text that became safe to emit with this token (may be empty)
    bool finished = false;
    FinishReason finish_reason = FinishReason::kLength;  // meaningful when finished
    std::string stop_string;  // the stop string that matched, if one did
  };
  // `token` is the n_generated-th generated token (the count includes it); `context_full` when
  // the context has no position left to run it. Nothing is pushed after a finished outcome.
  Outcome push(int32_t token, int64_t n_generated, bool context_full);

  // Feeds a token generated elsewhere (the prefill worker's first token) through the decoder
  // and the stop matcher, dropping its text, so that text and stop strings go on exactly where
  // that worker's left off.
  void replay(int32_t token);

 private:
  bool is_end_id(int32_t token) const;

  std::vector<int32_t> end_ids_;  // stop_token_ids, then eos_ids not among them
  int64_t max_tokens_;
  int64_t min_tokens_;
  StreamDecoder decoder_;
  StopMatcher stops_;
};

}  // namespace cleave
