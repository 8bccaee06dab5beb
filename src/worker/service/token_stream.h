// The worker's streaming RPCs (Generate, Decode) on gRPC's callback API: no thread is held per
// stream, so a decode worker carries thousands of streams on a few threads.
//
// A TokenStreamCall is the reactor of one streaming RPC. The engine's callback (engine thread)
// appends each event to the call's queue under the call's lock and, when no write is in flight
// and the call is not queued already, hands the call to the StreamPump: one thread
// ("stream-pump") that turns the next event into a TokenEvent and starts its write; OnWriteDone
// (a gRPC thread) starts the write after it. So the engine thread never touches gRPC, and one
// pump wake-up serves every stream an engine step fed.
//
// A Decode first waits for its reservation's KV without a thread: the pump polls the
// reservation table whenever the table signals a change (a notice, a release, shutdown) and
// every kCancelPoll (lease end, client gone). Then it submits the request and streams.
//
// The call ends with the request's finished event (OK), its error, or CANCELLED when the client
// went away: the request is cancelled in the engine and the call finishes when the engine
// confirms, or kCancelGrace later for a stuck engine.
//
// Thread-safety: TokenStreamPump's methods may be called from any thread.
#pragma once

#include <condition_variable>
#include <memory>
#include <mutex>
#include <thread>
#include <vector>

#include "worker_core.h"

namespace cleave::worker_service {

class TokenStreamCall;

class TokenStreamPump {
 public:
  // Starts the pump thread; the table's listener wakes it. `core` must outlive the pump.
  explicit TokenStreamPump(WorkerCore& core);
  // stop().
  ~TokenStreamPump();
  TokenStreamPump(const TokenStreamPump&) = delete;
  TokenStreamPump& operator=(const TokenStreamPump&) = delete;

  // The call has an event to write (or a state to act on) and no write in flight.
  void schedule(std::shared_ptr<TokenStreamCall> call);
  // The call is polled every kCancelPoll (and on every wake-up) until its poll returns false.
  void watch(std::shared_ptr<TokenStreamCall> call);
  void wake();
  // Joins the thread. Calls still scheduled or watched are dropped (the gRPC server has ended
  // them all by then). Idempotent.
  void stop();

  WorkerCore& core() { return core_; }

 private:
  void loop();

  WorkerCore& core_;
  std::mutex mu_;
  std::condition_variable cv_;
  bool stop_ = false;
  bool woken_ = false;
  std::vector<std::shared_ptr<TokenStreamCall>> ready_;
  std::vector<std::shared_ptr<TokenStreamCall>> watched_;
  std::thread thread_;
};

// Starts the reactor of a Generate (unified workers) or a Decode (decode workers); what the
// callback service's method returns. The reactor never reads the call's
// grpc::CallbackServerContext (gRPC may free it once OnDone has run, while the engine's callback
// or the pump still hold the reactor): cancellation reaches it through OnCancel.
grpc::ServerWriteReactor<v1::TokenEvent>* start_generate(TokenStreamPump& pump,
                                                         const v1::GenerateRequest* request);
grpc::ServerWriteReactor<v1::TokenEvent>* start_decode(TokenStreamPump& pump,
                                                       const v1::DecodeRequest* request);

}  // namespace cleave::worker_service
