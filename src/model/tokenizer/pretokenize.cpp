#include "pretokenize.h"

#include <fmt/format.h>

#include <map>

namespace cleave::tok {
namespace {

// Patterns follow the tokenizer.json files of the model families (as collected by llama.cpp's
// llama-vocab.cpp for each tokenizer.ggml.pre value).
const char* const kGpt2 =
    "'s|'t|'re|'ve|'m|'ll|'d| ?\\p{L}+| ?\\p{N}+| ?[^\\s\\p{L}\\p{N}]+|\\s+(?!\\S)|\\s+";
const char* const kLlama3 =
    "(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\\r\\n\\p{L}\\p{N}]?\\p{L}+|\\p{N}{1,3}| "
    "?[^\\s\\p{L}\\p{N}]+[\\r\\n]*|\\s*[\\r\\n]+|\\s+(?!\\S)|\\s+";
const char* const kQwen2 =
    "(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\\r\\n\\p{L}\\p{N}]?\\p{L}+|\\p{N}| "
    "?[^\\s\\p{L}\\p{N}]+[\\r\\n]*|\\s*[\\r\\n]+|\\s+(?!\\S)|\\s+";
const char* const kGpt2NoTrailing =
    "'s|'t|'re|'ve|'m|'ll|'d| ?\\p{L}+| ?\\p{N}+| ?[^\\s\\p{L}\\p{N}]+|\\s+(?!\\S)";
const char* const kTekken =
    "[^\\r\\n\\p{L}\\p{N}]?[\\p{Lu}\\p{Lt}\\p{Lm}\\p{Lo}\\p{M}]*[\\p{Ll}\\p{Lm}\\p{Lo}\\p{M}]+|"
    "[^\\r\\n\\p{L}\\p{N}]?[\\p{Lu}\\p{Lt}\\p{Lm}\\p{Lo}\\p{M}]+[\\p{Ll}\\p{Lm}\\p{Lo}\\p{M}]*|"
    "\\p{N}| ?[^\\s\\p{L}\\p{N}]+[\\r\\n/]*|\\s*[\\r\\n]+|\\s+(?!\\S)|\\s+";
const char* const kGpt4o =
    "[^\\r\\n\\p{L}\\p{N}]?[\\p{Lu}\\p{Lt}\\p{Lm}\\p{Lo}\\p{M}]*[\\p{Ll}\\p{Lm}\\p{Lo}\\p{M}]+"
    "(?i:'s|'t|'re|'ve|'m|'ll|'d)?|[^\\r\\n\\p{L}\\p{N}]?[\\p{Lu}\\p{Lt}\\p{Lm}\\p{Lo}\\p{M}]+"
    "[\\p{Ll}\\p{Lm}\\p{Lo}\\p{M}]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?|\\p{N}{1,3}| "
    "?[^\\s\\p{L}\\p{N}]+[\\r\\n/]*|\\s*[\\r\\n]+|\\s+(?!\\S)|\\s+";
const char* const kSeedCoder =
    "(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\\r\\n\\p{L}\\p{N}]?\\p{L}+|\\p{N}{1}| "
    "?[^\\s\\p{L}\\p{N}\\r\\n]+|\\s*[\\r\\n]+|\\s+(?!\\S)|\\s+";
const char* const kBloom = " ?[^(\\s|.,!?…。，、।۔،)]+";
const char* const kCjk = "[一-龥ࠀ-一가-퟿]+";

using Table = std::map<std::string, std::vector<std::string>, std::less<>>;

const Table& table() {
  static const Table t = [] {
    Table m;
    auto add = [&](std::initializer_list<const char*> names, std::vector<std::string> res) {
      for (const char* n : names) m[n] = res;
    };
    // The default for GGUF files without (or with "default") tokenizer.ggml.pre.
    add({"default"}, {"[\\p{P}\\$\\+<=>\\^~\\|]+", kGpt2NoTrailing, "\\p{N}+", "[0-9][0-9][0-9]"});
    add({"gpt-2", "gpt2", "phi-2", "jina-es", "jina-de", "gigachat", "jina-v1-en", "jina-v2-es",
         "jina-v2-de", "jina-v2-code", "roberta-bpe", "mpt", "olmo", "jais", "trillion",
         "granite-docling"},
        {kGpt2NoTrailing});
    add({"llama3", "llama-v3", "llama-bpe", "falcon3", "falcon-h1", "pixtral", "midm-2.0",
         "lfm2", "dbrx", "smaug-bpe", "chatglm-bpe", "bailingmoe", "bailingmoe2", "exaone4",
         "a.x-4.0"},
        {kLlama3});
    add({"qwen2", "deepseek-r1-qwen", "megrez", "stablelm2", "hunyuan", "qwen35"}, {kQwen2});
    add({"deepseek-llm"},
        {"[\r\n]",
         "\\s?[A-Za-zµÀ-ÖØ-öø-ƺƼ-ƿǄ-ʓʕ-ʯͰ-ͳͶͷͻ-ͽͿΆΈ-ΊΌΎ-ΡΣ-ϵϷ-ҁҊ-ԯԱ-ՖႠ-ჅᎠ-Ᏽᏸ-ᏽᲐ-ᲺᲽ-Ჿᴀ-ᴫᵫ-ᵷᵹ-ᶚḀ-ἕἘ-Ἕἠ-ὅὈ-Ὅὐ-ὗὙὛὝὟ-\\x{1F7D}ᾀ-ᾴᾶ-ᾼ\\x{1FBE}ῂ-ῄῆ-ῌῐ-\\x{1FD3}ῖ-\\x{1FDB}ῠ-Ῥῲ-ῴῶ-ῼℂℇℊ-ℓℕℙ-ℝℤ\\x{2126}ℨ\\x{212A}-ℭℯ-ℴℹℼ-ℿⅅ-ⅉⅎↃↄⰀ-ⱻⱾ-ⳤⳫ-ⳮⳲⳳꙀ-ꙭꚀ-ꚛꜢ-ꝯꝱ-ꞇꞋ-ꞎꭰ-ꮿﬀ-ﬆﬓ-ﬗＡ-Ｚａ-ｚ𐐀-𐑏𐒰-𐓓𐓘-𐓻𐲀-𐲲𐳀-𐳲𑢠-𑣟𞤀-𞥃]+",
         "\\s?[!-/:-~！-／：-～‘-‟　-。]+", "\\s+$", kCjk, "\\p{N}+"});
    add({"deepseek-v3", "hunyuan-dense"},
        {"\\p{N}{1,3}", "[一-龥぀-ゟ゠-ヿ]+",
         "[!\"#$%&'()*+,\\-./:;<=>?@\\[\\\\\\]^_`{|}~][A-Za-z]+|[^\r\n\\p{L}\\p{P}\\p{S}]?[\\p{L}"
         "\\p{M}]+| ?[\\p{P}\\p{S}]+[\r\n]*|\\s*[\r\n]+|\\s+(?!\\S)|\\s+"});
    add({"deepseek-coder"}, {"[\r\n]", "\\s?\\p{L}+", "\\s?\\p{P}+", kCjk, "\\p{N}"});
    add({"falcon"},
        {"[\\p{P}\\$\\+<=>\\^~\\|`]+", kGpt2NoTrailing, "[0-9][0-9][0-9]"});
    add({"starcoder", "refact", "command-r", "smollm", "codeshell", "exaone", "minerva-7b"},
        {"\\p{N}", kGpt2NoTrailing});
    add({"poro-chat", "bloom", "gpt3-finnish"}, {kBloom});
    add({"viking"}, {kBloom, "\\p{N}"});
    add({"tekken"}, {kTekken});
    add({"gpt-4o", "llama4", "kimi-k2"}, {kGpt4o});
    add({"seed-coder"}, {kSeedCoder});
    add({"gpt2-full"}, {kGpt2});  // GPT-2's tokenizer.json form, with the trailing \s+
    return m;
  }();
  return t;
}

}  // namespace

const std::vector<std::string>* pre_tokenizer_regexes(std::string_view pre_name) {
  auto it = table().find(pre_name);
  return it == table().end() ? nullptr : &it->second;
}

std::string known_pre_tokenizer_names() {
  std::string out;
  for (const auto& [name, res] : table()) {
    if (!out.empty()) out += ", ";
    out += name;
  }
  return out;
}

std::string pre_tokenizer_name_for(const std::vector<std::string>& regexes) {
  // Prefer the canonical names (first in each family) when several share regexes.
  static const char* const kPreferred[] = {"gpt-2", "llama-bpe", "qwen2", "deepseek-llm",
                                           "deepseek-v3", "deepseek-coder", "falcon",
                                           "starcoder", "bloom", "viking", "tekken", "gpt-4o",
                                           "seed-coder", "default", "gpt2-full"};
  for (const char* name : kPreferred)
    if (*pre_tokenizer_regexes(name) == regexes) return name;
  for (const auto& [name, res] : table())
    if (res == regexes) return name;
  return "";
}

Result<PreTokenizer> PreTokenizer::from_regexes(const std::vector<std::string>& regexes) {
  PreTokenizer p;
  for (const auto& r : regexes) {
    CLEAVE_ASSIGN_OR_RETURN(auto re, CodepointRegex::compile(r));
    p.regexes_.push_back(std::move(re));
  }
  return p;
}

std::vector<std::pair<size_t, size_t>> PreTokenizer::split(std::string_view text) const {
  CodepointText cps = CodepointText::from_utf8(text);
  // Pieces as code point ranges.
  std::vector<std::pair<size_t, size_t>> pieces;
  if (!cps.cps.empty()) pieces.push_back({0, cps.cps.size()});
  std::vector<std::pair<size_t, size_t>> next;
  for (const auto& re : regexes_) {
    next.clear();
    for (auto [b, e] : pieces) {
      size_t pos = b;
      while (pos < e) {
        size_t mb = 0, me = 0;
        if (!re.search(cps, b, e, pos, &mb, &me)) break;
        if (me == mb) {  // an empty match splits nothing; move on
          if (mb > pos) next.push_back({pos, mb});
          if (mb < e) next.push_back({mb, mb + 1});
          pos = mb + 1;
          continue;
        }
        if (mb > pos) next.push_back({pos, mb});
        next.push_back({mb, me});
        pos = me;
      }
      if (pos < e) next.push_back({pos, e});
    }
    pieces.swap(next);
  }
  std::vector<std::pair<size_t, size_t>> bytes;
  bytes.reserve(pieces.size());
  for (auto [b, e] : pieces) bytes.push_back({cps.byte_offset[b], cps.byte_offset[e]});
  return bytes;
}

}  // namespace cleave::tok
