// tokenizer_spec_from_hf_dir: Hugging Face tokenizer.json (+ tokenizer_config.json,
// chat_template.jinja, generation_config.json when present) to a TokenizerSpec.
//
// BPE models only. Byte-level ones (pre-tokenizer or decoder ByteLevel) become model "gpt2" with
// the pre-tokenizer regexes taken from the Split/ByteLevel/Digits steps (named after a known
// GGUF pre value when they match one). SentencePiece-style ones (byte_fallback, Metaspace,
// Replace " " -> U+2581) become model "llama" with scores derived from the merge ranks (see
// tokenizer_json.h).
#include <fmt/format.h>

#include <algorithm>
#include <filesystem>
#include <functional>
#include <fstream>
#include <map>
#include <nlohmann/json.hpp>
#include <sstream>
#include <unordered_map>

#include "cleave/common/log.h"
#include "cleave/model/tokenizer.h"
#include "hf_common.h"
#include "pretokenize.h"
#include "spec_checks.h"

namespace cleave {
namespace {

using nlohmann::json;

Result<json> read_json(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) return NotFound(fmt::format("cannot open '{}'", path));
  std::ostringstream ss;
  ss << in.rdbuf();
  json j = json::parse(ss.str(), nullptr, /*allow_exceptions=*/false);
  if (j.is_discarded()) return InvalidArgument(fmt::format("'{}' is not valid JSON", path));
  return j;
}

// A token written as "text" or {"content": "text", ...}.
std::string token_content(const json& j) {
  if (j.is_string()) return j.get<std::string>();
  if (j.is_object() && j.contains("content") && j["content"].is_string())
    return j["content"].get<std::string>();
  return "";
}

// Regex-escapes a literal Split pattern.
std::string escape_regex(const std::string& s) {
  std::string out;
  for (char c : s) {
    if (std::string_view("\\^$.|?*+()[]{}-").find(c) != std::string_view::npos) out.push_back('\\');
    out.push_back(c);
  }
  return out;
}

bool has_step(const json& j, std::string_view type) {
  if (!j.is_object()) return false;
  if (j.value("type", "") == type) return true;
  for (const char* list : {"pretokenizers", "decoders", "normalizers"})
    if (j.contains(list) && j[list].is_array())
      for (const auto& s : j[list])
        if (has_step(s, type)) return true;
  return false;
}

// Collects the regex steps of a byte-level pre-tokenizer.
Status collect_regexes(const json& pt, std::vector<std::string>* out) {
  if (pt.is_null()) return Status::Ok();
  const std::string type = pt.value("type", "");
  if (type == "Sequence") {
    for (const auto& s : pt.at("pretokenizers")) CLEAVE_RETURN_IF_ERROR(collect_regexes(s, out));
    return Status::Ok();
  }
  if (type == "ByteLevel") {
    if (pt.value("add_prefix_space", false))
      return Unimplemented("ByteLevel pre-tokenizer with add_prefix_space=true is not supported");
    if (pt.value("use_regex", true)) out->push_back(*tok::pre_tokenizer_regexes("gpt2-full")->begin());
    return Status::Ok();
  }
  if (type == "Split") {
    const json& pat = pt.at("pattern");
    std::string re;
    if (pat.contains("Regex")) re = pat["Regex"].get<std::string>();
    else if (pat.contains("String")) re = escape_regex(pat["String"].get<std::string>());
    else return InvalidArgument("Split pre-tokenizer without a Regex or String pattern");
    std::string behavior = pt.value("behavior", "Isolated");
    if (behavior != "Isolated")
      return Unimplemented(fmt::format("Split behavior '{}' is not supported (only Isolated)",
                                       behavior));
    if (pt.value("invert", false)) return Unimplemented("inverted Split is not supported");
    out->push_back(re);
    return Status::Ok();
  }
  if (type == "Digits") {
    out->push_back(pt.value("individual_digits", false) ? "\\p{N}" : "\\p{N}+");
    return Status::Ok();
  }
  return Unimplemented(fmt::format("pre-tokenizer '{}' is not supported", type));
}

bool spm_adds_space_prefix(const json& tj) {
  const json& norm = tj.contains("normalizer") ? tj["normalizer"] : json();
  const json& pre = tj.contains("pre_tokenizer") ? tj["pre_tokenizer"] : json();
  std::function<bool(const json&)> find = [&](const json& j) -> bool {
    if (!j.is_object()) return false;
    std::string type = j.value("type", "");
    if (type == "Prepend" && j.value("prepend", "") == tok::kSpmSpace) return true;
    if (type == "Metaspace") {
      if (j.contains("prepend_scheme")) return j["prepend_scheme"] != "never";
      return j.value("add_prefix_space", true);
    }
    for (const char* list : {"pretokenizers", "normalizers"})
      if (j.contains(list) && j[list].is_array())
        for (const auto& s : j[list])
          if (find(s)) return true;
    return false;
  };
  return find(norm) || find(pre);
}

Result<TokenizerSpec> parse_hf(const std::string& dir, const json& tj, const json& cfg) {
  TokenizerSpec spec;
  const json& model = tj.at("model");
  const std::string mtype = model.value("type", "BPE");
  if (mtype != "BPE")
    return Unimplemented(fmt::format("tokenizer.json model type '{}' is not supported (BPE only)",
                                     mtype));
  // Vocabulary and added tokens.
  std::map<int64_t, std::string> by_id;
  for (const auto& [text, id] : model.at("vocab").items()) {
    if (!id.is_number_integer() || id.get<int64_t>() < 0)
      return InvalidArgument(fmt::format("vocab entry '{}' has an invalid id", text));
    by_id[id.get<int64_t>()] = text;
  }
  std::map<int64_t, bool> added;  // id -> special
  if (tj.contains("added_tokens") && tj["added_tokens"].is_array()) {
    for (const auto& t : tj["added_tokens"]) {
      int64_t id = t.at("id").get<int64_t>();
      if (id < 0) return InvalidArgument("added token with a negative id");
      by_id[id] = t.at("content").get<std::string>();
      added[id] = t.value("special", false);
    }
  }
  if (by_id.empty()) return InvalidArgument("tokenizer.json has an empty vocabulary");
  const int64_t n = by_id.rbegin()->first + 1;
  if (n > (1 << 24)) return InvalidArgument(fmt::format("token id {} is too large", n - 1));
  spec.tokens.resize(n);
  spec.token_types.assign(n, TokenType::kNormal);
  for (int64_t id = 0; id < n; ++id) {
    auto it = by_id.find(id);
    if (it == by_id.end()) {
      spec.tokens[id] = fmt::format("<cleave_missing_{}>", id);
      spec.token_types[id] = TokenType::kUnused;
      continue;
    }
    spec.tokens[id] = it->second;
  }
  for (auto [id, special] : added)
    spec.token_types[id] = special ? TokenType::kControl : TokenType::kUserDefined;

  // Merges: "a b" strings or [a, b] pairs.
  if (model.contains("merges") && model["merges"].is_array()) {
    spec.merges.reserve(model["merges"].size());
    for (const auto& m : model["merges"]) {
      if (m.is_string()) {
        spec.merges.push_back(m.get<std::string>());
      } else if (m.is_array() && m.size() == 2 && m[0].is_string() && m[1].is_string()) {
        std::string a = m[0].get<std::string>(), b = m[1].get<std::string>();
        if (a.find(' ') != std::string::npos)
          return Unimplemented(fmt::format("merge part '{}' contains a space", a));
        spec.merges.push_back(a + " " + b);
      } else {
        return InvalidArgument(fmt::format("merge #{} is neither \"a b\" nor [a, b]",
                                           spec.merges.size()));
      }
    }
  }

  const json& pre = tj.contains("pre_tokenizer") ? tj["pre_tokenizer"] : json();
  const json& dec = tj.contains("decoder") ? tj["decoder"] : json();
  const bool byte_level = has_step(pre, "ByteLevel") || has_step(dec, "ByteLevel");
  std::unordered_map<std::string, int32_t> index;
  for (int64_t i = 0; i < n; ++i) index.emplace(spec.tokens[i], static_cast<int32_t>(i));
  auto find_id = [&](const std::string& text) -> int32_t {
    auto it = index.find(text);
    return text.empty() || it == index.end() ? -1 : it->second;
  };
  spec.unk_id = model.contains("unk_token") ? find_id(token_content(model["unk_token"])) : -1;

  if (byte_level) {
    spec.model = "gpt2";
    std::vector<std::string> regexes;
    CLEAVE_RETURN_IF_ERROR(collect_regexes(pre, &regexes).with_context("tokenizer.json"));
    std::string name = tok::pre_tokenizer_name_for(regexes);
    if (name == "gpt2-full") name = "gpt-2";
    if (name.empty()) {
      spec.pre = "custom";
      spec.pre_regexes = regexes;
    } else {
      spec.pre = name;
    }
    spec.ignore_merges = model.value("ignore_merges", false);
    spec.add_space_prefix = false;
    spec.add_bos = false;
  } else {
    spec.model = "llama";
    spec.pre = "default";
    spec.add_space_prefix = spm_adds_space_prefix(tj);
    spec.add_bos = true;
    if (!model.value("byte_fallback", false))
      log::warn("{}: SentencePiece-style tokenizer.json without byte_fallback", dir);
    for (int b = 0; b < 256; ++b) {
      int32_t id = find_id(fmt::format("<0x{:02X}>", b));
      if (id >= 0 && spec.token_types[id] == TokenType::kNormal)
        spec.token_types[id] = TokenType::kByte;
    }
    // Scores: exact ones written by cleave, else minus the rank of the first merge making each
    // token (tokens no merge makes get the lowest score).
    spec.scores.assign(n, -1e30f);
    if (cfg.contains(tok::kConfigSpmScores) && cfg[tok::kConfigSpmScores].is_array() &&
        static_cast<int64_t>(cfg[tok::kConfigSpmScores].size()) == n) {
      for (int64_t i = 0; i < n; ++i) spec.scores[i] = cfg[tok::kConfigSpmScores][i].get<float>();
    } else {
      std::vector<bool> seen(n, false);
      for (size_t rank = 0; rank < spec.merges.size(); ++rank) {
        const std::string& m = spec.merges[rank];
        size_t sp = m.find(' ', 1);
        if (sp == std::string::npos) continue;  // check_spec_shape reports it
        auto it = index.find(m.substr(0, sp) + m.substr(sp + 1));
        if (it == index.end() || seen[it->second]) continue;
        seen[it->second] = true;
        spec.scores[it->second] = -static_cast<float>(rank);
      }
    }
    spec.merges.clear();  // SentencePiece-style tokenizers work from the scores
  }
  if (spec.unk_id >= 0 && spec.token_types[spec.unk_id] == TokenType::kControl)
    spec.token_types[spec.unk_id] = TokenType::kUnknown;

  // tokenizer_config.json
  if (cfg.is_object()) {
    if (cfg.contains("bos_token")) spec.bos_id = find_id(token_content(cfg["bos_token"]));
    if (cfg.contains("eos_token")) spec.eos_id = find_id(token_content(cfg["eos_token"]));
    if (cfg.contains("unk_token") && spec.unk_id < 0)
      spec.unk_id = find_id(token_content(cfg["unk_token"]));
    if (cfg.contains("pad_token")) spec.pad_id = find_id(token_content(cfg["pad_token"]));
    if (cfg.contains("add_bos_token") && cfg["add_bos_token"].is_boolean())
      spec.add_bos = cfg["add_bos_token"].get<bool>();
    else if (spec.model == "gpt2")
      spec.add_bos = tj.contains("post_processor") &&
                     tj["post_processor"].dump().find("\"SpecialToken\"") != std::string::npos &&
                     spec.bos_id >= 0;
    if (cfg.contains("add_eos_token") && cfg["add_eos_token"].is_boolean())
      spec.add_eos = cfg["add_eos_token"].get<bool>();
    if (cfg.contains("chat_template")) {
      const json& ct = cfg["chat_template"];
      if (ct.is_string()) {
        spec.chat_template = ct.get<std::string>();
      } else if (ct.is_array()) {
        for (const auto& t : ct)
          if (t.value("name", "") == "default") spec.chat_template = t.value("template", "");
      }
    }
    if (cfg.contains(tok::kConfigEotIds) && cfg[tok::kConfigEotIds].is_array())
      for (const auto& id : cfg[tok::kConfigEotIds])
        if (id.is_number_integer()) spec.eot_ids.push_back(id.get<int32_t>());
  }
  if (spec.bos_id < 0 && spec.model == "llama") spec.bos_id = find_id("<s>");
  if (spec.eos_id < 0 && spec.model == "llama") spec.eos_id = find_id("</s>");
  return spec;
}

}  // namespace

