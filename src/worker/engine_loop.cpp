// The engine thread: queue draining, one scheduled forward_batch per step, sampling and
// streaming with the same stop handling as Generator (src/engine/generator.cpp).
#include "cleave/worker/engine_loop.h"

#include "engine_loop_state.h"

#include <algorithm>
#include <exception>
#include <utility>

#include "cleave/common/log.h"
#include "cleave/common/thread_pool.h"
#include "fmt/format.h"

namespace cleave {
namespace {

// What the exception being handled says (call inside a catch).
std::string current_exception_text() {
  try {
    throw;
  } catch (const std::exception& e) {
    return e.what();
  } catch (...) {
    return "an exception that is not a std::exception";
  }
}

double seconds_since(std::chrono::steady_clock::time_point t0) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
}

}  // namespace

Result<std::unique_ptr<EngineLoop>> EngineLoop::create(std::unique_ptr<LlamaModel> model,
                                                       std::shared_ptr<const Tokenizer> tokenizer,
                                                       const EngineLoopOptions& opts) {
  if (!model) return InvalidArgument("engine loop: no model");
  if (!tokenizer) return InvalidArgument("engine loop: no tokenizer");
  CLEAVE_RETURN_IF_ERROR(opts.scheduler.validate());
  if (opts.block_size < 1) {
    return InvalidArgument(
        fmt::format("engine loop: block_size is {}, it must be at least 1", opts.block_size));
  }
  int64_t blocks = opts.num_blocks;
  if (blocks <= 0) {
    const KvLayout one = model->kv_layout(opts.block_size, 1, opts.kv_dtype);
    const uint64_t per_block = one.block_bytes() * static_cast<uint64_t>(one.n_layers);
    blocks = per_block == 0 ? 0 : static_cast<int64_t>(opts.kv_cache_bytes / per_block);
    if (blocks <= 0) {
      return InvalidArgument(fmt::format(
          "engine loop: a KV cache budget of {} bytes holds no block of {} tokens for this model "
          "(raise kv_cache_bytes or set num_blocks)",
          opts.kv_cache_bytes, opts.block_size));
    }
  }
  CLEAVE_ASSIGN_OR_RETURN(auto pool,
                          model->create_kv_pool(opts.block_size, blocks, opts.kv_dtype));
  std::unique_ptr<KvStaging> staging;
  if (opts.kv_staging && pool->storage().on_device()) {
    CLEAVE_ASSIGN_OR_RETURN(staging, model->backend().make_kv_staging(pool->storage()));
  }
  std::unique_ptr<EngineLoop> loop(
      new EngineLoop(std::move(model), std::move(tokenizer), std::move(pool), opts));
  loop->staging_ = std::move(staging);
  loop->thread_ = std::thread([l = loop.get()] { l->run(); });
  return loop;
}

EngineLoop::EngineLoop(std::unique_ptr<LlamaModel> model,
                       std::shared_ptr<const Tokenizer> tokenizer,
                       std::unique_ptr<KvBlockPool> pool, const EngineLoopOptions& opts)
    : model_(std::move(model)),
      tokenizer_(std::move(tokenizer)),
      pool_(std::move(pool)),
      opts_(opts),
      ledger_(*pool_, opts.scheduler),
      scheduler_(ledger_.scheduler()),
      vocab_(model_->config().vocab_size),
      context_(model_->max_context()),
      eos_ids_(TokenFinisher::end_of_generation_ids(*tokenizer_, vocab_)) {
  const auto rows = static_cast<size_t>(opts_.scheduler.max_num_seqs);
  batch_.reserve(rows);
  scoring_.reserve(rows);
  logits_.assign(rows * static_cast<size_t>(vocab_), 0.0f);
  plan_.chunks.reserve(rows);
  publish_stats();
}

EngineLoop::~EngineLoop() { shutdown(); }

void EngineLoop::shutdown() {
  {
    std::lock_guard<std::mutex> lk(mu_);
    stopping_ = true;
  }
  work_cv_.notify_all();
  if (thread_.joinable()) thread_.join();
  // The engine thread is gone: the reservations still held end here, fenced like the others.
  StateHold state(state_mu_, this);
  ledger_.end_all();
}

