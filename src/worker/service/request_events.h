// The queue between the engine thread and one RPC's thread: the engine callback copies each
// event in (short lock, never blocks on I/O) and the RPC thread takes them out in batches,
// writing to its stream with no lock held.
#pragma once

#include <chrono>
#include <condition_variable>
#include <memory>
#include <mutex>
#include <vector>

#include "cleave/worker/engine_loop.h"

namespace cleave::worker_service {

class RequestEvents {
 public:
  // The engine callback; it keeps the queue alive, so the RPC may return before the engine's
  // last event without a dangling reference.
  static EngineEventCallback callback(const std::shared_ptr<RequestEvents>& q);

  // Swaps the queued events into `out` (cleared first; its capacity is reused). Waits at most
  // `timeout` when nothing is queued; false when nothing came.
  bool take(std::vector<EngineEvent>& out, std::chrono::milliseconds timeout);

 private:
  std::mutex mu_;
  std::condition_variable cv_;
  std::vector<EngineEvent> pending_;
};

}  // namespace cleave::worker_service
