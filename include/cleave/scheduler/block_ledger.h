// The one owner of every claim on a worker's KvBlockPool (DESIGN.md §3 "One owner for KV
// blocks"). A block is claimed by exactly these:
//   running   - sequences of the Scheduler (the ledger owns it; its admission sees the others)
//   reserved  - set aside for a prompt whose KV another worker writes (decode side), until the
//               reservation is consumed, released or its lease ends
//   pinned    - blocks of an ended prefill whose KV may still be on its way out (prefill side),
//               held until release_pinned()
//   pending   - a prefilled sequence whose KV is in place, waiting for a running slot
//               (max_num_seqs), admitted in arrival order
// Why a class beside the Scheduler and not inside it: the Scheduler is the batching policy over
// running and waiting sequences (what runs next, preemption); reservations and pins are claims
// with their own ends (a lease, a transfer) that the policy must only see as "blocks held for a
// while". The ledger holds both, so that nothing else allocates from or releases to the pool.
//
// Lease clock: one, injectable (`now`, for tests). Deadlines are checked in expire_leases()
// only; next_deadline() tells the engine thread how long it may sleep.
//
// Fences: a reservation's `on_end` runs exactly once, with how it ended, before any of its
// blocks can go to another claim (consumed: the KV is in place and nothing may write there any
// more; released; expired; shutdown). The decode worker revokes there the memory key it gave the
// writer, so that a late write never lands in reused blocks. A reserve() that fails never runs
// it. end_all() (shutdown) and the destructor run the fences of the reservations still held.
// Where a key cannot be revoked (EFA and verbs: the provider's registration cache hands every
// registration of the pool the same key, and a registration of its own per reservation would pin
// the whole pool each time), the reservation is made with a hold instead: when it is released or
// expires, its blocks stay held ("held after their end") until the later of then and its lease
// deadline, plus the hold (a bound on a write posted before the writer's lease ended); only then
// do they go back to the pool. A consumed reservation is not held (its KV is in place: every
// write completed before the notice); nor is one ended by shutdown.
//
// Admission waits for held blocks: schedule() tells the Scheduler how many blocks reservations,
// pins and holds keep. They all come back in bounded time (a lease or a hold ends; a pin is
// released when its transfer ends, which the transfer engine bounds), so a sequence that does
// not fit now but would once they are back waits (StepPlan::blocked) instead of failing; one
// that needs more blocks than the whole pool fails with ResourceExhausted. Pending prefilled blocks are not
// counted as coming back: they wait for a running slot, which a stalled sequence may be the
// one to hold, and counting them could wait forever.
//
// Thread-safety: none; owned by the engine thread, like the pool.
#pragma once

#include <chrono>
#include <cstdint>
#include <deque>
#include <functional>
#include <optional>
#include <span>
#include <unordered_map>
#include <vector>

#include "cleave/common/status.h"
#include "cleave/kvcache/kv_block_pool.h"
#include "cleave/scheduler/scheduler.h"

namespace cleave {

// How a reservation ended (what its fence is told).
enum class ReservationEnd : uint8_t {
  kConsumed,  // its prefilled sequence took the blocks
  kReleased,  // release_reservation()
  kExpired,   // its lease ended unconsumed
  kShutdown,  // end_all() / the ledger's destruction
};
const char* reservation_end_name(ReservationEnd end);

using ReservationFence = std::function<void(ReservationEnd)>;

struct LedgerCounters {
  uint64_t leases_expired = 0;         // reservations whose lease ended unconsumed
  uint64_t reservations_released = 0;  // ended by release_reservation()
  uint64_t leases_renewed = 0;         // renew_lease() calls that found the reservation
  uint64_t reservations_held = 0;      // released or expired ones whose blocks were held after
};

class BlockLedger {
 public:
  using Clock = std::chrono::steady_clock;
  using NowFn = std::function<Clock::time_point()>;

  // `pool` must outlive the ledger. `now` defaults to Clock::now.
  BlockLedger(KvBlockPool& pool, const SchedulerOptions& opts, NowFn now = {});
  ~BlockLedger();  // end_all(), then the scheduler releases its sequences' blocks
  BlockLedger(const BlockLedger&) = delete;
  BlockLedger& operator=(const BlockLedger&) = delete;

  // Running and waiting sequences. Blocks go to and from them through the scheduler only.
  Scheduler& scheduler() { return scheduler_; }
  const Scheduler& scheduler() const { return scheduler_; }
  const KvBlockPool& pool() const { return pool_; }
  Clock::time_point now() const { return now_(); }

  // Plans a step (Scheduler::schedule) with the blocks held by reservations and pins.
  void schedule(StepPlan& plan) { scheduler_.schedule(plan, blocks_coming_back()); }

