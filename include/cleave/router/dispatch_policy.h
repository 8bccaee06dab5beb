// The policies that pick one worker of a pool for a request (dispatch_options.h describes them
// for operators): round robin, least loaded by the power of two choices, and prefix aware.
//
// A policy sees only candidates: the pool's ready workers that the request may use, each with
// a stable key and its load. It keeps no reference to workers; forget() drops what it holds
// about one (the worker left the pool or restarted with an empty cache).
//
// Thread-safety: a policy is not thread-safe; its owner serializes every call (the dispatcher
// calls it under its pool lock). pick() does no I/O and allocates nothing but, for
// prefix_aware, routed() keeps the block hashes it is given.
#pragma once

#include <cstddef>
#include <cstdint>
#include <list>
#include <memory>
#include <random>
#include <span>
#include <unordered_map>

#include "cleave/router/dispatch_options.h"

namespace cleave::router {

struct WorkerCandidate {
  uint64_t worker = 0;  // stable key of the worker in the dispatcher
  int64_t load = 0;     // requests waiting + running on it, as the router knows them
  double kv_usage = 0;  // blocks used / blocks total, 0..1
};

// Lower load first, then lower KV usage.
bool less_loaded(const WorkerCandidate& a, const WorkerCandidate& b);

class DispatchPolicy {
 public:
  virtual ~DispatchPolicy() = default;
  // The index in `candidates` (not empty) of the worker to use. `block_hashes`: the prompt's
  // full-block hash chain (hash_full_blocks); only prefix_aware reads it.
  virtual size_t pick(std::span<const WorkerCandidate> candidates,
                      std::span<const uint64_t> block_hashes) = 0;
  // A request with `block_hashes` went to `worker`.
  virtual void routed(uint64_t worker, std::span<const uint64_t> block_hashes) {
    (void)worker;
    (void)block_hashes;
  }
  // Drops what the policy knows about `worker`.
  virtual void forget(uint64_t worker) { (void)worker; }
  // Whether pick() reads block hashes (the caller computes them only then).
  virtual bool wants_block_hashes() const { return false; }
};

// Each candidate in turn: the n-th pick returns n mod candidates.size().
class RoundRobinPolicy final : public DispatchPolicy {
 public:
  size_t pick(std::span<const WorkerCandidate> candidates,
              std::span<const uint64_t> block_hashes) override;

 private:
  uint64_t next_ = 0;
};

// Power of two choices: two distinct candidates drawn at random (seeded), the less loaded one
// wins (less_loaded; a tie goes to the first drawn). One candidate: it.
class LeastLoadedPolicy final : public DispatchPolicy {
 public:
  explicit LeastLoadedPolicy(uint64_t seed) : rng_(seed) {}
  size_t pick(std::span<const WorkerCandidate> candidates,
              std::span<const uint64_t> block_hashes) override;

 private:
  std::mt19937_64 rng_;
};

// Remembers, per worker, the block hashes of the prompts recently routed to it (at most
// `blocks_per_worker`, the least recently routed dropped first). pick(): the candidate holding
// the longest prefix of `block_hashes` among those whose load is at most the least loaded
// candidate's + `load_slack` (ties: less_loaded, then the first); when none holds even the
// first block, least_loaded.
class PrefixAwarePolicy final : public DispatchPolicy {
 public:
  PrefixAwarePolicy(uint64_t seed, int64_t blocks_per_worker, int64_t load_slack);
  size_t pick(std::span<const WorkerCandidate> candidates,
              std::span<const uint64_t> block_hashes) override;
  void routed(uint64_t worker, std::span<const uint64_t> block_hashes) override;
  void forget(uint64_t worker) override;
  bool wants_block_hashes() const override { return true; }

  // How many leading blocks of `block_hashes` `worker` is remembered to hold.
  size_t matched_blocks(uint64_t worker, std::span<const uint64_t> block_hashes) const;
  // Hashes remembered for `worker`.
  size_t remembered(uint64_t worker) const;

 private:
  // Most recently routed first.
  struct Recent {
    std::list<uint64_t> order;
    std::unordered_map<uint64_t, std::list<uint64_t>::iterator> where;
  };
  LeastLoadedPolicy fallback_;
  size_t capacity_;
  int64_t load_slack_;
  std::unordered_map<uint64_t, Recent> recent_;
};

std::unique_ptr<DispatchPolicy> make_dispatch_policy(DispatchPolicyKind kind,
                                                     const DispatcherOptions& options,
                                                     uint64_t seed);

}  // namespace cleave::router
