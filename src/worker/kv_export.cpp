#include "cleave/worker/kv_export.h"

#include <algorithm>
#include <atomic>
#include <cassert>
#include <optional>

#include "cleave/common/log.h"
#include "fmt/format.h"

namespace cleave {

using Clock = std::chrono::steady_clock;

// ---- write plan ----

namespace {

// Calls emit(local_offset, remote_offset, len) for each write of the plan (see plan_kv_writes).
template <typename Emit>
void plan_writes(const KvLayout& local, std::span<const BlockId> local_blocks,
                 const KvLayout& remote, std::span<const BlockId> remote_blocks, int64_t layer,
                 int64_t begin, int64_t end, Emit&& emit) {
  const int64_t bs = local.block_size;
  assert(0 <= begin && begin <= end);
  assert(bs == remote.block_size && local.kv_dim() == remote.kv_dim() && local.dtype == remote.dtype);
  assert(static_cast<int64_t>(local_blocks.size()) * bs >= end);
  assert(static_cast<int64_t>(remote_blocks.size()) * bs >= end);
  if (begin >= end) return;
  const uint64_t unit = local.block_bytes();
  const uint64_t row = unit / (2 * static_cast<uint64_t>(bs));  // one position of K (or of V)
  const uint64_t v_at = static_cast<uint64_t>(bs) * row;        // V follows K in the unit
  for (int64_t i = begin / bs; i * bs < end; ++i) {
    const int64_t first = i * bs;
    const int64_t lo = std::max(begin, first), hi = std::min(end, first + bs);
    const size_t idx = static_cast<size_t>(i);
    const uint64_t lu = local.offset(layer, local_blocks[idx]);
    const uint64_t ru = remote.offset(layer, remote_blocks[idx]);
    if (lo == first && hi == first + bs) {
      emit(lu, ru, unit);
    } else {
      const uint64_t skip = static_cast<uint64_t>(lo - first) * row;
      const uint64_t len = static_cast<uint64_t>(hi - lo) * row;
      emit(lu + skip, ru + skip, len);
      emit(lu + v_at + skip, ru + v_at + skip, len);
    }
  }
}

}  // namespace

void plan_kv_writes(const KvLayout& local, uint64_t local_region,
                    std::span<const BlockId> local_blocks, const KvLayout& remote,
                    const transfer::RemoteDescriptor& remote_region,
                    std::span<const BlockId> remote_blocks, int64_t layer, int64_t begin,
                    int64_t end, std::vector<transfer::WriteOp>& out) {
  plan_writes(local, local_blocks, remote, remote_blocks, layer, begin, end,
              [&](uint64_t lo, uint64_t ro, uint64_t len) {
                out.push_back({local_region, lo, remote_region, ro, len});
              });
}

// ---- sender ----

struct KvSender::State {
  transfer::TransferEngine* engine = nullptr;
  uint64_t peer = 0;
  uint64_t local_region = 0;
  KvLayout local;
  KvDestination dest;
  int64_t prompt_len = 0;
  // Nothing is posted at or after this instant (the lease's end less its margin, moved by
  // renew_lease); max() when the destination gave no lease. Read by the engine thread and the
  // finishing thread, moved by RenewLease's.
  std::atomic<Clock::rep> post_by_ticks{Clock::time_point::max().time_since_epoch().count()};
  Clock::time_point post_by() const {
    return Clock::time_point(Clock::duration(post_by_ticks.load(std::memory_order_acquire)));
  }
  // The transfer engine's post_by for what is submitted now: none without a lease.
  std::optional<Clock::time_point> post_bound() const {
    if (dest.lease.count() <= 0) return std::nullopt;
    return post_by();
  }

  // Engine thread only: the batch whose write vector is reused from layer to layer (its
  // WriteOps keep their copy of the destination descriptor, so a reused slot allocates nothing).
  transfer::Batch batch;
  size_t checked = 0;  // handles[0, checked) are known to have succeeded

  std::atomic<bool> failed{false};
  std::atomic<bool> finishing{false};
  std::atomic<bool> hold_notice{false};  // the notice waits for finish_async's value
  std::atomic<uint64_t> bytes{0};

