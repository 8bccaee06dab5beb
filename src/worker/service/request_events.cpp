#include "request_events.h"

namespace cleave::worker_service {

EngineEventCallback RequestEvents::callback(const std::shared_ptr<RequestEvents>& q) {
  return [q](const EngineEvent& ev) {
    {
      std::lock_guard<std::mutex> lock(q->mu_);
      q->pending_.push_back(ev);
    }
    q->cv_.notify_one();
  };
}

bool RequestEvents::take(std::vector<EngineEvent>& out, std::chrono::milliseconds timeout) {
  out.clear();
  std::unique_lock<std::mutex> lock(mu_);
  if (!cv_.wait_for(lock, timeout, [&] { return !pending_.empty(); })) return false;
  out.swap(pending_);
  return true;
}

}  // namespace cleave::worker_service
