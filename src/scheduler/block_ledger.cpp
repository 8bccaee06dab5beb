// Every claim on the KV pool in one place: the scheduler's sequences, reservations with their
// lease clock and fences, pins of ended prefills, prefilled sequences waiting for a slot.
#include "cleave/scheduler/block_ledger.h"

#include <algorithm>
#include <exception>

#include "cleave/common/log.h"
#include "fmt/format.h"

namespace cleave {

const char* reservation_end_name(ReservationEnd end) {
  switch (end) {
    case ReservationEnd::kConsumed: return "consumed";
    case ReservationEnd::kReleased: return "released";
    case ReservationEnd::kExpired: return "expired";
    case ReservationEnd::kShutdown: return "shutdown";
  }
  return "unknown";
}

BlockLedger::BlockLedger(KvBlockPool& pool, const SchedulerOptions& opts, NowFn now)
    : pool_(pool), scheduler_(pool, opts), now_(now ? std::move(now) : NowFn([] { return Clock::now(); })) {}

BlockLedger::~BlockLedger() {
  end_all();
  for (auto& [id, blocks] : pinned_) pool_.release(blocks);
  for (Pending& p : pending_) pool_.release(p.blocks);
}

Result<std::vector<BlockId>> BlockLedger::reserve(SequenceId id, int64_t num_tokens,
                                                  std::chrono::milliseconds lease,
                                                  ReservationFence on_end,
                                                  std::chrono::milliseconds hold) {
  if (num_tokens < 1) {
    return InvalidArgument(
        fmt::format("reserve {}: num_tokens is {}, it must be at least 1", id, num_tokens));
  }
  if (lease.count() < 1) {
    return InvalidArgument(fmt::format("reserve {}: the lease is {} ms, it must be at least 1 ms",
                                       id, lease.count()));
  }
  if (reservations_.count(id) != 0 || scheduler_.find(id) != nullptr ||
      std::any_of(pending_.begin(), pending_.end(), [id](const Pending& p) { return p.id == id; })) {
    return AlreadyExists(fmt::format("reserve {}: the id holds a reservation or a sequence", id));
  }
  const int64_t bs = pool_.layout().block_size;
  const int64_t need = (num_tokens + bs - 1) / bs;
  if (!pool_.can_allocate(need)) {
    return ResourceExhausted(fmt::format(
        "reserve {}: {} KV blocks needed, {} free or evictable now (of {}; {} reserved, {} pinned, "
        "{} held after their reservation ended)",
        id, need, pool_.free_blocks() + pool_.cached_blocks(), pool_.total_blocks(),
        blocks_reserved_, blocks_pinned_, blocks_held_));
  }
  std::vector<BlockId> blocks;
  CLEAVE_RETURN_IF_ERROR(pool_.allocate(need, blocks));
  blocks_reserved_ += need;
  reservations_.emplace(id, Reservation{blocks, now_() + lease, std::move(on_end),
                                        std::max(hold, std::chrono::milliseconds(0))});
  return blocks;
}

std::vector<BlockId> BlockLedger::take_reservation(
    std::unordered_map<SequenceId, Reservation>::iterator it, ReservationEnd how) {
  const SequenceId id = it->first;
  Reservation res = std::move(it->second);
  reservations_.erase(it);
  blocks_reserved_ -= static_cast<int64_t>(res.blocks.size());
  if (res.on_end) {
    // The fence must not cost the blocks: they are still claimed here, whatever it does.
    try {
      res.on_end(how);
    } catch (const std::exception& e) {
      log::error("ledger: the end fence of reservation {} ({}) threw: {}", id,
                 reservation_end_name(how), e.what());
    } catch (...) {
      log::error("ledger: the end fence of reservation {} ({}) threw", id, reservation_end_name(how));
    }
  }
  return std::move(res.blocks);
}

void BlockLedger::end_reservation(std::unordered_map<SequenceId, Reservation>::iterator it,
                                  ReservationEnd how) {
  const std::chrono::milliseconds hold = it->second.hold;
  const Clock::time_point deadline = it->second.deadline;
  std::vector<BlockId> blocks = take_reservation(it, how);
  if (hold.count() > 0 && (how == ReservationEnd::kReleased || how == ReservationEnd::kExpired)) {
    blocks_held_ += static_cast<int64_t>(blocks.size());
    held_.push_back(Held{std::max(now_(), deadline) + hold, std::move(blocks)});
    ++counters_.reservations_held;
    return;
  }
  pool_.release(blocks);
}

void BlockLedger::release_held(Clock::time_point now, bool all) {
  for (size_t i = 0; i < held_.size();) {
    if (!all && held_[i].until > now) {
      ++i;
      continue;
    }
    pool_.release(held_[i].blocks);
    blocks_held_ -= static_cast<int64_t>(held_[i].blocks.size());
    held_[i] = std::move(held_.back());
    held_.pop_back();
  }
}

bool BlockLedger::release_reservation(SequenceId id) {
  auto it = reservations_.find(id);
  if (it == reservations_.end()) return false;
  end_reservation(it, ReservationEnd::kReleased);
  ++counters_.reservations_released;
  return true;
}

bool BlockLedger::renew_lease(SequenceId id, std::chrono::milliseconds lease) {
  auto it = reservations_.find(id);
  if (it == reservations_.end() || lease.count() < 1) return false;
  it->second.deadline = std::max(it->second.deadline, now_() + lease);
  ++counters_.leases_renewed;
  return true;
}

std::optional<BlockLedger::Clock::time_point> BlockLedger::next_deadline() const {
  std::optional<Clock::time_point> soonest;
  for (const auto& [id, res] : reservations_) {
    if (!soonest || res.deadline < *soonest) soonest = res.deadline;
  }
  for (const Held& h : held_) {
    if (!soonest || h.until < *soonest) soonest = h.until;
  }
  return soonest;
}

std::vector<SequenceId> BlockLedger::expire_leases(const std::function<bool(SequenceId)>& spare) {
  std::vector<SequenceId> expired;
  const Clock::time_point now = now_();
  if (!held_.empty()) release_held(now, false);
  if (reservations_.empty()) return expired;
  std::vector<std::pair<Clock::time_point, SequenceId>> due;
  for (const auto& [id, res] : reservations_) {
    if (res.deadline <= now && !(spare && spare(id))) due.emplace_back(res.deadline, id);
  }
  std::sort(due.begin(), due.end());
  for (const auto& [deadline, id] : due) {
    auto it = reservations_.find(id);
    log::info("ledger: the KV reservation of request {} ({} blocks) expired unfilled", id,
              it->second.blocks.size());
    end_reservation(it, ReservationEnd::kExpired);
    ++counters_.leases_expired;
    expired.push_back(id);
  }
  return expired;
}

void BlockLedger::end_all() {
  while (!reservations_.empty()) end_reservation(reservations_.begin(), ReservationEnd::kShutdown);
  release_held(now_(), true);
}

Status BlockLedger::add_prefilled(SequenceId id, std::vector<int32_t> prompt, int32_t first_token) {
  auto it = reservations_.find(id);
  if (it == reservations_.end()) {
    return FailedPrecondition(fmt::format(
        "request {}: its KV reservation ended (lease expired or released) before decode started",
        id));
  }
  // The KV is in place (its notice came): nothing may write into these blocks any more.
  std::vector<BlockId> blocks = take_reservation(it, ReservationEnd::kConsumed);
  if (pending_.empty()) {  // else keep arrival order behind those already waiting
    const Status added = scheduler_.add_prefilled(id, prompt, first_token, blocks);
    if (added.ok()) return added;
    if (added.code() != StatusCode::kUnavailable) {
      pool_.release(blocks);
      return added;
    }
  }
  blocks_pending_ += static_cast<int64_t>(blocks.size());
  pending_.push_back(Pending{id, std::move(prompt), first_token, std::move(blocks)});
  return Status::Ok();
}

void BlockLedger::admit_pending(std::vector<std::pair<SequenceId, Status>>& failed) {
  while (!pending_.empty()) {
    Pending& p = pending_.front();
    const Status added = scheduler_.add_prefilled(p.id, p.prompt, p.first_token, p.blocks);
    if (added.code() == StatusCode::kUnavailable) return;  // no running slot yet
    blocks_pending_ -= static_cast<int64_t>(p.blocks.size());
    if (!added.ok()) {
      pool_.release(p.blocks);
      failed.emplace_back(p.id, added);
    }
    pending_.pop_front();
  }
}

bool BlockLedger::finish(SequenceId id, bool pin) {
  if (const Sequence* seq = scheduler_.find(id); seq != nullptr) {
    if (pin) {
      // Writes of this prefill may still be reading its blocks: one more reference each, so
      // that the scheduler's release below leaves them held.
      std::vector<BlockId>& pins = pinned_[id];
      for (BlockId b : seq->block_table) {
        pool_.acquire(b);
        pins.push_back(b);
      }
      blocks_pinned_ += static_cast<int64_t>(seq->block_table.size());
    }
    return scheduler_.finish(id);
  }
  auto p = std::find_if(pending_.begin(), pending_.end(), [id](const Pending& q) { return q.id == id; });
  if (p == pending_.end()) return false;
  pool_.release(p->blocks);
  blocks_pending_ -= static_cast<int64_t>(p->blocks.size());
  pending_.erase(p);
  return true;
}

bool BlockLedger::release_pinned(SequenceId id) {
  auto it = pinned_.find(id);
  if (it == pinned_.end()) return false;
  pool_.release(it->second);
  blocks_pinned_ -= static_cast<int64_t>(it->second.size());
  pinned_.erase(it);
  return true;
}

}  // namespace cleave
