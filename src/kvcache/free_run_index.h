// Private to src/kvcache: which block ids are free, with O(log n) queries for the lowest-numbered
// run of n consecutive free ids.
//
// A segment tree over the ids (padded to a power of two; padding counts as taken). Each node keeps
// the free run at its left edge (prefix), at its right edge (suffix) and the longest inside it, so
// that the lowest start of a long-enough run is found by one descent from the root.
#pragma once

#include <cstddef>
#include <cstdint>
#include <vector>

namespace cleave::kvcache_detail {

class FreeRunIndex {
 public:
  // `n` ids, all free when `all_free`, else all taken.
  FreeRunIndex(int64_t n, bool all_free);

  int64_t size() const { return n_; }
  int64_t free_count() const { return free_count_; }
  bool is_free(int64_t id) const { return nodes_[static_cast<size_t>(leaves_ + id)].best != 0; }
  // Marks one id; O(log n). Setting the state it already has is a no-op.
  void set_free(int64_t id, bool free);
  // The lowest id s such that s .. s+len-1 are all free, or -1. len >= 1; O(log n).
  int64_t find_run(int64_t len) const;
  // The lowest free id, or -1.
  int64_t first_free() const { return find_run(1); }
  // Length of the longest free run.
  int64_t longest_run() const { return nodes_[1].best; }

 private:
  struct Node {
    int32_t prefix = 0;  // free ids at the left edge of the node's range
    int32_t suffix = 0;  // free ids at the right edge
    int32_t best = 0;    // longest free run inside the range
  };
  void pull(size_t node, int32_t half);

  int64_t n_ = 0;
  int64_t leaves_ = 1;  // power of two >= n_
  int64_t free_count_ = 0;
  std::vector<Node> nodes_;  // 1-based heap layout; leaves at [leaves_, 2 * leaves_)
};

}  // namespace cleave::kvcache_detail