Result<TokenizerSpec> tokenizer_spec_from_hf_dir(const std::string& dir) {
  namespace fs = std::filesystem;
  const std::string tpath = (fs::path(dir) / "tokenizer.json").string();
  CLEAVE_ASSIGN_OR_RETURN(json tj, read_json(tpath));
  json cfg = json::object();
  const std::string cpath = (fs::path(dir) / "tokenizer_config.json").string();
  std::error_code ec;
  if (fs::exists(cpath, ec)) {
    CLEAVE_ASSIGN_OR_RETURN(cfg, read_json(cpath));
  }
  Result<TokenizerSpec> spec = InvalidArgument("unreachable");
  try {
    spec = parse_hf(dir, tj, cfg);
  } catch (const json::exception& e) {
    return InvalidArgument(fmt::format("{}: unexpected structure: {}", tpath, e.what()));
  }
  if (!spec.ok()) return spec.status().with_context(tpath);
  // A template beside the config (newer transformers) wins when the config has none.
  const std::string jinja = (fs::path(dir) / "chat_template.jinja").string();
  if (spec->chat_template.empty() && fs::exists(jinja, ec)) {
    std::ifstream in(jinja, std::ios::binary);
    std::ostringstream ss;
    ss << in.rdbuf();
    spec->chat_template = ss.str();
  }
  // generation_config.json's eos_token_id (an id or a list) ends generation too.
  const std::string gpath = (fs::path(dir) / "generation_config.json").string();
  if (fs::exists(gpath, ec)) {
    auto g = read_json(gpath);
    if (g.ok() && g->contains("eos_token_id")) {
      json e = (*g)["eos_token_id"];
      if (e.is_number_integer()) e = json::array({e});
      if (e.is_array())
        for (const auto& id : e)
          if (id.is_number_integer() && id.get<int64_t>() >= 0 &&
              id.get<int64_t>() < static_cast<int64_t>(spec->tokens.size()) &&
              id.get<int32_t>() != spec->eos_id &&
              std::find(spec->eot_ids.begin(), spec->eot_ids.end(), id.get<int32_t>()) ==
                  spec->eot_ids.end())
            spec->eot_ids.push_back(id.get<int32_t>());
    }
  }
  add_known_end_of_turn_tokens(&*spec);
  CLEAVE_RETURN_IF_ERROR(check_spec_shape(*spec).with_context(tpath));
  return spec;
}

}  // namespace cleave
