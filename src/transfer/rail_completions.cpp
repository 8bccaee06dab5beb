// FabricRail's completion side: one progress pass, completions and completion errors matched
// to their operations, a batch finished by its last write, and the bounds that turn a peer
// that stops answering (or a provider that keeps refusing posts) into errors.
#include <cstring>

#include "cleave/common/log.h"
#include "fabric_rail.h"
#include "fmt/format.h"

namespace cleave::transfer {

namespace {

bool is_connection_error(int err) {
  switch (err) {
    case FI_ECONNREFUSED: case FI_ECONNRESET: case FI_ECONNABORTED: case FI_ENOTCONN:
    case FI_EHOSTUNREACH: case FI_ENETUNREACH: case FI_EIO: case FI_ESHUTDOWN:
    case FI_ENOENT: case FI_ETIMEDOUT: case FI_EADDRNOTAVAIL:
    // tcp;ofi_rxm: the target dropped the connection with this write in flight (its key check
    // refused a write: the key was revoked).
    case FI_ECANCELED:
      return true;
    default:
      return false;
  }
}

}  // namespace

int FabricRail::try_progress() {
  // Stamped before the attempt: a waiter that finds the lock taken by the rail's own thread
  // makes that thread step aside, so that the waiter gets the next pass.
  const int64_t now = steady_ns(Clock::now());
  driven_at_ns_.store(now, std::memory_order_relaxed);
  std::unique_lock<std::timed_mutex> lock(progress_mu_, std::try_to_lock);
  if (!lock.owns_lock()) return -1;
  Held held(this, now);
  return progress_once();
}

void FabricRail::finish_write(OpContext* op) {
  auto& t = op->work.transfer;
  metrics_->add_rail_write(index_, op->work.len);
  if (t->writes_left.fetch_sub(1, std::memory_order_acq_rel) == 1 && !t->is_done()) {
    if (t->notify_tag) {
      send_notice_now(t);
    } else {
      t->finish(Status::Ok());
    }
  }
}

void FabricRail::handle_completion(OpContext* op, bool error, const std::string& error_text,
                                   int err, Clock::time_point now) {
  last_activity_ = now;
  if (op->kind == OpContext::Kind::kRecv) {
    if (!error) {
      NoticeWire wire;
      std::memcpy(&wire, storage_->recv_slot(op->slot), sizeof(wire));
      if (wire.magic == kNoticeMagic && !received_.first_time(wire.from_engine, wire.id)) {
        log::debug("transfer rail {}: dropped a second copy of notice {} from engine {:016x} "
                   "(re-sent after its sender's endpoint was replaced)", index_, wire.tag,
                   wire.from_engine);
      } else if (wire.magic == kNoticeMagic) {
        metrics_->add_notice_received();
        on_notice_(Notice{wire.from_engine, wire.tag, wire.value});
      } else if (wire.magic == kWakeMagic) {
        // Writes follow: handling this completion made the pass count as activity.
      } else {
        log::warn("transfer rail {}: dropped a message that is not a notice", index_);
      }
    }
    if (!stop_.load() && err != FI_ECANCELED) {
      Status s = post_recv(op->slot);
      if (!s.ok()) log::error("transfer rail {}: {}", index_, s.message());
    }
    return;
  }
  if (op->kind == OpContext::Kind::kWake) {
    // Only a hint: an error (the peer is gone) shows up on the writes that follow.
    if (wakes_inflight_.erase(op) == 0) return;  // released by a reopen
    free_send_slots_.push_back(op->slot);
    free_op(op);
    return;
  }
  if (op->abandoned) {  // its transfer already failed on a timeout
    if (op->kind == OpContext::Kind::kWrite) {
      --writes_inflight_;
      --peer_inflight_[op->work.transfer->peer.get()];
    }
    auto it = std::find(abandoned_.begin(), abandoned_.end(), op);
    if (it != abandoned_.end()) abandoned_.erase(it);
    if (op->kind == OpContext::Kind::kNotice) free_send_slots_.push_back(op->slot);
    free_op(op);
    return;
  }
  if (!remove_inflight(op)) return;  // not ours (already released by a reopen)
  auto t = op->work.transfer;
  PeerRecord* peer = t->peer.get();
  if (op->kind == OpContext::Kind::kWrite) {
    --writes_inflight_;
    --peer_inflight_[peer];
  }
  last_completion_[peer] = now;
  if (op->kind == OpContext::Kind::kNotice) free_send_slots_.push_back(op->slot);
  if (error) {
    if (is_connection_error(err)) {
      t->mark_peer_unreachable();
      // ofi_rxm (1.17) keeps a broken connection to that address for good, so a connect() of
      // the same peer again would not help: a fresh endpoint makes fresh connections. Not for
      // shm, which has no connections (and whose endpoints are never closed: see reopen()).
      if (!leak_on_reopen_) reopen_wanted_ = true;
    }
    std::string what = op->kind == OpContext::Kind::kWrite
                           ? fmt::format("RMA write of {} bytes to remote address {:#x} (key "
                                         "{:#x})", op->work.len, op->work.remote_addr,
                                         op->work.key)
                           : fmt::format("notice {}", t->notify_tag.value_or(0));
    t->finish(Unavailable(fmt::format("{} to peer {:016x} failed on rail {} ({}): {}", what,
                                      peer->engine_id, index_, provider_name(), error_text)),
              TransferErrorKind::kCompletionError);
  } else if (op->kind == OpContext::Kind::kWrite) {
    finish_write(op);
  } else {
    if (t->metrics) metrics_->add_notice_sent();  // not for a re-sent copy (no metrics)
    remember_sent_notice(t, now);
    t->finish(Status::Ok());
  }
  free_op(op);
}

int FabricRail::read_completions() {
  if (!ep_) return 0;
  last_read_ns_ = held_since_ns_.load(std::memory_order_relaxed);
  int total = 0;
  for (;;) {
    fi_cq_data_entry entries[64];
    ssize_t n = ep_->read(entries, 64);
    if (n > 0) {
      const auto now = Clock::now();
      for (ssize_t i = 0; i < n; ++i) {
        handle_completion(reinterpret_cast<OpContext*>(entries[i].op_context), false, {}, 0,
                          now);
      }
      total += static_cast<int>(n);
      if (n < 64) return total;
      continue;
    }
    if (n == -FI_EAVAIL) {
      fi_cq_err_entry err{};
      ssize_t rc = ep_->read_error(&err);
      if (rc < 0) return total;
      ++total;
      if (err.err == FI_ECANCELED && stop_.load()) continue;
      std::string prov = ep_->provider_error(err);
      std::string text = fmt::format("{} (provider: {})", fi_strerror(err.err), prov);
      if (err.op_context) {
        handle_completion(reinterpret_cast<OpContext*>(err.op_context), true, text, err.err,
                          Clock::now());
      } else {
        log::warn("transfer rail {}: error completion without context: {}", index_, text);
      }
      continue;
    }
    return total;
  }
}

void FabricRail::abandon(OpContext* op, Status why, TransferErrorKind kind) {
  remove_inflight(op);
  op->abandoned = true;
  abandoned_.push_back(op);
  reopen_wanted_ = true;
  auto& t = op->work.transfer;
  t->mark_peer_unreachable();
  t->finish(std::move(why), kind);
}

void FabricRail::remember_sent_notice(const std::shared_ptr<TransferState>& t,
                                      Clock::time_point now) {
  const auto window = std::chrono::milliseconds(
      std::min<int64_t>(settings_.completion_timeout_ms, kResendWindowMs));
  while (!sent_recently_.empty() &&
         (sent_recently_.size() >= kResendMax || now - sent_recently_.front().at > window)) {
    sent_recently_.pop_front();
  }
  sent_recently_.push_back({t->peer, *t->notify_tag, t->notice_id, now});
}

bool FabricRail::held_back_by_other(PeerRecord* peer, Clock::time_point since) const {
  for (const OpContext* op : inflight_) {
    if (op->work.transfer->peer.get() != peer && op->posted <= since) return true;
  }
  return false;
}

void FabricRail::check_timeouts() {
  const auto now = pass_now_;
  if (now - last_timeout_check_ < std::chrono::milliseconds(5)) return;
  last_timeout_check_ = now;
  const auto bound = std::chrono::milliseconds(settings_.completion_timeout_ms);
  std::vector<OpContext*> stuck, dead;
  std::unordered_map<PeerRecord*, bool> alive;  // same-host peers with operations in flight
  for (OpContext* op : inflight_) {
    PeerRecord* peer = op->work.transfer->peer.get();
    if (peer->same_host) {
      auto [it, fresh] = alive.try_emplace(peer, true);
      if (fresh) it->second = peer->alive();
      if (!it->second) {
        dead.push_back(op);
        continue;
      }
    }
    auto since = op->posted;
    auto it = last_completion_.find(peer);
    if (it != last_completion_.end() && it->second > since) since = it->second;
    if (now - since > bound) stuck.push_back(op);
  }
  // shm reads its completions in posting order, so one operation that is never answered (a
  // write its target refused) holds back the completions of every later one, to every peer.
  // Only the peer of the oldest unanswered operation is to blame (its own later completions
  // may have kept it from counting as stuck): the others' operations are posted again on the
  // rebuilt endpoint, with a fresh bound.
  PeerRecord* culprit = nullptr;
  if (leak_on_reopen_ && !abandoned_.empty()) {
    stuck.clear();  // the rebuild for the last fault is still to come: it restarts the bounds
  } else if (leak_on_reopen_ && !stuck.empty()) {
    culprit = (*std::min_element(inflight_.begin(), inflight_.end(),
                                 [](OpContext* a, OpContext* b) { return a->posted < b->posted; }))
                  ->work.transfer->peer.get();
    stuck.clear();
    for (OpContext* op : inflight_) {
      if (op->work.transfer->peer.get() == culprit && now - op->posted > bound &&
          std::find(dead.begin(), dead.end(), op) == dead.end()) {
        stuck.push_back(op);
      }
    }
  }
  for (OpContext* op : dead) {
    auto& t = op->work.transfer;
    abandon(op, Unavailable(fmt::format("peer {:016x} (pid {} on this host) exited with a {} to it "
                                        "in flight on rail {} ({}); the peer is marked "
                                        "unreachable", t->peer->engine_id, t->peer->pid,
                                        op->kind == OpContext::Kind::kWrite ? "write" : "notice",
                                        index_, provider_name())),
            TransferErrorKind::kPeerUnavailable);
  }
  for (OpContext* op : stuck) {
    auto& t = op->work.transfer;
    const bool write = op->kind == OpContext::Kind::kWrite;
    // shm answers a write its target refuses (a key revoked when the reservation it named
    // ended) with nothing at all: the completion timeout is then the only way it ends.
    const bool maybe_refused = write && leak_on_reopen_;
    abandon(op, DeadlineExceeded(fmt::format(
                    "peer {:016x} did not complete a {} within {} ms on rail {} ({}){}; the "
                    "peer is marked unreachable",
                    t->peer->engine_id, write ? "write" : "notice",
                    settings_.completion_timeout_ms, index_, provider_name(),
                    maybe_refused
                        ? fmt::format(": the write was refused by the target (its key {:#x} "
                                      "revoked: the destination's reservation ended) or the "
                                      "target stopped progressing; shm does not answer a "
                                      "refused write, so this bound is how it ends",
                                      op->work.key)
                        : std::string())),
            TransferErrorKind::kTimeout);
  }
  // A peer whose writes the provider keeps refusing with -FI_EAGAIN fails the same way.
  for (auto it = eagain_since_.begin(); it != eagain_since_.end();) {
    if (now - it->second.since <= bound) { ++it; continue; }
    PeerRecord* peer = it->first;
    // shm: refusals behind another peer's unanswered operation (its completions hold back
    // ours, and with them the credits): the rebuild that fault causes clears them.
    if (leak_on_reopen_ && (culprit || reopen_wanted_ || held_back_by_other(peer, it->second.since))) {
      ++it;
      continue;
    }
    peer->unreachable.store(true);
    for (auto& w : ready_) {
      if (w.transfer->peer.get() != peer) continue;
      w.transfer->finish(DeadlineExceeded(fmt::format(
                             "rail {} ({}) could not post a write to peer {:016x} for {} ms "
                             "(-FI_EAGAIN); the peer is marked unreachable",
                             index_, provider_name(), peer->engine_id,
                             settings_.completion_timeout_ms)),
                         TransferErrorKind::kTimeout);
      break;
    }
    it = eagain_since_.erase(it);
  }
  // Slices queued behind a failed or unreachable transfer are dropped by post_ready().
}

int FabricRail::progress_once() {
  // Where the rail's thread never sleeps inside the provider (no CQ wait object: shm), any
  // lock holder may rebuild the endpoint; a waiter that keeps driving the rail would otherwise
  // hold the rebuild off, and with it every other peer's completions (shm answers in order).
  if (reopen_wanted_ && leak_on_reopen_ && !cq_waitable_) {
    reopen_wanted_ = false;
    reopen();
  }
  if (incoming_queued_.load(std::memory_order_acquire)) {
    std::lock_guard<std::mutex> ilock(incoming_mu_);
    incoming_queued_.store(false, std::memory_order_relaxed);
    if (!incoming_.empty()) {
      // From here on the work is in state only the lock holder can reach: track it so that a
      // declare_stuck() fails it (work still in incoming_ is handed to the replacement).
      std::lock_guard<std::mutex> tlock(tracked_mu_);
      track(incoming_);
    }
    while (!incoming_.empty()) {
      push_ready(std::move(incoming_.front()));
      incoming_.pop_front();
    }
  }
  if (!ep_) {  // out of service: fail what is queued
    for (auto& w : ready_) {
      w.transfer->finish(Unavailable(fmt::format("rail {} is out of service", index_)),
                         TransferErrorKind::kPostError);
    }
    int n = static_cast<int>(ready_.size());
    ready_.clear();
    return n;
  }
  if (!ready_.empty()) post_ready();
  int n = read_completions();
  if (n > 0 && !ready_.empty()) post_ready();  // completions freed credits
  // After the read: it may have finished the batches a deferred notice waits for, and freed
  // the send slots a pending one waits for.
  if (!deferred_notices_.empty() || !pending_notices_.empty()) post_deferred_notices();
  if (!hellos_due_.empty()) send_hellos();
  if (!inflight_.empty() || !eagain_since_.empty()) check_timeouts();
  return n;
}

}  // namespace cleave::transfer
