// write_hf_tokenizer: a TokenizerSpec as tokenizer.json + tokenizer_config.json (layout and the
// choices for SentencePiece-style vocabularies are described in tokenizer_json.h).
#include <fmt/format.h>

#include <algorithm>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <unordered_map>

#include "cleave/model/tokenizer_json.h"
#include "hf_common.h"
#include "pretokenize.h"
#include "spec_checks.h"
#include "unicode.h"

namespace cleave {
namespace {

using nlohmann::ordered_json;

TokenType type_at(const TokenizerSpec& spec, size_t id) {
  return spec.token_types.empty() ? TokenType::kNormal : spec.token_types[id];
}

ordered_json added_tokens(const TokenizerSpec& spec) {
  ordered_json arr = ordered_json::array();
  for (size_t id = 0; id < spec.tokens.size(); ++id) {
    TokenType t = type_at(spec, id);
    if (t != TokenType::kControl && t != TokenType::kUserDefined && t != TokenType::kUnknown)
      continue;
    arr.push_back({{"id", id},
                   {"content", spec.tokens[id]},
                   {"single_word", false},
                   {"lstrip", false},
                   {"rstrip", false},
                   {"normalized", false},
                   {"special", t != TokenType::kUserDefined}});
  }
  return arr;
}

ordered_json vocab_object(const TokenizerSpec& spec) {
  ordered_json v = ordered_json::object();
  for (size_t id = 0; id < spec.tokens.size(); ++id)
    if (!v.contains(spec.tokens[id])) v[spec.tokens[id]] = id;
  return v;
}

ordered_json template_processing(const TokenizerSpec& spec) {
  bool bos = spec.add_bos && spec.bos_id >= 0, eos = spec.add_eos && spec.eos_id >= 0;
  if (!bos && !eos) return nullptr;
  auto special = [&](int32_t id, int type_id) {
    return ordered_json{{"SpecialToken", {{"id", spec.tokens[id]}, {"type_id", type_id}}}};
  };
  auto seq = [](const char* which, int type_id) {
    return ordered_json{{"Sequence", {{"id", which}, {"type_id", type_id}}}};
  };
  ordered_json single = ordered_json::array(), pair = ordered_json::array();
  if (bos) single.push_back(special(spec.bos_id, 0));
  single.push_back(seq("A", 0));
  if (eos) single.push_back(special(spec.eos_id, 0));
  pair = single;
  if (bos) pair.push_back(special(spec.bos_id, 1));
  pair.push_back(seq("B", 1));
  if (eos) pair.push_back(special(spec.eos_id, 1));
  ordered_json tokens = ordered_json::object();
  for (int32_t id : {bos ? spec.bos_id : -1, eos ? spec.eos_id : -1})
    if (id >= 0)
      tokens[spec.tokens[id]] = {{"id", spec.tokens[id]}, {"ids", {id}}, {"tokens", {spec.tokens[id]}}};
  return {{"type", "TemplateProcessing"}, {"single", single}, {"pair", pair},
          {"special_tokens", tokens}};
}

Result<ordered_json> byte_level_json(const TokenizerSpec& spec) {
  const std::vector<std::string>* regexes =
      spec.pre_regexes.empty() ? tok::pre_tokenizer_regexes(spec.pre) : &spec.pre_regexes;
  if (regexes == nullptr)
    return InvalidArgument(fmt::format("unknown pre-tokenizer '{}'", spec.pre));
  ordered_json pre;
  if (*regexes == *tok::pre_tokenizer_regexes("gpt-2") ||
      *regexes == *tok::pre_tokenizer_regexes("gpt2-full")) {
    pre = {{"type", "ByteLevel"}, {"add_prefix_space", false}, {"trim_offsets", true},
           {"use_regex", true}};
  } else {
    ordered_json steps = ordered_json::array();
    for (const auto& re : *regexes)
      steps.push_back({{"type", "Split"}, {"pattern", {{"Regex", re}}},
                       {"behavior", "Isolated"}, {"invert", false}});
    steps.push_back({{"type", "ByteLevel"}, {"add_prefix_space", false}, {"trim_offsets", true},
                     {"use_regex", false}});
    pre = {{"type", "Sequence"}, {"pretokenizers", steps}};
  }
  ordered_json merges = ordered_json::array();
  for (const auto& m : spec.merges) merges.push_back(m);
  ordered_json model = {{"type", "BPE"}, {"dropout", nullptr}, {"unk_token", nullptr},
                        {"continuing_subword_prefix", nullptr}, {"end_of_word_suffix", nullptr},
                        {"fuse_unk", false}, {"byte_fallback", false},
                        {"ignore_merges", spec.ignore_merges || spec.pre == "llama-bpe" ||
                                              spec.pre == "llama3" || spec.pre == "llama-v3"},
                        {"vocab", vocab_object(spec)}, {"merges", merges}};
  return ordered_json{{"version", "1.0"}, {"truncation", nullptr}, {"padding", nullptr},
                      {"added_tokens", added_tokens(spec)}, {"normalizer", nullptr},
                      {"pre_tokenizer", pre}, {"post_processor", template_processing(spec)},
                      {"decoder", {{"type", "ByteLevel"}, {"add_prefix_space", true},
                                   {"trim_offsets", true}, {"use_regex", true}}},
                      {"model", model}};
}

// SentencePiece-style: merges from the scores. Sets *exact_scores_needed when ranks cannot
// reproduce the score order (ties, or a multi-character token that no merge makes).
ordered_json spm_json(const TokenizerSpec& spec, bool* exact_scores_needed) {
  const size_t n = spec.tokens.size();
  std::unordered_map<std::string_view, int32_t> index;
  for (size_t i = 0; i < n; ++i) index[spec.tokens[i]] = static_cast<int32_t>(i);
  auto score = [&](size_t id) { return spec.scores.empty() ? 0.0f : spec.scores[id]; };
  struct Merge {
    int32_t result, left, right;
  };
  std::vector<Merge> merges;
  *exact_scores_needed = false;
  for (size_t id = 0; id < n; ++id) {
    TokenType t = type_at(spec, id);
    if (t != TokenType::kNormal && t != TokenType::kUndefined && t != TokenType::kUnused) continue;
    const std::string& text = spec.tokens[id];
    size_t chars = 0;
    bool any = false;
    for (size_t i = 0; i < text.size();) {
      size_t len = tok::decode_utf8(text, i).len;
      i += len;
      ++chars;
      if (i >= text.size()) break;
      auto l = index.find(std::string_view(text).substr(0, i));
      auto r = index.find(std::string_view(text).substr(i));
      if (l == index.end() || r == index.end()) continue;
      merges.push_back({static_cast<int32_t>(id), l->second, r->second});
      any = true;
    }
    if (chars > 1 && !any) *exact_scores_needed = true;
  }
  std::stable_sort(merges.begin(), merges.end(), [&](const Merge& a, const Merge& b) {
    if (score(a.result) != score(b.result)) return score(a.result) > score(b.result);
    if (a.result != b.result) return a.result < b.result;
    return a.left < b.left;
  });
  for (size_t i = 1; i < merges.size(); ++i)
    if (merges[i].result != merges[i - 1].result &&
        score(merges[i].result) == score(merges[i - 1].result))
      *exact_scores_needed = true;
  ordered_json jm = ordered_json::array();
  for (const auto& m : merges) jm.push_back(spec.tokens[m.left] + " " + spec.tokens[m.right]);

  ordered_json replace_space = {{"type", "Replace"}, {"pattern", {{"String", " "}}},
                                {"content", tok::kSpmSpace}};
  ordered_json normalizer =
      spec.add_space_prefix
          ? ordered_json{{"type", "Sequence"},
                         {"normalizers",
                          {{{"type", "Prepend"}, {"prepend", tok::kSpmSpace}}, replace_space}}}
          : replace_space;
  ordered_json decoders = {
      {{"type", "Replace"}, {"pattern", {{"String", tok::kSpmSpace}}}, {"content", " "}},
      {{"type", "ByteFallback"}},
      {{"type", "Fuse"}}};
  if (spec.add_space_prefix)
    decoders.push_back({{"type", "Strip"}, {"content", " "}, {"start", 1}, {"stop", 0}});
  ordered_json model = {
      {"type", "BPE"}, {"dropout", nullptr},
      {"unk_token", spec.unk_id >= 0 ? ordered_json(spec.tokens[spec.unk_id]) : ordered_json()},
      {"continuing_subword_prefix", nullptr}, {"end_of_word_suffix", nullptr},
      {"fuse_unk", true}, {"byte_fallback", true}, {"ignore_merges", false},
      {"vocab", vocab_object(spec)}, {"merges", jm}};
  return {{"version", "1.0"}, {"truncation", nullptr}, {"padding", nullptr},
          {"added_tokens", added_tokens(spec)}, {"normalizer", normalizer},
          {"pre_tokenizer", nullptr}, {"post_processor", template_processing(spec)},
          {"decoder", {{"type", "Sequence"}, {"decoders", decoders}}}, {"model", model}};
}

Status write_text(const std::filesystem::path& path, const std::string& text) {
  std::ofstream out(path, std::ios::binary | std::ios::trunc);
  if (!out) return Unavailable(fmt::format("cannot write '{}'", path.string()));
  out << text;
  out.close();
  if (!out) return Unavailable(fmt::format("error writing '{}'", path.string()));
  return Status::Ok();
}

}  // namespace

Status write_hf_tokenizer(const TokenizerSpec& spec, const std::string& dir) {
  CLEAVE_RETURN_IF_ERROR(check_spec_shape(spec).with_context("write_hf_tokenizer"));
  namespace fs = std::filesystem;
  std::error_code ec;
  fs::create_directories(dir, ec);
  if (ec) return Unavailable(fmt::format("cannot create '{}': {}", dir, ec.message()));
  ordered_json tj;
  bool exact_scores = false;
  if (spec.model == "gpt2") {
    CLEAVE_ASSIGN_OR_RETURN(tj, byte_level_json(spec));
  } else if (spec.model == "llama") {
    tj = spm_json(spec, &exact_scores);
  } else {
    return Unimplemented(
        fmt::format("cannot write tokenizer.json for tokenizer model '{}'", spec.model));
  }
  ordered_json cfg = {{"add_bos_token", spec.add_bos}, {"add_eos_token", spec.add_eos}};
  auto put = [&](const char* key, int32_t id) {
    if (id >= 0) cfg[key] = spec.tokens[id];
  };
  put("bos_token", spec.bos_id);
  put("eos_token", spec.eos_id);
  put("unk_token", spec.unk_id);
  put("pad_token", spec.pad_id);
  cfg["clean_up_tokenization_spaces"] = false;
  cfg["tokenizer_class"] = spec.model == "llama" ? "LlamaTokenizerFast" : "PreTrainedTokenizerFast";
  if (spec.model == "llama") cfg["legacy"] = true;
  if (!spec.chat_template.empty()) cfg["chat_template"] = spec.chat_template;
  if (!spec.eot_ids.empty()) cfg[tok::kConfigEotIds] = spec.eot_ids;
  if (exact_scores) cfg[tok::kConfigSpmScores] = spec.scores;
  std::string tjs, cfgs;
  try {
    tjs = tj.dump(1, ' ', false, nlohmann::json::error_handler_t::replace);
    cfgs = cfg.dump(2, ' ', false, nlohmann::json::error_handler_t::replace);
  } catch (const nlohmann::json::exception& e) {
    return Internal(fmt::format("cannot serialise the tokenizer: {}", e.what()));
  }
  CLEAVE_RETURN_IF_ERROR(write_text(fs::path(dir) / "tokenizer.json", tjs));
  return write_text(fs::path(dir) / "tokenizer_config.json", cfgs);
}

}  // namespace cleave
