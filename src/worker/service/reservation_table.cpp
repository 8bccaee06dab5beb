#include "reservation_table.h"

namespace cleave::worker_service {

uint64_t ReservationTable::add(RequestId id, int64_t num_tokens, std::chrono::milliseconds lease,
                               Clock::time_point deadline) {
  std::lock_guard<std::mutex> lock(mu_);
  if (auto old = by_id_.find(id); old != by_id_.end()) erase_locked(old);  // a stale entry
  uint64_t tag = 0;
  do {
    tag = rng_();
  } while (tag == 0 || by_tag_.count(tag) != 0);
  by_id_[id] = Entry{tag, num_tokens, lease, deadline, false, false};
  by_tag_[tag] = id;
  return tag;
}

bool ReservationTable::mark_filled(uint64_t tag) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    auto t = by_tag_.find(tag);
    if (t == by_tag_.end()) return false;
    by_id_.at(t->second).filled = true;
  }
  cv_.notify_all();
  return true;
}

ReservationTable::Taken ReservationTable::wait_and_take(RequestId id,
                                                        const std::function<bool()>& give_up,
                                                        std::chrono::milliseconds poll) {
  std::unique_lock<std::mutex> lock(mu_);
  if (shutdown_) return {Outcome::kShutdown};
  auto it = by_id_.find(id);
  if (it == by_id_.end()) return {Outcome::kNotFound};
  if (it->second.claimed) return {Outcome::kBusy};
  it->second.claimed = true;
  const uint64_t tag = it->second.tag;
  Taken taken{Outcome::kFilled, it->second.num_tokens, it->second.lease};
  for (;;) {
    if (shutdown_) {
      taken.outcome = Outcome::kShutdown;
      break;
    }
    it = by_id_.find(id);
    // Gone, or replaced under the same id by a new Reserve after a Release.
    if (it == by_id_.end() || it->second.tag != tag) {
      taken.outcome = Outcome::kReleased;
      return taken;
    }
    if (it->second.filled) {
      taken.outcome = Outcome::kFilled;
      break;
    }
    const auto now = Clock::now();
    if (now >= it->second.deadline) {
      taken.outcome = Outcome::kExpired;
      break;
    }
    lock.unlock();
    const bool quit = give_up && give_up();
    lock.lock();
    if (quit) {
      taken.outcome = Outcome::kGaveUp;
      break;
    }
    it = by_id_.find(id);
    if (it == by_id_.end() || it->second.tag != tag) continue;  // reported above
    const auto wake = std::min(it->second.deadline, Clock::now() + poll);
    cv_.wait_until(lock, wake);
  }
  it = by_id_.find(id);
  if (it != by_id_.end() && it->second.tag == tag) erase_locked(it);
  return taken;
}

bool ReservationTable::remove(RequestId id) {
  bool removed = false;
  {
    std::lock_guard<std::mutex> lock(mu_);
    auto it = by_id_.find(id);
    if (it != by_id_.end()) {
      erase_locked(it);
      removed = true;
    }
  }
  if (removed) cv_.notify_all();
  return removed;
}

int ReservationTable::purge_expired(Clock::time_point now) {
  std::lock_guard<std::mutex> lock(mu_);
  int n = 0;
  for (auto it = by_id_.begin(); it != by_id_.end();) {
    auto next = std::next(it);
    if (!it->second.claimed && now >= it->second.deadline) {
      erase_locked(it);
      ++n;
    }
    it = next;
  }
  return n;
}

void ReservationTable::shutdown() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    shutdown_ = true;
  }
  cv_.notify_all();
}

int64_t ReservationTable::size() const {
  std::lock_guard<std::mutex> lock(mu_);
  return static_cast<int64_t>(by_id_.size());
}

void ReservationTable::erase_locked(std::unordered_map<RequestId, Entry>::iterator it) {
  by_tag_.erase(it->second.tag);
  by_id_.erase(it);
}

}  // namespace cleave::worker_service