Status EngineLoop::submit(EngineRequest request, EngineEventCallback on_event) {
  const auto& prompt = request.prompt;
  if (prompt.empty()) {
    return InvalidArgument(fmt::format("request {}: the prompt has no tokens (add BOS)", request.id));
  }
  for (size_t i = 0; i < prompt.size(); ++i) {
    if (prompt[i] < 0 || prompt[i] >= vocab_) {
      return InvalidArgument(fmt::format(
          "request {}: prompt token {} at index {} is outside the vocabulary [0, {})", request.id,
          prompt[i], i, vocab_));
    }
  }
  const auto& resume = request.resume_tokens;
  for (size_t i = 0; i < resume.size(); ++i) {
    if (resume[i] < 0 || resume[i] >= vocab_) {
      return InvalidArgument(fmt::format(
          "request {}: resume token {} at index {} is outside the vocabulary [0, {})", request.id,
          resume[i], i, vocab_));
    }
  }
  // A migrated request's known prefix is its prompt and the tokens it generated elsewhere.
  const int64_t known = static_cast<int64_t>(prompt.size() + resume.size());
  if (known > context_) {
    return OutOfRange(fmt::format(
        "request {}: the prompt has {} tokens ({} more generated before), the context holds {}",
        request.id, prompt.size(), resume.size(), context_));
  }
  CLEAVE_RETURN_IF_ERROR(
      request.params.validate(static_cast<int32_t>(vocab_)).with_context(fmt::format("request {}", request.id)));
  if (const int64_t done = static_cast<int64_t>(resume.size()) + (request.prefilled ? 1 : 0);
      !resume.empty() && done >= request.params.max_tokens) {
    return InvalidArgument(fmt::format(
        "request {}: {} tokens were generated before, max_tokens is {}: nothing is left to "
        "generate",
        request.id, done, request.params.max_tokens));
  }
  const int64_t bs = pool_->layout().block_size;
  const int64_t need = (known + bs - 1) / bs;
  if (need > pool_->total_blocks()) {
    return ResourceExhausted(fmt::format(
        "request {}: the prompt has {} tokens ({} more generated before) and needs {} KV blocks "
        "of {} tokens; the pool has {} blocks in all (raise the KV cache size)",
        request.id, prompt.size(), resume.size(), need, bs, pool_->total_blocks()));
  }
  if (request.prefilled && (request.first_token < 0 || request.first_token >= vocab_)) {
    return InvalidArgument(fmt::format("request {}: first token {} is outside the vocabulary [0, {})",
                                       request.id, request.first_token, vocab_));
  }
  if (request.prefilled && request.kv_export) {
    return InvalidArgument(
        fmt::format("request {}: a request cannot be both prefilled and exported", request.id));
  }
  {
    std::lock_guard<std::mutex> lk(mu_);
    if (stopping_) return Unavailable(fmt::format("request {}: the engine is shutting down", request.id));
    if (in_flight_.count(request.id) != 0) {
      return AlreadyExists(fmt::format("request id {} is already in flight", request.id));
    }
    if (request.prefilled) {
      if (reserved_ids_.erase(request.id) == 0) {  // consumed: no release or expiry takes it now
        return FailedPrecondition(fmt::format(
            "request {}: no KV reservation under this id (never made, released, or its lease "
            "ended)",
            request.id));
      }
    } else if (reserved_ids_.count(request.id) != 0) {
      return AlreadyExists(fmt::format("request id {} holds a KV reservation", request.id));
    }
    in_flight_.insert(request.id);
    incoming_.push_back(
        Submission{std::move(request), std::move(on_event), std::chrono::steady_clock::now()});
    idle_ = false;
    ++published_.requests_submitted;
  }
  work_cv_.notify_one();
  return Status::Ok();
}

bool EngineLoop::cancel(RequestId id) {
  {
    std::lock_guard<std::mutex> lk(mu_);
    if (in_flight_.count(id) == 0) return false;
    cancels_.push_back(id);
  }
  work_cv_.notify_one();
  return true;
}

