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
// Disaggregation (DESIGN.md §1):
// - Prefill side: a request with `kv_export` set is a prefill whose decoding happens elsewhere.
//   After each forward pass the loop hands every layer's newly computed K/V of the request to
//   the sink, layer by layer, as soon as that layer is done (on_layer_ready, on the engine
//   thread, inside the forward pass). The request ends after its first sampled token: the
//   finished event carries that token, with handoff = true when generation goes on (no end
//   token, stop string or max_tokens reached). After its finished event, whatever the outcome
//   (handoff, end, cancel, error), the blocks it held stay held ("pinned"), so that writes
//   still in flight read what was computed and nothing else, until release_pinned(id).
// - Decode side: reserve(id, n) sets aside blocks for a prompt whose KV another worker writes,
//   for a lease. A later submit() of the same id with `prefilled` set consumes the reservation:
//   the sequence starts running from the given first token with the prompt's KV taken as
//   present (only call it once the KV is in place). An unconsumed reservation goes back to the
//   pool when its lease ends (counted in stats().leases_expired) or on release_reservation().
//
// Every claim on the pool (running sequences, reservations, pins, prefilled sequences waiting for a
// slot) is held by one BlockLedger (scheduler/block_ledger.h), with one lease clock. The ledger,
// the scheduler and the requests are the engine's state, under one lock that the engine thread
// holds except while it waits for work and while a step's forward pass computes: a reservation is
// made then on the caller's thread, at once, instead of waiting for the step. A request that does
// not fit because reservations or pins hold blocks waits for them (they come back in bounded time)
// instead of failing; the engine thread then sleeps until the next lease deadline or the next
// queued change, never spinning.
//
// Thread-safety: submit(), cancel(), reserve(), reserve_async(), release_reservation(),
// renew_reservation(), release_pinned(), stats(), wait_idle() and shutdown() may be called from
// any thread. Callbacks run one at a time under the engine's state lock (on the engine thread, or
// for reservations on the thread of reserve_async()): they may call submit(), cancel(),
// reserve_async(), release_reservation() and release_pinned(), and should return quickly (they
// hold up every request).
#pragma once

#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <deque>
#include <functional>
#include <memory>
#include <mutex>
#include <span>
#include <string>
#include <thread>
#include <unordered_map>
#include <unordered_set>
#include <vector>

#include "cleave/common/status.h"
#include "cleave/engine/engine_settings.h"
#include "cleave/engine/generator.h"
#include "cleave/engine/llama_model.h"
#include "cleave/engine/sampler.h"
#include "cleave/kvcache/kv_block_pool.h"
#include "cleave/model/tokenizer.h"
#include "cleave/request/request.h"
#include "cleave/scheduler/block_ledger.h"
#include "cleave/scheduler/scheduler.h"

