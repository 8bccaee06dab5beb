// Tokenizer::create, the shared encode path (special tokens, BOS/EOS) and whole-sequence decode.
#include <fmt/format.h>

#include <algorithm>

#include "cleave/model/tokenizer.h"
#include "spec_checks.h"
#include "tokenizer_impl.h"

namespace cleave {

Result<std::unique_ptr<Tokenizer>> Tokenizer::create(const TokenizerSpec& spec) {
  CLEAVE_RETURN_IF_ERROR(check_spec_shape(spec).with_context("tokenizer"));
  if (spec.model == "llama") return tok::create_spm_tokenizer(spec);
  if (spec.model == "gpt2") return tok::create_bpe_tokenizer(spec);
  return InvalidArgument(fmt::format(
      "tokenizer model '{}' is not supported (supported: 'llama' = SentencePiece-style, "
      "'gpt2' = byte-level BPE)",
      spec.model));
}

bool Tokenizer::is_end_of_generation(int32_t id) const {
  if (id < 0) return false;
  if (id == spec_.eos_id) return true;
  return std::find(spec_.eot_ids.begin(), spec_.eot_ids.end(), id) != spec_.eot_ids.end();
}

bool Tokenizer::is_control(int32_t id) const {
  if (id < 0 || id >= vocab_size() || spec_.token_types.empty()) return false;
  return spec_.token_types[id] == TokenType::kControl;
}

std::string Tokenizer::decode(const std::vector<int32_t>& ids, bool render_special) const {
  std::string out;
  bool strip_space = spec_.model == "llama" && spec_.add_space_prefix;
  for (int32_t id : ids) {
    std::string piece = token_to_piece(id, render_special);
    if (strip_space && !is_control(id) && !piece.empty()) {
      if (piece[0] == ' ') piece.erase(0, 1);
      strip_space = false;
    }
    out += piece;
  }
  return out;
}

namespace tok {

std::string byte_token_text(uint8_t byte) { return fmt::format("<0x{:02X}>", byte); }

TokenizerBase::TokenizerBase(TokenizerSpec spec) : Tokenizer(std::move(spec)) {}

Status TokenizerBase::init_common() {
  token_index_.reserve(spec_.tokens.size() * 2);
  for (size_t i = 0; i < spec_.tokens.size(); ++i)
    token_index_[spec_.tokens[i]] = static_cast<int32_t>(i);
  for (size_t i = 0; i < spec_.tokens.size(); ++i) {
    TokenType t = type_of(static_cast<int32_t>(i));
    if ((t == TokenType::kControl || t == TokenType::kUserDefined || t == TokenType::kUnknown) &&
        !spec_.tokens[i].empty())
      special_tokens_.push_back(static_cast<int32_t>(i));
  }
  std::stable_sort(special_tokens_.begin(), special_tokens_.end(), [&](int32_t a, int32_t b) {
    return spec_.tokens[a].size() > spec_.tokens[b].size();
  });
  return Status::Ok();
}

void TokenizerBase::split_special(std::string_view text, bool parse_special,
                                  std::vector<Fragment>* fragments) const {
  fragments->clear();
  if (text.empty()) return;
  fragments->push_back({-1, text});
  std::vector<Fragment> next;
  // As llama.cpp: each special token in turn (longest first) splits every raw fragment at all
  // its occurrences. Without parse_special only user-defined tokens are split out.
  for (int32_t id : special_tokens_) {
    if (!parse_special && type_of(id) != TokenType::kUserDefined) continue;
    std::string_view needle = spec_.tokens[id];
    bool any = false;
    for (const Fragment& f : *fragments)
      if (f.token < 0 && f.text.find(needle) != std::string_view::npos) { any = true; break; }
    if (!any) continue;
    next.clear();
    for (const Fragment& f : *fragments) {
      if (f.token >= 0) {
        next.push_back(f);
        continue;
      }
      std::string_view rest = f.text;
      for (size_t p; (p = rest.find(needle)) != std::string_view::npos;) {
        if (p > 0) next.push_back({-1, rest.substr(0, p)});
        next.push_back({id, {}});
        rest.remove_prefix(p + needle.size());
      }
      if (!rest.empty()) next.push_back({-1, rest});
    }
    fragments->swap(next);
  }
}

std::string TokenizerBase::token_to_piece(int32_t id, bool render_special) const {
  if (id < 0 || id >= vocab_size()) return "";
  const std::string& text = spec_.tokens[static_cast<size_t>(id)];
  switch (type_of(id)) {
    case TokenType::kControl: return render_special ? text : "";
    case TokenType::kUserDefined: return text;
    case TokenType::kUnused: return "";
    default: return piece_text(id, text);
  }
}

std::vector<int32_t> TokenizerBase::encode(std::string_view text,
                                           const EncodeOptions& opts) const {
  std::vector<int32_t> out;
  out.reserve(text.size() / 3 + 4);
  if (opts.add_bos && spec_.bos_id >= 0) out.push_back(spec_.bos_id);
  std::vector<Fragment> fragments;
  split_special(text, opts.parse_special, &fragments);
  bool after_special = true;
  for (const Fragment& f : fragments) {
    if (f.token >= 0) {
      out.push_back(f.token);
      after_special = true;
    } else {
      encode_fragment(f.text, after_special, &out);
      after_special = false;
    }
  }
  if (opts.add_eos && spec_.eos_id >= 0) out.push_back(spec_.eos_id);
  return out;
}

}  // namespace tok
}  // namespace cleave