EngineStats EngineLoop::stats() const {
  std::lock_guard<std::mutex> lk(mu_);
  EngineStats s = published_;
  s.waiting += static_cast<int64_t>(incoming_.size());
  return s;
}

bool EngineLoop::wait_idle(std::chrono::milliseconds timeout) {
  std::unique_lock<std::mutex> lk(mu_);
  return idle_cv_.wait_for(lk, timeout, [&] {
    return (idle_ && incoming_.empty() && in_flight_.empty()) || stopped_;
  });
}

void EngineLoop::publish_stats() {
  const bool idle = requests_.empty() && scheduler_.idle();
  {
    std::lock_guard<std::mutex> lk(mu_);
    const uint64_t submitted = published_.requests_submitted;
    published_ = local_stats_;
    published_.requests_submitted = submitted;
    published_.running = scheduler_.num_running();
    published_.waiting = scheduler_.num_waiting();
    published_.blocks_total = pool_->total_blocks();
    published_.blocks_free = pool_->free_blocks();
    published_.blocks_cached = pool_->cached_blocks();
    published_.blocks_used = pool_->used_blocks();
    published_.scheduler = scheduler_.counters();
    published_.evictions = pool_->evictions();
    published_.reservations = ledger_.num_reservations();
    published_.blocks_reserved = ledger_.blocks_reserved();
    published_.blocks_pinned = ledger_.blocks_pinned();
    published_.blocks_held = ledger_.blocks_held();
    published_.leases_expired = ledger_.counters().leases_expired;
    published_.reservations_released = ledger_.counters().reservations_released;
    published_.leases_renewed = ledger_.counters().leases_renewed;
    if (idle && ledger_.idle() && incoming_.empty() && reserves_.empty()) idle_ = true;
  }
  idle_cv_.notify_all();
}

void EngineLoop::run() {
  set_thread_name(opts_.thread_name);
  std::vector<Submission> incoming;
  std::vector<RequestId> cancels;
  std::vector<std::shared_ptr<ReserveOp>> reserves;
  StateHold state(state_mu_, this);
  // Fails with INTERNAL the requests of a step that threw. plan_ may name sequences the step
  // already finished (their pointers dangle): compared, never dereferenced.
  const auto fail_scheduled = [this](const std::string& what) {
    std::vector<RequestId> ids;
    for (const auto& [id, r] : requests_) {
      const Sequence* seq = scheduler_.find(id);
      if (seq == nullptr) continue;
      for (const ScheduledChunk& c : plan_.chunks) {
        if (c.seq == seq) {
          ids.push_back(id);
          break;
        }
      }
    }
    std::sort(ids.begin(), ids.end());
    log::error("engine: a step over {} sequences threw: {}; failing {} requests",
               plan_.chunks.size(), what, ids.size());
    for (RequestId id : ids) {
      fail(id, Internal(fmt::format("request {}: the engine failed while computing it: {}", id,
                                    what)));
    }
  };
  for (;;) {
    bool stopping = false;
    {
      // Stalled (waiting for reserved or pinned blocks), the requests alone are no work: only
      // a queued change or the next lease deadline can let them fit. The state is free while
      // the thread waits: a reservation made meanwhile sets rewait_ (its lease may end first).
      const bool busy = !requests_.empty() && !stalled_;
      const auto deadline = ledger_.next_deadline();
      state.unlock();
      std::unique_lock<std::mutex> lk(mu_);
      const auto has_work = [&] {
        return stopping_ || !incoming_.empty() || !cancels_.empty() || busy || !reserves_.empty() ||
               !reservation_releases_.empty() || !pin_releases_.empty() || rewait_;
      };
      if (deadline) {
        work_cv_.wait_until(lk, *deadline, has_work);
      } else {
        work_cv_.wait(lk, has_work);
      }
      rewait_ = false;
      lk.unlock();
      state.lock();
      lk.lock();
      incoming.swap(incoming_);
      cancels.swap(cancels_);
      stopping = stopping_;
    }
    run_control_ops();
    for (Submission& s : incoming) admit(std::move(s.request), std::move(s.on_event), s.submitted);
    incoming.clear();
    for (RequestId id : cancels) cancel_now(id);
    cancels.clear();
    expire_leases();
    if (stopping) {
      std::vector<RequestId> ids;
      for (const auto& [id, r] : requests_) ids.push_back(id);
      std::sort(ids.begin(), ids.end());
      for (RequestId id : ids) fail(id, Unavailable("the engine is shutting down"));
      publish_stats();
      {
        std::lock_guard<std::mutex> lk(mu_);
        stopped_ = true;
        // Reserves that came in after the swap above: refused (the thread is leaving), outside
        // the lock, since their callbacks may call back in.
        reserves.swap(reserves_);
      }
      for (auto& op : reserves) answer(*op, Unavailable("the engine is shutting down"));
      idle_cv_.notify_all();
      return;
    }
    admit_pending_prefilled();
    stalled_ = false;
    if (!scheduler_.idle()) {
      // The thread's boundary: a throw inside a step (a sink, a hook, a bug) fails the
      // requests that step computed, not the worker.
      try {
        step(state);
      } catch (...) {
        fail_scheduled(current_exception_text());
      }
    }
    publish_stats();
  }
}