namespace cleave {

// RequestId: request/request.h.

struct EngineLoopOptions {
  int64_t block_size = 16;                  // tokens per KV block
  int64_t num_blocks = 0;                   // > 0: the pool's block count (wins over the budget)
  uint64_t kv_cache_bytes = 256ull << 20;   // else the pool's memory budget
  DType kv_dtype = DType::kF32;             // K/V element type: f32, f16 or bf16
  SchedulerOptions scheduler;
  std::string thread_name = "engine";
  // A pool in device memory gets a host mirror (Backend::make_kv_staging) that the transfer
  // engine registers instead (kv_transfer_data()): each exported layer's K/V are copied to it
  // before the writes, and a prefilled request's blocks are copied from it to the device before
  // it decodes. For transfer providers that cannot reach device memory.
  bool kv_staging = false;
};

// Whether a worker's KV pool needs the host mirror (EngineLoopOptions::kv_staging): a pool in
// device memory (backend_device >= 0) whose transfer provider cannot reach device memory (no
// FI_HMEM: tcp, shm, Debian's libfabric).
inline bool kv_mirror_needed(int backend_device, bool provider_hmem) {
  return backend_device >= 0 && !provider_hmem;
}

// Receives a prefill's KV as it is computed (see "Disaggregation" above). Called on the engine
// thread inside the forward pass: must not block (queue the transfer and return).
class KvExportSink {
 public:
  virtual ~KvExportSink() = default;
  // K/V of positions [begin, end) of `layer` are in the pool, in `block_table` (block i holds
  // positions [i*block_size, (i+1)*block_size)). Every layer of a step comes in order. The first
  // call for a request covers the prompt from 0, prefix-cache hits included; later ones each
  // step's chunk (a chunk recomputed after a preemption comes again, with the same values).
  // `last` is true for the step that completes the prompt. Return false when the transfer
  // failed: the request then ends with an Unavailable error event after this step.
  virtual bool on_layer_ready(int64_t layer, int64_t begin, int64_t end,
                              std::span<const BlockId> block_table, bool last) = 0;
};

struct EngineRequest {
  RequestId id = 0;
  std::vector<int32_t> prompt;  // token ids (BOS included when the model wants one)
  SamplingParams params;
  // Prefill side: export the KV here and stop after the first token (see above).
  std::shared_ptr<KvExportSink> kv_export;
  // Decode side: the prompt's KV is in the blocks reserved under this id, and `first_token` was
  // sampled by the prefill (and already streamed by the caller). Generation goes on from it:
  // its text is not sent again, and it counts as the first generated token for max_tokens,
  // min_tokens, penalties and stop handling.
  bool prefilled = false;
  int32_t first_token = 0;
  // A request migrated from another worker (DESIGN.md §3 "Resumable sampling"): the tokens it
  // had generated there and delivered, in order. The engine computes prompt + resume_tokens as
  // the known prefix (chunked like a prompt; a kv_export request exports all of it and a
  // prefilled request's reservation covers all of it) and samples on from the next position.
  // They count as generated for max_tokens, min_tokens, penalties and usage, and they run
  // through the stop handling without their text being sent again, so that the text and stop
  // strings go on exactly where the other worker's left off. Prefilled: first_token follows
  // them. Their count must stay below max_tokens (one less when prefilled).
  std::vector<int32_t> resume_tokens;
};

struct EngineEvent {
  RequestId id = 0;
  bool has_token = false;
  int32_t token = 0;
  std::string text;     // text that became safe to emit with this token (may be empty)
  SampleResult sample;  // logprob and top alternatives when params.logprobs >= 0
  // On the first token event of a request with params.prompt_logprobs >= 0: each prompt token's
  // logprob given the tokens before it and the top prompt_logprobs there, for prompt positions
  // 1..n-1 (position 0 has none). Such a prompt is computed whole (no prefix-cache hits).
  std::vector<SampleResult> prompt_logprobs;
  bool finished = false;
  FinishReason finish_reason = FinishReason::kLength;  // when finished with an OK error
  std::string stop_string;  // the stop string that matched, if any
  Status error;             // non-OK: the request failed (finished is true)
  // Usage, filled on the finished event.
  int64_t prompt_tokens = 0;
  int64_t cached_prompt_tokens = 0;  // served by the prefix cache when first admitted
  int64_t generated_tokens = 0;      // tokens sampled, a final EOS / stop token included
  int32_t preemptions = 0;
  // A kv_export request that ended after its first token because generation continues on the
  // decode worker (finish_reason is kLength then and means nothing).
  bool handoff = false;
  // On the first token this engine samples for a request it computes from its prompt: seconds
  // from its submit() to the start of the first engine step that computed it (its wait in this
  // engine's queue); -1 on other events (and on every event of a prefilled request).
  double queue_seconds = -1;
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
  // Disaggregation.
  int64_t reservations = 0;         // reservations not yet consumed or ended
  int64_t blocks_reserved = 0;      // blocks those hold
  int64_t blocks_pinned = 0;        // blocks of ended prefills held until release_pinned()
  int64_t blocks_held = 0;          // of ended reservations, until their hold ends
  uint64_t leases_expired = 0;      // reservations whose lease ended unconsumed
  uint64_t reservations_released = 0;  // ended by release_reservation()
  uint64_t leases_renewed = 0;      // renew_reservation() calls that extended a lease
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

