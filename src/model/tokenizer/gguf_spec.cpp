// tokenizer_spec_from_gguf: reads tokenizer.ggml.* metadata into a TokenizerSpec and validates it;
// load_tokenizer: the tokenizer of a GGUF file or a Hugging Face directory.
#include <fmt/format.h>

#include <filesystem>

#include "cleave/common/log.h"
#include "cleave/model/gguf.h"
#include "cleave/model/tokenizer.h"
#include "spec_checks.h"

namespace cleave {
namespace {

// Reads an optional token id key; absent keeps *out. Values outside the vocabulary are errors,
// except for the padding id, which some converters set to n_vocab: it is dropped with a warning.
Status read_token_id(const GgufFile& gguf, std::string_view key, size_t n_vocab, bool lenient,
                     int32_t* out) {
  const GgufValue* v = gguf.find(key);
  if (v == nullptr) return Status::Ok();
  auto id = gguf.get_uint(key);
  if (!id.ok()) {
    // Some files store -1 for "none".
    if (v->is_integer() && v->i == -1) {
      *out = -1;
      return Status::Ok();
    }
    return id.status();
  }
  if (*id == 0xFFFFFFFFull || *id == ~0ull) {  // -1 stored as an unsigned integer: none
    *out = -1;
    return Status::Ok();
  }
  if (*id >= n_vocab) {
    if (lenient) {
      log::warn("GGUF '{}' = {} is outside the vocabulary ({} tokens); ignoring it", key, *id,
                n_vocab);
      *out = -1;
      return Status::Ok();
    }
    return InvalidArgument(fmt::format("GGUF '{}' = {} is outside the vocabulary ({} tokens)", key,
                                       *id, n_vocab));
  }
  *out = static_cast<int32_t>(*id);
  return Status::Ok();
}

}  // namespace

Result<TokenizerSpec> tokenizer_spec_from_gguf(const GgufFile& gguf) {
  TokenizerSpec spec;
  CLEAVE_ASSIGN_OR_RETURN(spec.model, gguf.get_string("tokenizer.ggml.model"));
  const bool spm = spec.model == "llama";
  spec.pre = gguf.get_string_or("tokenizer.ggml.pre", "default");
  if (spec.pre.empty()) spec.pre = "default";

  CLEAVE_ASSIGN_OR_RETURN(const GgufValue* tokens,
                          gguf.get_array("tokenizer.ggml.tokens", GgufType::kString));
  spec.tokens = tokens->strs;
  const size_t n = spec.tokens.size();
  if (n == 0) return InvalidArgument("GGUF 'tokenizer.ggml.tokens' is empty");

  if (gguf.find("tokenizer.ggml.scores") != nullptr) {
    CLEAVE_ASSIGN_OR_RETURN(const GgufValue* scores,
                            gguf.get_array("tokenizer.ggml.scores", GgufType::kFloat32));
    if (scores->floats.size() != n)
      return InvalidArgument(fmt::format(
          "GGUF 'tokenizer.ggml.scores' has {} entries but 'tokenizer.ggml.tokens' has {}",
          scores->floats.size(), n));
    spec.scores.assign(scores->floats.begin(), scores->floats.end());
  }
  if (gguf.find("tokenizer.ggml.token_type") != nullptr) {
    CLEAVE_ASSIGN_OR_RETURN(const GgufValue* types,
                            gguf.get_array("tokenizer.ggml.token_type", GgufType::kInt32));
    if (types->ints.size() != n)
      return InvalidArgument(fmt::format(
          "GGUF 'tokenizer.ggml.token_type' has {} entries but 'tokenizer.ggml.tokens' has {}",
          types->ints.size(), n));
    spec.token_types.reserve(n);
    for (size_t i = 0; i < n; ++i) {
      int64_t t = types->ints[i];
      if (t < 0 || t > static_cast<int64_t>(TokenType::kByte))
        return InvalidArgument(fmt::format(
            "GGUF 'tokenizer.ggml.token_type'[{}] = {} is not a known token type (0..6)", i, t));
      spec.token_types.push_back(static_cast<TokenType>(t));
    }
  }
  if (gguf.find("tokenizer.ggml.merges") != nullptr) {
    CLEAVE_ASSIGN_OR_RETURN(const GgufValue* merges,
                            gguf.get_array("tokenizer.ggml.merges", GgufType::kString));
    spec.merges = merges->strs;
  }

  // Defaults as llama.cpp uses them when the keys are absent.
  if (spm) {
    spec.bos_id = n > 1 ? 1 : -1;
    spec.eos_id = n > 2 ? 2 : -1;
    spec.unk_id = 0;
    spec.add_bos = true;
    spec.add_space_prefix = true;
  } else {
    spec.add_bos = spec.pre == "llama-bpe" || spec.pre == "llama3" || spec.pre == "llama-v3";
    spec.add_space_prefix = false;
  }
  CLEAVE_RETURN_IF_ERROR(read_token_id(gguf, "tokenizer.ggml.bos_token_id", n, false, &spec.bos_id));
  CLEAVE_RETURN_IF_ERROR(read_token_id(gguf, "tokenizer.ggml.eos_token_id", n, false, &spec.eos_id));
  CLEAVE_RETURN_IF_ERROR(
      read_token_id(gguf, "tokenizer.ggml.unknown_token_id", n, false, &spec.unk_id));
  CLEAVE_RETURN_IF_ERROR(
      read_token_id(gguf, "tokenizer.ggml.padding_token_id", n, true, &spec.pad_id));
  for (const char* key : {"tokenizer.ggml.eot_token_id", "tokenizer.ggml.eom_token_id"}) {
    int32_t id = -1;
    CLEAVE_RETURN_IF_ERROR(read_token_id(gguf, key, n, false, &id));
    if (id >= 0) spec.eot_ids.push_back(id);
  }
  for (auto [key, out] : {std::pair{"tokenizer.ggml.add_bos_token", &spec.add_bos},
                          std::pair{"tokenizer.ggml.add_eos_token", &spec.add_eos},
                          std::pair{"tokenizer.ggml.add_space_prefix", &spec.add_space_prefix}}) {
    if (gguf.find(key) == nullptr) continue;
    CLEAVE_ASSIGN_OR_RETURN(*out, gguf.get_bool(key));
  }
  if (gguf.find("tokenizer.chat_template") != nullptr) {
    CLEAVE_ASSIGN_OR_RETURN(spec.chat_template, gguf.get_string("tokenizer.chat_template"));
  }
  add_known_end_of_turn_tokens(&spec);
  CLEAVE_RETURN_IF_ERROR(check_spec_shape(spec).with_context("GGUF tokenizer"));
  return spec;
}

Result<std::unique_ptr<Tokenizer>> load_tokenizer(const std::string& path) {
  std::error_code ec;
  TokenizerSpec spec;
  if (std::filesystem::is_directory(path, ec)) {
    CLEAVE_ASSIGN_OR_RETURN(spec, tokenizer_spec_from_hf_dir(path));
  } else {
    CLEAVE_ASSIGN_OR_RETURN(GgufFile gguf, GgufFile::open(path));
    CLEAVE_ASSIGN_OR_RETURN(spec, tokenizer_spec_from_gguf(gguf));
  }
  return Tokenizer::create(spec);
}

}  // namespace cleave
