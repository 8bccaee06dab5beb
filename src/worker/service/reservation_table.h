// A decode worker's reservations as the control plane sees them: request id, the notice tag the
// prefill worker's notice will carry, the prompt length and the lease. The engine loop owns the
// blocks (EngineLoop::reserve and its lease expiry); this table pairs notices with requests and
// lets Decode wait for its KV, without a thread: claim() once, then poll() whenever the table
// signals a change (its listener) or a timer fires.
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
  using Clock = std::chrono::steady_clock;

  // Records a reservation (the engine has already reserved its blocks) and returns its notice
  // tag: random, non-zero, unique among the table's entries. The entry ends at `deadline`.
  uint64_t add(RequestId id, int64_t num_tokens, std::chrono::milliseconds lease,
               Clock::time_point deadline);

  // The notice with `tag` arrived: its reservation's KV is in place. false for an unknown tag
  // (an expired, released or aborted reservation).
  bool mark_filled(uint64_t tag);

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
    std::chrono::milliseconds lease{0};
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

  // Release / Abort: removes the entry (a waiting Decode sees kReleased). false when none.
  bool remove(RequestId id);
  // Drops unclaimed entries whose lease ended (the engine returns their blocks itself).
  // Returns how many were dropped.
  int purge_expired(Clock::time_point now);
  // Wakes every waiter with kShutdown; later waits answer kShutdown at once.
  void shutdown();

  int64_t size() const;

 private:
  struct Entry {
    uint64_t tag = 0;
    int64_t num_tokens = 0;
    std::chrono::milliseconds lease{0};
    Clock::time_point deadline;
    bool filled = false;
    bool claimed = false;  // a Decode waits on it
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
