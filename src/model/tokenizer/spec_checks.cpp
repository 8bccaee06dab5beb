#include "spec_checks.h"

#include <algorithm>
#include <fmt/format.h>

namespace cleave {

Status check_spec_shape(const TokenizerSpec& spec) {
  const size_t n = spec.tokens.size();
  if (n == 0) return InvalidArgument("the vocabulary is empty");
  if (n > static_cast<size_t>(INT32_MAX))
    return InvalidArgument(fmt::format("the vocabulary has {} tokens, too many", n));
  if (!spec.scores.empty() && spec.scores.size() != n)
    return InvalidArgument(
        fmt::format("{} scores for {} tokens: the lengths must agree", spec.scores.size(), n));
  if (!spec.token_types.empty() && spec.token_types.size() != n)
    return InvalidArgument(fmt::format("{} token types for {} tokens: the lengths must agree",
                                       spec.token_types.size(), n));
  auto check_id = [&](const char* what, int32_t id) -> Status {
    if (id < -1 || id >= static_cast<int64_t>(n))
      return InvalidArgument(
          fmt::format("{} token id {} is outside the vocabulary ({} tokens)", what, id, n));
    return Status::Ok();
  };
  CLEAVE_RETURN_IF_ERROR(check_id("BOS", spec.bos_id));
  CLEAVE_RETURN_IF_ERROR(check_id("EOS", spec.eos_id));
  CLEAVE_RETURN_IF_ERROR(check_id("unknown", spec.unk_id));
  CLEAVE_RETURN_IF_ERROR(check_id("padding", spec.pad_id));
  for (int32_t id : spec.eot_ids) {
    CLEAVE_RETURN_IF_ERROR(check_id("end-of-turn", id));
    if (id < 0) return InvalidArgument("end-of-turn token id -1 is not a token");
  }
  for (size_t i = 0; i < spec.merges.size(); ++i) {
    const std::string& m = spec.merges[i];
    if (m.size() < 3 || m.find(' ', 1) == std::string::npos || m.find(' ', 1) == m.size() - 1)
      return InvalidArgument(
          fmt::format("merge #{} '{}' is not of the form 'left right'", i, m));
  }
  return Status::Ok();
}

void add_known_end_of_turn_tokens(TokenizerSpec* spec) {
  static const char* const kNames[] = {
      "<|eot_id|>", "<|im_end|>",     "<|end|>", "<end_of_turn>", "<|endoftext|>",
      "<|eom_id|>", "<EOT>",          "_<EOT>",  "<|end_of_text|>", "<end_of_utterance>",
      "<｜end▁of▁sentence｜>", "<|return|>", "<|call|>"};
  for (size_t id = 0; id < spec->tokens.size(); ++id) {
    if (!spec->token_types.empty() && spec->token_types[id] != TokenType::kControl &&
        spec->token_types[id] != TokenType::kUserDefined)
      continue;
    const std::string& t = spec->tokens[id];
    if (t.empty() || (t[0] != '<' && t[0] != '_')) continue;
    for (const char* name : kNames) {
      if (t != name) continue;
      auto i32 = static_cast<int32_t>(id);
      if (i32 != spec->eos_id &&
          std::find(spec->eot_ids.begin(), spec->eot_ids.end(), i32) == spec->eot_ids.end())
        spec->eot_ids.push_back(i32);
    }
  }
}

}  // namespace cleave