  // Decode side: reserves the blocks for a prompt of `num_tokens` tokens (positions [0,
  // num_tokens)) under `id`, until `lease` from now, without waiting: `done` gets the result once:
  // inside this call when the engine is waiting for work or computing a forward pass (the common
  // case), else on the engine thread before its next forward pass, or on shutdown()'s thread when
  // the engine stops first. A non-OK return means nothing was queued and `done` never runs:
  // InvalidArgument for num_tokens < 1 or a lease under 1 ms; OutOfRange when it does not fit the
  // context; ResourceExhausted when it needs more blocks than the pool has; AlreadyExists when the
  // id has a reservation or is in flight; Unavailable after shutdown(). `done` gets the block ids
  // in position order, or ResourceExhausted when the pool cannot give them now (nothing is taken or
  // evicted then), Cancelled when release_reservation() came first, Unavailable on shutdown.
  // `on_end` (may be empty) fences the blocks: it runs once when the reservation ends, told how
  // (consumed by its prefilled submit, released, its lease expired, shutdown), before any of its
  // blocks can go to another request; the decode worker revokes there the memory key it gave the
  // writer, so that a write arriving late never lands in reused blocks. It runs under the engine's
  // state lock, after `done` delivered the blocks; when `done` gets an error it never runs (the
  // caller revokes). shutdown() runs those of the reservations still held, on its own thread once
  // the engine thread has stopped (so their target must still be alive then; the destructor's
  // shutdown() finds none left). Where the key cannot be revoked, `hold` > 0 keeps a released or
  // expired reservation's blocks held that long after its lease deadline (BlockLedger::reserve).
  using ReserveCallback = std::function<void(Result<std::vector<BlockId>>)>;
  Status reserve_async(RequestId id, int64_t num_tokens, std::chrono::milliseconds lease,
                       ReservationFence on_end, ReserveCallback done,
                       std::chrono::milliseconds hold = std::chrono::milliseconds(0));
  // reserve_async() that waits for the result (at most the bookkeeping of one engine step; for
  // in-process callers and tests, not for RPC threads). Its errors are reserve_async()'s and
  // `done`'s.
  Result<std::vector<BlockId>> reserve(RequestId id, int64_t num_tokens,
                                       std::chrono::milliseconds lease,
                                       ReservationFence on_end = {},
                                       std::chrono::milliseconds hold = std::chrono::milliseconds(0));
  // Gives a reservation's blocks back (in the engine's next iteration; does not wait). false
  // when there is none under `id` (consumed, released or expired).
  bool release_reservation(RequestId id);
  // Runs the reservation's lease again from now: it ends no earlier than `lease` from this call
  // (BlockLedger::renew_lease). Does not wait: the engine applies it before it next looks at
  // lease deadlines, and true means exactly that it will (the reservation had not ended, and
  // cannot end by its old deadline now). false when there is none under `id` (consumed,
  // released or expired) or the lease is under 1 ms.
  bool renew_reservation(RequestId id, std::chrono::milliseconds lease);
  // Prefill side: releases the blocks a kv_export request kept after its finished event (call
  // it once its transfer has ended, successfully or not). Does not wait. false when nothing is
  // pinned for id.
  bool release_pinned(RequestId id);

  EngineStats stats() const;
  // Blocks until every submitted request has ended and its blocks are released, or `timeout`;
  // false on timeout.
  bool wait_idle(std::chrono::milliseconds timeout);
  // Ends every pending request with an Unavailable error event and joins the thread.
  // Idempotent; submit() fails afterwards.
  void shutdown();

  const ModelConfig& config() const { return model_->config(); }
  const KvLayout& kv_layout() const { return pool_->layout(); }
  // The KV pool's buffer; fixed for the loop's life. In device memory when kv_device() >= 0.
  std::byte* kv_data() const { return pool_->data(); }
  uint64_t kv_bytes() const { return pool_->size_bytes(); }
  int kv_device() const { return pool_->storage().device(); }
  // What the transfer engine registers: the host mirror with kv_staging, else kv_data().
  std::byte* kv_transfer_data() const { return staging_ ? staging_->host() : pool_->data(); }
  bool kv_staged() const { return staging_ != nullptr; }

 private:
  struct RequestState;
  EngineLoop(std::unique_ptr<LlamaModel> model, std::shared_ptr<const Tokenizer> tokenizer,
             std::unique_ptr<KvBlockPool> pool, const EngineLoopOptions& opts);

