// Shared by the workload builders: prompts assembled from blocks, and the file datasets.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "cleave/bench/workload.h"

namespace cleave::bench {

struct PromptBlock {
  uint64_t id = 0;
  int64_t words = 0;
};

// A prompt as a chain of blocks (their text appended in order), in words of `list`.
struct PromptBuilder {
  explicit PromptBuilder(const WordList& list) : list(&list) {}
  const WordList* list;
  std::string text;
  std::vector<PromptBlock> blocks;
  int64_t words = 0;
  void add(uint64_t block_id, int64_t words);
  // The prompt is the text without its last space: N words are N tokens (a trailing space
  // would be a token of its own), and a shorter chain's prompt is still a prefix of a longer
  // one's, token for token.
  WorkloadRequest request(int64_t output_len) const;
};

// Share of block words whose whole prefix chain appeared in an earlier chain.
double prefix_reuse(const std::vector<std::vector<PromptBlock>>& chains);

// trace_request() that also returns the prompt's block chain.
WorkloadRequest trace_request(const TraceEntry& e, double time_scale, double length_scale,
                              const WordList& list, std::vector<PromptBlock>* chain);

Result<Workload> trace_workload(const std::string& path, const WorkloadOptions& o,
                                const WordList& list,
                                std::vector<std::vector<PromptBlock>>* chains);
Result<Workload> sharegpt_workload(const std::string& path, const WorkloadOptions& o,
                                   std::vector<std::vector<PromptBlock>>* chains);

}  // namespace cleave::bench
