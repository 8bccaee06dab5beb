// The engine loop's side of the KV handoff (DESIGN.md §1): KV reservations with leases and
// prefilled admissions on the decode side; per-layer export and pinned blocks on the prefill
// side. Everything named *_now runs under the engine's state lock (on the engine thread, or on
// reserve_async()'s caller's thread while the engine waits or computes a forward pass).
#include <algorithm>
#include <exception>
#include <future>

#include "cleave/common/log.h"
#include "cleave/worker/engine_loop.h"
#include "engine_loop_state.h"
#include "fmt/format.h"

namespace cleave {

Status EngineLoop::reserve_async(RequestId id, int64_t num_tokens, std::chrono::milliseconds lease,
                                 ReservationFence on_end, ReserveCallback done,
                                 std::chrono::milliseconds hold) {
  if (num_tokens < 1) {
    return InvalidArgument(
        fmt::format("reserve {}: num_tokens is {}, it must be at least 1", id, num_tokens));
  }
  if (num_tokens > context_) {
    return OutOfRange(fmt::format("reserve {}: a prompt of {} tokens does not fit the context of {}",
                                  id, num_tokens, context_));
  }
  if (lease.count() < 1) {
    return InvalidArgument(fmt::format("reserve {}: the lease is {} ms, it must be at least 1 ms",
                                       id, lease.count()));
  }
  const int64_t bs = pool_->layout().block_size;
  const int64_t need = (num_tokens + bs - 1) / bs;
  if (need > pool_->total_blocks()) {
    return ResourceExhausted(fmt::format(
        "reserve {}: a prompt of {} tokens needs {} KV blocks of {} tokens; the pool has {} in all",
        id, num_tokens, need, bs, pool_->total_blocks()));
  }
  if (!done) return InvalidArgument(fmt::format("reserve {}: no result callback", id));
  auto op = std::make_shared<ReserveOp>();
  op->id = id;
  op->num_tokens = num_tokens;
  op->lease = lease;
  op->on_end = std::move(on_end);
  op->done = std::move(done);
  op->hold = hold;
  {
    std::lock_guard<std::mutex> lk(mu_);
    if (stopping_ || stopped_) return Unavailable(fmt::format("reserve {}: the engine is shutting down", id));
    op->op = next_reserve_op_++;
    if (in_flight_.count(id) != 0 || !reserved_ids_.emplace(id, op->op).second) {
      return AlreadyExists(fmt::format("reserve {}: the id is already reserved or in flight", id));
    }
    reserves_.push_back(std::move(op));
    idle_ = false;
  }
  // Made here and now when the engine's state is free (the engine waits for work or computes a
  // forward pass); else the engine thread makes it before its next forward pass. Never waits.
  if (t_state_holder != this) {
    StateHold state(state_mu_, this, std::try_to_lock);
    if (state.owns()) {
      run_control_ops();
      state.unlock();
      std::lock_guard<std::mutex> lk(mu_);
      rewait_ = true;  // a waiting engine thread takes the new lease deadline into account
    }
  }
  work_cv_.notify_one();
  return Status::Ok();
}

Result<std::vector<BlockId>> EngineLoop::reserve(RequestId id, int64_t num_tokens,
                                                 std::chrono::milliseconds lease,
                                                 ReservationFence on_end,
                                                 std::chrono::milliseconds hold) {
  auto reply = std::make_shared<std::promise<Result<std::vector<BlockId>>>>();
  std::future<Result<std::vector<BlockId>>> result = reply->get_future();
  CLEAVE_RETURN_IF_ERROR(reserve_async(
      id, num_tokens, lease, std::move(on_end),
      [reply](Result<std::vector<BlockId>> r) { reply->set_value(std::move(r)); }, hold));
  return result.get();
}

bool EngineLoop::release_reservation(RequestId id) {
  {
    std::lock_guard<std::mutex> lk(mu_);
    if (reserved_ids_.erase(id) == 0) return false;
    reservation_releases_.push_back(id);
  }
  work_cv_.notify_one();
  return true;
}

bool EngineLoop::renew_reservation(RequestId id, std::chrono::milliseconds lease) {
  if (lease.count() < 1) return false;
  std::lock_guard<std::mutex> lk(mu_);
  // An expiry erases the id under this lock when it decides (expire_leases): once renewed here,
  // the reservation is spared until the renewal is applied. Applied later, the lease runs from
  // then: never shorter than asked.
  if (reserved_ids_.count(id) == 0) return false;
  auto [it, added] = lease_renewals_.emplace(id, lease);
  if (!added) it->second = std::max(it->second, lease);
  return true;
}

bool EngineLoop::release_pinned(RequestId id) {
  {
    std::lock_guard<std::mutex> lk(mu_);
    if (pinned_ids_.erase(id) == 0) return false;
    pin_releases_.push_back(id);
  }
  work_cv_.notify_one();
  return true;
}

void EngineLoop::run_control_ops() {
  std::vector<RequestId> pin_releases, reservation_releases;
  std::vector<std::shared_ptr<ReserveOp>> reserves;
  bool stopping = false;
  {
    std::lock_guard<std::mutex> lk(mu_);
    pin_releases.swap(pin_releases_);
    reservation_releases.swap(reservation_releases_);
    reserves.swap(reserves_);
    stopping = stopping_;
  }
  for (RequestId id : pin_releases) release_pinned_now(id);
  // Releases before reserves: a release queued before a new reserve of the same id ends the
  // old reservation, never the new one.
  for (RequestId id : reservation_releases) release_reservation_now(id);
  for (auto& op : reserves) {
    if (!stopping) {
      reserve_now(*op);
      continue;
    }
    {
      std::lock_guard<std::mutex> lk(mu_);
      if (auto it = reserved_ids_.find(op->id); it != reserved_ids_.end() && it->second == op->op)
        reserved_ids_.erase(it);
    }
    answer(*op, Unavailable("the engine is shutting down"));
  }
}

void EngineLoop::reserve_now(ReserveOp& op) {
  bool wanted = true;
  {
    std::lock_guard<std::mutex> lk(mu_);
    // Released before it was made (its entry gone, or another reserve's now): not wanted.
    auto it = reserved_ids_.find(op.id);
    wanted = it != reserved_ids_.end() && it->second == op.op;
  }
  if (!wanted) {
    answer(op, Cancelled(fmt::format("reserve {}: released while being made", op.id)));
    return;
  }
  Result<std::vector<BlockId>> blocks =
      ledger_.reserve(op.id, op.num_tokens, op.lease, std::move(op.on_end), op.hold);
  if (!blocks.ok()) {
    std::lock_guard<std::mutex> lk(mu_);
    if (auto it = reserved_ids_.find(op.id); it != reserved_ids_.end() && it->second == op.op)
      reserved_ids_.erase(it);
  } else {
    publish_stats();  // stats() shows the reservation once the result is out
  }
  answer(op, std::move(blocks));
}

void EngineLoop::answer(ReserveOp& op, Result<std::vector<BlockId>> result) {
  // The callback is the caller's: a throw must not end the engine thread. A reservation made
  // stays held then and ends by its lease like an unclaimed one.
  try {
    op.done(std::move(result));
  } catch (const std::exception& e) {
    log::error("engine: the reserve callback of request {} threw: {}", op.id, e.what());
  } catch (...) {
    log::error("engine: the reserve callback of request {} threw", op.id);
  }
}

void EngineLoop::release_reservation_now(RequestId id) {
  // Nothing when consumed by a prefilled submit in the meantime, or expired.
  (void)ledger_.release_reservation(id);
}

void EngineLoop::apply_lease_renewals() {
  std::unordered_map<RequestId, std::chrono::milliseconds> renewals;
  {
    std::lock_guard<std::mutex> lk(mu_);
    if (lease_renewals_.empty()) return;
    renewals.swap(lease_renewals_);
  }
  for (const auto& [id, lease] : renewals) (void)ledger_.renew_lease(id, lease);
}

void EngineLoop::expire_leases() {
  if (ledger_.num_reservations() == 0 && ledger_.blocks_held() == 0) return;
  apply_lease_renewals();
  (void)ledger_.expire_leases([this](SequenceId id) {
    std::lock_guard<std::mutex> lk(mu_);
    // A prefilled submit already took it (queued, not yet admitted): not expired.
    if (reserved_ids_.count(id) == 0 && in_flight_.count(id) != 0) return true;
    // Renewed since the renewals were applied: it waits for the next round.
    if (lease_renewals_.count(id) != 0) return true;
    // It expires: from now on a renewal or a release finds nothing under the id.
    reserved_ids_.erase(id);
    return false;
  });
}

void EngineLoop::release_pinned_now(RequestId id) { (void)ledger_.release_pinned(id); }

void EngineLoop::admit_prefilled(EngineRequest&& req, std::unique_ptr<RequestState> r) {
  const RequestId id = req.id;
  // Replays the prefill's first token through the decoder and the stop matcher, so that text
  // and stop strings continue exactly where the prefill worker's left off (its text was sent).
  r->finisher.replay(req.first_token);
  r->generated = r->resumed + 1;
  r->cached_prompt_tokens = 0;
  requests_.emplace(id, std::move(r));
  if (staging_) {
    // The KV came into the pool's host mirror: the reserved blocks go to the device first (the
    // copy is done before any later step's kernels are queued).
    const std::vector<BlockId>* blocks = ledger_.reservation_blocks(id);
    const Status staged = blocks ? stage_blocks(*blocks, 0, pool_->layout().n_layers, true)
                                 : Status::Ok();
    if (!staged.ok()) {
      fail(id, staged);
      return;
    }
  }
  // The ledger fences the reservation (the KV is in place: nothing may write there any more)
  // and runs the sequence now or queues it for a running slot.
  const Status added = ledger_.add_prefilled(id, std::move(req.prompt), req.first_token);
  if (!added.ok()) fail(id, added);
}

void EngineLoop::admit_pending_prefilled() {
  if (ledger_.num_pending() == 0) return;
  std::vector<std::pair<SequenceId, Status>> failed;
  ledger_.admit_pending(failed);
  for (const auto& [id, st] : failed) fail(id, st);
}

Status EngineLoop::stage_blocks(std::span<const BlockId> blocks, int64_t l0, int64_t l1,
                                bool to_device) {
  const KvLayout& layout = pool_->layout();
  stage_ranges_.clear();
  for (int64_t l = l0; l < l1; ++l) {
    for (size_t i = 0; i < blocks.size();) {
      size_t j = i + 1;
      while (j < blocks.size() && blocks[j] == blocks[j - 1] + 1) ++j;
      stage_ranges_.push_back(KvRange{layout.offset(l, blocks[i]),
                                      layout.block_bytes() * static_cast<uint64_t>(j - i)});
      i = j;
    }
  }
  return to_device ? staging_->to_device(stage_ranges_) : staging_->to_host(stage_ranges_);
}

void EngineLoop::export_layer(int64_t layer) {
  for (const ExportChunk& e : exports_) {
    RequestState& r = *e.request;
    if (r.export_failed) continue;
    if (staging_ && e.end > e.begin) {
      // The layer's K/V of [begin, end) go to the host mirror the writes read (whole units).
      const int64_t bs = pool_->layout().block_size;
      const auto first = static_cast<size_t>(e.begin / bs);
      const auto last = static_cast<size_t>((e.end - 1) / bs) + 1;
      const Status staged =
          stage_blocks(std::span<const BlockId>(e.seq->block_table).subspan(first, last - first),
                       layer, layer + 1, false);
      if (!staged.ok()) {
        log::error("request {}: copying layer {} of its KV to the host mirror failed: {}",
                   r.id, layer, staged.message());
        r.export_failed = true;
        continue;
      }
    }
    if (!r.sink->on_layer_ready(layer, e.begin, e.end, e.seq->block_table, e.last)) {
      r.export_failed = true;
    }
  }
}

}  // namespace cleave
