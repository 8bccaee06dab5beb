// run_request and wait_until_ready (run_request.h): a blocking wait on the dispatcher's
// asynchronous run of one request.
#include "cleave/router/run_request.h"

#include <condition_variable>
#include <memory>
#include <mutex>
#include <thread>

namespace cleave::router {
namespace {

using Clock = std::chrono::steady_clock;

double seconds_since(Clock::time_point t0) {
  return std::chrono::duration<double>(Clock::now() - t0).count();
}

// What the observer and the waiting caller share. The observer's fields are written on the
// dispatcher's threads (one callback at a time) and read by the caller after `released`.
struct RunState {
  const TokenEventCallback* on_event = nullptr;
  Clock::time_point t0;

  std::mutex mu;
  std::condition_variable cv;
  bool released = false;                   // the dispatcher let go of the observer
  bool cancel = false;                     // on_event returned false before the end
  std::shared_ptr<DispatchHandle> handle;  // set once submit() has returned

  // Callback side.
  RequestOutcome out;
  bool prefilled = false;
  bool failed = false;
  Status error;
};

// Forwards the events to the caller's callback. The dispatcher holds the only reference to
// it until the request is over (dispatcher.h): its destructor tells the caller so.
class RunObserver final : public RequestObserver {
 public:
  explicit RunObserver(std::shared_ptr<RunState> s) : s_(std::move(s)) {}

  ~RunObserver() override {
    std::lock_guard<std::mutex> lock(s_->mu);
    s_->released = true;
    s_->cv.notify_all();
  }

  void on_prefilled(const PrefillFigures& f) override {
    s_->prefilled = true;
    s_->out.kv_bytes = f.kv_bytes;
    s_->out.kv_tail_seconds = f.kv_tail_seconds;
  }

  void on_event(const v1::TokenEvent& ev) override {
    if (cancelling()) return;  // events that came before the dispatcher heard of the cancel
    RequestOutcome& out = s_->out;
    const bool first = out.events == 0;
    if (first) out.ttft_seconds = seconds_since(s_->t0);
    ++out.events;
    const bool keep_going = (*s_->on_event)(ev);
    if (ev.finished()) {
      out.last = ev;
      return;
    }
    if (first && s_->prefilled && keep_going) out.handed_off = true;
    if (keep_going) return;
    std::shared_ptr<DispatchHandle> handle;
    {
      std::lock_guard<std::mutex> lock(s_->mu);
      s_->cancel = true;
      handle = s_->handle;
    }
    // From inside the callback the dispatcher defers it until we return. Without the handle
    // yet, the caller cancels once submit() has returned.
    if (handle) handle->cancel();
  }

  void on_error(const Status& error, bool started) override {
    (void)started;
    if (cancelling()) return;
    s_->failed = true;
    s_->error = error;
  }

 private:
  bool cancelling() {
    std::lock_guard<std::mutex> lock(s_->mu);
    return s_->cancel;
  }

  const std::shared_ptr<RunState> s_;
};

}  // namespace

Result<RequestOutcome> run_request(Dispatcher& dispatcher, DispatchRequest request,
                                   const TokenEventCallback& on_event) {
  auto state = std::make_shared<RunState>();
  state->on_event = &on_event;
  state->t0 = Clock::now();
  auto handle = dispatcher.submit(std::move(request), std::make_shared<RunObserver>(state));
  if (!handle.ok()) return handle.status();
  bool cancel_now = false;
  {
    std::lock_guard<std::mutex> lock(state->mu);
    state->handle = *handle;
    cancel_now = state->cancel;
  }
  if (cancel_now) (*handle)->cancel();
  {
    std::unique_lock<std::mutex> lock(state->mu);
    state->cv.wait(lock, [&] { return state->released; });
    state->out.cancelled = state->cancel;
    state->handle.reset();
  }
  if (state->out.cancelled) {
    state->out.last.Clear();
  } else if (state->failed) {
    return state->error;
  } else if (!state->out.last.finished()) {
    return Internal("the dispatcher ended the request without a finished event or an error");
  }
  state->out.total_seconds = seconds_since(state->t0);
  return std::move(state->out);
}

Status wait_until_ready(const Dispatcher& dispatcher, std::chrono::milliseconds timeout) {
  const auto until = Clock::now() + timeout;
  for (;;) {
    Status why = dispatcher.readiness();
    if (why.ok() || why.code() == StatusCode::kFailedPrecondition || Clock::now() >= until) {
      return why;
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
}

}  // namespace cleave::router
