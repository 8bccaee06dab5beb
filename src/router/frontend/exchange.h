// One API request in flight (HTTP or gRPC): its dispatches (one per choice) and the response
// they build.
//
// The dispatcher's callbacks (gRPC threads) call into the Exchange: under its mutex, with no
// I/O, each event is appended to the response: streaming, through the exchange's
// ExchangeStream (HTTP: SSE chunks into a pending buffer; gRPC: deltas into a pending
// GenerateTextResponse); otherwise, into the choice's text and logprobs. Then the owner is woken
// (`notify`, at most once until the next take()): the HTTP session posts to its strand, the gRPC
// reactor writes when no write is in flight, and calls take(), which hands over the pending
// output by swapping buffers (no copy, no allocation once both have grown). Nothing here
// touches a socket.
//
// Life: start() submits the dispatches; the response ends when every choice has finished
// (kComplete), when a dispatch fails (kFailed before the stream opened: the response is the
// error; kFailedAfterOpen: the stream got an error event and [DONE]), or on cancel()
// (kCancelled: client gone or server stopping). A failure leaves the other dispatches running
// until the owner calls cancel() (take() says so): DispatchHandle::cancel may wait for a
// callback, so it is never called from one.
//
// Thread-safety: every method may be called from any thread; notify runs on the caller's
// thread under the mutex and must only post.
#pragma once

#include <chrono>
#include <cstdint>
#include <functional>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <vector>

#include "cleave/router/dispatcher.h"
#include "cleave/router/openai_error.h"
#include "cleave/router/openai_response.h"
#include "cleave/router/router_frontend.h"
#include "cleave/v1/inference.pb.h"

namespace cleave::router {

struct RouterMetrics;

enum class ExchangeState : uint8_t {
  kActive,           // dispatches running
  kComplete,         // every choice finished: the response is whole
  kFailed,           // failed before anything was sent: answer with ExchangeOutput::error
  kFailedAfterOpen,  // the stream ended with an error event: close the connection after it
  kCancelled,        // cancel() was called
};

// What take() hands over.
struct ExchangeOutput {
  // HTTP streaming: SSE bytes to send after the previous ones. HTTP non-streaming, kComplete:
  // the JSON body of the response.
  std::string bytes;
  // gRPC: the deltas (and, at the end, the usage) to write next; `has_message` when there are.
  v1::GenerateTextResponse message;
  bool has_message = false;
  bool open = false;  // streaming: the stream opened; send the response head before `bytes`
  ExchangeState state = ExchangeState::kActive;
  std::optional<openai::ApiError> error;  // kFailed and kFailedAfterOpen
  bool cancel_dispatches = false;         // dispatches still run after a failure: cancel()
};

// The wire a streaming exchange writes: SSE for the HTTP API, GenerateTextResponse messages
// for the gRPC API (always streaming).
enum class ExchangeWire : uint8_t { kHttp, kGrpc };

// How a streaming exchange writes its output. Called under the exchange's mutex; no I/O.
class ExchangeStream {
 public:
  virtual ~ExchangeStream() = default;
  // One chunk of choice `index`: `text` (may be empty), the token it came with (-1: none, as for
  // an echoed prompt), that token's logprob (null: none) and the finish on the choice's last
  // chunk.
  virtual void chunk(int32_t index, std::string_view text, int32_t token,
                     const openai::LogprobToken* logprob, std::optional<FinishReason> finish) = 0;
  // Every choice has finished: the end of the stream, with the request's usage.
  virtual void complete(const openai::Usage& usage) = 0;
  // The stream fails after it opened (what it delivered stays delivered).
  virtual void fail(const openai::ApiError& error) = 0;
  // Drops what was not taken yet (a failure before the stream opened answers with the error).
  virtual void discard() = 0;
  // Moves what was written since the last take into `out` (swapping buffers).
  virtual void take(ExchangeOutput& out) = 0;
};

// The stream of each wire (exchange_sse.cpp, grpc/grpc_stream.cpp).
std::unique_ptr<ExchangeStream> make_sse_stream(const PreparedRequest& request);
std::unique_ptr<ExchangeStream> make_grpc_stream(const PreparedRequest& request);

class Exchange : public std::enable_shared_from_this<Exchange> {
 public:
  using Clock = std::chrono::steady_clock;

  // `tokenizer` and `metrics` must outlive the exchange. `arrival`: when the request was read.
  // kGrpc exchanges always stream (request.stream is taken as true).
  Exchange(PreparedRequest request, const Tokenizer& tokenizer, RouterMetrics& metrics,
           Clock::time_point arrival, ExchangeWire wire = ExchangeWire::kHttp);
  ~Exchange();

  // Set before start(): called when take() has something new (see above).
  void set_notify(std::function<void()> notify);
  // Drops the notify function (and whatever it holds). Idempotent.
  void detach();

  // Submits every dispatch, with no lock held. A submit that fails cancels the dispatches
  // already submitted and returns the error that answers the request (nothing has been sent:
  // the caller has not taken anything yet).
  std::optional<openai::ApiError> start(Dispatcher& dispatcher);

  void take(ExchangeOutput& out);

  // Ends every dispatch still running (their blocks go back to the pool); returns once no
  // callback runs any more. Idempotent.
  void cancel();

  bool streaming() const { return request_.stream; }

 private:
  class Observer;
  enum class Phase : uint8_t { kQueued, kRunning, kDone };
  struct Choice {
    Phase phase = Phase::kQueued;
    bool has_token = false;
    bool echoed = false;
    Clock::time_point last_token{};
    Clock::time_point submitted{};  // handed to the dispatcher
    std::string text;                                          // non-streaming
    std::optional<std::vector<openai::LogprobToken>> logprobs;  // non-streaming
    FinishReason finish = FinishReason::kLength;
    int64_t completion_tokens = 0;
    int64_t cached_tokens = 0;
  };

  void on_event(int32_t index, const v1::TokenEvent& event);
  void on_error(int32_t index, const Status& error, bool started);
  void finish_choice_locked(Choice& c, const v1::TokenEvent& event, FinishReason reason);
  void complete_locked();
  // Takes a choice that has not finished out of the gauges (and counts it aborted).
  void retire_locked(Choice& c, bool aborted);
  void fail_locked(const openai::ApiError& error);
  void notify_locked();
  void fill_logprob(const v1::TokenEvent& event, openai::LogprobToken* out) const;
  int64_t prompt_tokens_of(int32_t index) const;

  const PreparedRequest request_;
  const Tokenizer& tokenizer_;
  RouterMetrics& metrics_;
  const Clock::time_point arrival_;

  std::mutex mu_;
  ExchangeState state_ = ExchangeState::kActive;
  std::function<void()> notify_;
  bool notify_pending_ = false;
  std::unique_ptr<ExchangeStream> stream_;  // streaming only
  std::string pending_;  // non-streaming: the response body once complete
  bool opened_ = false;
  bool open_pending_ = false;
  std::optional<openai::ApiError> error_;
  bool cancel_needed_ = false;
  std::vector<Choice> choices_;
  int32_t remaining_ = 0;
  std::vector<std::shared_ptr<DispatchHandle>> handles_;
  openai::LogprobToken scratch_logprob_;  // streaming: reused per token
};

}  // namespace cleave::router
