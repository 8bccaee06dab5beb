// The Dispatcher: admission (queue limit, no worker), the watchdog thread of stage deadlines,
// shutdown, and make_dispatcher.
#include <algorithm>
#include <chrono>
#include <condition_variable>
#include <mutex>
#include <optional>
#include <thread>

#include "cleave/common/log.h"
#include "cleave/common/thread_pool.h"
#include "cleave/router/dispatch_options.h"
#include "dispatch/dispatch_call.h"
#include "dispatch/worker_discovery.h"
#include "fmt/format.h"

namespace cleave::router {

namespace {

// How long shutdown() waits, beyond the cleanup RPCs' own deadline (an ended request's Abort or
// Release may still be in flight), for the ended requests' gRPC callbacks to drop the
// dispatcher's state.
constexpr auto kCoreReleaseMargin = std::chrono::seconds(1);

// The core holds the pools' channels, which must not be destroyed on one of gRPC's callback
// threads (worker_pools.h). Its owner deletes it at once (t_owner_releases); a last reference
// dropped anywhere else (a callback that outlived shutdown's wait, a caller's handle) hands the
// deletion to a thread of its own.
thread_local bool t_owner_releases = false;

void delete_core(DispatchCore* core) {
  if (t_owner_releases) {
    delete core;
    return;
  }
  std::thread([core] {
    set_thread_name("dispatch-free");
    delete core;
  }).detach();
}

class DispatcherImpl final : public Dispatcher {
 public:
  explicit DispatcherImpl(const DispatcherOptions& options)
      : core_(new DispatchCore(options), delete_core),
        discovery_(std::make_unique<WorkerDiscovery>(options, core_->pools)) {
    discovery_->start();
    watch_ = std::thread([this] { watch_loop(); });
  }

  ~DispatcherImpl() override {
    shutdown();
    discovery_.reset();  // it reads the core's pools
    t_owner_releases = true;
    core_.reset();
    t_owner_releases = false;
  }

  Result<std::shared_ptr<DispatchHandle>> submit(DispatchRequest request,
                                                 std::shared_ptr<RequestObserver> observer) override {
    if (core_->stopping.load()) return Unavailable("the router is shutting down");
    if (!observer) return InvalidArgument("submit: no observer");
    if (request.prompt.empty()) return InvalidArgument("the prompt has no tokens");
    const int64_t limit = core_->options.queue_limit;
    if (core_->admitted.fetch_add(1, std::memory_order_acq_rel) >= limit) {
      core_->admitted.fetch_sub(1, std::memory_order_acq_rel);
      return ResourceExhausted(fmt::format(
          "the router's queue is full: {} requests are in flight (queue_limit)", limit));
    }
    // Queued (empty) behind the requests already waiting for room on a prefill worker, in
    // arrival order, or when no prefill worker has room for it now.
    std::optional<Assignment> workers;
    if (!core_->has_waiting()) {
      bool busy = false;
      auto chosen = core_->pools.choose(request.prompt, {},
                                        static_cast<int64_t>(request.prompt.size()), &busy);
      if (!chosen.ok() && !busy) {
        core_->admitted.fetch_sub(1, std::memory_order_acq_rel);
        return chosen.status();
      }
      if (chosen.ok()) workers = std::move(*chosen);
    }
    auto call = std::make_shared<DispatchCall>(core_, std::move(request), std::move(observer));
    core_->add_call(call);
    if (workers) {
      call->start(std::move(*workers));
    } else {
      call->start_queued();
    }
    return std::shared_ptr<DispatchHandle>(call);
  }

  bool ready() const override { return !core_->stopping.load() && core_->pools.ready(); }

  Status readiness() const override {
    if (core_->stopping.load()) return Unavailable("the router is shutting down");
    return core_->pools.readiness();
  }

  std::vector<PoolSnapshot> pools() const override { return core_->pools.snapshot(); }

  v1::WorkerInfo model_info() const override { return core_->pools.model_info(); }

  void shutdown() override {
    std::lock_guard<std::mutex> lock(shutdown_mu_);  // a concurrent shutdown finishes first
    if (shut_down_) return;
    shut_down_ = true;
    core_->stopping.store(true);
    discovery_->stop();
    std::vector<std::shared_ptr<DispatchCall>> calls;
    core_->calls_in_flight(calls);
    const Status why = Unavailable("the router is shutting down");
    for (auto& c : calls) c->abandon(why);
    calls.clear();
    const auto bound = core_->options.timeouts.cleanup + std::chrono::seconds(2);
    if (!core_->wait_no_calls(bound)) {
      log::warn("dispatch: requests still in flight {} ms after shutdown began", bound.count());
    }
    {
      std::lock_guard<std::mutex> wl(watch_mu_);
      watch_stop_ = true;
    }
    watch_cv_.notify_all();
    if (watch_.joinable()) watch_.join();
    // The ended calls' last references go on gRPC's callback threads a moment after their end;
    // the core, with the channels of its pools, must be destroyed here, not there (see
    // worker_pools.h). A handle its caller still holds keeps it past the bound.
    const auto until =
        std::chrono::steady_clock::now() + core_->options.timeouts.cleanup + kCoreReleaseMargin;
    while (core_.use_count() > 1 && std::chrono::steady_clock::now() < until) {
      std::this_thread::sleep_for(std::chrono::milliseconds(1));
    }
    if (core_.use_count() > 1) {
      log::debug("dispatch: {} request(s) still hold the dispatcher's state after its shutdown",
                 core_.use_count() - 1);
    }
  }

 private:
  void watch_loop() {
    set_thread_name("dispatch-watch");
    std::vector<std::shared_ptr<DispatchCall>> calls;  // reused: no allocation per round
    std::unique_lock<std::mutex> lock(watch_mu_);
    while (!watch_cv_.wait_for(lock, core_->watch_period, [&] { return watch_stop_; })) {
      lock.unlock();
      // Room a lost wake-up, a new worker or a recovered one made.
      core_->admit_waiting();
      core_->calls_in_flight(calls);
      const auto now = std::chrono::steady_clock::now();
      // Outside every lock: a cancellation may run its completion on this thread.
      for (auto& c : calls) c->check_deadline(now);
      calls.clear();
      lock.lock();
    }
  }

  std::shared_ptr<DispatchCore> core_;
  std::unique_ptr<WorkerDiscovery> discovery_;
  std::thread watch_;
  std::mutex watch_mu_;
  std::condition_variable watch_cv_;
  bool watch_stop_ = false;
  std::mutex shutdown_mu_;
  bool shut_down_ = false;
};

}  // namespace

Result<std::unique_ptr<Dispatcher>> make_dispatcher(const DispatcherOptions& options) {
  CLEAVE_RETURN_IF_ERROR(validate_dispatcher_options(options));
  return std::unique_ptr<Dispatcher>(new DispatcherImpl(options));
}

}  // namespace cleave::router
