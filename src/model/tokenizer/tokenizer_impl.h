// Internal: the shared machinery of the tokenizers (vocabulary index, special-token splitting,
// BOS/EOS) and the two algorithms (SentencePiece-style, byte-level BPE).
#pragma once

#include <memory>
#include <string>
#include <string_view>
#include <unordered_map>
#include <vector>

#include "cleave/model/tokenizer.h"
#include "pretokenize.h"

namespace cleave::tok {

// A piece of the input: raw text to tokenize, or a special token already recognised.
struct Fragment {
  int32_t token = -1;      // >= 0: a special token
  std::string_view text;   // raw text when token < 0
};

class TokenizerBase : public Tokenizer {
 public:
  std::vector<int32_t> encode(std::string_view text, const EncodeOptions& opts) const override;
  // The rules every model shares: ids out of range and unused tokens give "", control tokens
  // their text only when render_special, user-defined tokens their text as is. Every other token
  // is spelled by the model's piece_text().
  std::string token_to_piece(int32_t id, bool render_special) const final;

 protected:
  explicit TokenizerBase(TokenizerSpec spec);
  // Builds the text index and the special token list; call from create().
  Status init_common();

  TokenType type_of(int32_t id) const {
    return spec_.token_types.empty() ? TokenType::kNormal : spec_.token_types[id];
  }
  int32_t find_token(std::string_view text) const {
    auto it = token_index_.find(text);
    return it == token_index_.end() ? -1 : it->second;
  }

  // The bytes of token `id` (in range; not control, user-defined or unused) whose vocabulary
  // text is `text`.
  virtual std::string piece_text(int32_t id, const std::string& text) const = 0;

  // Appends the ids of one raw-text fragment. `after_special` is true for the first fragment
  // and for fragments that follow a special token (SentencePiece's space prefix rule).
  virtual void encode_fragment(std::string_view text, bool after_special,
                               std::vector<int32_t>* out) const = 0;

  std::unordered_map<std::string_view, int32_t> token_index_;  // text -> id (last id wins)

 private:
  void split_special(std::string_view text, bool parse_special,
                     std::vector<Fragment>* fragments) const;
  std::vector<int32_t> special_tokens_;  // control, user-defined, unknown: longest text first
};

Result<std::unique_ptr<Tokenizer>> create_spm_tokenizer(const TokenizerSpec& spec);
Result<std::unique_ptr<Tokenizer>> create_bpe_tokenizer(const TokenizerSpec& spec);

// "<0x0A>" style byte token text.
std::string byte_token_text(uint8_t byte);

}  // namespace cleave::tok
