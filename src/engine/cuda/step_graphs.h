// Which decode steps the CUDA backend records as CUDA graphs, and when it replays them (no CUDA
// in this header, so the policy has CPU tests: tests/unit/engine/step_graphs_test.cpp).
//
// A recorded step holds by value every launch's grid and arguments: the token count, the
// attention splits (they size the attention grid) and the KV pool's address and layout (a freed
// pool's address comes back for a pool of another size). Those make the key; the index arrays
// and activations sit at fixed addresses (the backend keeps them there) and are read at replay.
// A shape's first step runs eagerly (it also sizes every scratch buffer), its second is recorded,
// later ones replay. At `max` shapes the table is emptied (the graphs destroyed) and refilled.
#pragma once

#include <cstddef>
#include <cstdint>
#include <functional>
#include <unordered_map>

namespace cleave {

struct StepShape {
  int64_t n_tokens = 0;
  int64_t attention_splits = 0;
  const void* kv = nullptr;
  int64_t num_blocks = 0, block_size = 0, kv_dim = 0;
  int dtype = 0;
  bool operator==(const StepShape&) const = default;
};

struct StepShapeHash {
  size_t operator()(const StepShape& k) const {
    size_t h = std::hash<const void*>()(k.kv);
    for (int64_t v : {k.n_tokens, k.attention_splits, k.num_blocks, k.block_size, k.kv_dim,
                      static_cast<int64_t>(k.dtype)}) {
      h = h * 1000003u ^ std::hash<int64_t>()(v);
    }
    return h;
  }
};

// Exec: the recorded graph's handle (cudaGraphExec_t in the backend); destroy frees one.
template <typename Exec>
class StepGraphs {
 public:
  enum class Action { kEager, kRecord, kReplay };
  using Destroy = std::function<void(Exec)>;

  explicit StepGraphs(Destroy destroy, size_t max = 256) : destroy_(std::move(destroy)), max_(max) {}
  ~StepGraphs() { clear(); }
  StepGraphs(const StepGraphs&) = delete;
  StepGraphs& operator=(const StepGraphs&) = delete;

  // What to do for a step of `shape`; with kReplay, *exec is its graph.
  Action lookup(const StepShape& shape, Exec* exec) {
    auto it = graphs_.find(shape);
    if (it == graphs_.end()) {
      if (graphs_.size() >= max_) clear();
      graphs_.emplace(shape, Exec{});
      return Action::kEager;
    }
    if (it->second != Exec{}) {
      *exec = it->second;
      return Action::kReplay;
    }
    return Action::kRecord;
  }
  // The graph recorded for `shape` (after lookup() said kRecord).
  void recorded(const StepShape& shape, Exec exec) {
    Exec& slot = graphs_[shape];
    if (slot != Exec{} && slot != exec) destroy_(slot);
    slot = exec;
  }
  // Destroys every graph (buffers they read have moved, or graphs are turned off).
  void clear() {
    for (auto& [shape, exec] : graphs_) {
      if (exec != Exec{}) destroy_(exec);
    }
    graphs_.clear();
  }
  size_t size() const { return graphs_.size(); }

 private:
  Destroy destroy_;
  size_t max_;
  std::unordered_map<StepShape, Exec, StepShapeHash> graphs_;
};

}  // namespace cleave
