// Worker choice: round robin, power of two choices, prefix aware.
#include "cleave/router/dispatch_policy.h"

#include <algorithm>

namespace cleave::router {

bool less_loaded(const WorkerCandidate& a, const WorkerCandidate& b) {
  if (a.load != b.load) return a.load < b.load;
  return a.kv_usage < b.kv_usage;
}

size_t RoundRobinPolicy::pick(std::span<const WorkerCandidate> candidates,
                              std::span<const uint64_t> /*block_hashes*/) {
  return static_cast<size_t>(next_++ % candidates.size());
}

size_t LeastLoadedPolicy::pick(std::span<const WorkerCandidate> candidates,
                               std::span<const uint64_t> /*block_hashes*/) {
  const size_t n = candidates.size();
  if (n <= 1) return 0;
  const size_t a = static_cast<size_t>(rng_() % n);
  size_t b = static_cast<size_t>(rng_() % (n - 1));
  if (b >= a) ++b;  // distinct from a, uniform over the others
  return less_loaded(candidates[b], candidates[a]) ? b : a;
}

PrefixAwarePolicy::PrefixAwarePolicy(uint64_t seed, int64_t blocks_per_worker, int64_t load_slack)
    : fallback_(seed),
      capacity_(static_cast<size_t>(std::max<int64_t>(1, blocks_per_worker))),
      load_slack_(std::max<int64_t>(0, load_slack)) {}

size_t PrefixAwarePolicy::matched_blocks(uint64_t worker,
                                         std::span<const uint64_t> block_hashes) const {
  auto it = recent_.find(worker);
  if (it == recent_.end()) return 0;
  // Each hash names its whole prefix, so the last remembered one gives the match length.
  for (size_t i = block_hashes.size(); i > 0; --i) {
    if (it->second.where.count(block_hashes[i - 1]) > 0) return i;
  }
  return 0;
}

size_t PrefixAwarePolicy::remembered(uint64_t worker) const {
  auto it = recent_.find(worker);
  return it == recent_.end() ? 0 : it->second.order.size();
}

size_t PrefixAwarePolicy::pick(std::span<const WorkerCandidate> candidates,
                               std::span<const uint64_t> block_hashes) {
  if (candidates.size() <= 1) return 0;
  if (!block_hashes.empty()) {
    int64_t min_load = candidates[0].load;
    for (const WorkerCandidate& c : candidates) min_load = std::min(min_load, c.load);
    size_t best = candidates.size();
    size_t best_match = 0;
    for (size_t i = 0; i < candidates.size(); ++i) {
      if (candidates[i].load > min_load + load_slack_) continue;
      const size_t m = matched_blocks(candidates[i].worker, block_hashes);
      if (m == 0) continue;
      if (m > best_match || (m == best_match && less_loaded(candidates[i], candidates[best]))) {
        best = i;
        best_match = m;
      }
    }
    if (best < candidates.size()) return best;
  }
  return fallback_.pick(candidates, block_hashes);
}

void PrefixAwarePolicy::routed(uint64_t worker, std::span<const uint64_t> block_hashes) {
  if (block_hashes.empty()) return;
  Recent& r = recent_[worker];
  // Deepest block first, so that a prompt's first blocks end up the most recent ones: a
  // shared system prompt outlives the tails that follow it.
  for (size_t i = block_hashes.size(); i > 0; --i) {
    const uint64_t h = block_hashes[i - 1];
    auto it = r.where.find(h);
    if (it != r.where.end()) {
      r.order.splice(r.order.begin(), r.order, it->second);
    } else {
      r.order.push_front(h);
      r.where.emplace(h, r.order.begin());
    }
  }
  while (r.order.size() > capacity_) {
    r.where.erase(r.order.back());
    r.order.pop_back();
  }
}

void PrefixAwarePolicy::forget(uint64_t worker) { recent_.erase(worker); }

std::unique_ptr<DispatchPolicy> make_dispatch_policy(DispatchPolicyKind kind,
                                                     const DispatcherOptions& options,
                                                     uint64_t seed) {
  switch (kind) {
    case DispatchPolicyKind::kRoundRobin: return std::make_unique<RoundRobinPolicy>();
    case DispatchPolicyKind::kLeastLoaded: return std::make_unique<LeastLoadedPolicy>(seed);
    case DispatchPolicyKind::kPrefixAware:
      return std::make_unique<PrefixAwarePolicy>(seed, options.prefix_blocks_per_worker,
                                                 options.prefix_load_slack);
  }
  return std::make_unique<RoundRobinPolicy>();
}

}  // namespace cleave::router
