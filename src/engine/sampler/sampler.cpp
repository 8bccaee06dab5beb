// sample_token: penalties, suppression, temperature, top-k / top-p / min-p and the seeded
// inverse-CDF draw. See include/cleave/engine/sampler.h for the order of operations.
#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>

#include "cleave/engine/sampler.h"

namespace cleave {
namespace {

constexpr float kNegInf = -std::numeric_limits<float>::infinity();

uint64_t fmix64(uint64_t z) {
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ULL;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBULL;
  return z ^ (z >> 31);
}

struct Candidate {
  float logit;
  int32_t id;
};

// A candidate with its unnormalised probability exp(logit - max_logit).
struct Weighted {
  float logit;
  int32_t id;
  double weight;
};

// The fixed sampling order: logit descending, ties by id ascending. A strict total order, so
// every selection below has a unique answer for given logits.
template <typename T>
bool comes_before(const T& a, const T& b) {
  if (a.logit != b.logit) return a.logit > b.logit;
  return a.id < b.id;
}

// Cumulative mass in sampling order: f(j) = weight of the j+1 first candidates. Returns the
// smallest j in [0, n) with f(j) > target (strict) or f(j) >= target (!strict), or n - 1 when
// rounding leaves no such j. Afterwards items[0, j] are the j+1 first candidates in sampling
// order (in no particular order among themselves).
//
// O(n), no full sort: candidates are bucketed by logit into equal-width buckets (bucket order
// is sampling order, since the bucket index is monotone in the logit); the bucket where the
// cumulative mass crosses the target is found from per-bucket sums, and only that bucket is
// sorted and walked. Deterministic: the same items in the same order give the same answer.
constexpr size_t kBuckets = 4096;

struct BucketScratch {
  std::vector<double> mass = std::vector<double>(kBuckets);
  std::vector<uint32_t> count = std::vector<uint32_t>(kBuckets);
  std::vector<Weighted> reordered;
};

size_t walk_sorted(std::span<Weighted> items, size_t lo, size_t hi, double before, double target,
                   bool strict) {
  std::sort(items.begin() + static_cast<std::ptrdiff_t>(lo),
            items.begin() + static_cast<std::ptrdiff_t>(hi), comes_before<Weighted>);
  for (size_t j = lo; j < hi; ++j) {
    before += items[j].weight;
    if (strict ? before > target : before >= target) return j;
  }
  return hi == 0 ? 0 : hi - 1;
}

size_t find_crossing(std::span<Weighted> items, double target, bool strict, BucketScratch& s) {
  const size_t n = items.size();
  if (n <= 256) return walk_sorted(items, 0, n, 0.0, target, strict);
  float hi_logit = items[0].logit, lo_logit = items[0].logit;
  for (const Weighted& c : items) {
    const float v = c.logit;
    hi_logit = v > hi_logit ? v : hi_logit;
    lo_logit = v < lo_logit ? v : lo_logit;
  }
  const double range = static_cast<double>(hi_logit) - lo_logit;
  if (!(range > 0)) return walk_sorted(items, 0, n, 0.0, target, strict);  // all equal
  const double scale = static_cast<double>(kBuckets) / range;
  auto bucket_of = [&](const Weighted& c) {
    const auto b = static_cast<size_t>((static_cast<double>(hi_logit) - c.logit) * scale);
    return std::min(b, kBuckets - 1);
  };
  std::fill(s.mass.begin(), s.mass.end(), 0.0);
  std::fill(s.count.begin(), s.count.end(), 0u);
  for (const Weighted& c : items) {
    const size_t b = bucket_of(c);
    s.mass[b] += c.weight;
    ++s.count[b];
  }
  // The crossing bucket (the last non-empty one if rounding leaves none).
  double before = 0;
  size_t cb = kBuckets;
  size_t last_nonempty = 0;
  for (size_t b = 0; b < kBuckets; ++b) {
    if (s.count[b] == 0) continue;
    last_nonempty = b;
    const double after = before + s.mass[b];
    if (strict ? after > target : after >= target) {
      cb = b;
      break;
    }
    before = after;
  }
  if (cb == kBuckets) {
    cb = last_nonempty;
    before -= s.mass[cb];
  }
  // Stable three-way split: buckets before cb, then cb, then the rest.
  size_t n_before = 0;
  for (size_t b = 0; b < cb; ++b) n_before += s.count[b];
  const size_t n_cb = s.count[cb];
  s.reordered.resize(n);
  size_t i0 = 0, i1 = n_before, i2 = n_before + n_cb;
  for (const Weighted& c : items) {
    const size_t b = bucket_of(c);
    size_t& dst = b < cb ? i0 : (b == cb ? i1 : i2);
    s.reordered[dst++] = c;
  }
  std::copy(s.reordered.begin(), s.reordered.end(), items.begin());
  return walk_sorted(items, n_before, n_before + n_cb, before, target, strict);
}

// Per-thread scratch reused across calls (vocabularies up to a few hundred thousand ids).
struct Scratch {
  std::vector<Weighted> candidates;
  BucketScratch buckets;
  std::vector<int32_t> generated_count;  // per id, zero between calls
  std::vector<uint8_t> seen;             // per id: in prompt or generated; zero between calls
  std::vector<int32_t> touched;          // ids whose counters were set in this call
  std::vector<Candidate> saved_raw;      // raw logits of penalised ids (for logprobs)
};

Scratch& scratch() {
  thread_local Scratch s;
  return s;
}

bool is_valid_id(int32_t id, size_t vocab) {
  return id >= 0 && static_cast<size_t>(id) < vocab;
}

// Applies repetition, frequency and presence penalties in place; records the raw logit of every
// changed id in s.saved_raw.
void apply_penalties(std::span<float> logits, const SamplingParams& p,
                     std::span<const int32_t> prompt_tokens, std::span<const int32_t> generated,
                     Scratch& s) {
  const size_t vocab = logits.size();
  const bool repetition = p.repetition_penalty != 1.0f;
  const bool additive = p.presence_penalty != 0.0f || p.frequency_penalty != 0.0f;
  s.saved_raw.clear();
  if (!repetition && !additive) return;
  if (s.generated_count.size() < vocab) {
    s.generated_count.resize(vocab, 0);
    s.seen.resize(vocab, 0);
  }
  s.touched.clear();
  auto touch = [&](int32_t id) {
    if (!s.seen[id]) {
      s.seen[id] = 1;
      s.touched.push_back(id);
    }
  };
  if (repetition) {
    for (int32_t id : prompt_tokens) {
      if (is_valid_id(id, vocab)) touch(id);
    }
  }
  for (int32_t id : generated) {
    if (!is_valid_id(id, vocab)) continue;
    touch(id);
    ++s.generated_count[id];
  }
  for (int32_t id : s.touched) {
    float& logit = logits[static_cast<size_t>(id)];
    s.saved_raw.push_back({logit, id});
    if (repetition) {
      logit = logit > 0 ? logit / p.repetition_penalty : logit * p.repetition_penalty;
    }
    const int32_t count = s.generated_count[id];
    if (additive && count > 0) {
      logit -= p.frequency_penalty * static_cast<float>(count) + p.presence_penalty;
    }
  }
  for (int32_t id : s.touched) {
    s.seen[id] = 0;
    s.generated_count[id] = 0;
  }
}

// log(sum(exp(raw))) over non-NaN logits, in double.
double log_sum_exp(std::span<const float> logits) {
  float max_logit = kNegInf;
  for (float v : logits) {
    if (v > max_logit) max_logit = v;  // NaN compares false
  }
  if (max_logit == kNegInf) return kNegInf;
  double sum = 0;
  for (float v : logits) {
    if (v == v) sum += std::exp(static_cast<double>(v) - max_logit);
  }
  return max_logit + std::log(sum);
}

// The n most likely ids by raw logit (ties by id ascending), most likely first.
void top_logprobs(std::span<const float> logits, int32_t n, double lse,
                  std::vector<TokenLogprob>& out) {
  out.clear();
  if (n <= 0) return;
  Candidate best[kMaxLogprobs];
  const size_t want = std::min(static_cast<size_t>(std::min(n, kMaxLogprobs)), logits.size());
  size_t have = 0;
  for (size_t i = 0; i < logits.size(); ++i) {
    const Candidate c{logits[i], static_cast<int32_t>(i)};
    if (c.logit != c.logit) continue;  // NaN
    if (have == want && !comes_before(c, best[have - 1])) continue;
    size_t pos = have < want ? have++ : want - 1;
    while (pos > 0 && comes_before(c, best[pos - 1])) {
      best[pos] = best[pos - 1];
      --pos;
    }
    best[pos] = c;
  }
  out.reserve(have);
  for (size_t i = 0; i < have; ++i) {
    out.push_back({best[i].id, static_cast<float>(best[i].logit - lse)});
  }
}

int32_t argmax_lowest_id(std::span<const float> logits) {
  int32_t best = 0;
  float best_logit = kNegInf;
  bool found = false;
  for (size_t i = 0; i < logits.size(); ++i) {
    const float v = logits[i];
    if (v != v) continue;
    if (!found || v > best_logit) {
      best = static_cast<int32_t>(i);
      best_logit = v;
      found = true;
    }
  }
  return best;
}

float max_candidate_logit(std::span<const Weighted> cands) {
  float m = kNegInf;
  for (const Weighted& c : cands) m = c.logit > m ? c.logit : m;
  return m;
}

// Builds the candidate set from logits / temperature, truncates it with top-k, top-p and
// min-p, and draws with u. Every truncation keeps a prefix in sampling order; selections are
// O(n) expected (nth_element, weighted quickselect), never a full sort of the vocabulary.
int32_t sample_truncated(std::span<const float> logits, const SamplingParams& p, double u,
                         Scratch& s) {
  std::vector<Weighted>& cands = s.candidates;
  cands.clear();
  const float temperature = p.temperature;
  const bool small_top_k = p.top_k >= 1 && static_cast<size_t>(p.top_k) < logits.size() / 8;
  if (small_top_k) {
    // A bounded heap whose front is the worst kept candidate: one compare per logit.
    const size_t k = static_cast<size_t>(p.top_k);
    for (size_t i = 0; i < logits.size(); ++i) {
      const float v = logits[i];
      if (!(v > kNegInf)) continue;  // drops -inf and NaN
      const Weighted c{v / temperature, static_cast<int32_t>(i), 0.0};
      if (cands.size() < k) {
        cands.push_back(c);
        std::push_heap(cands.begin(), cands.end(), comes_before<Weighted>);
      } else if (comes_before(c, cands.front())) {
        std::pop_heap(cands.begin(), cands.end(), comes_before<Weighted>);
        cands.back() = c;
        std::push_heap(cands.begin(), cands.end(), comes_before<Weighted>);
      }
    }
  } else {
    for (size_t i = 0; i < logits.size(); ++i) {
      const float v = logits[i];
      if (v > kNegInf) cands.push_back({v / temperature, static_cast<int32_t>(i), 0.0});
    }
  }
  if (cands.empty()) return 0;
  const float max_logit = max_candidate_logit(cands);
  if (std::isinf(max_logit)) {  // a +inf logit is certain (lowest such id)
    int32_t id = std::numeric_limits<int32_t>::max();
    for (const Weighted& c : cands) {
      if (c.logit == max_logit) id = std::min(id, c.id);
    }
    return id;
  }

  size_t kept = cands.size();
  if (!small_top_k && p.top_k >= 1 && static_cast<size_t>(p.top_k) < kept) {
    kept = static_cast<size_t>(p.top_k);
    std::nth_element(cands.begin(), cands.begin() + static_cast<std::ptrdiff_t>(kept - 1),
                     cands.end(), comes_before<Weighted>);
  }
  double mass = 0;
  for (size_t i = 0; i < kept; ++i) {
    cands[i].weight = std::exp(static_cast<double>(cands[i].logit) - max_logit);
    mass += cands[i].weight;
  }
  std::span<Weighted> set(cands.data(), kept);

  if (p.top_p < 1.0f) {
    // Keep candidate j while the mass before it is < top_p: up to the first j whose cumulative
    // mass reaches top_p (at least one).
    const size_t last = find_crossing(set, static_cast<double>(p.top_p) * mass, false, s.buckets);
    set = set.first(last + 1);
    mass = 0;
    for (const Weighted& c : set) mass += c.weight;
  }

  if (p.min_p > 0.0f) {
    // p_i >= min_p * p_max  <=>  logit_i >= max_logit + log(min_p); the max is always kept.
    const double threshold = max_logit + std::log(static_cast<double>(p.min_p));
    auto end = std::partition(set.begin(), set.end(),
                              [&](const Weighted& c) { return c.logit >= threshold; });
    set = set.first(std::max<size_t>(static_cast<size_t>(end - set.begin()), 1));
    mass = 0;
    for (const Weighted& c : set) mass += c.weight;
  }

  // Inverse CDF in sampling order.
  return set[find_crossing(set, u * mass, true, s.buckets)].id;
}

}  // namespace

double sampling_uniform(uint64_t seed, uint64_t position) {
  const uint64_t h = fmix64(fmix64(seed ^ 0xA0761D6478BD642FULL) ^
                            fmix64(position + 0x9E3779B97F4A7C15ULL));
  return static_cast<double>(h >> 11) * 0x1.0p-53;
}

SampleResult sample_token(std::span<float> logits, const SamplingParams& params,
                          std::span<const int32_t> prompt_tokens,
                          std::span<const int32_t> generated, uint64_t position,
                          std::span<const int32_t> suppress) {
  SampleResult result;
  if (logits.empty()) return result;
  Scratch& s = scratch();
  const size_t vocab = logits.size();

  double lse = 0;
  const bool want_logprobs = params.logprobs >= 0;
  if (want_logprobs) {
    lse = log_sum_exp(logits);
    top_logprobs(logits, params.logprobs, lse, result.top);
  }

  apply_penalties(logits, params, prompt_tokens, generated, s);
  for (int32_t id : suppress) {
    if (!is_valid_id(id, vocab)) continue;
    float& logit = logits[static_cast<size_t>(id)];
    if (want_logprobs) s.saved_raw.push_back({logit, id});  // after penalised ids: not used first
    logit = kNegInf;
  }

  if (params.temperature < kGreedyTemperature) {
    result.token = argmax_lowest_id(logits);
  } else {
    result.token = sample_truncated(logits, params, sampling_uniform(params.seed, position), s);
  }

  if (want_logprobs) {
    // The raw logit of the chosen token: changed ids had their raw value saved (first entry).
    float raw = logits[static_cast<size_t>(result.token)];
    for (const Candidate& c : s.saved_raw) {
      if (c.id == result.token) {
        raw = c.logit;
        break;
      }
    }
    result.logprob = static_cast<float>(raw - lse);
  }
  return result;
}

SampleResult token_logprob(std::span<const float> logits, int32_t token, int32_t top_n) {
  SampleResult result;
  result.token = token;
  const double lse = log_sum_exp(logits);
  top_logprobs(logits, top_n, lse, result.top);
  result.logprob = static_cast<float>(logits[static_cast<size_t>(token)] - lse);
  return result;
}

}  // namespace cleave
