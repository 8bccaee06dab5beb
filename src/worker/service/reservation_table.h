// A decode worker's reservations as the control plane sees them: request id, the notice tag the
// prefill worker's notice will carry, and the prompt length (and lease, for messages). The
// engine's block ledger owns the blocks and the lease clock (scheduler/block_ledger.h); this
// table only pairs notices with requests and lets Decode wait for its KV, without a thread:
// claim() once, then poll() whenever the table signals a change (its listener) or a timer
// fires. The end of a lease is told to it by the engine (the reservation's fence calls
// expire()), so the table keeps no deadline of its own.
//
// Thread-safety: every method may be called from any thread.
#pragma once

#include <chrono>
#include <cstdint>
#include <functional>
#include <mutex>
#include <optional>
#include <random>
#include <unordered_map>

#include "cleave/worker/engine_loop.h"

namespace cleave::worker_service {

class ReservationTable {
 public:
  // Records a reservation (the engine has already reserved its blocks) and returns its notice
  // tag: random, non-zero, unique among the table's entries. An entry already under `id` (a
  // stale one) is replaced. `writer`: the transfer engine id whose notice alone fills it (0:
  // any engine's).
  uint64_t add(RequestId id, int64_t num_tokens, std::chrono::milliseconds lease,
               uint64_t writer = 0);

  enum class Notice : uint8_t {
    kFilled,       // the reservation's KV is in place
    kUnknown,      // no entry has this tag (expired, released, aborted, or never made)
    kExpired,      // its lease ended: its blocks are gone, the KV came too late
    kWrongWriter,  // the tag is right but another engine sent it: refused, the entry waits on
  };
  struct NoticeMatch {
    Notice outcome = Notice::kUnknown;
    RequestId id = 0;       // the entry's request (kFilled, kExpired, kWrongWriter)
    uint64_t expected = 0;  // its expected writer (kWrongWriter)
  };
  // A notice with `tag` came from engine `from`, carrying `value` (transfer::Notice::value):
  // fills its reservation when the tag and the writer match; poll() hands the value on.
  NoticeMatch mark_filled(uint64_t tag, uint64_t from, uint64_t value = 0);

  // The engine ended reservation `id` (tag `tag`) at the end of its lease: a claimed entry
  // answers kExpired to its Decode's next poll; an unclaimed one is dropped. false (nothing
  // changes) when the table has no entry under `id` with that tag (released, taken, replaced).
  bool expire(RequestId id, uint64_t tag);

  enum class Outcome {
    kFilled,       // the KV is in place: the caller submits the request
    kNotFound,     // no reservation under this id (never made, used, released or expired)
    kBusy,         // another Decode is already waiting on it
    kExpired,      // the lease ended before the notice
    kReleased,     // Release or Abort ended it while waiting
    kGaveUp,       // give_up() returned true (client gone)
    kShutdown,     // the worker is shutting down
  };
  struct Taken {
    Outcome outcome = Outcome::kNotFound;
    int64_t num_tokens = 0;
    std::chrono::milliseconds lease{0};  // kExpired: the last renewal's (if any); else the first
    int renewals = 0;
    uint64_t notice_value = 0;  // what the filling notice carried (kFilled)
  };
  // Claims the reservation of `id` for one Decode: kFilled means "claimed" (poll() tells when
  // the KV is in place); kNotFound, kBusy (another Decode claimed it) and kShutdown are final.
  struct Claim {
    Outcome outcome = Outcome::kNotFound;
    uint64_t tag = 0;  // what poll() takes
    int64_t num_tokens = 0;
    std::chrono::milliseconds lease{0};
  };
  Claim claim(RequestId id);
  // The claimed reservation's state: nullopt while its KV is not in place and its lease runs;
  // else the outcome (kFilled, kExpired, kReleased, kShutdown, or kGaveUp when `give_up`), and
  // the entry is gone.
  std::optional<Taken> poll(RequestId id, const Claim& claim, bool give_up);
  // Called after every change a poll() may see (a notice, a release, shutdown), outside the
  // table's lock; set before any claim, cleared (nullptr) before its target goes.
  void set_listener(std::function<void()> listener);

  // RenewLease renewed reservation `id` in the engine for `lease`: recorded for messages
  // (the engine's ledger keeps the clock). false when the table has no entry under `id`.
  bool renewed(RequestId id, std::chrono::milliseconds lease);

  // Release / Abort: removes the entry (a waiting Decode sees kReleased). false when none.
  bool remove(RequestId id);
  // Wakes every waiter with kShutdown; later waits answer kShutdown at once.
  void shutdown();

  int64_t size() const;
  // Entries a Decode has claimed (waiting for their KV).
  int64_t claimed() const;

 private:
  struct Entry {
    uint64_t tag = 0;
    int64_t num_tokens = 0;
    std::chrono::milliseconds lease{0};
    uint64_t writer = 0;  // the engine whose notice fills it; 0: any
    uint64_t notice_value = 0;
    bool filled = false;
    bool expired = false;  // the engine ended it at the end of its lease
    bool claimed = false;  // a Decode waits on it
    int renewals = 0;
  };
  void erase_locked(std::unordered_map<RequestId, Entry>::iterator it);

  void notify();

  mutable std::mutex mu_;
  std::function<void()> listener_;
  std::unordered_map<RequestId, Entry> by_id_;
  std::unordered_map<uint64_t, RequestId> by_tag_;
  std::mt19937_64 rng_{std::random_device{}()};
  bool shutdown_ = false;
};

}  // namespace cleave::worker_service
