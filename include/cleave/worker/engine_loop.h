// The engine loop of a worker: one thread, named "engine", owns the model, the KV block pool and
// the scheduler, and runs continuous batching. Other threads submit requests and cancel them
// through a queue; each request's tokens come back as events through its callback, by request
// id (DESIGN.md §3 "Engine loop").
//
// Each step: drain the queue (new requests, cancellations), schedule (decode tokens and prefill
// chunks under the token budget, preempting when blocks run out), run one forward_batch over
// every scheduled sequence, and sample each sequence whose chunk reached its last token. A
// request produces exactly the tokens and text that Generator produces for it alone (batch
// invariance, sampling as a pure function of (seed, position), the same stop handling:
// EOS unless ignore_eos, stop token ids, stop strings, max_tokens, min_tokens, the end of the
// context), whatever ran beside it, however its prompt was chunked, and across preemptions.
//
// Events: one per sampled token (token, text that became safe to emit, logprobs), the last one
// with finished = true and the finish reason; a request that is cancelled or fails ends with one
// finished event without a token (finish reason kCancelled, or a non-OK `error`). After its
// finished event a request's blocks are back in the pool and its id may be reused.
//
// Thread-safety: submit(), cancel(), stats(), wait_idle() and shutdown() may be called from any
// thread. Callbacks run on the engine thread, one at a time, without any lock held: they may call
// submit() and cancel(), and should return quickly (they hold up every request).
#pragma once

#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <unordered_map>
#include <unordered_set>
#include <vector>

#include "cleave/common/config.h"
#include "cleave/common/status.h"
#include "cleave/engine/generator.h"
#include "cleave/engine/llama_model.h"
#include "cleave/engine/sampler.h"
#include "cleave/kvcache/kv_block_pool.h"
#include "cleave/model/tokenizer.h"
#include "cleave/scheduler/scheduler.h"

namespace cleave {

using RequestId = uint64_t;

struct EngineLoopOptions {
  int64_t block_size = 16;                  // tokens per KV block
  int64_t num_blocks = 0;                   // > 0: the pool's block count (wins over the budget)
  uint64_t kv_cache_bytes = 256ull << 20;   // else the pool's memory budget
  SchedulerOptions scheduler;
  std::string thread_name = "engine";
};

struct EngineRequest {
  RequestId id = 0;
  std::vector<int32_t> prompt;  // token ids (BOS included when the model wants one)
  SamplingParams params;
};

struct EngineEvent {
  RequestId id = 0;
  bool has_token = false;
  int32_t token = 0;
  std::string text;     // text that became safe to emit with this token (may be empty)
  SampleResult sample;  // logprob and top alternatives when params.logprobs >= 0
  bool finished = false;
  FinishReason finish_reason = FinishReason::kLength;  // when finished with an OK error
  std::string stop_string;  // the stop string that matched, if any
  Status error;             // non-OK: the request failed (finished is true)
  // Usage, filled on the finished event.
  int64_t prompt_tokens = 0;
  int64_t cached_prompt_tokens = 0;  // served by the prefix cache when first admitted
  int64_t generated_tokens = 0;      // tokens sampled, a final EOS / stop token included
  int32_t preemptions = 0;
};
using EngineEventCallback = std::function<void(const EngineEvent&)>;

// A snapshot, published by the engine thread after every step.
struct EngineStats {
  int64_t running = 0;
  int64_t waiting = 0;   // queued in the scheduler and not yet drained from the submit queue
  int64_t blocks_total = 0;
  int64_t blocks_free = 0;
  int64_t blocks_cached = 0;  // cached and unreferenced (evictable)
  int64_t blocks_used = 0;
  // blocks_free + blocks_cached == blocks_total when nothing holds a block; the metrics endpoint
  // publishes blocks_used as the "blocks not back in the pool" gauge.
  SchedulerCounters scheduler;
  uint64_t evictions = 0;
  uint64_t requests_submitted = 0;
  uint64_t requests_finished = 0;   // stop or length
  uint64_t requests_cancelled = 0;
  uint64_t requests_failed = 0;
  uint64_t tokens_generated = 0;
  uint64_t forward_passes = 0;
  double forward_seconds = 0;       // time inside forward_batch
};

class EngineLoop {
 public:
  // Takes the model, builds the pool (block count or memory budget) and the scheduler, and
  // starts the engine thread. InvalidArgument for bad options; ResourceExhausted when the pool
  // cannot be allocated.
  static Result<std::unique_ptr<EngineLoop>> create(std::unique_ptr<LlamaModel> model,
                                                    std::shared_ptr<const Tokenizer> tokenizer,
                                                    const EngineLoopOptions& opts);
  // shutdown(), then frees everything.
  ~EngineLoop();
  EngineLoop(const EngineLoop&) = delete;
  EngineLoop& operator=(const EngineLoop&) = delete;

