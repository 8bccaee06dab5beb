// Everything needed to build a tokenizer, independent of where it came from (GGUF metadata or
// tokenizer.json + tokenizer_config.json). Field meanings follow GGUF's tokenizer.ggml.* keys.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

namespace cleave {

// GGUF tokenizer.ggml.token_type values (llama.cpp's llama_token_type).
enum class TokenType : int32_t {
  kUndefined = 0,
  kNormal = 1,
  kUnknown = 2,
  kControl = 3,
  kUserDefined = 4,
  kUnused = 5,
  kByte = 6,
};

struct TokenizerSpec {
  std::string model;  // "llama" (SentencePiece) or "gpt2" (byte-level BPE)
  std::string pre;    // pre-tokenizer name: "default", "llama-bpe", "qwen2", "gpt-2", ...
  // Byte-level BPE only: explicit pre-tokenizer regexes (from a tokenizer.json whose Split
  // patterns match no known name). When non-empty they are used instead of `pre`.
  std::vector<std::string> pre_regexes;
  bool ignore_merges = false;  // BPE: a whole pre-token that is in the vocabulary is one token
  std::vector<std::string> tokens;
  std::vector<float> scores;          // may be empty (BPE)
  std::vector<TokenType> token_types; // may be empty: all normal
  std::vector<std::string> merges;    // "a b" per line, rank = index (BPE)
  int32_t bos_id = -1;
  int32_t eos_id = -1;
  int32_t unk_id = -1;
  int32_t pad_id = -1;
  std::vector<int32_t> eot_ids;       // extra end-of-generation ids (e.g. <|eot_id|>, <|im_end|>)
  bool add_bos = true;
  bool add_eos = false;
  bool add_space_prefix = true;       // SentencePiece: prepend a space to the text
  std::string chat_template;          // tokenizer.chat_template, may be empty
};

}  // namespace cleave
