// Pre-tokenizers of byte-level BPE: a list of regular expressions applied one after another;
// each splits every piece of the previous step into its matches and the text between them
// (as llama.cpp's unicode_regex_split and Hugging Face's Split(behavior=Isolated) do).
#pragma once

#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "cleave/common/status.h"
#include "regex.h"

namespace cleave::tok {

// The regexes of a GGUF tokenizer.ggml.pre name (llama.cpp's names), or nullptr when unknown.
const std::vector<std::string>* pre_tokenizer_regexes(std::string_view pre_name);
// All names pre_tokenizer_regexes() knows, for error messages.
std::string known_pre_tokenizer_names();
// The canonical name whose regexes are `regexes`, or "" (used when reading tokenizer.json).
std::string pre_tokenizer_name_for(const std::vector<std::string>& regexes);

class PreTokenizer {
 public:
  static Result<PreTokenizer> from_regexes(const std::vector<std::string>& regexes);

  // Byte ranges [begin, end) of the pieces of `text`, in order, covering it exactly.
  std::vector<std::pair<size_t, size_t>> split(std::string_view text) const;

 private:
  std::vector<CodepointRegex> regexes_;
};

}  // namespace cleave::tok
