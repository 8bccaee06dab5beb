// Dispatch fan-out of one HTTP request and the merge of its choices into one response.
#include "frontend/exchange.h"

#include "cleave/common/log.h"
#include "cleave/router/openai_response.h"
#include "frontend/router_metrics.h"

namespace cleave::router {
namespace {

double seconds(Exchange::Clock::duration d) { return std::chrono::duration<double>(d).count(); }

FinishReason parse_finish_reason(const std::string& text) {
  if (text == "length") return FinishReason::kLength;
  if (text == "cancelled" || text == "abort") return FinishReason::kCancelled;
  return FinishReason::kStop;
}

}  // namespace

// Forwards one dispatch's callbacks with its choice index.
class Exchange::Observer final : public RequestObserver {
 public:
  Observer(std::shared_ptr<Exchange> exchange, int32_t index)
      : exchange_(std::move(exchange)), index_(index) {}
  void on_event(const v1::TokenEvent& event) override { exchange_->on_event(index_, event); }
  void on_error(const Status& error, bool started) override {
    exchange_->on_error(index_, error, started);
  }

 private:
  std::shared_ptr<Exchange> exchange_;
  int32_t index_;
};

namespace {
PreparedRequest for_wire(PreparedRequest request, ExchangeWire wire) {
  if (wire == ExchangeWire::kGrpc) request.stream = true;
  return request;
}
}  // namespace

Exchange::Exchange(PreparedRequest request, const Tokenizer& tokenizer, RouterMetrics& metrics,
                   Clock::time_point arrival, ExchangeWire wire)
    : request_(for_wire(std::move(request), wire)),
      tokenizer_(tokenizer),
      metrics_(metrics),
      arrival_(arrival),
      choices_(request_.dispatches.size()),
      remaining_(static_cast<int32_t>(request_.dispatches.size())) {
  if (request_.stream) {
    stream_ = wire == ExchangeWire::kGrpc ? make_grpc_stream(request_) : make_sse_stream(request_);
  }
}

Exchange::~Exchange() = default;

void Exchange::set_notify(std::function<void()> notify) {
  std::lock_guard<std::mutex> lk(mu_);
  notify_ = std::move(notify);
}

void Exchange::detach() {
  std::function<void()> old;
  {
    std::lock_guard<std::mutex> lk(mu_);
    old.swap(notify_);
  }
  // `old` (and the session it may hold) goes here, outside the lock.
}

int64_t Exchange::prompt_tokens_of(int32_t index) const {
  return request_.prompt_tokens[static_cast<size_t>(index / request_.n)];
}

std::optional<openai::ApiError> Exchange::start(Dispatcher& dispatcher) {
  auto self = shared_from_this();
  for (size_t i = 0; i < request_.dispatches.size(); ++i) {
    const auto index = static_cast<int32_t>(i);
    metrics_.requests_waiting->add(1);
    {
      std::lock_guard<std::mutex> lk(mu_);
      choices_[i].submitted = Clock::now();
    }
    // The dispatch request is copied: request_ stays whole for the response (prompt counts).
    auto handle = dispatcher.submit(request_.dispatches[i], std::make_shared<Observer>(self, index));
    bool cancel_now = false;
    {
      std::lock_guard<std::mutex> lk(mu_);
      if (!handle.ok()) {
        if (choices_[i].phase != Phase::kDone) {
          // Not counted as aborted: it never ran.
          choices_[i].phase = Phase::kDone;
          metrics_.requests_waiting->add(-1);
        }
        if (state_ == ExchangeState::kActive) fail_locked(openai::from_status(handle.status()));
      } else {
        if (state_ == ExchangeState::kActive) {
          handles_.push_back(*handle);
        } else {
          cancel_now = true;
        }
      }
    }
    if (cancel_now) (*handle)->cancel();
    if (!handle.ok()) break;
  }
  std::optional<openai::ApiError> error;
  {
    std::lock_guard<std::mutex> lk(mu_);
    // A failure during start (at submit, or reported at once by a callback) answers the request
    // whatever was produced meanwhile: nothing has been taken, so nothing was sent.
    if (state_ == ExchangeState::kFailed || state_ == ExchangeState::kFailedAfterOpen) {
      error = error_ ? *error_ : openai::internal_error("a dispatch failed");
    }
  }
  if (error) cancel();
  return error;
}

void Exchange::fill_logprob(const v1::TokenEvent& event, openai::LogprobToken* out) const {
  out->token = tokenizer_.token_to_piece(event.token(), /*render_special=*/true);
  out->logprob = event.logprob();
  out->top.resize(static_cast<size_t>(event.top_logprobs_size()));
  for (int k = 0; k < event.top_logprobs_size(); ++k) {
    const auto& alt = event.top_logprobs(k);
    out->top[static_cast<size_t>(k)].token = tokenizer_.token_to_piece(alt.token(), true);
    out->top[static_cast<size_t>(k)].logprob = alt.logprob();
  }
}

void Exchange::on_event(int32_t index, const v1::TokenEvent& event) {
  const auto now = Clock::now();
  std::lock_guard<std::mutex> lk(mu_);
  if (state_ != ExchangeState::kActive) return;
  if (index < 0 || static_cast<size_t>(index) >= choices_.size()) return;
  Choice& c = choices_[static_cast<size_t>(index)];
  if (c.phase == Phase::kDone) return;
  if (c.phase == Phase::kQueued) {
    c.phase = Phase::kRunning;
    metrics_.requests_waiting->add(-1);
    metrics_.requests_running->add(1);
    // Queue time: the router's part (parsing, template, tokenization) and the wait in the
    // worker engine's queue that the worker reports on the first token.
    const double worker_queue = event.queue_seconds() > 0 ? event.queue_seconds() : 0.0;
    metrics_.queue_time->observe(seconds(c.submitted - arrival_) + worker_queue);
  }
  if (event.has_token()) {
    if (!c.has_token) {
      metrics_.time_to_first_token->observe(seconds(now - arrival_));
    } else {
      metrics_.inter_token_latency->observe(seconds(now - c.last_token));
    }
    c.has_token = true;
    c.last_token = now;
  }
  std::optional<FinishReason> finish;
  if (event.finished()) finish = parse_finish_reason(event.finish_reason());
  const bool with_logprob = request_.logprobs && event.has_token();

  if (request_.stream) {
    if (!opened_) {
      opened_ = true;
      open_pending_ = true;
    }
    if (request_.echo && !c.echoed) {
      c.echoed = true;
      const auto& text = request_.prompt_texts[static_cast<size_t>(index / request_.n)];
      if (!text.empty()) stream_->chunk(index, text, -1, nullptr, std::nullopt);
    }
    if (request_.echo_only) {
      if (finish) stream_->chunk(index, "", -1, nullptr, finish);
    } else if (event.has_token() || finish || !event.text().empty()) {
      if (with_logprob) fill_logprob(event, &scratch_logprob_);
      stream_->chunk(index, event.text(), event.has_token() ? event.token() : -1,
                     with_logprob ? &scratch_logprob_ : nullptr, finish);
    }
  } else {
    if (request_.echo && !c.echoed) {
      c.echoed = true;
      const auto prompt = static_cast<size_t>(index / request_.n);
      c.text = request_.prompt_texts[prompt];
      if (request_.logprobs) {
        // The prompt's tokens: the first without a logprob, then what the worker computed.
        c.logprobs.emplace();
        openai::LogprobToken& first = c.logprobs->emplace_back();
        first.token = tokenizer_.token_to_piece(request_.prompt_first_ids[prompt], true);
        first.has_logprob = false;
        for (const v1::PromptLogprob& p : event.prompt_logprobs()) {
          openai::LogprobToken& t = c.logprobs->emplace_back();
          t.token = tokenizer_.token_to_piece(p.token(), true);
          t.logprob = p.logprob();
          for (const v1::TopLogprob& alt : p.top_logprobs()) {
            t.top.push_back({tokenizer_.token_to_piece(alt.token(), true), alt.logprob()});
          }
        }
      }
    }
    if (!request_.echo_only) {
      c.text += event.text();
      if (request_.logprobs) {
        if (!c.logprobs) c.logprobs.emplace();
        if (with_logprob) fill_logprob(event, &c.logprobs->emplace_back());
      }
    }
  }
  if (finish) finish_choice_locked(c, event, *finish);
  notify_locked();
}

void Exchange::finish_choice_locked(Choice& c, const v1::TokenEvent& event, FinishReason reason) {
  c.phase = Phase::kDone;
  // max_tokens 0: the token that ended the workers' part is not part of the response.
  c.finish = request_.echo_only ? FinishReason::kLength : reason;
  c.completion_tokens = request_.echo_only ? 0 : event.usage().completion_tokens();
  c.cached_tokens = event.usage().cached_prompt_tokens();
  metrics_.requests_running->add(-1);
  metrics_.e2e_latency->observe(seconds(Clock::now() - arrival_));
  const auto index = static_cast<int32_t>(&c - choices_.data());
  metrics_.prompt_tokens->inc(static_cast<double>(prompt_tokens_of(index)));
  metrics_.cached_prompt_tokens->inc(static_cast<double>(c.cached_tokens));
  metrics_.generation_tokens->inc(static_cast<double>(c.completion_tokens));
  switch (reason) {
    case FinishReason::kStop: metrics_.success_stop->inc(); break;
    case FinishReason::kLength: metrics_.success_length->inc(); break;
    case FinishReason::kCancelled: metrics_.success_abort->inc(); break;
  }
  if (--remaining_ == 0) complete_locked();
}

void Exchange::complete_locked() {
  openai::Usage usage;
  for (int64_t t : request_.prompt_tokens) usage.prompt_tokens += t;
  for (size_t i = 0; i < choices_.size(); ++i) {
    usage.completion_tokens += choices_[i].completion_tokens;
    // The prompt is counted once per prompt, so are its cached tokens (its first choice's).
    if (i % static_cast<size_t>(request_.n) == 0) usage.cached_tokens += choices_[i].cached_tokens;
  }
  state_ = ExchangeState::kComplete;
  if (request_.stream) {
    stream_->complete(usage);
    return;
  }
  std::vector<openai::ChoiceOutput> out(choices_.size());
  for (size_t i = 0; i < choices_.size(); ++i) {
    out[i].index = static_cast<int32_t>(i);
    out[i].text = std::move(choices_[i].text);
    out[i].finish_reason = choices_[i].finish;
    out[i].logprobs = std::move(choices_[i].logprobs);
    if (request_.logprobs && !out[i].logprobs) out[i].logprobs.emplace();
  }
  pending_ = request_.endpoint == openai::Endpoint::kChatCompletions
                 ? openai::chat_completion_response_json(request_.id, request_.created,
                                                         request_.model, out, usage)
                 : openai::completion_response_json(request_.id, request_.created,
                                                    request_.model, out, usage);
}

void Exchange::retire_locked(Choice& c, bool aborted) {
  if (c.phase == Phase::kDone) return;
  if (c.phase == Phase::kQueued) metrics_.requests_waiting->add(-1);
  if (c.phase == Phase::kRunning) metrics_.requests_running->add(-1);
  c.phase = Phase::kDone;
  if (aborted) metrics_.success_abort->inc();
}

void Exchange::fail_locked(const openai::ApiError& error) {
  for (auto& c : choices_) {
    if (c.phase != Phase::kDone) {
      retire_locked(c, /*aborted=*/true);
      cancel_needed_ = true;
    }
  }
  error_ = error;
  if (request_.stream && opened_) {
    stream_->fail(error);
    state_ = ExchangeState::kFailedAfterOpen;
  } else {
    if (stream_) stream_->discard();
    pending_.clear();
    state_ = ExchangeState::kFailed;
  }
}

void Exchange::on_error(int32_t index, const Status& error, bool started) {
  std::lock_guard<std::mutex> lk(mu_);
  if (state_ != ExchangeState::kActive) return;
  if (index < 0 || static_cast<size_t>(index) >= choices_.size()) return;
  Choice& c = choices_[static_cast<size_t>(index)];
  if (c.phase == Phase::kDone) return;
  retire_locked(c, /*aborted=*/false);
  log::warn("request {} choice {} failed{}: {}", request_.id, index,
            started ? " after it started" : "", error.to_string());
  fail_locked(openai::from_status(error));
  notify_locked();
}

void Exchange::notify_locked() {
  if (notify_pending_ || !notify_) return;
  notify_pending_ = true;
  notify_();
}

void Exchange::take(ExchangeOutput& out) {
  out.bytes.clear();
  out.has_message = false;
  std::lock_guard<std::mutex> lk(mu_);
  notify_pending_ = false;
  if (stream_) {
    stream_->take(out);
  } else {
    out.bytes.swap(pending_);
  }
  out.open = open_pending_;
  open_pending_ = false;
  out.state = state_;
  out.error = state_ == ExchangeState::kFailed || state_ == ExchangeState::kFailedAfterOpen
                  ? error_
                  : std::nullopt;
  out.cancel_dispatches = cancel_needed_;
  cancel_needed_ = false;
}

void Exchange::cancel() {
  std::vector<std::shared_ptr<DispatchHandle>> handles;
  {
    std::lock_guard<std::mutex> lk(mu_);
    if (state_ == ExchangeState::kActive) {
      state_ = ExchangeState::kCancelled;
      for (auto& c : choices_) retire_locked(c, /*aborted=*/true);
    }
    handles.swap(handles_);
    cancel_needed_ = false;
  }
  for (auto& h : handles) h->cancel();
}

}  // namespace cleave::router
