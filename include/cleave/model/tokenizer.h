// Tokenizers: SentencePiece-style (GGUF model "llama") and byte-level BPE (GGUF model "gpt2"),
// built from a TokenizerSpec (GGUF metadata or tokenizer.json). Thread-safe after construction
// (encode/decode are const).
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <string_view>
#include <vector>

#include "cleave/common/status.h"
#include "cleave/model/tokenizer_spec.h"

namespace cleave {

class GgufFile;

struct EncodeOptions {
  bool add_bos = false;        // prepend BOS (when the tokenizer has one)
  bool parse_special = false;  // recognise special/control token text such as "<|im_end|>"
  bool add_eos = false;        // append EOS (when the tokenizer has one)
};

class Tokenizer {
 public:
  virtual ~Tokenizer() = default;

  // Fails with InvalidArgument when the spec is inconsistent (unknown model or pre-tokenizer,
  // missing byte tokens, bad merges).
  static Result<std::unique_ptr<Tokenizer>> create(const TokenizerSpec& spec);

  virtual std::vector<int32_t> encode(std::string_view text, const EncodeOptions& opts) const = 0;
  // The bytes of one token as they appear in text (byte tokens give their byte, SPM's U+2581
  // becomes a space, byte-level BPE is mapped back to raw bytes). Control tokens give "" unless
  // `render_special`.
  virtual std::string token_to_piece(int32_t id, bool render_special = false) const = 0;
  // Decodes a whole sequence (SPM: drops the leading space after BOS as SentencePiece does).
  std::string decode(const std::vector<int32_t>& ids, bool render_special = false) const;

  const TokenizerSpec& spec() const { return spec_; }
  int32_t vocab_size() const { return static_cast<int32_t>(spec_.tokens.size()); }
  int32_t bos_id() const { return spec_.bos_id; }
  int32_t eos_id() const { return spec_.eos_id; }
  // EOS or any end-of-turn token.
  bool is_end_of_generation(int32_t id) const;
  bool is_control(int32_t id) const;

 protected:
  explicit Tokenizer(TokenizerSpec spec) : spec_(std::move(spec)) {}
  TokenizerSpec spec_;
};

// Incremental detokenizer for streaming: feed tokens, get the text that is complete so far.
// Bytes of an incomplete UTF-8 sequence are held back until the sequence is complete (or
// flushed at the end, replaced by U+FFFD when they can never complete).
class StreamDecoder {
 public:
  explicit StreamDecoder(const Tokenizer& tok) : tok_(tok) {}
  // Returns the newly completed text after `id`.
  std::string push(int32_t id);
  // Returns whatever is held back (invalid bytes become U+FFFD).
  std::string flush();

 private:
  const Tokenizer& tok_;
  std::string pending_;
  bool first_ = true;  // SPM: strip the leading space of the first piece
};

// Reads tokenizer.ggml.* metadata (works on vocab-only GGUF files too).
Result<TokenizerSpec> tokenizer_spec_from_gguf(const GgufFile& gguf);
// Reads a Hugging Face tokenizer.json (and tokenizer_config.json beside it when present).
Result<TokenizerSpec> tokenizer_spec_from_hf_dir(const std::string& dir);
// The tokenizer of `path`: a GGUF file (a vocab-only one is enough) or a Hugging Face directory.
Result<std::unique_ptr<Tokenizer>> load_tokenizer(const std::string& path);

}  // namespace cleave
