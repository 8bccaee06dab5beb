// Synthetic workloads (random and the presets), block text and its words, gamma arrivals,
// prefix reuse.
#include "cleave/bench/workload.h"

#include <fmt/format.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <unordered_set>

#include "cleave/model/tokenizer.h"
#include "workload_internal.h"

namespace cleave::bench {
namespace {

// Short, common words: one token each in most vocabularies (a small SentencePiece model still
// splits some of them; the server's usage gives the true count).
constexpr std::string_view kWords[] = {
    "the", "a", "and", "to", "of", "in", "it", "is", "was", "he", "she", "they", "we", "you",
    "that", "on", "for", "with", "as", "at", "his", "her", "had", "said", "not", "but", "one",
    "day", "big", "little", "very", "happy", "sad", "dog", "cat", "tree", "ball", "sun", "mom",
    "dad", "play", "went", "saw", "got", "look", "run", "good", "new", "old", "red", "blue",
    "can", "will", "did", "so", "then", "there", "what", "when", "time", "up", "out", "all",
    "be", "have", "do", "go", "see", "come", "make", "like", "know", "get", "want", "park",
    "friend", "home", "toy", "bird", "fish", "box", "car", "book", "cake", "water", "room", "door",
    "girl", "boy", "name", "house", "help", "find", "took", "made", "came", "from", "by", "or",
    "this", "my", "your", "our", "their", "no", "yes", "more", "some", "many", "each", "every",
    "jump", "walk", "talk", "eat", "sleep", "smile", "laugh", "sing", "read", "draw", "share",
    "kind", "nice", "fun", "small", "long", "fast", "slow", "warm", "cold", "bright"};

uint64_t splitmix(uint64_t x) {
  x += 0x9e3779b97f4a7c15ull;
  x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ull;
  x = (x ^ (x >> 27)) * 0x94d049bb133111ebull;
  return x ^ (x >> 31);
}

int64_t scaled(int64_t len, double scale) {
  return std::max<int64_t>(1, std::llround(static_cast<double>(len) * scale));
}

// Block-id spaces of the synthetic datasets, apart from each other and from trace ids.
constexpr uint64_t kSpaceRandom = 1ull << 56, kSpaceChat = 2ull << 56, kSpaceRag = 3ull << 56,
                   kSpaceReasoning = 4ull << 56, kSpaceAgentic = 5ull << 56;

uint64_t unique_id(uint64_t space, uint64_t seed, uint64_t i) {
  return space | (splitmix(seed * 0x100000001b3ull + i) & ((1ull << 56) - 1));
}

}  // namespace

const WordList& builtin_words() {
  static const WordList list(std::begin(kWords), std::end(kWords));
  return list;
}

Result<WordList> one_token_words(const Tokenizer& tok, size_t max_words) {
  WordList out;
  const EncodeOptions plain;
  for (int32_t id = 0; id < tok.vocab_size() && out.size() < max_words; ++id) {
    if (tok.is_control(id)) continue;
    // A word piece: a space, then 2-12 lower-case ASCII letters (SPM's U+2581 is a space here).
    const std::string piece = tok.token_to_piece(id);
    if (piece.size() < 3 || piece.size() > 13 || piece[0] != ' ') continue;
    std::string word = piece.substr(1);
    if (!std::all_of(word.begin(), word.end(), [](char c) { return c >= 'a' && c <= 'z'; })) {
      continue;
    }
    // One token at the start of a text (where SPM adds its space and byte-level BPE has none)
    // and after a space: "word word" is two tokens.
    if (tok.encode(word, plain).size() != 1) continue;
    if (tok.encode(word + " " + word, plain).size() != 2) continue;
    out.push_back(std::move(word));
  }
  if (out.size() < 16) {
    return FailedPrecondition(fmt::format(
        "the tokenizer has {} words of one token (at least 16 are needed), so prompts cannot "
        "be sized in its tokens",
        out.size()));
  }
  return out;
}

std::string block_text(uint64_t block_id, int64_t words, const WordList& list) {
  std::string out;
  uint64_t state = splitmix(block_id ^ 0x5eed5eed5eedull);
  for (int64_t i = 0; i < words; ++i) {
    state = splitmix(state);
    out += list[state % list.size()];
    out += ' ';
  }
  return out;
}

void PromptBuilder::add(uint64_t block_id, int64_t words) {
  if (words <= 0) return;
  text += block_text(block_id, words, *list);
  blocks.push_back({block_id, words});
  this->words += words;
}

WorkloadRequest PromptBuilder::request(int64_t output_len) const {
  WorkloadRequest r;
  r.prompt = text;
  if (!r.prompt.empty() && r.prompt.back() == ' ') r.prompt.pop_back();
  r.input_len = words;
  r.output_len = std::max<int64_t>(1, output_len);
  return r;
}

double prefix_reuse(const std::vector<std::vector<PromptBlock>>& chains) {
  std::unordered_set<uint64_t> seen;
  int64_t reused = 0, total = 0;
  for (const auto& chain : chains) {
    uint64_t h = 0x243f6a8885a308d3ull;
    for (const auto& b : chain) {
      h = splitmix(h ^ splitmix(b.id) ^ static_cast<uint64_t>(b.words) * 0x9e37ull);
      total += b.words;
      if (!seen.insert(h).second) reused += b.words;
    }
  }
  return total > 0 ? static_cast<double>(reused) / static_cast<double>(total) : 0.0;
}

std::vector<double> gamma_arrivals(int64_t n, double rate, double burstiness, uint64_t seed) {
  std::vector<double> out(static_cast<size_t>(std::max<int64_t>(0, n)), 0.0);
  if (std::isinf(rate)) return out;
  std::mt19937_64 rng(seed);
  std::gamma_distribution<double> gap(burstiness, 1.0 / (rate * burstiness));
  double t = 0;
  for (auto& a : out) {
    a = t;
    t += gap(rng);
  }
  return out;
}

namespace {

struct Synth {
  std::mt19937_64 rng;
  int64_t uniform(int64_t lo, int64_t hi) {
    return std::uniform_int_distribution<int64_t>(lo, std::max(lo, hi))(rng);
  }
};

Workload random_workload(const WorkloadOptions& o, const WordList& list,
                         std::vector<std::vector<PromptBlock>>* chains) {
  Workload w;
  w.name = "random";
  Synth s{std::mt19937_64(o.seed)};
  const auto range = [&](int64_t len) {
    const int64_t lo = std::max<int64_t>(1, static_cast<int64_t>(len * (1.0 - o.random_range_ratio)));
    const int64_t hi = std::max<int64_t>(lo, static_cast<int64_t>(len * (1.0 + o.random_range_ratio)));
    return s.uniform(lo, hi);
  };
  for (int64_t i = 0; i < o.num_prompts; ++i) {
    PromptBuilder p(list);
    const int64_t in = range(o.random_input_len);
    const int64_t out = range(o.random_output_len);
    p.add(unique_id(kSpaceRandom, o.seed, static_cast<uint64_t>(i)), in);
    w.requests.push_back(p.request(out));
    chains->push_back(p.blocks);
  }
  return w;
}

Workload preset_workload(const std::string& name, const WorkloadOptions& o, const WordList& list,
                         std::vector<std::vector<PromptBlock>>* chains) {
  Workload w;
  w.name = "preset:" + name;
  Synth s{std::mt19937_64(o.seed ^ splitmix(std::hash<std::string>{}(name)))};
  const auto len = [&](int64_t lo, int64_t hi) { return scaled(s.uniform(lo, hi), o.scale); };
  uint64_t piece = 0;
  const auto fresh = [&](uint64_t space) { return unique_id(space, o.seed, piece++); };
  const auto push = [&](const PromptBuilder& p, int64_t out) {
    w.requests.push_back(p.request(out));
    chains->push_back(p.blocks);
  };
  if (name == "chat") {
    for (int64_t i = 0; i < o.num_prompts; ++i) {
      PromptBuilder p(list);
      p.add(fresh(kSpaceChat), len(64, 512));
      push(p, len(64, 384));
    }
  } else if (name == "rag") {
    // A pool of passages with skewed popularity (the square of a uniform draw favours low ids).
    constexpr uint64_t kPassages = 200;
    const int64_t passage_words = scaled(512, o.scale);
    for (int64_t i = 0; i < o.num_prompts; ++i) {
      PromptBuilder p(list);
      p.add(kSpaceRag | 0, scaled(128, o.scale));  // the shared instruction
      const int64_t passages = s.uniform(4, 16);   // 2K-8K tokens of context
      for (int64_t k = 0; k < passages; ++k) {
        const double u = std::uniform_real_distribution<double>(0, 1)(s.rng);
        p.add(kSpaceRag | (1 + static_cast<uint64_t>(u * u * kPassages)), passage_words);
      }
      p.add(fresh(kSpaceRag), len(16, 64));  // the question
      push(p, len(32, 160));
    }
  } else if (name == "reasoning") {
    for (int64_t i = 0; i < o.num_prompts; ++i) {
      PromptBuilder p(list);
      p.add(fresh(kSpaceReasoning), len(32, 256));
      push(p, len(2048, 8192));
    }
  } else if (name == "agentic") {
    const int64_t system_words = scaled(1024, o.scale);  // system prompt and tool schemas
    while (static_cast<int64_t>(w.requests.size()) < o.num_prompts) {
      PromptBuilder p(list);
      p.add(kSpaceAgentic | 0, system_words);
      p.add(fresh(kSpaceAgentic), len(32, 128));  // the user's task
      const int64_t turns = s.uniform(5, 10);
      for (int64_t t = 0; t < turns && static_cast<int64_t>(w.requests.size()) < o.num_prompts; ++t) {
        if (t > 0) p.add(fresh(kSpaceAgentic), len(128, 1024));  // the tool's result
        const int64_t out = len(32, 256);
        push(p, out);
        if (t > 0) {
          w.requests.back().depends_on = static_cast<int64_t>(w.requests.size()) - 2;
        }
        p.add(fresh(kSpaceAgentic), out);  // the model's answer (a stand-in), re-sent next turn
      }
    }
  } else {
    return w;  // caller reports the unknown name
  }
  return w;
}

}  // namespace

Result<Workload> build_workload(const WorkloadOptions& o) {
  if (o.num_prompts <= 0) {
    return InvalidArgument(fmt::format("--num-prompts {} is not positive", o.num_prompts));
  }
  if (!(o.random_range_ratio >= 0 && o.random_range_ratio < 1)) {
    return InvalidArgument(
        fmt::format("--random-range-ratio {} is not in [0, 1)", o.random_range_ratio));
  }
  if (o.random_input_len <= 0 || o.random_output_len <= 0) {
    return InvalidArgument(fmt::format("--random-input-len {} / --random-output-len {}: lengths must be positive",
                                       o.random_input_len, o.random_output_len));
  }
  if (!(o.scale > 0) || !std::isfinite(o.scale)) {
    return InvalidArgument(fmt::format("--scale {} is not a positive number", o.scale));
  }
  WordList sized;
  if (o.tokenizer) {
    CLEAVE_ASSIGN_OR_RETURN(sized, one_token_words(*o.tokenizer));
  }
  const WordList& list = o.tokenizer ? sized : builtin_words();
  std::vector<std::vector<PromptBlock>> chains;
  Workload w;
  const std::string& d = o.dataset;
  if (d == "random") {
    w = random_workload(o, list, &chains);
  } else if (d.starts_with("preset:")) {
    const std::string name = d.substr(7);
    w = preset_workload(name, o, list, &chains);
    if (w.requests.empty()) {
      return InvalidArgument(fmt::format(
          "--dataset {}: unknown preset '{}' (chat, rag, reasoning or agentic)", d, name));
    }
  } else if (d.starts_with("trace:")) {
    CLEAVE_ASSIGN_OR_RETURN(w, trace_workload(d.substr(6), o, list, &chains));
  } else if (d.starts_with("sharegpt:")) {
    CLEAVE_ASSIGN_OR_RETURN(w, sharegpt_workload(d.substr(9), o, &chains));
  } else {
    return InvalidArgument(fmt::format(
        "--dataset '{}' is not random, preset:NAME, trace:FILE or sharegpt:FILE", d));
  }
  w.prefix_reuse = prefix_reuse(chains);
  return w;
}

}  // namespace cleave::bench