void EngineLoop::admit(EngineRequest&& req, EngineEventCallback&& cb,
                       std::chrono::steady_clock::time_point submitted) {
  auto r = std::make_unique<RequestState>(req.id, std::move(req.params), std::move(cb), *tokenizer_,
                                          eos_ids_, req.prompt.back());
  r->submitted = submitted;
  r->prompt_tokens = static_cast<int64_t>(req.prompt.size());
  if (!req.resume_tokens.empty()) {
    // Migrated: its tokens so far replay through the decoder and the stop matcher (their text
    // was delivered by the worker that generated them) and join the prompt as the scheduler's
    // known prefix; the split stays here (prompt_tokens) for sampling and usage.
    for (int32_t t : req.resume_tokens) r->finisher.replay(t);
    r->resumed = r->generated = static_cast<int64_t>(req.resume_tokens.size());
    req.prompt.insert(req.prompt.end(), req.resume_tokens.begin(), req.resume_tokens.end());
    req.resume_tokens.clear();
  }
  if (req.prefilled) {
    admit_prefilled(std::move(req), std::move(r));
    return;
  }
  r->sink = std::move(req.kv_export);
  const RequestId id = req.id;
  // A migrated request's prompt logprobs went out with its first token, elsewhere.
  const bool scores_prompt = r->params.prompt_logprobs >= 0 && r->resumed == 0;
  if (scores_prompt) r->prompt_logprobs.resize(req.prompt.size() - 1);
  const Status added = scheduler_.add(id, std::move(req.prompt), scores_prompt);
  requests_.emplace(id, std::move(r));
  if (!added.ok()) fail(id, added);
}

void EngineLoop::cancel_now(RequestId id) {
  auto it = requests_.find(id);
  if (it == requests_.end()) return;  // already finished
  EngineEvent ev;
  ev.finish_reason = FinishReason::kCancelled;
  finish(*it->second, ev);
}

