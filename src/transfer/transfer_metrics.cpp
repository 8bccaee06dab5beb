// Metrics counters and the completion state of transfers.
#include <bit>

#include "fmt/format.h"

#include "transfer_internal.h"

namespace cleave::transfer {

void MetricsCounters::init(std::string provider, int rails) {
  provider_ = std::move(provider);
  rails_ = rails;
  rail_bytes_ = std::make_unique<std::atomic<uint64_t>[]>(static_cast<size_t>(rails));
  rail_writes_ = std::make_unique<std::atomic<uint64_t>[]>(static_cast<size_t>(rails));
  for (int i = 0; i < rails; ++i) {
    rail_bytes_[i].store(0);
    rail_writes_[i].store(0);
  }
}

void MetricsCounters::add_rail_write(int rail, uint64_t bytes) {
  rail_bytes_[rail].fetch_add(bytes, std::memory_order_relaxed);
  rail_writes_[rail].fetch_add(1, std::memory_order_relaxed);
}

MetricsCounters::PeerAtomics* MetricsCounters::peer_counters(uint64_t peer_engine) {
  std::lock_guard<std::mutex> lock(peers_mu_);
  auto& p = peers_[peer_engine];
  if (!p) p = std::make_unique<PeerAtomics>();
  return p.get();
}

void MetricsCounters::add_transfer(PeerAtomics* peer, uint64_t bytes, Clock::duration latency,
                                   bool ok) {
  auto us = std::chrono::duration_cast<std::chrono::microseconds>(latency).count();
  size_t bucket = us <= 0 ? 0 : static_cast<size_t>(std::bit_width(static_cast<uint64_t>(us)));
  bucket = std::min<size_t>(bucket, TransferMetricsSnapshot::kLatencyBuckets - 1);
  if (ok) latency_[bucket].fetch_add(1, std::memory_order_relaxed);
  if (!peer) return;
  if (ok) {
    peer->bytes.fetch_add(bytes, std::memory_order_relaxed);
    peer->transfers.fetch_add(1, std::memory_order_relaxed);
  } else {
    peer->failures.fetch_add(1, std::memory_order_relaxed);
  }
}

void MetricsCounters::add_error(TransferErrorKind kind) {
  errors_[static_cast<size_t>(kind)].fetch_add(1, std::memory_order_relaxed);
}

TransferMetricsSnapshot MetricsCounters::snapshot() const {
  TransferMetricsSnapshot s;
  s.provider = provider_;
  for (int i = 0; i < rails_; ++i) {
    s.rail_bytes.push_back(rail_bytes_[i].load());
    s.rail_writes.push_back(rail_writes_[i].load());
  }
  for (size_t i = 0; i < latency_.size(); ++i) s.latency_us_buckets[i] = latency_[i].load();
  for (size_t i = 0; i < errors_.size(); ++i) s.errors[i] = errors_[i].load();
  s.notices_sent = notices_sent_.load();
  s.notices_received = notices_received_.load();
  std::lock_guard<std::mutex> lock(peers_mu_);
  for (const auto& [engine, p] : peers_) {
    auto& out = s.peers[engine];
    out.bytes = p->bytes.load(std::memory_order_relaxed);
    out.transfers = p->transfers.load(std::memory_order_relaxed);
    out.failures = p->failures.load(std::memory_order_relaxed);
  }
  return s;
}

bool TransferState::finish(Status s, std::optional<TransferErrorKind> kind) {
  std::vector<std::function<void()>> callbacks;
  {
    std::lock_guard<std::mutex> lock(mu);
    if (done) return false;
    done = true;
    end = Clock::now();
    status = std::move(s);
    finished.store(true, std::memory_order_release);
    callbacks.swap(on_done);
  }
  if (metrics) {
    if (kind) metrics->add_error(*kind);
    metrics->add_transfer(peer ? peer->stats : nullptr, bytes, end - start, status.ok());
  }
  cv.notify_all();
  for (auto& fn : callbacks) fn();
  return true;
}

void TransferHandle::on_done(std::function<void()> fn) const {
  if (!state_) {
    fn();
    return;
  }
  {
    std::lock_guard<std::mutex> lock(state_->mu);
    if (!state_->done) {
      state_->on_done.push_back(std::move(fn));
      return;
    }
  }
  fn();
}

bool TransferState::fail_if_past_deadline(Clock::time_point now, std::string_view what) {
  if (now < post_by) return false;
  finish(DeadlineExceeded(fmt::format(
             "{} to peer {:016x} not posted: the transfer's deadline passed {} us ago (the "
             "destination stops accepting writes then)",
             what, peer ? peer->engine_id : 0,
             std::chrono::duration_cast<std::chrono::microseconds>(now - post_by).count())),
         TransferErrorKind::kPastDeadline);
  return true;
}

std::optional<std::chrono::steady_clock::time_point> TransferHandle::completed_at() const {
  if (!state_ || !state_->is_done()) return std::nullopt;
  std::lock_guard<std::mutex> lock(state_->mu);
  return state_->end;
}

std::optional<Status> TransferHandle::poll() const {
  if (!state_) return FailedPrecondition("poll() on an empty transfer handle");
  if (!state_->is_done() && state_->driver) state_->driver->drive_progress();
  if (!state_->is_done()) return std::nullopt;
  std::lock_guard<std::mutex> lock(state_->mu);
  return state_->status;
}

// The waiter drives progress itself (no hand-off from the progress thread, no wake-up latency)
// and keeps polling while completions keep coming: providers with manual progress (tcp, shm)
// move data only while somebody polls, and the rail's own thread backs off meanwhile, so that
// one thread polls. After s.hot (transfer.idle_poll_us) without a completion, or when every rail
// is driven by somebody else, it sleeps on the transfer's condition variable in short slices,
// driving a pass after each (the rail threads finish the transfer meanwhile).
Status TransferHandle::wait(std::chrono::milliseconds timeout) const {
  if (!state_) return FailedPrecondition("wait() on an empty transfer handle");
  TransferState& s = *state_;
  const bool forever = timeout == std::chrono::milliseconds::max();
  const auto deadline = forever ? Clock::time_point::max() : Clock::now() + timeout;
  constexpr auto kShared = std::chrono::microseconds(200);
  constexpr auto kNap = std::chrono::milliseconds(1);
  auto last_event = Clock::now();
  auto last_drive = last_event;
  while (!s.is_done()) {
    ProgressDriver::Pass pass = s.driver ? s.driver->drive_progress() : ProgressDriver::Pass{};
    if (s.is_done()) break;
    auto now = Clock::now();
    if (pass.events > 0) last_event = now;
    if (pass.rails > 0) last_drive = now;
    if (now >= deadline) {
      return DeadlineExceeded(fmt::format("transfer of {} bytes still in flight after {} ms",
                                          s.bytes, timeout.count()));
    }
    if (now - last_event < s.hot && now - last_drive < kShared) {
      std::this_thread::yield();
      continue;
    }
    std::unique_lock<std::mutex> lock(s.mu);
    auto until = std::min(deadline, now + kNap);
    s.cv.wait_until(lock, until, [&] { return s.done; });
    last_event = last_drive = Clock::now() - s.hot / 2;  // poll a little after each nap
  }
  std::lock_guard<std::mutex> lock(s.mu);
  return s.status;
}

uint64_t TransferHandle::bytes() const { return state_ ? state_->bytes : 0; }

}  // namespace cleave::transfer
