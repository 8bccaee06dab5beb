#include <gtest/gtest.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <limits>
#include <numeric>
#include <random>
#include <vector>

#include "cleave/engine/sampler.h"

namespace cleave {
namespace {

constexpr float kInf = std::numeric_limits<float>::infinity();

SampleResult sample(std::vector<float> logits, const SamplingParams& p, uint64_t position = 0,
                    std::vector<int32_t> prompt = {}, std::vector<int32_t> generated = {},
                    std::vector<int32_t> suppress = {}) {
  return sample_token(logits, p, prompt, generated, position, suppress);
}

std::vector<double> softmax(const std::vector<float>& logits, double temperature) {
  double mx = *std::max_element(logits.begin(), logits.end());
  std::vector<double> p(logits.size());
  double sum = 0;
  for (size_t i = 0; i < logits.size(); ++i) sum += p[i] = std::exp((logits[i] - mx) / temperature);
  for (double& v : p) v /= sum;
  return p;
}

std::vector<float> logits_of(const std::vector<double>& probs) {
  std::vector<float> l;
  for (double p : probs) l.push_back(static_cast<float>(std::log(p)) + 3.0f);
  return l;
}

// Counts of each token over `n` positions.
std::vector<int> histogram(const std::vector<float>& logits, const SamplingParams& p, int n) {
  std::vector<int> counts(logits.size(), 0);
  for (int pos = 0; pos < n; ++pos) ++counts[sample(logits, p, pos).token];
  return counts;
}

double chi_square(const std::vector<int>& counts, const std::vector<double>& probs) {
  const double n = std::accumulate(counts.begin(), counts.end(), 0.0);
  double chi = 0;
  for (size_t i = 0; i < counts.size(); ++i) {
    if (probs[i] == 0) {
      EXPECT_EQ(counts[i], 0) << "token " << i << " has probability 0 but was drawn";
      continue;
    }
    const double e = n * probs[i];
    chi += (counts[i] - e) * (counts[i] - e) / e;
  }
  return chi;
}

TEST(SamplingUniform, DeterministicInRangeAndUniform) {
  EXPECT_EQ(sampling_uniform(42, 7), sampling_uniform(42, 7));
  EXPECT_NE(sampling_uniform(42, 7), sampling_uniform(43, 7));
  EXPECT_NE(sampling_uniform(42, 7), sampling_uniform(42, 8));
  // seed and position are not interchangeable.
  EXPECT_NE(sampling_uniform(1, 2), sampling_uniform(2, 1));
  // 20 equal bins over 100k positions: chi-square with 19 dof (p = 1e-4 at ~51).
  std::vector<int> bins(20, 0);
  const int n = 100000;
  for (int i = 0; i < n; ++i) {
    const double u = sampling_uniform(123, static_cast<uint64_t>(i));
    ASSERT_GE(u, 0.0);
    ASSERT_LT(u, 1.0);
    ++bins[static_cast<size_t>(u * 20)];
  }
  std::vector<double> flat(20, 1.0 / 20);
  EXPECT_LT(chi_square(bins, flat), 51.0);
}

TEST(SamplingUniform, PinnedValuesAreAWireContract) {
  // Workers resume each other's requests: these values must never change.
  auto bits = [](double u) { return static_cast<uint64_t>(u * 0x1.0p53); };
  const uint64_t a = bits(sampling_uniform(0, 0));
  const uint64_t b = bits(sampling_uniform(0xDEADBEEF, 12345));
  // Recomputed here from the documented formula.
  auto fmix = [](uint64_t z) {
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ULL;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBULL;
    return z ^ (z >> 31);
  };
  auto formula = [&](uint64_t seed, uint64_t pos) {
    return fmix(fmix(seed ^ 0xA0761D6478BD642FULL) ^ fmix(pos + 0x9E3779B97F4A7C15ULL)) >> 11;
  };
  EXPECT_EQ(a, formula(0, 0));
  EXPECT_EQ(b, formula(0xDEADBEEF, 12345));
}

TEST(Sampler, GreedyPicksArgmaxWithTiesToLowestId) {
  SamplingParams p;
  p.temperature = 0;
  EXPECT_EQ(sample({0.1f, 2.0f, -1.0f, 1.9f}, p).token, 1);
  EXPECT_EQ(sample({0.1f, 2.0f, 2.0f, 2.0f}, p).token, 1);
  EXPECT_EQ(sample({-kInf, -kInf, -3.0f}, p).token, 2);
  EXPECT_EQ(sample({std::nanf(""), 1.0f, 0.5f}, p).token, 1);
  // The seed and position do not matter.
  for (uint64_t pos = 0; pos < 50; ++pos) {
    p.seed = pos * 77;
    EXPECT_EQ(sample({0.3f, 0.2f, 0.31f, 0.1f}, p, pos).token, 2);
  }
}

TEST(Sampler, TopKOfOneIsGreedy) {
  SamplingParams p;
  p.temperature = 1.5f;
  p.top_k = 1;
  for (uint64_t pos = 0; pos < 200; ++pos) {
    EXPECT_EQ(sample({0.3f, 0.2f, 0.31f, 0.1f}, p, pos).token, 2);
  }
}

std::vector<float> random_logits(size_t vocab, uint64_t seed, float scale = 3.0f) {
  std::mt19937_64 rng(seed);
  std::normal_distribution<float> dist(0.0f, scale);
  std::vector<float> l(vocab);
  for (float& v : l) v = dist(rng);
  return l;
}

TEST(Sampler, SameSeedSameTokensDifferentSeedsDiffer) {
  const std::vector<float> logits = random_logits(1000, 5, 1.0f);
  SamplingParams a;
  a.temperature = 0.9f;
  a.seed = 1234;
  SamplingParams b = a;
  b.seed = 1235;
  int differ = 0;
  for (uint64_t pos = 0; pos < 500; ++pos) {
    const int32_t t1 = sample(logits, a, pos).token;
    const int32_t t2 = sample(logits, a, pos).token;
    EXPECT_EQ(t1, t2) << "position " << pos;
    if (sample(logits, b, pos).token != t1) ++differ;
  }
  EXPECT_GT(differ, 400);  // near-flat over 1000 ids: almost every draw differs
}

TEST(Sampler, SameSeedAndPositionIsIndependentOfCallHistory) {
  // Resumable: the token at position 17 does not depend on what was sampled before.
  const std::vector<float> logits = random_logits(300, 9, 1.0f);
  SamplingParams p;
  p.seed = 99;
  const int32_t fresh = sample(logits, p, 17).token;
  for (uint64_t pos = 0; pos < 17; ++pos) (void)sample(logits, p, pos);
  EXPECT_EQ(sample(logits, p, 17).token, fresh);
}

TEST(Sampler, EmpiricalDistributionMatchesSoftmaxOverTemperature) {
  const std::vector<float> logits = {1.0f, 0.5f, 2.0f, -1.0f, 0.0f, 1.5f, -0.5f, 0.7f};
  for (float t : {0.5f, 1.0f, 1.7f}) {
    SamplingParams p;
    p.temperature = t;
    p.seed = 2024;
    const std::vector<int> counts = histogram(logits, p, 40000);
    // 7 degrees of freedom; p-value 1e-4 at ~29.9. Deterministic: the draws are seeded.
    EXPECT_LT(chi_square(counts, softmax(logits, t)), 29.9) << "temperature " << t;
  }
}

TEST(Sampler, TopKExcludesAllButTheKMostLikely) {
  const std::vector<float> logits = {1.0f, 0.5f, 2.0f, -1.0f, 0.0f, 1.5f, -0.5f, 0.7f};
  SamplingParams p;
  p.top_k = 3;
  p.seed = 7;
  const std::vector<int> counts = histogram(logits, p, 30000);
  std::vector<float> kept = logits;
  for (size_t i : {1, 3, 4, 6, 7}) kept[i] = -kInf;
  // Renormalised over {0, 2, 5}; 2 dof, p = 1e-4 at ~18.4.
  EXPECT_LT(chi_square(counts, softmax(kept, 1.0)), 18.4);
  for (size_t i : {1, 3, 4, 6, 7}) EXPECT_EQ(counts[i], 0);
}

TEST(Sampler, TopPKeepsTheSmallestPrefixReachingP) {
  const std::vector<double> probs = {0.05, 0.5, 0.15, 0.3};  // sorted: 1, 3, 2, 0
  const std::vector<float> logits = logits_of(probs);
  SamplingParams p;
  p.seed = 11;
  p.top_p = 0.75f;  // 0.5 < 0.75 <= 0.8: keep {1, 3}
  std::vector<int> counts = histogram(logits, p, 20000);
  EXPECT_EQ(counts[0], 0);
  EXPECT_EQ(counts[2], 0);
  EXPECT_LT(chi_square(counts, {0, 0.5 / 0.8, 0, 0.3 / 0.8}), 15.1);  // 1 dof: p = 1e-4
  p.top_p = 0.9f;  // keep {1, 3, 2}
  counts = histogram(logits, p, 20000);
  EXPECT_EQ(counts[0], 0);
  EXPECT_GT(counts[2], 0);
  p.top_p = 0.3f;  // keep {1} only: at least one token
  counts = histogram(logits, p, 1000);
  EXPECT_EQ(counts[1], 1000);
}

TEST(Sampler, MinPKeepsTokensAboveFractionOfTheMax) {
  const std::vector<double> probs = {0.05, 0.5, 0.15, 0.3};
  const std::vector<float> logits = logits_of(probs);
  SamplingParams p;
  p.seed = 12;
  p.min_p = 0.2f;  // threshold 0.1: keep {1, 2, 3}
  std::vector<int> counts = histogram(logits, p, 20000);
  EXPECT_EQ(counts[0], 0);
  EXPECT_LT(chi_square(counts, {0, 0.5 / 0.95, 0.15 / 0.95, 0.3 / 0.95}), 18.4);
  p.min_p = 0.5f;  // threshold 0.25: keep {1, 3}
  counts = histogram(logits, p, 20000);
  EXPECT_EQ(counts[0] + counts[2], 0);
  EXPECT_GT(counts[3], 0);
}

TEST(Sampler, TruncationsCombineInOrder) {
  const std::vector<double> probs = {0.05, 0.4, 0.15, 0.3, 0.1};  // sorted: 1, 3, 2, 4, 0
  const std::vector<float> logits = logits_of(probs);
  SamplingParams p;
  p.seed = 3;
  p.top_k = 4;      // drops 0
  p.top_p = 0.8f;   // of {1,3,2,4} renormalised (0.421, 0.316, 0.158, 0.105): keeps 1, 3, 2
  p.min_p = 0.3f;   // threshold 0.12: keeps 1, 3, 2 (0.15 >= 0.12)
  std::vector<int> counts = histogram(logits, p, 20000);
  EXPECT_EQ(counts[0] + counts[4], 0);
  EXPECT_GT(counts[2], 0);
  p.min_p = 0.4f;  // threshold 0.16: drops 2 as well
  counts = histogram(logits, p, 20000);
  EXPECT_EQ(counts[0] + counts[4] + counts[2], 0);
}

// A straightforward full-sort reference for the truncations and the draw.
int32_t reference_sample(std::vector<float> logits, const SamplingParams& p, uint64_t pos) {
  std::vector<std::pair<float, int32_t>> c;
  for (size_t i = 0; i < logits.size(); ++i) {
    c.push_back({logits[i] / p.temperature, static_cast<int32_t>(i)});
  }
  std::sort(c.begin(), c.end(), [](auto& a, auto& b) {
    return a.first != b.first ? a.first > b.first : a.second < b.second;
  });
  size_t kept = c.size();
  if (p.top_k >= 1) kept = std::min(kept, static_cast<size_t>(p.top_k));
  const double mx = c[0].first;
  std::vector<double> w;
  for (size_t i = 0; i < kept; ++i) w.push_back(std::exp(c[i].first - mx));
  double total = std::accumulate(w.begin(), w.end(), 0.0);
  size_t n = 0;
  double before = 0;
  while (n < kept && (n == 0 || before < p.top_p * total)) before += w[n++];
  kept = n;
  size_t m = 0;
  while (m < kept && c[m].first >= mx + std::log(static_cast<double>(p.min_p))) ++m;
  kept = std::max<size_t>(m, 1);
  total = std::accumulate(w.begin(), w.begin() + static_cast<std::ptrdiff_t>(kept), 0.0);
  const double target = sampling_uniform(p.seed, pos) * total;
  double cum = 0;
  for (size_t i = 0; i < kept; ++i) {
    cum += w[i];
    if (cum > target) return c[i].second;
  }
  return c[kept - 1].second;
}

TEST(Sampler, MatchesAFullSortReference) {
  std::mt19937 rng(77);
  for (int trial = 0; trial < 300; ++trial) {
    const size_t vocab = 1 + rng() % 3000;
    std::vector<float> logits = random_logits(vocab, trial, 0.5f + (rng() % 8));
    // Ties exercise the id order.
    for (size_t i = 0; i + 1 < vocab; i += 7) logits[i + 1] = logits[i];
    SamplingParams p;
    p.seed = rng();
    p.temperature = 0.2f + static_cast<float>(rng() % 20) / 10.0f;
    const int kinds = trial % 5;
    if (kinds == 1 || kinds == 4) p.top_k = 1 + static_cast<int32_t>(rng() % 100);
    if (kinds == 2 || kinds == 4) p.top_p = 0.05f + static_cast<float>(rng() % 95) / 100.0f;
    if (kinds == 3 || kinds == 4) p.min_p = static_cast<float>(rng() % 50) / 100.0f;
    for (uint64_t pos = 0; pos < 20; ++pos) {
      ASSERT_EQ(sample(logits, p, pos).token, reference_sample(logits, p, pos))
          << "trial " << trial << " vocab " << vocab << " position " << pos;
    }
  }
}

TEST(Sampler, RepetitionPenaltyFollowsTheFormulaOncePerToken) {
  std::vector<float> logits = {2.0f, -1.0f, 0.5f, 3.0f, -2.0f};
  SamplingParams p;
  p.temperature = 0;
  p.repetition_penalty = 2.0f;
  const std::vector<int32_t> prompt = {0, 1, 0, 0};
  const std::vector<int32_t> generated = {4};
  (void)sample_token(logits, p, prompt, generated, 0, {});
  EXPECT_FLOAT_EQ(logits[0], 1.0f);    // positive: divided, once despite 3 occurrences
  EXPECT_FLOAT_EQ(logits[1], -2.0f);   // negative: multiplied
  EXPECT_FLOAT_EQ(logits[2], 0.5f);    // not seen
  EXPECT_FLOAT_EQ(logits[3], 3.0f);
  EXPECT_FLOAT_EQ(logits[4], -4.0f);   // generated counts too
}

TEST(Sampler, PresenceAndFrequencyPenaltiesCountGeneratedOnly) {
  std::vector<float> logits = {2.0f, -1.0f, 0.5f, 3.0f, -2.0f};
  SamplingParams p;
  p.temperature = 0;
  p.presence_penalty = 0.5f;
  p.frequency_penalty = 0.25f;
  const std::vector<int32_t> prompt = {0, 1};
  const std::vector<int32_t> generated = {3, 3, 3, 2, 99, -1};  // out of range ids ignored
  const SampleResult r = sample_token(logits, p, prompt, generated, 0, {});
  EXPECT_FLOAT_EQ(logits[0], 2.0f);                      // prompt only: untouched
  EXPECT_FLOAT_EQ(logits[1], -1.0f);
  EXPECT_FLOAT_EQ(logits[2], 0.5f - 0.25f - 0.5f);
  EXPECT_FLOAT_EQ(logits[3], 3.0f - 3 * 0.25f - 0.5f);
  EXPECT_FLOAT_EQ(logits[4], -2.0f);
  EXPECT_EQ(r.token, 0);  // 3 fell to 1.75 < 2
}

TEST(Sampler, RepetitionThenAdditivePenalties) {
  std::vector<float> logits = {4.0f, 1.0f};
  SamplingParams p;
  p.temperature = 0;
  p.repetition_penalty = 1.6f;
  p.frequency_penalty = -1.0f;  // negative: encourages
  const std::vector<int32_t> generated = {0, 0};
  (void)sample_token(logits, p, {}, generated, 0, {});
  EXPECT_FLOAT_EQ(logits[0], 4.0f / 1.6f + 2.0f);
  // Scratch is clean for the next call: no penalties leak.
  std::vector<float> again = {4.0f, 1.0f};
  SamplingParams none;
  none.temperature = 0;
  (void)sample_token(again, none, {}, {}, 0, {});
  EXPECT_FLOAT_EQ(again[0], 4.0f);
  // And counts do not accumulate across calls.
  std::vector<float> third = {4.0f, 1.0f};
  (void)sample_token(third, p, {}, generated, 0, {});
  EXPECT_FLOAT_EQ(third[0], 4.0f / 1.6f + 2.0f);
}

TEST(Sampler, SuppressedIdsAreNeverChosen) {
  const std::vector<float> logits = {0.0f, 5.0f, 4.9f, 0.1f};
  SamplingParams greedy;
  greedy.temperature = 0;
  EXPECT_EQ(sample(logits, greedy, 0, {}, {}, {1}).token, 2);
  SamplingParams p;
  p.temperature = 2.0f;
  for (uint64_t pos = 0; pos < 2000; ++pos) {
    EXPECT_NE(sample(logits, p, pos, {}, {}, {1, 3}).token, 1);
    EXPECT_NE(sample(logits, p, pos, {}, {}, {1, 3}).token, 3);
  }
}

TEST(Sampler, NanLogitsAreNeverSampled) {
  const std::vector<float> logits = {std::nanf(""), 0.0f, std::nanf(""), 0.0f};
  SamplingParams p;
  for (uint64_t pos = 0; pos < 500; ++pos) {
    const int32_t t = sample(logits, p, pos).token;
    EXPECT_TRUE(t == 1 || t == 3);
  }
}

TEST(Sampler, LogprobsAreFromTheRawDistribution) {
  const std::vector<float> raw = random_logits(500, 31, 2.0f);
  std::vector<double> probs = softmax(raw, 1.0);
  SamplingParams p;
  p.temperature = 0.6f;
  p.top_k = 5;
  p.repetition_penalty = 1.3f;
  p.presence_penalty = 1.0f;
  p.logprobs = 20;
  std::vector<int32_t> generated;
  for (uint64_t pos = 0; pos < 50; ++pos) {
    std::vector<float> logits = raw;
    const SampleResult r = sample_token(logits, p, {}, generated, pos, {});
    EXPECT_NEAR(r.logprob, std::log(probs[static_cast<size_t>(r.token)]), 1e-4);
    ASSERT_EQ(r.top.size(), 20u);
    std::vector<size_t> order(raw.size());
    std::iota(order.begin(), order.end(), 0);
    std::stable_sort(order.begin(), order.end(), [&](size_t a, size_t b) { return raw[a] > raw[b]; });
    for (size_t i = 0; i < 20; ++i) {
      EXPECT_EQ(r.top[i].token, static_cast<int32_t>(order[i]));
      EXPECT_NEAR(r.top[i].logprob, std::log(probs[order[i]]), 1e-4);
    }
    generated.push_back(r.token);  // penalised next time: logprob must still be raw
  }
}

TEST(Sampler, LogprobsNormaliseAndZeroMeansChosenOnly) {
  const std::vector<float> raw = {1.0f, 2.0f, 3.0f, -kInf};
  SamplingParams p;
  p.logprobs = 4;
  const SampleResult r = sample(raw, p, 3);
  ASSERT_EQ(r.top.size(), 4u);
  double total = 0;
  for (const TokenLogprob& t : r.top) total += std::exp(t.logprob);
  EXPECT_NEAR(total, 1.0, 1e-6);
  EXPECT_EQ(r.top[0].token, 2);
  EXPECT_EQ(r.top[3].token, 3);
  EXPECT_EQ(r.top[3].logprob, -kInf);
  p.logprobs = 0;
  const SampleResult chosen_only = sample(raw, p, 3);
  EXPECT_TRUE(chosen_only.top.empty());
  EXPECT_LT(chosen_only.logprob, 0.0f);
  EXPECT_NEAR(chosen_only.logprob, std::log(softmax({1.0f, 2.0f, 3.0f}, 1.0)[chosen_only.token]),
              1e-5);
  p.logprobs = -1;
  EXPECT_EQ(sample(raw, p, 3).logprob, 0.0f);
}

TEST(Sampler, LargeVocabularyTopKIsFastAndCorrect) {
  const size_t vocab = 256 * 1024;
  const std::vector<float> raw = random_logits(vocab, 3, 2.0f);
  SamplingParams p;
  p.top_k = 40;
  p.top_p = 0.95f;
  p.seed = 5;
  std::vector<float> sorted = raw;
  std::nth_element(sorted.begin(), sorted.begin() + 39, sorted.end(), std::greater<>());
  const float kth = sorted[39];
  std::vector<float> logits;
  const auto start = std::chrono::steady_clock::now();
  const int calls = 50;
  for (int pos = 0; pos < calls; ++pos) {
    logits = raw;
    const int32_t t = sample_token(logits, p, {}, {}, static_cast<uint64_t>(pos), {}).token;
    ASSERT_GE(raw[static_cast<size_t>(t)], kth);
  }
  const double ms = std::chrono::duration<double, std::milli>(
                        std::chrono::steady_clock::now() - start).count() / calls;
  std::printf("256K vocab, top_k 40 + top_p: %.3f ms per token\n", ms);
}

TEST(StopTokens, SuppressionBeforeMinTokensAndStopChecks) {
  SamplingParams p;
  p.min_tokens = 2;
  p.stop_token_ids = {7, 2};
  const std::vector<int32_t> eos = {2};
  EXPECT_EQ(tokens_to_suppress(p, eos, 0), (std::vector<int32_t>{2, 7}));
  EXPECT_EQ(tokens_to_suppress(p, eos, 1), (std::vector<int32_t>{2, 7}));
  EXPECT_TRUE(tokens_to_suppress(p, eos, 2).empty());
  EXPECT_FALSE(is_stop_token(2, p, eos, 1));
  EXPECT_TRUE(is_stop_token(2, p, eos, 2));
  EXPECT_TRUE(is_stop_token(7, p, eos, 3));
  EXPECT_FALSE(is_stop_token(5, p, eos, 3));
  p.ignore_eos = true;
  p.stop_token_ids = {7};
  EXPECT_FALSE(is_stop_token(2, p, eos, 3));  // EOS ignored
  EXPECT_TRUE(is_stop_token(7, p, eos, 3));   // explicit stop ids still stop
  EXPECT_EQ(tokens_to_suppress(p, eos, 0), (std::vector<int32_t>{7}));
}

void expect_invalid(const SamplingParams& p, const std::string& field) {
  const Status s = p.validate(100);
  EXPECT_EQ(s.code(), StatusCode::kInvalidArgument) << field;
  EXPECT_NE(s.message().find(field), std::string::npos) << s.message();
}

TEST(SamplingParamsValidate, AcceptsDefaultsAndEdges) {
  SamplingParams p;
  EXPECT_TRUE(p.validate(100).ok());
  p.temperature = 0;
  p.top_k = -1;
  p.top_p = 1.0f;
  p.min_p = 1.0f;
  p.presence_penalty = -2.0f;
  p.frequency_penalty = 2.0f;
  p.logprobs = 20;
  p.max_tokens = 1;
  p.min_tokens = 1;
  p.stop = std::vector<std::string>(16, "x");
  p.stop_token_ids = {0, 99};
  EXPECT_TRUE(p.validate(100).ok()) << p.validate(100).to_string();
}

TEST(SamplingParamsValidate, RejectsEachFieldByName) {
  auto with = [](auto mutate) {
    SamplingParams p;
    mutate(p);
    return p;
  };
  expect_invalid(with([](SamplingParams& p) { p.temperature = -0.1f; }), "temperature");
  expect_invalid(with([](SamplingParams& p) { p.temperature = std::nanf(""); }), "temperature");
  expect_invalid(with([](SamplingParams& p) { p.top_p = 0.0f; }), "top_p");
  expect_invalid(with([](SamplingParams& p) { p.top_p = 1.01f; }), "top_p");
  expect_invalid(with([](SamplingParams& p) { p.top_k = -2; }), "top_k");
  expect_invalid(with([](SamplingParams& p) { p.min_p = -0.1f; }), "min_p");
  expect_invalid(with([](SamplingParams& p) { p.min_p = 1.5f; }), "min_p");
  expect_invalid(with([](SamplingParams& p) { p.presence_penalty = 2.5f; }), "presence_penalty");
  expect_invalid(with([](SamplingParams& p) { p.frequency_penalty = -2.5f; }),
                 "frequency_penalty");
  expect_invalid(with([](SamplingParams& p) { p.repetition_penalty = 0.0f; }),
                 "repetition_penalty");
  expect_invalid(with([](SamplingParams& p) { p.logprobs = 21; }), "logprobs");
  expect_invalid(with([](SamplingParams& p) { p.logprobs = -2; }), "logprobs");
  expect_invalid(with([](SamplingParams& p) { p.max_tokens = 0; }), "max_tokens");
  expect_invalid(with([](SamplingParams& p) { p.min_tokens = 17; }), "min_tokens");
  expect_invalid(with([](SamplingParams& p) { p.min_tokens = -1; }), "min_tokens");
  expect_invalid(with([](SamplingParams& p) { p.stop = std::vector<std::string>(17, "x"); }),
                 "stop");
  expect_invalid(with([](SamplingParams& p) { p.stop = {"ok", ""}; }), "stop");
  expect_invalid(with([](SamplingParams& p) { p.stop_token_ids = {100}; }), "stop_token_ids");
  expect_invalid(with([](SamplingParams& p) { p.stop_token_ids = {-1}; }), "stop_token_ids");
  EXPECT_FALSE(SamplingParams{}.validate(0).ok());
}

}  // namespace
}  // namespace cleave