void EngineLoop::step(StateHold& state) {
  const auto step_start = std::chrono::steady_clock::now();
  ledger_.schedule(plan_);
  stalled_ = plan_.empty() && plan_.blocked;
  for (const FailedSequence& f : plan_.failed) {
    fail(f.id, ResourceExhausted(fmt::format(
                   "request {} has {} tokens (prompt and generated) and needs {} KV blocks of {} "
                   "tokens; the pool has {} in all (raise the KV cache size or lower max_tokens)",
                   f.id, f.num_tokens, f.blocks_needed, pool_->layout().block_size,
                   pool_->total_blocks())));
  }
  if (plan_.empty()) return;

  batch_.clear();
  scoring_.clear();
  size_t row = 0;
  bool scoring = false;
  for (const ScheduledChunk& c : plan_.chunks) {
    std::span<float> logits;
    if (c.samples) {
      logits = std::span<float>(logits_).subspan(row * static_cast<size_t>(vocab_),
                                                 static_cast<size_t>(vocab_));
      ++row;
    }
    // A prompt whose log-probabilities are wanted: every logit row of its chunk that predicts
    // a prompt token, until they have gone out with its first token.
    RequestState* scores = nullptr;
    if (auto it = requests_.find(c.seq->id); it != requests_.end() &&
                                             !it->second->prompt_logprobs.empty() &&
                                             it->second->generated == 0 &&
                                             c.start_pos + 1 < c.seq->prompt_len) {
      scores = it->second.get();
      scoring = true;
    }
    batch_.push_back(BatchSequence{.tokens = c.tokens(), .start_pos = c.start_pos,
                                   .block_table = c.seq->block_table, .logits = logits,
                                   .all_logits = scores != nullptr});
    scoring_.push_back(scores);
  }
  exports_.clear();
  for (const ScheduledChunk& c : plan_.chunks) {
    auto it = requests_.find(c.seq->id);
    if (it == requests_.end() || !it->second->sink) continue;
    RequestState& r = *it->second;
    exports_.push_back(ExportChunk{&r, c.seq, std::min(r.export_from, c.start_pos),
                                   c.start_pos + c.num_tokens, c.samples});
  }
  ForwardHooks hooks;
  if (!exports_.empty()) hooks.on_layer_done = [this](int64_t layer) { export_layer(layer); };
  if (scoring) {
    hooks.on_token_logits = [this](size_t s, int64_t i, std::span<const float> logits) {
      RequestState& r = *scoring_[s];
      const Sequence& seq = *plan_.chunks[s].seq;
      const int64_t predicted = plan_.chunks[s].start_pos + i + 1;  // the position it predicts
      if (predicted >= seq.prompt_len ||
          predicted > static_cast<int64_t>(r.prompt_logprobs.size()))
        return;
      r.prompt_logprobs[static_cast<size_t>(predicted - 1)] = token_logprob(
          logits, seq.tokens[static_cast<size_t>(predicted)], r.params.prompt_logprobs);
    };
  }
  // Reservations asked for while this step was planned are made now, not after its forward
  // pass; those asked for during the pass are made at once on their caller's thread (the pass
  // reads only the blocks of the planned sequences, which no reservation can take).
  run_control_ops();
  const auto t0 = std::chrono::steady_clock::now();
  Status st;
  {
    struct Relock {
      StateHold& state;
      ~Relock() { state.lock(); }
    } relock{state};
    state.unlock();
    st = model_->forward_batch(batch_, *pool_, hooks);
  }
  local_stats_.forward_seconds += seconds_since(t0);
  ++local_stats_.forward_passes;
  if (!st.ok()) {
    log::error("engine: forward pass over {} sequences ({} tokens) failed: {}", plan_.chunks.size(),
               plan_.num_tokens, st.to_string());
    std::vector<SequenceId> ids;
    for (const ScheduledChunk& c : plan_.chunks) ids.push_back(c.seq->id);
    for (SequenceId id : ids) fail(id, st);
    return;
  }
  scheduler_.complete(plan_);
  for (const ExportChunk& e : exports_) e.request->export_from = std::max(e.request->export_from, e.end);

  row = 0;
  for (const ScheduledChunk& c : plan_.chunks) {
    const bool samples = c.samples;
    auto it = requests_.find(c.seq->id);
    if (it == requests_.end()) {
      if (samples) ++row;
      continue;
    }
    RequestState& r = *it->second;
    if (r.cached_prompt_tokens < 0) {  // its first admission
      r.cached_prompt_tokens = c.seq->num_cached_prompt_tokens;
      r.queue_seconds =
          std::max(0.0, std::chrono::duration<double>(step_start - r.submitted).count());
    }
    if (r.export_failed) {
      if (samples) ++row;
      fail(r.id, Unavailable(fmt::format(
                     "request {}: the transfer of its KV to the decode worker failed", r.id)));
      continue;
    }
    if (!samples) continue;
    std::span<float> logits = std::span<float>(logits_).subspan(
        row * static_cast<size_t>(vocab_), static_cast<size_t>(vocab_));
    ++row;
    sample_and_stream(r, *c.seq, logits);  // may finish r and its sequence: touch neither after
  }
}

