#include "free_run_index.h"

#include <algorithm>
#include <cassert>

namespace cleave::kvcache_detail {

FreeRunIndex::FreeRunIndex(int64_t n, bool all_free) : n_(n) {
  assert(n >= 1 && n <= (int64_t{1} << 30));
  while (leaves_ < n_) leaves_ *= 2;
  nodes_.resize(static_cast<size_t>(2 * leaves_));
  if (all_free) {
    for (int64_t i = 0; i < n_; ++i) nodes_[static_cast<size_t>(leaves_ + i)] = Node{1, 1, 1};
    free_count_ = n_;
  }
  int32_t half = 1;
  for (int64_t level_start = leaves_ / 2; level_start >= 1; level_start /= 2, half *= 2) {
    for (int64_t node = level_start; node < 2 * level_start; ++node) pull(static_cast<size_t>(node), half);
  }
}

inline void FreeRunIndex::pull(size_t node, int32_t half) {
  const Node& l = nodes_[2 * node];
  const Node& r = nodes_[2 * node + 1];
  Node& p = nodes_[node];
  p.prefix = l.prefix == half ? half + r.prefix : l.prefix;
  p.suffix = r.suffix == half ? half + l.suffix : r.suffix;
  p.best = std::max({l.best, r.best, l.suffix + r.prefix});
}

void FreeRunIndex::set_free(int64_t id, bool free) {
  assert(id >= 0 && id < n_);
  size_t node = static_cast<size_t>(leaves_ + id);
  if ((nodes_[node].best != 0) == free) return;
  const int32_t v = free ? 1 : 0;
  nodes_[node] = Node{v, v, v};
  free_count_ += free ? 1 : -1;
  int32_t half = 1;
  for (node /= 2; node >= 1; node /= 2, half *= 2) {
    const Node before = nodes_[node];
    pull(node, half);
    const Node& after = nodes_[node];
    // Ancestors depend on this node only through its summary: stop once it no longer changes.
    if (after.prefix == before.prefix && after.suffix == before.suffix && after.best == before.best) break;
  }
}

int64_t FreeRunIndex::find_run(int64_t len) const {
  assert(len >= 1);
  if (nodes_[1].best < len) return -1;
  size_t node = 1;
  int64_t start = 0;  // first id of the node's range
  int64_t half = leaves_ / 2;
  while (half >= 1) {
    const Node& l = nodes_[2 * node];
    const Node& r = nodes_[2 * node + 1];
    if (l.best >= len) {
      node = 2 * node;
    } else if (l.suffix + r.prefix >= len) {
      return start + half - l.suffix;
    } else {
      node = 2 * node + 1;
      start += half;
    }
    half /= 2;
  }
  return start;  // a single free leaf and len == 1
}

}  // namespace cleave::kvcache_detail
