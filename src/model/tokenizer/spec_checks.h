// Checks and fix-ups shared by the TokenizerSpec readers (GGUF, tokenizer.json).
#pragma once

#include "cleave/common/status.h"
#include "cleave/model/tokenizer_spec.h"

namespace cleave {

// Lengths of scores/token_types agree with tokens, special ids are in range, merges are "a b".
Status check_spec_shape(const TokenizerSpec& spec);

// Adds well-known end-of-turn control tokens (<|eot_id|>, <|im_end|>, <|end|>, <end_of_turn>...)
// present in the vocabulary to spec->eot_ids, as llama.cpp does, without duplicates.
void add_known_end_of_turn_tokens(TokenizerSpec* spec);

}  // namespace cleave