  void run();
  void admit(EngineRequest&& req, EngineEventCallback&& cb,
             std::chrono::steady_clock::time_point submitted);
  void cancel_now(RequestId id);
  class StateHold;  // state_mu_ held by this thread (engine_loop_state.h)
  // `state` is held; let go during the forward pass.
  void step(StateHold& state);
  void sample_and_stream(RequestState& r, const Sequence& seq, std::span<float> logits);
  // Removes the request (scheduler included) after sending `ev` (finished is set here).
  void finish(RequestState& r, EngineEvent& ev);
  void fail(RequestId id, const Status& error);
  void deliver(RequestState& r, const EngineEvent& ev);
  void publish_stats();
  // Disaggregation, under the state lock.
  struct ReserveOp;
  void run_control_ops();  // the queued releases (first) and reserves
  void reserve_now(ReserveOp& op);
  void answer(ReserveOp& op, Result<std::vector<BlockId>> result);  // calls op.done, catching
  void release_reservation_now(RequestId id);
  void release_pinned_now(RequestId id);
  void expire_leases();
  // The renewals asked for since the last call go to the ledger (before expiring leases).
  void apply_lease_renewals();
  void admit_prefilled(EngineRequest&& req, std::unique_ptr<RequestState> r);
  void admit_pending_prefilled();
  void export_layer(int64_t layer);

  std::unique_ptr<LlamaModel> model_;
  std::shared_ptr<const Tokenizer> tokenizer_;
  std::unique_ptr<KvBlockPool> pool_;
  std::unique_ptr<KvStaging> staging_;  // opts.kv_staging: the pool's host mirror
  // Engine thread: copies (layer, block) units of `blocks` for layers [l0, l1) between the pool
  // and its mirror (runs of consecutive ids coalesce into one copy).
  Status stage_blocks(std::span<const BlockId> blocks, int64_t l0, int64_t l1, bool to_device);
  std::vector<KvRange> stage_ranges_;
  EngineLoopOptions opts_;
  BlockLedger ledger_;    // every claim on pool_
  Scheduler& scheduler_;  // ledger_'s running and waiting sequences
  int64_t vocab_ = 0;
  int64_t context_ = 0;
  std::vector<int32_t> eos_ids_;  // the tokenizer's end-of-generation ids

  // Engine thread only.
  std::unordered_map<RequestId, std::unique_ptr<RequestState>> requests_;
  StepPlan plan_;
  std::vector<BatchSequence> batch_;
  std::vector<RequestState*> scoring_;  // per batch_ entry: the request whose prompt it scores
  std::vector<float> logits_;  // max_num_seqs rows of vocab_size
  EngineStats local_stats_;
  // The last step planned nothing because its sequences wait for reserved or pinned blocks:
  // the thread sleeps until a queued change or a lease deadline instead of stepping again.
  bool stalled_ = false;
  struct ExportChunk {  // a kv_export request's share of the step being computed
    RequestState* request;
    const Sequence* seq;
    int64_t begin, end;
    bool last;
  };
  std::vector<ExportChunk> exports_;

  // The engine's state (everything above): held by the engine thread but while it waits and
  // while forward_batch() computes; then reserve_async() takes it to make its reservation.
  std::mutex state_mu_;
  // Shared with the submitting threads, under mu_.
  mutable std::mutex mu_;
  std::condition_variable work_cv_;  // the engine thread waits for work
  std::condition_variable idle_cv_;  // wait_idle() waits for the engine to drain
  struct Submission {
    EngineRequest request;
    EngineEventCallback on_event;
    std::chrono::steady_clock::time_point submitted;
  };
  std::vector<Submission> incoming_;
  std::vector<RequestId> cancels_;
  std::unordered_set<RequestId> in_flight_;  // submitted and not yet finished
  std::vector<std::shared_ptr<ReserveOp>> reserves_;
  std::vector<RequestId> reservation_releases_;
  std::vector<RequestId> pin_releases_;
  // Renewals asked for and not yet applied to the ledger (expire_leases applies them).
  std::unordered_map<RequestId, std::chrono::milliseconds> lease_renewals_;
  // Asked for, made, and not consumed or ended, with the ReserveOp that asked: a release that
  // races a new reserve of the same id cancels only the old one.
  std::unordered_map<RequestId, uint64_t> reserved_ids_;
  uint64_t next_reserve_op_ = 1;
  std::unordered_set<RequestId> pinned_ids_;
  bool stopping_ = false;
  bool stopped_ = false;  // the engine thread has exited
  bool idle_ = true;
  bool rewait_ = false;  // the ledger changed while the engine waited: wait again, anew
  EngineStats published_;

  std::thread thread_;
};

// The engine loop's options from the configuration's engine section (engine.kv_dtype is one
// of f32, f16, bf16: the settings registry checks it).
EngineLoopOptions engine_loop_options(const EngineSettings& settings);

}  // namespace cleave
