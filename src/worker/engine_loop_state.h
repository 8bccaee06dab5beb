// Private to the engine loop's .cpp files: per-request state and small helpers.
#pragma once

#include <algorithm>
#include <chrono>
#include <mutex>

#include "cleave/engine/token_finisher.h"
#include "cleave/worker/engine_loop.h"

namespace cleave {

struct EngineLoop::RequestState {
  RequestState(RequestId rid, SamplingParams p, EngineEventCallback cb, const Tokenizer& tok,
               std::span<const int32_t> eos_ids, int32_t last_prompt_token)
      : id(rid),
        params(std::move(p)),
        on_event(std::move(cb)),
        finisher(tok, params, eos_ids, last_prompt_token) {}
  RequestId id;
  SamplingParams params;
  EngineEventCallback on_event;
  TokenFinisher finisher;  // end ids, text and stop strings of its generated tokens
  int64_t prompt_tokens = 0;
  int64_t cached_prompt_tokens = -1;  // set at the first admission
  std::chrono::steady_clock::time_point submitted;  // submit() was called
  double queue_seconds = -1;  // submit() to the first step that computed it (first admission)
  int64_t generated = 0;
  // Tokens generated before this engine had the request (EngineRequest::resume_tokens); its
  // prompt is the first prompt_tokens of the sequence, those follow it.
  int64_t resumed = 0;
  // params.prompt_logprobs >= 0: the logprobs of prompt positions 1..n-1, filled as the prompt
  // is computed and sent (moved out) with the first token.
  std::vector<SampleResult> prompt_logprobs;
  // kv_export (prefill side): positions below export_from have been handed to the sink.
  std::shared_ptr<KvExportSink> sink;
  int64_t export_from = 0;
  bool export_failed = false;
};

// The engine loop whose state lock this thread holds (nullptr: none): reserve_async() called
// with it held (from a callback) queues instead of taking the lock again.
inline thread_local const EngineLoop* t_state_holder = nullptr;

// The engine's state lock held by this thread, with t_state_holder naming its loop meanwhile;
// let go, t_state_holder names again the loop (if any) it named before. Every take and release
// of state_mu_ goes through it, so the two never disagree.
class EngineLoop::StateHold {
 public:
  // Takes the lock (blocking).
  StateHold(std::mutex& mu, const EngineLoop* loop) : mu_(mu), loop_(loop) { lock(); }
  // Takes the lock only if it is free now: owns() says whether it did.
  StateHold(std::mutex& mu, const EngineLoop* loop, std::try_to_lock_t) : mu_(mu), loop_(loop) {
    if (mu_.try_lock()) hold();
  }
  ~StateHold() {
    if (owns_) unlock();
  }
  StateHold(const StateHold&) = delete;
  StateHold& operator=(const StateHold&) = delete;

  bool owns() const { return owns_; }
  void lock() {
    mu_.lock();
    hold();
  }
  void unlock() {
    t_state_holder = outer_;
    owns_ = false;
    mu_.unlock();
  }

 private:
  void hold() {
    outer_ = t_state_holder;
    t_state_holder = loop_;
    owns_ = true;
  }

  std::mutex& mu_;
  const EngineLoop* const loop_;
  const EngineLoop* outer_ = nullptr;
  bool owns_ = false;
};

struct EngineLoop::ReserveOp {
  RequestId id = 0;
  uint64_t op = 0;  // its entry in reserved_ids_
  int64_t num_tokens = 0;
  std::chrono::milliseconds lease{0};
  ReservationFence on_end;  // moves into the ledger's reservation when it is made
  ReserveCallback done;     // called once with the result
  std::chrono::milliseconds hold{0};  // BlockLedger::reserve's
};

}  // namespace cleave
