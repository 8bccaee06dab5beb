// The engine loop's side of the KV handoff (DESIGN.md §1): KV reservations with leases and
// prefilled admissions on the decode side; per-layer export and pinned blocks on the prefill
// side. Everything named *_now runs on the engine thread.
#include <algorithm>

#include "cleave/common/log.h"
#include "cleave/worker/engine_loop.h"
#include "engine_loop_state.h"
#include "fmt/format.h"

namespace cleave {

Result<std::vector<BlockId>> EngineLoop::reserve(RequestId id, int64_t num_tokens,
                                                 std::chrono::milliseconds lease,
                                                 std::function<void()> on_end) {
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
  auto op = std::make_shared<ReserveOp>();
  op->id = id;
  op->num_tokens = num_tokens;
  op->lease = lease;
  op->on_end = std::move(on_end);
  auto reply = op->reply.get_future();
  {
    std::lock_guard<std::mutex> lk(mu_);
    if (stopping_ || stopped_) return Unavailable(fmt::format("reserve {}: the engine is shutting down", id));
    if (in_flight_.count(id) != 0 || !reserved_ids_.insert(id).second) {
      return AlreadyExists(fmt::format("reserve {}: the id is already reserved or in flight", id));
    }
    reserves_.push_back(std::move(op));
    idle_ = false;
  }
  work_cv_.notify_one();
  return reply.get();
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

bool EngineLoop::release_pinned(RequestId id) {
  {
    std::lock_guard<std::mutex> lk(mu_);
    if (pinned_ids_.erase(id) == 0) return false;
    pin_releases_.push_back(id);
  }
  work_cv_.notify_one();
  return true;
}

void EngineLoop::reserve_now(ReserveOp& op) {
  const int64_t bs = pool_->layout().block_size;
  const int64_t need = (op.num_tokens + bs - 1) / bs;
  std::vector<BlockId> blocks;
  Status st = pool_->can_allocate(need)
                  ? pool_->allocate(need, blocks)
                  : ResourceExhausted(fmt::format(
                        "reserve {}: {} KV blocks needed, {} free or evictable now (of {})", op.id,
                        need, pool_->free_blocks() + pool_->cached_blocks(), pool_->total_blocks()));
  bool wanted = true;
  {
    std::lock_guard<std::mutex> lk(mu_);
    // Released before it was made: the caller no longer wants it.
    wanted = reserved_ids_.count(op.id) != 0;
    if (!st.ok()) reserved_ids_.erase(op.id);
  }
  if (!st.ok()) {
    op.reply.set_value(std::move(st));
    return;
  }
  if (!wanted) {
    pool_->release(blocks);
    op.reply.set_value(Cancelled(fmt::format("reserve {}: released while being made", op.id)));
    return;
  }
  blocks_reserved_ += need;
  reservations_[op.id] =
      Reservation{blocks, std::chrono::steady_clock::now() + op.lease, std::move(op.on_end)};
  publish_stats();  // stats() shows the reservation once reserve() returns
  op.reply.set_value(std::move(blocks));
}

void EngineLoop::release_reservation_now(RequestId id, bool expired) {
  auto it = reservations_.find(id);
  if (it == reservations_.end()) return;  // consumed by a prefilled submit in the meantime
  if (it->second.on_end) it->second.on_end();  // fenced before the blocks can be reused
  pool_->release(it->second.blocks);
  blocks_reserved_ -= static_cast<int64_t>(it->second.blocks.size());
  reservations_.erase(it);
  if (expired) {
    ++local_stats_.leases_expired;
    std::lock_guard<std::mutex> lk(mu_);
    reserved_ids_.erase(id);
  } else {
    ++local_stats_.reservations_released;
  }
}

void EngineLoop::expire_leases() {
  if (reservations_.empty()) return;
  const auto now = std::chrono::steady_clock::now();
  std::vector<RequestId> expired;
  for (const auto& [id, res] : reservations_)
    if (res.deadline <= now) expired.push_back(id);
  for (RequestId id : expired) {
    bool consumed = false;
    {
      std::lock_guard<std::mutex> lk(mu_);
      // A prefilled submit already took it (queued, not yet admitted): not expired.
      consumed = reserved_ids_.count(id) == 0 && in_flight_.count(id) != 0;
    }
    if (consumed) continue;
    log::info("engine: the KV reservation of request {} ({} blocks) expired unfilled", id,
              reservations_[id].blocks.size());
    release_reservation_now(id, true);
  }
}

void EngineLoop::release_pinned_now(RequestId id) {
  auto it = pinned_.find(id);
  if (it == pinned_.end()) return;
  pool_->release(it->second);
  blocks_pinned_ -= static_cast<int64_t>(it->second.size());
  pinned_.erase(it);
}

void EngineLoop::admit_prefilled(EngineRequest&& req, std::unique_ptr<RequestState> r) {
  const RequestId id = req.id;
  // Replays the prefill's first token through the decoder and the stop matcher, so that text
  // and stop strings continue exactly where the prefill worker's left off (its text was sent).
  r->finisher.replay(req.first_token);
  r->generated = r->resumed + 1;
  r->cached_prompt_tokens = 0;
  requests_.emplace(id, std::move(r));
  auto res = reservations_.find(id);
  if (res == reservations_.end()) {
    fail(id, FailedPrecondition(fmt::format(
                 "request {}: its KV reservation ended (lease expired or released) before decode "
                 "started",
                 id)));
    return;
  }
  // The KV is in place (its notice came): nothing may write into these blocks any more.
  if (res->second.on_end) res->second.on_end();
  std::vector<BlockId> blocks = std::move(res->second.blocks);
  blocks_reserved_ -= static_cast<int64_t>(blocks.size());
  reservations_.erase(res);
  if (!prefilled_pending_.empty()) {  // keep arrival order behind those already waiting
    prefilled_pending_.push_back(
        PendingPrefilled{id, std::move(req.prompt), req.first_token, std::move(blocks)});
    return;
  }
  const Status added = scheduler_.add_prefilled(id, req.prompt, req.first_token, blocks);
  if (added.code() == StatusCode::kUnavailable) {
    prefilled_pending_.push_back(
        PendingPrefilled{id, std::move(req.prompt), req.first_token, std::move(blocks)});
  } else if (!added.ok()) {
    pool_->release(blocks);
    fail(id, added);
  }
}

void EngineLoop::admit_pending_prefilled() {
  while (!prefilled_pending_.empty()) {
    PendingPrefilled& p = prefilled_pending_.front();
    const Status added = scheduler_.add_prefilled(p.id, p.prompt, p.first_token, p.blocks);
    if (added.code() == StatusCode::kUnavailable) return;
    const RequestId id = p.id;
    if (!added.ok()) pool_->release(p.blocks);
    prefilled_pending_.pop_front();
    if (!added.ok()) fail(id, added);
  }
}

void EngineLoop::export_layer(int64_t layer) {
  for (const ExportChunk& e : exports_) {
    RequestState& r = *e.request;
    if (r.export_failed) continue;
    if (!r.sink->on_layer_ready(layer, e.begin, e.end, e.seq->block_table, e.last)) {
      r.export_failed = true;
    }
  }
}

}  // namespace cleave
