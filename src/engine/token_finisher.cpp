#include "cleave/engine/token_finisher.h"

#include <algorithm>

namespace cleave {

std::vector<int32_t> TokenFinisher::end_of_generation_ids(const Tokenizer& tokenizer,
                                                         int64_t vocab_size) {
  std::vector<int32_t> ids;
  for (int32_t id = 0; id < vocab_size; ++id) {
    if (tokenizer.is_end_of_generation(id)) ids.push_back(id);
  }
  return ids;
}

TokenFinisher::TokenFinisher(const Tokenizer& tokenizer, const SamplingParams& params,
                             std::span<const int32_t> eos_ids, int32_t last_prompt_token)
    : end_ids_(params.stop_token_ids),
      max_tokens_(params.max_tokens),
      min_tokens_(params.min_tokens),
      decoder_(tokenizer),
      stops_(params.stop) {
  if (!params.ignore_eos) {
    for (int32_t id : eos_ids) {
      if (!is_end_id(id)) end_ids_.push_back(id);
    }
  }
  if (last_prompt_token != tokenizer.bos_id()) (void)decoder_.push(last_prompt_token);
}

bool TokenFinisher::is_end_id(int32_t token) const {
  return std::find(end_ids_.begin(), end_ids_.end(), token) != end_ids_.end();
}

std::span<const int32_t> TokenFinisher::suppressed(int64_t n_generated) const {
  if (n_generated < min_tokens_) return end_ids_;
  return {};
}

TokenFinisher::Outcome TokenFinisher::push(int32_t token, int64_t n_generated, bool context_full) {
  Outcome out;
  const bool end_token = is_end_id(token);
  if (end_token) {
    out.finished = true;
    out.finish_reason = FinishReason::kStop;
  } else if (n_generated >= max_tokens_ || context_full) {
    out.finished = true;
    out.finish_reason = FinishReason::kLength;
  }
  // An end token's own text is not part of the output.
  StopMatcher::Update upd = stops_.push(end_token ? std::string() : decoder_.push(token));
  out.text = std::move(upd.emit);
  if (upd.stopped) {
    out.finished = true;
    out.finish_reason = FinishReason::kStop;
    out.stop_string = std::move(upd.matched);
  } else if (out.finished) {
    StopMatcher::Update tail = stops_.push(decoder_.flush());
    out.text += tail.emit;
    if (tail.stopped) {
      out.finish_reason = FinishReason::kStop;
      out.stop_string = std::move(tail.matched);
    } else {
      out.text += stops_.flush();
    }
  }
  return out;
}

void TokenFinisher::replay(int32_t token) { (void)stops_.push(decoder_.push(token)); }

}  // namespace cleave
