// Writing a TokenizerSpec as Hugging Face tokenizer files (the reader is
// tokenizer_spec_from_hf_dir in tokenizer.h).
//
// write_hf_tokenizer writes <dir>/tokenizer.json and <dir>/tokenizer_config.json:
// - byte-level BPE ("gpt2"): model BPE (vocab, merges as "a b" strings), pre_tokenizer ByteLevel
//   (GPT-2's regex) or Sequence[Split(regex)..., ByteLevel(use_regex=false)] for the other
//   pre-tokenizers, decoder ByteLevel.
// - SentencePiece-style ("llama"): what Hugging Face uses for Llama: model BPE with
//   byte_fallback, merges derived from the scores (every pair a+b of vocabulary entries, ordered
//   by the score of a+b, highest first, ties by id), normalizer Prepend("▁") + Replace(" ", "▁")
//   (or none when add_space_prefix is false), decoder Replace/ByteFallback/Fuse/Strip.
//   The reader turns such a file back into a SentencePiece-style spec whose scores are minus the
//   rank of the first merge that forms each token; SentencePiece's merge order depends only on
//   the order of those scores, so the ids are identical as long as the original scores of
//   mergeable tokens are distinct (they are for SentencePiece BPE models, whose scores are
//   ranks). When they are not, the exact scores are stored as "cleave_spm_scores" in
//   tokenizer_config.json (an extra key other readers ignore) and the reader uses them.
// Special tokens (control, user-defined, unknown) become added_tokens; tokenizer_config.json
// carries bos/eos/unk/pad tokens, add_bos_token, add_eos_token and chat_template.
#pragma once

#include <string>

#include "cleave/common/status.h"
#include "cleave/model/tokenizer_spec.h"

namespace cleave {

// Creates `dir` if needed; overwrites the two files.
Status write_hf_tokenizer(const TokenizerSpec& spec, const std::string& dir);

}  // namespace cleave
