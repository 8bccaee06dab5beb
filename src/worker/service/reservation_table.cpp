#include "reservation_table.h"

namespace cleave::worker_service {

uint64_t ReservationTable::add(RequestId id, int64_t num_tokens, std::chrono::milliseconds lease,
                               uint64_t writer) {
  std::lock_guard<std::mutex> lock(mu_);
  if (auto old = by_id_.find(id); old != by_id_.end()) erase_locked(old);  // a stale entry
  uint64_t tag = 0;
  do {
    tag = rng_();
  } while (tag == 0 || by_tag_.count(tag) != 0);
  by_id_[id] = Entry{tag, num_tokens, lease, writer, 0, false, false, false};
  by_tag_[tag] = id;
  return tag;
}

ReservationTable::NoticeMatch ReservationTable::mark_filled(uint64_t tag, uint64_t from,
                                                           uint64_t value) {
  NoticeMatch m;
  {
    std::lock_guard<std::mutex> lock(mu_);
    auto t = by_tag_.find(tag);
    if (t == by_tag_.end()) return m;
    Entry& e = by_id_.at(t->second);
    m.id = t->second;
    if (e.expired) {  // its blocks are gone: the KV came too late
      m.outcome = Notice::kExpired;
      return m;
    }
    if (e.writer != 0 && from != e.writer) {
      m.outcome = Notice::kWrongWriter;
      m.expected = e.writer;
      return m;
    }
    e.filled = true;
    e.notice_value = value;
    m.outcome = Notice::kFilled;
  }
  notify();
  return m;
}

bool ReservationTable::expire(RequestId id, uint64_t tag) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    auto it = by_id_.find(id);
    if (it == by_id_.end() || it->second.tag != tag) return false;
    if (!it->second.claimed) {
      erase_locked(it);  // no Decode waits: nobody to tell
      return true;
    }
    it->second.expired = true;
  }
  notify();
  return true;
}

ReservationTable::Claim ReservationTable::claim(RequestId id) {
  std::lock_guard<std::mutex> lock(mu_);
  if (shutdown_) return {Outcome::kShutdown};
  auto it = by_id_.find(id);
  if (it == by_id_.end()) return {Outcome::kNotFound};
  if (it->second.claimed) return {Outcome::kBusy};
  it->second.claimed = true;
  return {Outcome::kFilled, it->second.tag, it->second.num_tokens, it->second.lease};
}

std::optional<ReservationTable::Taken> ReservationTable::poll(RequestId id, const Claim& claim,
                                                              bool give_up) {
  std::lock_guard<std::mutex> lock(mu_);
  Taken taken{Outcome::kFilled, claim.num_tokens, claim.lease};
  auto it = by_id_.find(id);
  // Gone, or replaced under the same id by a new Reserve after a Release.
  if (it == by_id_.end() || it->second.tag != claim.tag) {
    taken.outcome = shutdown_ ? Outcome::kShutdown : Outcome::kReleased;
    return taken;
  }
  if (shutdown_) {
    taken.outcome = Outcome::kShutdown;
  } else if (it->second.expired) {  // before filled: the blocks are gone either way
    taken.outcome = Outcome::kExpired;
    taken.lease = it->second.lease;
    taken.renewals = it->second.renewals;
  } else if (it->second.filled) {
    taken.outcome = Outcome::kFilled;
    taken.notice_value = it->second.notice_value;
  } else if (give_up) {
    taken.outcome = Outcome::kGaveUp;
  } else {
    return std::nullopt;
  }
  erase_locked(it);
  return taken;
}

bool ReservationTable::renewed(RequestId id, std::chrono::milliseconds lease) {
  std::lock_guard<std::mutex> lock(mu_);
  auto it = by_id_.find(id);
  if (it == by_id_.end()) return false;
  it->second.lease = lease;
  ++it->second.renewals;
  return true;
}

void ReservationTable::set_listener(std::function<void()> listener) {
  std::lock_guard<std::mutex> lock(mu_);
  listener_ = std::move(listener);
}

void ReservationTable::notify() {
  std::function<void()> listener;
  {
    std::lock_guard<std::mutex> lock(mu_);
    listener = listener_;
  }
  if (listener) listener();
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
  if (removed) notify();
  return removed;
}

void ReservationTable::shutdown() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    shutdown_ = true;
  }
  notify();
}

int64_t ReservationTable::size() const {
  std::lock_guard<std::mutex> lock(mu_);
  return static_cast<int64_t>(by_id_.size());
}

int64_t ReservationTable::claimed() const {
  std::lock_guard<std::mutex> lock(mu_);
  int64_t n = 0;
  for (const auto& [id, e] : by_id_) n += e.claimed ? 1 : 0;
  return n;
}

void ReservationTable::erase_locked(std::unordered_map<RequestId, Entry>::iterator it) {
  by_tag_.erase(it->second.tag);
  by_id_.erase(it);
}

}  // namespace cleave::worker_service