  // Queues a request; its events go to `on_event` (on the engine thread). Checked here, before
  // anything is queued: InvalidArgument for an empty prompt, an out-of-vocabulary id or bad
  // params; OutOfRange when the prompt does not fit the context; ResourceExhausted when it
  // needs more KV blocks than the pool has; AlreadyExists for an id in flight; Unavailable after
  // shutdown(). On error no event is sent.
  Status submit(EngineRequest request, EngineEventCallback on_event);
  // Asks for the request to end: it gets a finished event with kCancelled (unless it finishes
  // first) and its blocks are freed in the next step. false when the id is not in flight.
  bool cancel(RequestId id);

  EngineStats stats() const;
  // Blocks until every submitted request has ended and its blocks are released, or `timeout`;
  // false on timeout.
  bool wait_idle(std::chrono::milliseconds timeout);
  // Ends every pending request with an Unavailable error event and joins the thread.
  // Idempotent; submit() fails afterwards.
  void shutdown();

  const ModelConfig& config() const { return model_->config(); }
  const KvLayout& kv_layout() const { return pool_->layout(); }

 private:
  struct RequestState;
  EngineLoop(std::unique_ptr<LlamaModel> model, std::shared_ptr<const Tokenizer> tokenizer,
             std::unique_ptr<KvBlockPool> pool, const EngineLoopOptions& opts);

  void run();
  void admit(EngineRequest&& req, EngineEventCallback&& cb);
  void cancel_now(RequestId id);
  void step();
  void sample_and_stream(RequestState& r, const Sequence& seq, std::span<float> logits);
  // Removes the request (scheduler included) after sending `ev` (finished is set here).
  void finish(RequestState& r, EngineEvent& ev);
  void fail(RequestId id, const Status& error);
  void deliver(RequestState& r, const EngineEvent& ev);
  void publish_stats();

  std::unique_ptr<LlamaModel> model_;
  std::shared_ptr<const Tokenizer> tokenizer_;
  std::unique_ptr<KvBlockPool> pool_;
  EngineLoopOptions opts_;
  Scheduler scheduler_;
  int64_t vocab_ = 0;
  int64_t context_ = 0;
  std::vector<int32_t> eos_ids_;  // the tokenizer's end-of-generation ids

  // Engine thread only.
  std::unordered_map<RequestId, std::unique_ptr<RequestState>> requests_;
  StepPlan plan_;
  std::vector<BatchSequence> batch_;
  std::vector<float> logits_;  // max_num_seqs rows of vocab_size
  EngineStats local_stats_;

  // Shared with the submitting threads, under mu_.
  mutable std::mutex mu_;
  std::condition_variable work_cv_;  // the engine thread waits for work
  std::condition_variable idle_cv_;  // wait_idle() waits for the engine to drain
  struct Submission {
    EngineRequest request;
    EngineEventCallback on_event;
  };
  std::vector<Submission> incoming_;
  std::vector<RequestId> cancels_;
  std::unordered_set<RequestId> in_flight_;  // submitted and not yet finished
  bool stopping_ = false;
  bool stopped_ = false;  // the engine thread has exited
  bool idle_ = true;
  EngineStats published_;

  std::thread thread_;
};

// The engine loop's options from the configuration's engine section.
EngineLoopOptions engine_loop_options(const EngineSettings& settings);

}  // namespace cleave
