// The requests of a `cleave bench serve` run: prompts, output lengths and arrival times.
//
// Prompts are text made of words, one space between them. A prompt is built from *blocks*:
// block id -> a fixed run of words drawn from a generator seeded by the id, so that requests
// naming the same block ids in the same order share that text, and the server's prefix cache
// sees the shared prefix, as the traffic behind a Mooncake trace did.
//
// Lengths are in tokens of the served model when the workload is given its tokenizer
// (WorkloadOptions::tokenizer; `--tokenizer`, and `cleave tune` uses its model's): the words are
// then drawn from those that are one token each in it, wherever they stand (one_token_words),
// so a prompt of N words is N tokens of text (the server adds BOS or the chat template), and
// ShareGPT's prompt and reply lengths are counted by encoding them, as vLLM does. Without a
// tokenizer a word stands for one token: a built-in list of short common words, most of them
// one token in most vocabularies; the server's usage.prompt_tokens then gives the true count.
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
//                   the length of the reply after it is the output length (tokens with a
//                   tokenizer, else words).
#pragma once

#include <cstdint>
#include <memory>
#include <optional>
#include <random>
#include <string>
#include <string_view>
#include <vector>

#include "cleave/common/status.h"

namespace cleave {
class Tokenizer;
}

namespace cleave::bench {

struct WorkloadRequest {
  std::string prompt;
  int64_t input_len = 0;   // in words (tokens of the workload's tokenizer when it has one)
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
  // The served model's tokenizer: lengths become its tokens (see the top of this file).
  std::shared_ptr<const Tokenizer> tokenizer;
};

Result<Workload> build_workload(const WorkloadOptions& options);

// The words prompts are drawn from.
using WordList = std::vector<std::string>;
// The built-in list (short common words; no tokenizer).
const WordList& builtin_words();
// The words of `tok`'s vocabulary (lower-case ASCII letters, a token of their own with and
// without a space before them) that encode to exactly one token each at the start of a text
// and after a space, in vocabulary order (BPE: the most frequent first), at most `max_words`.
// FailedPrecondition when fewer than 16 qualify: prompts could not be sized in its tokens.
Result<WordList> one_token_words(const Tokenizer& tok, size_t max_words = 1024);

// The words of block `block_id`, `words` of them, each followed by a space (the same id and
// count: the same text; fewer words: a prefix of it), drawn from `list`.
std::string block_text(uint64_t block_id, int64_t words, const WordList& list = builtin_words());

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
WorkloadRequest trace_request(const TraceEntry& e, double time_scale, double length_scale,
                              const WordList& list = builtin_words());

// Arrival times (seconds from the start) of `n` requests: inter-arrival gaps drawn from a gamma
// distribution with shape `burstiness` and mean 1 / rate (burstiness 1: Poisson); the first
// request at 0 and a gap after each, as vLLM does. rate = infinity: all at 0.
std::vector<double> gamma_arrivals(int64_t n, double rate, double burstiness, uint64_t seed);

}  // namespace cleave::bench