void EngineLoop::sample_and_stream(RequestState& r, const Sequence& seq, std::span<float> logits) {
  const SamplingParams& p = r.params;
  // The request's own split, not the scheduler's: a migrated request's tokens generated
  // elsewhere are in the scheduler's prompt but are generated tokens for the sampler.
  const std::span<const int32_t> all(seq.tokens);
  const std::span<const int32_t> prompt = all.first(static_cast<size_t>(r.prompt_tokens));
  const std::span<const int32_t> generated = all.subspan(static_cast<size_t>(r.prompt_tokens));
  const int64_t pos = static_cast<int64_t>(all.size());

  EngineEvent ev;
  ev.id = r.id;
  ev.has_token = true;
  ev.sample = sample_token(logits, p, prompt, generated, static_cast<uint64_t>(pos),
                           r.finisher.suppressed(static_cast<int64_t>(generated.size())));
  ev.token = ev.sample.token;
  if (r.generated == r.resumed) {  // the first token it samples
    ev.queue_seconds = r.queue_seconds;
    ev.prompt_logprobs = std::move(r.prompt_logprobs);
    r.prompt_logprobs.clear();
  }
  r.generated = static_cast<int64_t>(generated.size()) + 1;
  ++local_stats_.tokens_generated;

  TokenFinisher::Outcome outcome = r.finisher.push(ev.token, r.generated, pos >= context_);
  ev.text = std::move(outcome.text);
  const bool ending = outcome.finished;
  if (ending) {
    ev.finish_reason = outcome.finish_reason;
    ev.stop_string = std::move(outcome.stop_string);
  }
  if (ending) {
    finish(r, ev);
    return;
  }
  if (r.sink) {  // a prefill: the decode worker goes on from this token
    ev.handoff = true;
    ev.finish_reason = FinishReason::kLength;
    finish(r, ev);
    return;
  }
  const Status appended = scheduler_.append_token(r.id, ev.token);
  if (!appended.ok()) {
    fail(r.id, Internal(appended.message()));
    return;
  }
  deliver(r, ev);
}

void EngineLoop::finish(RequestState& r, EngineEvent& ev) {
  const RequestId id = r.id;
  ev.id = id;
  ev.finished = true;
  ev.prompt_tokens = r.prompt_tokens;
  // A migrated request's cache hits may reach into its resumed tokens: only the prompt's count.
  ev.cached_prompt_tokens = std::clamp<int64_t>(r.cached_prompt_tokens, 0, r.prompt_tokens);
  ev.generated_tokens = r.generated;
  const Sequence* seq = scheduler_.find(id);
  if (seq != nullptr) ev.preemptions = seq->preemptions;
  // Writes of a prefill may still be reading its blocks: they stay pinned until release_pinned().
  const bool pin = seq != nullptr && r.sink;
  (void)ledger_.finish(id, pin);  // blocks back (or pinned) before the event goes out
  if (pin) {
    std::lock_guard<std::mutex> lk(mu_);
    pinned_ids_.insert(id);
  }
  if (!ev.error.ok()) {
    ++local_stats_.requests_failed;
  } else if (ev.finish_reason == FinishReason::kCancelled) {
    ++local_stats_.requests_cancelled;
  } else {
    ++local_stats_.requests_finished;
  }
  {
    std::lock_guard<std::mutex> lk(mu_);
    in_flight_.erase(id);
  }
  auto it = requests_.find(id);
  std::unique_ptr<RequestState> owned = std::move(it->second);
  requests_.erase(it);
  deliver(*owned, ev);
}

void EngineLoop::fail(RequestId id, const Status& error) {
  auto it = requests_.find(id);
  if (it == requests_.end()) return;
  if (error.code() != StatusCode::kUnavailable) {
    log::warn("engine: request {} failed: {}", id, error.to_string());
  }
  EngineEvent ev;
  ev.error = error;
  finish(*it->second, ev);
}

void EngineLoop::deliver(RequestState& r, const EngineEvent& ev) {
  if (!r.on_event) return;
  try {
    r.on_event(ev);
  } catch (const std::exception& e) {
    log::error("engine: the event callback of request {} threw: {}", r.id, e.what());
  } catch (...) {
    log::error("engine: the event callback of request {} threw", r.id);
  }
}

}  // namespace cleave