  mutable std::mutex mu;  // never held across a transfer call
  Status failure;                                // the first failure seen
  bool failure_is_lease = false;                 // it was the lease's end
  std::vector<transfer::TransferHandle> handles;  // one per submitted batch, in order
  std::optional<transfer::TransferHandle> notice;
  std::vector<int64_t> sent_until;  // per layer: positions [0, sent_until) submitted
  std::optional<Clock::time_point> first_submit, last_layer_done, notice_done;

  bool lease_over(Clock::time_point now) const { return now >= post_by(); }
  // The failure of a transfer that stopped at the lease's end.
  Status lease_ended(std::string_view what) const {
    return DeadlineExceeded(fmt::format(
        "KV of request {}: {}: the lease of {} ms on decode worker {}'s blocks has ended (writes "
        "stop {} ms before its end, counted from when the destination arrived); the decode "
        "worker gives the blocks to others and refuses late writes, so no notice is sent",
        dest.request_id, what, dest.lease.count(), dest.worker_id,
        KvSender::lease_margin(dest.lease).count()));
  }

  // A failure past the lease's end is the lease's: the transfer engine's "not posted by its
  // deadline" (the deadline is the lease's), or a write posted in time that failed because the
  // decode worker, its lease over, revoked the reservation's key.
  void fail(Status s) {
    const bool lease = lease_over(Clock::now());
    record(lease ? lease_ended(s.to_string()) : std::move(s), lease);
  }
  // The writes stop at the lease's end: `what` was not sent.
  void fail_at_lease_end(std::string_view what) { record(lease_ended(what), true); }
  void record(Status s, bool lease) {
    std::lock_guard<std::mutex> lock(mu);
    if (failure.ok()) {
      log::warn("KV transfer of request {} to decode worker {} failed: {}", dest.request_id,
                dest.worker_id, s.to_string());
      failure = std::move(s);
      failure_is_lease = lease;
    }
    failed.store(true, std::memory_order_release);
  }
  bool lease_failed() const {
    std::lock_guard<std::mutex> lock(mu);
    return !failure.ok() && failure_is_lease;
  }
  Status first_failure() const {
    std::lock_guard<std::mutex> lock(mu);
    return failure;
  }
  std::vector<transfer::TransferHandle> all_handles() const {
    std::lock_guard<std::mutex> lock(mu);
    std::vector<transfer::TransferHandle> out = handles;
    if (notice) out.push_back(*notice);
    return out;
  }
};

namespace {

// Waits for `h` until `deadline`: its final status, or nullopt while it is still in flight.
std::optional<Status> wait_until(const transfer::TransferHandle& h, Clock::time_point deadline) {
  auto left = std::chrono::duration_cast<std::chrono::milliseconds>(deadline - Clock::now());
  Status s = h.wait(std::max(left, std::chrono::milliseconds(0)));
  if (std::optional<Status> done = h.poll()) return done;
  (void)s;
  return std::nullopt;
}

double seconds_between(Clock::time_point a, Clock::time_point b) {
  return std::chrono::duration<double>(b - a).count();
}

}  // namespace

std::chrono::milliseconds KvSender::lease_margin(std::chrono::milliseconds lease) {
  return std::min<std::chrono::milliseconds>(lease / 10, std::chrono::milliseconds(500));
}

Result<std::shared_ptr<KvSender>> KvSender::create(transfer::TransferEngine& engine, uint64_t peer,
                                                   const transfer::MemoryRegion& local_region,
                                                   const KvLayout& local_layout,
                                                   std::string_view local_fingerprint,
                                                   KvDestination dest, int64_t prompt_len) {
  const std::string who = fmt::format("KV destination of request {} (decode worker {})",
                                      dest.request_id, dest.worker_id);
  if (std::string e = local_layout.validate(); !e.empty()) {
    return InvalidArgument(fmt::format("{}: local KV layout: {}", who, e));
  }
  if (std::string e = dest.layout.validate(); !e.empty()) {
    return InvalidArgument(fmt::format("{}: its KV layout: {}", who, e));
  }
  if (std::string m = pairing_mismatch(local_fingerprint, local_layout, dest.model_fingerprint,
                                       dest.layout);
      !m.empty()) {
    Status (*make)(std::string) =
        local_fingerprint != dest.model_fingerprint ? FailedPrecondition : InvalidArgument;
    return make(fmt::format("{}: cannot pair: {}", who, m));
  }
  if (prompt_len < 1) {
    return InvalidArgument(fmt::format("{}: prompt length {} (at least 1)", who, prompt_len));
  }
  const int64_t bs = local_layout.block_size;
  const int64_t needed = (prompt_len + bs - 1) / bs;
  if (static_cast<int64_t>(dest.blocks.size()) < needed) {
    return InvalidArgument(fmt::format(
        "{}: {} reserved blocks of {} tokens hold {} positions, the prompt has {} tokens ({} "
        "blocks)", who, dest.blocks.size(), bs, static_cast<int64_t>(dest.blocks.size()) * bs,
        prompt_len, needed));
  }
  std::vector<BlockId> sorted(dest.blocks.begin(), dest.blocks.begin() + needed);
  std::sort(sorted.begin(), sorted.end());
  if (sorted.front() < 0 || sorted.back() >= dest.layout.num_blocks) {
    return InvalidArgument(fmt::format("{}: block id out of range [0, {}) (ids {}..{})", who,
                                       dest.layout.num_blocks, sorted.front(), sorted.back()));
  }
  if (std::adjacent_find(sorted.begin(), sorted.end()) != sorted.end()) {
    return InvalidArgument(fmt::format("{}: block {} is reserved twice", who,
                                       *std::adjacent_find(sorted.begin(), sorted.end())));
  }
  if (dest.region.len < dest.layout.total_bytes() || dest.region.keys.empty()) {
    return InvalidArgument(fmt::format("{}: its region descriptor ({} bytes, {} keys) does not "
                                       "cover its KV pool of {} bytes", who, dest.region.len,
                                       dest.region.keys.size(), dest.layout.total_bytes()));
  }
  if (local_region.len < local_layout.total_bytes()) {
    return InvalidArgument(fmt::format("{}: the local region ({} bytes) does not cover the local "
                                       "KV pool of {} bytes", who, local_region.len,
                                       local_layout.total_bytes()));
  }
  auto st = std::make_shared<State>();
  if (dest.lease.count() > 0) {
    const Clock::time_point post_by = Clock::now() + dest.lease - lease_margin(dest.lease);
    st->post_by_ticks.store(post_by.time_since_epoch().count(), std::memory_order_relaxed);
  }
  st->engine = &engine;
  st->peer = peer;
  st->local_region = local_region.id;
  st->local = local_layout;
  st->dest = std::move(dest);
  st->prompt_len = prompt_len;
  st->batch.peer = peer;
  st->batch.writes.reserve(static_cast<size_t>(2 * needed));
  st->handles.reserve(static_cast<size_t>(local_layout.n_layers) * 4);
  st->sent_until.assign(static_cast<size_t>(local_layout.n_layers), 0);
  std::shared_ptr<KvSender> sender(new KvSender());
  sender->state_ = std::move(st);
  return sender;
}

bool KvSender::on_layer_ready(int64_t layer, int64_t begin, int64_t end,
                              std::span<const BlockId> block_table, bool last) {
  State& s = *state_;
  const auto now = Clock::now();
  if (s.failed.load(std::memory_order_acquire)) return false;
  if (s.finishing.load(std::memory_order_acquire)) return false;  // nothing more after finish()
  const int64_t bs = s.local.block_size;
  if (layer < 0 || layer >= s.local.n_layers || begin < 0 || begin > end || end > s.prompt_len ||
      static_cast<int64_t>(block_table.size()) * bs < end) {
    s.fail(Internal(fmt::format("on_layer_ready: layer {} positions [{}, {}) with {} blocks does "
                                "not fit a {}-layer KV of a {}-token prompt", layer, begin, end,
                                block_table.size(), s.local.n_layers, s.prompt_len)));
    return false;
  }
  // Learn of failed batches without waiting: completed handles are checked in order, and at
  // most one still in flight is polled (one non-blocking round of progress).
  for (;;) {
    transfer::TransferHandle h;
    {
      std::lock_guard<std::mutex> lock(s.mu);
      if (s.checked == s.handles.size()) break;
      h = s.handles[s.checked];
    }
    std::optional<Status> done = h.poll();
    if (!done) break;
    if (!done->ok()) {
      s.fail(*done);
      return false;
    }
    ++s.checked;
  }
  if (s.lease_over(now)) {
    s.fail_at_lease_end(fmt::format("layer {} positions [{}, {}) not sent", layer, begin, end));
    return false;
  }
  if (begin < end) {
    // Fill the reused write vector slot by slot; a slot keeps its copy of the descriptor.
    std::vector<transfer::WriteOp>& w = s.batch.writes;
    size_t n = 0;
    uint64_t bytes = 0;
    plan_writes(s.local, block_table, s.dest.layout, s.dest.blocks, layer, begin, end,
                [&](uint64_t lo, uint64_t ro, uint64_t len) {
                  if (n == w.size()) w.push_back({s.local_region, 0, s.dest.region, 0, 0});
                  w[n].local_offset = lo;
                  w[n].remote_offset = ro;
                  w[n].len = len;
                  bytes += len;
                  ++n;
                });
    w.resize(n);
    s.batch.post_by = s.post_bound();  // a renewal moves it
    auto h = s.engine->submit(s.batch);
    if (!h.ok()) {
      s.fail(h.status());
      return false;
    }
    s.bytes.fetch_add(bytes, std::memory_order_relaxed);
    std::lock_guard<std::mutex> lock(s.mu);
    s.handles.push_back(std::move(*h));
    if (!s.first_submit) s.first_submit = now;
  }
  bool send_notice = false;
  {
    std::lock_guard<std::mutex> lock(s.mu);
    int64_t& sent = s.sent_until[static_cast<size_t>(layer)];
    if (begin <= sent) sent = std::max(sent, end);
    if (last && layer == s.local.n_layers - 1) {
      s.last_layer_done = now;
      // The whole prompt's KV is submitted: the notice goes now (ordered after every write),
      // not after the rest of the step, sampling and the RPC thread's finish().
      send_notice = !s.notice && !s.hold_notice.load(std::memory_order_acquire) &&
                    std::all_of(s.sent_until.begin(), s.sent_until.end(),
                                             [&](int64_t u) { return u >= s.prompt_len; });
    }
  }
  if (send_notice) {
    auto n = s.engine->notify(s.peer, s.dest.notice_tag, 0, s.post_bound());
    if (!n.ok()) {
      s.fail(n.status());
      return false;
    }
    std::lock_guard<std::mutex> lock(s.mu);
    s.notice = std::move(*n);
  }
  return true;
}

void KvSender::hold_notice() { state_->hold_notice.store(true, std::memory_order_release); }

void KvSender::start_finish(uint64_t notice_value) {
  State& s = *state_;
  s.finishing.store(true, std::memory_order_release);
  bool send_notice = false;
  {
    std::lock_guard<std::mutex> lock(s.mu);
    if (!s.notice && s.failure.ok()) {
      send_notice = true;
      for (size_t l = 0; l < s.sent_until.size(); ++l) {
        if (s.sent_until[l] < s.prompt_len) {
          send_notice = false;
          s.failure = FailedPrecondition(fmt::format(
              "KV of request {}: layer {} was sent for positions [0, {}) only, the prompt has {}",
              s.dest.request_id, l, s.sent_until[l], s.prompt_len));
          s.failed.store(true, std::memory_order_release);
          break;
        }
      }
    }
  }
  if (send_notice && s.lease_over(Clock::now())) {
    send_notice = false;
    s.fail_at_lease_end("its notice is not sent");
  }
  if (send_notice) {
    auto n = s.engine->notify(s.peer, s.dest.notice_tag, notice_value, s.post_bound());
    if (n.ok()) {
      std::lock_guard<std::mutex> lock(s.mu);
      s.notice = std::move(*n);
    } else {
      s.fail(n.status());
    }
  }
}

Status KvSender::finished_result() {
  State& s = *state_;
  std::optional<transfer::TransferHandle> notice;
  {
    std::lock_guard<std::mutex> lock(s.mu);
    notice = s.notice;
  }
  if (Status f = s.first_failure(); !f.ok()) return f;
  if (!notice) return Internal("finish: no notice was sent");
  std::optional<Status> r = notice->poll();
  if (!r) return Internal("finish: the notice is still in flight");
  if (!r->ok()) {
    s.fail(*r);
    return s.first_failure();
  }
  std::lock_guard<std::mutex> lock(s.mu);
  if (!s.notice_done) s.notice_done = notice->completed_at().value_or(Clock::now());
  return Status::Ok();
}

Status KvSender::finish(std::chrono::milliseconds timeout) {
  State& s = *state_;
  const auto deadline = Clock::now() + timeout;
  start_finish();
  // Every batch must end (so that no write reads the local blocks any more), failed or not.
  std::vector<transfer::TransferHandle> handles;
  std::optional<transfer::TransferHandle> notice;
  {
    std::lock_guard<std::mutex> lock(s.mu);
    handles = s.handles;
    notice = s.notice;
  }
  size_t in_flight = 0;
  for (const auto& h : handles) {
    std::optional<Status> r = wait_until(h, deadline);
    if (!r) ++in_flight;
    else if (!r->ok()) s.fail(*r);
  }
  if (in_flight > 0) {
    return DeadlineExceeded(fmt::format(
        "KV of request {}: {} of {} write batches to decode worker {} still in flight after {} ms "
        "(call drain() before releasing the blocks)", s.dest.request_id, in_flight,
        handles.size(), s.dest.worker_id, timeout.count()));
  }
  if (notice && s.first_failure().ok() && !wait_until(*notice, deadline)) {
    return DeadlineExceeded(fmt::format(
        "KV of request {}: the notice to decode worker {} was not placed within {} ms",
        s.dest.request_id, s.dest.worker_id, timeout.count()));
  }
  return finished_result();
}

void KvSender::when_all_done(std::function<void()> done) {
  // One count for every handle, plus one held here until every callback is registered, so that
  // handles finishing meanwhile cannot run `done` early. The last to arrive records the ended
  // handles' failures, then runs `done`.
  struct Join {
    std::atomic<int64_t> left{1};
    std::shared_ptr<State> state;
    std::function<void()> done;
    void arrive() {
      if (left.fetch_sub(1, std::memory_order_acq_rel) != 1) return;
      for (const auto& h : state->all_handles()) {
        if (std::optional<Status> r = h.poll(); r && !r->ok()) state->fail(*r);
      }
      done();
    }
  };
  auto join = std::make_shared<Join>();
  join->state = state_;
  join->done = std::move(done);
  std::vector<transfer::TransferHandle> handles = state_->all_handles();
  join->left.fetch_add(static_cast<int64_t>(handles.size()), std::memory_order_relaxed);
  for (const auto& h : handles) h.on_done([join] { join->arrive(); });
  join->arrive();
}

void KvSender::finish_async(std::function<void(Status)> done, uint64_t notice_value) {
  start_finish(notice_value);
  auto self = shared_from_this();
  when_all_done([self, done = std::move(done)] { done(self->finished_result()); });
}

void KvSender::when_drained(std::function<void()> done) { when_all_done(std::move(done)); }

bool KvSender::drain(std::chrono::milliseconds timeout) {
  const auto deadline = Clock::now() + timeout;
  bool all = true;
  for (const auto& h : state_->all_handles()) {
    std::optional<Status> r = wait_until(h, deadline);
    if (!r) all = false;
    else if (!r->ok()) state_->fail(*r);
  }
  return all;
}

uint64_t KvSender::bytes() const { return state_->bytes.load(std::memory_order_relaxed); }

double KvSender::tail_seconds() const {
  std::lock_guard<std::mutex> lock(state_->mu);
  if (!state_->last_layer_done || !state_->notice_done) return 0.0;
  return seconds_between(*state_->last_layer_done, *state_->notice_done);
}

double KvSender::transfer_seconds() const {
  std::lock_guard<std::mutex> lock(state_->mu);
  if (!state_->first_submit || !state_->notice_done) return 0.0;
  return seconds_between(*state_->first_submit, *state_->notice_done);
}

Status KvSender::failure() const { return state_->first_failure(); }

bool KvSender::lease_ended() const { return state_->lease_failed(); }

bool KvSender::renew_lease(std::chrono::milliseconds lease) {
  State& s = *state_;
  if (s.dest.lease.count() <= 0 || lease.count() < 1) return false;
  if (s.failed.load(std::memory_order_acquire)) return false;
  const Clock::time_point now = Clock::now();
  const Clock::rep want = (now + lease - lease_margin(s.dest.lease)).time_since_epoch().count();
  Clock::rep cur = s.post_by_ticks.load(std::memory_order_acquire);
  for (;;) {
    // A bound that has passed stays passed: the decode worker may have revoked the key by now.
    if (now.time_since_epoch().count() >= cur) return false;
    if (want <= cur) return true;
    if (s.post_by_ticks.compare_exchange_weak(cur, want, std::memory_order_acq_rel)) return true;
  }
}

}  // namespace cleave