  // ---- reservations (decode side) ----
  // Blocks for positions [0, num_tokens) under `id`, in position order, until now() + lease.
  // InvalidArgument for num_tokens < 1 or a lease under 1 ms; AlreadyExists when `id` has a
  // reservation, a pending prefilled sequence or a sequence; ResourceExhausted when the pool
  // cannot give them now (nothing taken or evicted). On error `on_end` is dropped unrun.
  // `hold` > 0: released or expired, its blocks stay held until max(then, the lease deadline) +
  // hold (see "Fences" above).
  Result<std::vector<BlockId>> reserve(SequenceId id, int64_t num_tokens,
                                       std::chrono::milliseconds lease, ReservationFence on_end,
                                       std::chrono::milliseconds hold = std::chrono::milliseconds(0));
  bool has_reservation(SequenceId id) const { return reservations_.count(id) != 0; }
  // The blocks reserved under `id` in position order; null when there is no reservation.
  const std::vector<BlockId>* reservation_blocks(SequenceId id) const {
    auto it = reservations_.find(id);
    return it == reservations_.end() ? nullptr : &it->second.blocks;
  }
  // Gives the blocks back after the fence (kReleased). false when there is none under `id`.
  bool release_reservation(SequenceId id);
  // The reservation's lease runs again from now(): its deadline becomes now() + lease, unless it
  // is later already (a renewal never shortens a lease). For a prefill that waits in its
  // worker's queue longer than the lease (the router renews while the Prefill runs). false when
  // there is none under `id` (consumed, released, expired) or the lease is under 1 ms.
  bool renew_lease(SequenceId id, std::chrono::milliseconds lease);
  // The soonest lease deadline or end of a hold; nullopt without either.
  std::optional<Clock::time_point> next_deadline() const;
  // Gives back the held blocks whose hold has ended, then ends (kExpired) every reservation whose
  // deadline is <= now() and for which `spare` (may be empty) is not true; returns their ids,
  // in deadline order.
  std::vector<SequenceId> expire_leases(const std::function<bool(SequenceId)>& spare = {});
  // Ends every reservation with kShutdown and gives back the held blocks (all to the pool).
  void end_all();

  // ---- prefilled admission (decode side) ----
  // The KV of reservation `id` is in place: runs its fence (kConsumed), then the sequence
  // (prompt + first_token, the prompt's KV in the reserved blocks) runs at once, or waits in
  // arrival order for a running slot behind the pending ones. FailedPrecondition when there is
  // no reservation under `id`; another error from Scheduler::add_prefilled (the blocks are back
  // in the pool then).
  Status add_prefilled(SequenceId id, std::vector<int32_t> prompt, int32_t first_token);
  // Moves pending sequences into running slots, in order. Appends to `failed` (id, error) those
  // the scheduler refused for good (their blocks are back).
  void admit_pending(std::vector<std::pair<SequenceId, Status>>& failed);

  // ---- ending a sequence ----
  // Removes `id` from the scheduler or the pending queue and gives its blocks back. With `pin`,
  // a sequence's blocks stay held under `id` until release_pinned(id) (a prefill whose writes may
  // still read them). false when the id is neither running, waiting nor pending.
  bool finish(SequenceId id, bool pin = false);
  // Releases the blocks pinned under `id`. false when none.
  bool release_pinned(SequenceId id);
  bool has_pinned(SequenceId id) const { return pinned_.count(id) != 0; }

  // ---- counters ----
  int64_t num_reservations() const { return static_cast<int64_t>(reservations_.size()); }
  int64_t blocks_reserved() const { return blocks_reserved_; }
  int64_t blocks_pinned() const { return blocks_pinned_; }
  int64_t blocks_held() const { return blocks_held_; }  // of ended reservations, until their hold ends
  int64_t num_pending() const { return static_cast<int64_t>(pending_.size()); }
  int64_t blocks_pending() const { return blocks_pending_; }
  // Reserved, pinned and held: the blocks that come back in bounded time (what admission waits
  // for).
  int64_t blocks_coming_back() const { return blocks_reserved_ + blocks_pinned_ + blocks_held_; }
  const LedgerCounters& counters() const { return counters_; }
  // Nothing running, waiting, pending, reserved, pinned or held.
  bool idle() const {
    return scheduler_.idle() && reservations_.empty() && pinned_.empty() && pending_.empty() &&
           held_.empty();
  }

 private:
  struct Reservation {
    std::vector<BlockId> blocks;
    Clock::time_point deadline;
    ReservationFence on_end;
    std::chrono::milliseconds hold{0};
  };
  struct Held {
    Clock::time_point until;
    std::vector<BlockId> blocks;
  };
  struct Pending {
    SequenceId id;
    std::vector<int32_t> prompt;
    int32_t first_token;
    std::vector<BlockId> blocks;
  };
  // Runs the fence, then releases the blocks (or holds them, released or expired with a hold)
  // and forgets the reservation.
  void end_reservation(std::unordered_map<SequenceId, Reservation>::iterator it, ReservationEnd how);
  // Gives back the held blocks whose hold ended by `now` (all of them with `all`).
  void release_held(Clock::time_point now, bool all);
  // Fence first, then the blocks leave the reservation (returned, still claimed).
  std::vector<BlockId> take_reservation(std::unordered_map<SequenceId, Reservation>::iterator it,
                                        ReservationEnd how);

  KvBlockPool& pool_;
  Scheduler scheduler_;
  NowFn now_;
  std::unordered_map<SequenceId, Reservation> reservations_;
  std::unordered_map<SequenceId, std::vector<BlockId>> pinned_;
  std::deque<Pending> pending_;
  std::vector<Held> held_;
  int64_t blocks_held_ = 0;
  int64_t blocks_reserved_ = 0;
  int64_t blocks_pinned_ = 0;
  int64_t blocks_pending_ = 0;
  LedgerCounters counters_;
};

}  // namespace cleave
