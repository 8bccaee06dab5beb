// The requests of a `cleave bench serve` run: prompts, output lengths and arrival times.
//
// Prompts are text made of words (a word stands for one token: the client has no tokenizer,
// and the server's usage.prompt_tokens gives the real count). A prompt is built from *blocks*:
// block id -> a fixed run of words drawn from a generator seeded by the id, so that requests
// naming the same block ids in the same order share that text, and the server's prefix cache
// sees the shared prefix, as the traffic behind a Mooncake trace did.
//
// Datasets:
//   random          --random-input-len / --random-output-len, each drawn uniformly from
//                   [len * (1 - ratio), len * (1 + ratio)] (vLLM's --random-range-ratio).
//   preset:chat     short questions, medium answers;
//   preset:rag      a question with 2-8K tokens of retrieved passages (drawn from a shared pool,
//                   so popular passages recur), short answers;
//   preset:reasoning short prompts, long answers;
//   preset:agentic  sessions of 5-10 turns; every turn re-sends the session's whole context
//                   (shared system prompt, earlier turns, the tool result) and waits for the
//                   turn before it to finish.
//                   Every preset length is multiplied by --scale.
//   trace:FILE      Mooncake JSONL (timestamp ms, input_length, output_length, hash_ids of
//                   512-token blocks), the first --max-requests lines; lengths and the block
//                   size times --length-scale, timestamps times --time-scale.
//   sharegpt:FILE   ShareGPT JSON: the first human turn of each conversation is the prompt and
//                   the length (in words) of the reply after it is the output length.
#pragma once

#include <cstdint>
#include <optional>
#include <random>
#include <string>
#include <string_view>
#include <vector>

#include "cleave/common/status.h"

namespace cleave::bench {

struct WorkloadRequest {
  std::string prompt;
  int64_t input_len = 0;   // in words (= tokens the workload meant)
  int64_t output_len = 1;  // max_tokens
  // Arrival in seconds from the start of the run, when the workload fixes it (traces);
  // otherwise the run draws arrivals from --request-rate / --burstiness.
  std::optional<double> arrival_s;
  // Sent only after this earlier request has finished (agentic turns), plus `delay_s`.
  int64_t depends_on = -1;
  double delay_s = 0;
};

struct Workload {
  std::string name;  // "random", "preset:chat", "trace:FILE"...
  std::vector<WorkloadRequest> requests;
  // Of all prompt blocks, the share whose whole prefix (this block and every block before it)
  // appeared in an earlier request: the prefix-cache hit rate an unbounded cache would reach.
  double prefix_reuse = 0;
};

struct WorkloadOptions {
  std::string dataset = "random";  // random | preset:NAME | trace:FILE | sharegpt:FILE
  int64_t num_prompts = 1000;
  int64_t random_input_len = 1024, random_output_len = 128;
  double random_range_ratio = 0.0;
  double scale = 1.0;         // presets
  int64_t max_requests = 1000;  // traces
  double time_scale = 1.0, length_scale = 1.0;  // traces
  uint64_t seed = 0;
};

Result<Workload> build_workload(const WorkloadOptions& options);

// The words of block `block_id`, `words` of them (the same id and count: the same text; fewer
// words: a prefix of it).
std::string block_text(uint64_t block_id, int64_t words);

// One Mooncake trace line, parsed.
struct TraceEntry {
  double timestamp_ms = 0;
  int64_t input_length = 0, output_length = 0;
  std::vector<int64_t> hash_ids;
};
// `line_no` names the line in errors.
Result<TraceEntry> parse_trace_line(std::string_view line, int64_t line_no);
// The request a trace entry becomes: blocks of round(512 * length_scale) words (at least 1),
// the last one cut so that the prompt has round(input_length * length_scale) words; output
// round(output_length * length_scale) (at least 1); arrival timestamp_ms / 1000 * time_scale.
WorkloadRequest trace_request(const TraceEntry& e, double time_scale, double length_scale);

// Arrival times (seconds from the start) of `n` requests: inter-arrival gaps drawn from a gamma
// distribution with shape `burstiness` and mean 1 / rate (burstiness 1: Poisson); the first
// request at 0 and a gap after each, as vLLM does. rate = infinity: all at 0.
std::vector<double> gamma_arrivals(int64_t n, double rate, double burstiness, uint64_t seed);

}  // namespace cleave::bench
