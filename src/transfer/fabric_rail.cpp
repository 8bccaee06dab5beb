// One rail: an RDM endpoint, its completion queue and address vector, the buffers for notices,
// and the progress thread that owns them all.
#include <pthread.h>

#include <cstring>

#include "cleave/common/log.h"
#include "fmt/format.h"
#include "transfer_internal.h"

namespace cleave::transfer {

namespace {

struct NoticeWire {
  uint64_t magic;
  uint64_t from_engine;
  uint64_t tag;
};
constexpr uint64_t kNoticeMagic = 0x31454349544f4e43ull;  // "CNOTICE1"

bool is_connection_error(int err) {
  switch (err) {
    case FI_ECONNREFUSED: case FI_ECONNRESET: case FI_ECONNABORTED: case FI_ENOTCONN:
    case FI_EHOSTUNREACH: case FI_ENETUNREACH: case FI_EIO: case FI_ESHUTDOWN:
    case FI_ENOENT: case FI_ETIMEDOUT: case FI_EADDRNOTAVAIL:
      return true;
    default:
      return false;
  }
}

}  // namespace

FabricRail::FabricRail(int index, fid_domain* domain, fi_info* info,
                       const TransferSettings& settings, MetricsCounters* metrics,
                       bool delivery_complete, std::function<void(const Notice&)> on_notice)
    : index_(index), domain_(domain), info_(info), settings_(settings), metrics_(metrics),
      delivery_complete_(delivery_complete), on_notice_(std::move(on_notice)) {}

FabricRail::~FabricRail() {
  stop();
  if (ep_) fi_close(&ep_->fid);
  for (OpContext* op : inflight_) delete op;
  for (OpContext* op : abandoned_) delete op;
  for (OpContext* op : recv_ops_) delete op;
  if (recv_mr_) fi_close(&recv_mr_->fid);
  if (send_mr_) fi_close(&send_mr_->fid);
  if (av_) fi_close(&av_->fid);
  if (cq_) fi_close(&cq_->fid);
}

Status FabricRail::open(uint64_t engine_id, uint64_t (*next_key)(void*), void* key_ctx) {
  engine_id_ = engine_id;
  fi_cq_attr cq_attr{};
  cq_attr.format = FI_CQ_FORMAT_DATA;
  cq_attr.wait_obj = FI_WAIT_UNSPEC;
  cq_attr.size = 0;
  int rc = fi_cq_open(domain_, &cq_attr, &cq_, nullptr);
  if (rc == 0) {
    // Only a wait object backed by a file descriptor sleeps until the provider has work (shm's
    // yield-based waits would neither sleep nor progress); otherwise poll the CQ.
    int fd = -1;
    cq_waitable_ = fi_control(&cq_->fid, FI_GETWAIT, &fd) == 0;
    if (!cq_waitable_) {
      fi_close(&cq_->fid);
      cq_ = nullptr;
      rc = -FI_ENOSYS;
    }
  }
  if (!cq_waitable_) {
    cq_attr.wait_obj = FI_WAIT_NONE;
    rc = fi_cq_open(domain_, &cq_attr, &cq_, nullptr);
    if (rc) return Internal(fabric_error(fmt::format("rail {}: fi_cq_open", index_), rc));
  }
  fi_av_attr av_attr{};
  av_attr.type = FI_AV_TABLE;
  rc = fi_av_open(domain_, &av_attr, &av_, nullptr);
  if (rc) return Internal(fabric_error(fmt::format("rail {}: fi_av_open", index_), rc));
  rc = fi_endpoint(domain_, info_, &ep_, nullptr);
  if (rc) return Internal(fabric_error(fmt::format("rail {}: fi_endpoint", index_), rc));
  rc = fi_ep_bind(ep_, &cq_->fid, FI_TRANSMIT | FI_RECV);
  if (rc) return Internal(fabric_error(fmt::format("rail {}: fi_ep_bind(cq)", index_), rc));
  rc = fi_ep_bind(ep_, &av_->fid, 0);
  if (rc) return Internal(fabric_error(fmt::format("rail {}: fi_ep_bind(av)", index_), rc));
  rc = fi_enable(ep_);
  if (rc) return Internal(fabric_error(fmt::format("rail {}: fi_enable", index_), rc));

  char name[512];
  size_t len = sizeof(name);
  rc = fi_getname(&ep_->fid, name, &len);
  if (rc) return Internal(fabric_error(fmt::format("rail {}: fi_getname", index_), rc));
  name_.assign(name, len);

  depth_ = info_->tx_attr->size ? info_->tx_attr->size : 128;
  if (settings_.max_inflight_per_rail > 0) {
    depth_ = std::min<size_t>(depth_, static_cast<size_t>(settings_.max_inflight_per_rail));
  }
  // Notices need send credits too; keep a few TX entries for them.
  if (depth_ > 16) depth_ -= 8;

  recv_buf_.assign(static_cast<size_t>(kRecvSlots) * kNoticeBytes, 0);
  send_buf_.assign(static_cast<size_t>(kSendSlots) * kNoticeBytes, 0);
  rc = fi_mr_reg(domain_, recv_buf_.data(), recv_buf_.size(), FI_RECV, 0, next_key(key_ctx), 0,
                 &recv_mr_, nullptr);
  if (rc) return Internal(fabric_error(fmt::format("rail {}: fi_mr_reg(notice recv)", index_), rc));
  rc = fi_mr_reg(domain_, send_buf_.data(), send_buf_.size(), FI_SEND, 0, next_key(key_ctx), 0,
                 &send_mr_, nullptr);
  if (rc) return Internal(fabric_error(fmt::format("rail {}: fi_mr_reg(notice send)", index_), rc));
  for (int i = kSendSlots - 1; i >= 0; --i) free_send_slots_.push_back(i);
  for (int i = 0; i < kRecvSlots; ++i) {
    auto* op = new OpContext{};
    op->kind = OpContext::Kind::kRecv;
    op->slot = i;
    recv_ops_.push_back(op);
  }
  for (int i = 0; i < kRecvSlots; ++i) CLEAVE_RETURN_IF_ERROR(post_recv(i));
  return Status::Ok();
}

Status FabricRail::post_recv(int slot) {
  OpContext* op = recv_ops_[static_cast<size_t>(slot)];
  void* buf = recv_buf_.data() + static_cast<size_t>(slot) * kNoticeBytes;
  for (;;) {
    ssize_t rc = fi_recv(ep_, buf, kNoticeBytes, fi_mr_desc(recv_mr_), FI_ADDR_UNSPEC, &op->ctx);
    if (rc == 0) return Status::Ok();
    if (rc != -FI_EAGAIN) {
      return Internal(fabric_error(fmt::format("rail {}: fi_recv", index_), static_cast<int>(rc)));
    }
    fi_cq_entry dummy;
    (void)fi_cq_read(cq_, &dummy, 0);
  }
}

Result<fi_addr_t> FabricRail::insert_peer(const std::string& name) {
  fi_addr_t addr = FI_ADDR_NOTAVAIL;
  int n = fi_av_insert(av_, name.data(), 1, &addr, 0, nullptr);
  if (n != 1) {
    return Unavailable(fmt::format("rail {}: fi_av_insert of a peer address ({} bytes) failed ({})",
                                   index_, name.size(), n < 0 ? fi_strerror(-n) : "0 inserted"));
  }
  return addr;
}

void FabricRail::start() {
  thread_ = std::thread([this] {
    std::string tname = fmt::format("xfer-rail{}", index_);
    pthread_setname_np(pthread_self(), tname.c_str());
    run();
  });
}

void FabricRail::stop() {
  if (!thread_.joinable()) return;
  stop_.store(true);
  wake();
  thread_.join();
}

void FabricRail::wake() {
  { std::lock_guard<std::mutex> lock(mu_); }
  cv_.notify_one();
  if (cq_waitable_ && cq_) fi_cq_signal(cq_);
}

void FabricRail::enqueue(std::vector<RailWork> work) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    for (auto& w : work) incoming_.push_back(std::move(w));
  }
  cv_.notify_one();
  if (cq_waitable_) fi_cq_signal(cq_);
}

int FabricRail::post(RailWork& w, fi_addr_t dest) {
  auto* op = new OpContext{};
  op->kind = OpContext::Kind::kWrite;
  op->work = w;
  iovec iov{w.local, w.len};
  void* desc = w.local_desc;
  fi_rma_iov rma{w.remote_addr, w.len, w.key};
  fi_msg_rma msg{};
  msg.msg_iov = &iov;
  msg.desc = &desc;
  msg.iov_count = 1;
  msg.addr = dest;
  msg.rma_iov = &rma;
  msg.rma_iov_count = 1;
  msg.context = &op->ctx;
  uint64_t flags = FI_COMPLETION | (delivery_complete_ ? FI_DELIVERY_COMPLETE : 0);
  ssize_t rc = fi_writemsg(ep_, &msg, flags);
  if (rc != 0) {
    delete op;
    return static_cast<int>(rc);
  }
  op->posted = Clock::now();
  inflight_.insert(op);
  ++writes_inflight_;
  ++peer_inflight_[w.transfer->peer.get()];
  return 0;
}

void FabricRail::post_ready() {
  // Each peer may hold at most a quarter of the TX depth, so that a peer that stops answering
  // (whose operations some providers never complete) cannot starve the others. Items of a
  // capped peer are skipped, keeping each peer's own order.
  const size_t peer_cap = std::max<size_t>(1, depth_ / 4);
  std::unordered_set<PeerRecord*> capped;
  for (auto it = ready_.begin(); it != ready_.end() && writes_inflight_ < depth_;) {
    RailWork& w = *it;
    const auto t = w.transfer;
    if (t->is_done()) {  // failed earlier: drop the rest of its slices
      if (it == ready_.begin()) eagain_since_.reset();
      it = ready_.erase(it);
      continue;
    }
    PeerRecord* peer = t->peer.get();
    if (peer->unreachable.load()) {
      t->finish(Unavailable(fmt::format("peer {:016x} is unreachable (an earlier transfer to it "
                                        "failed); reconnect before sending again",
                                        peer->engine_id)),
                TransferErrorKind::kPeerUnavailable);
      if (it == ready_.begin()) eagain_since_.reset();
      it = ready_.erase(it);
      continue;
    }
    if (w.kind == RailWork::Kind::kNotice) {
      deferred_notices_.push_back(t);
      it = ready_.erase(it);
      continue;
    }
    if (capped.count(peer) || peer_inflight_[peer] >= peer_cap) {
      capped.insert(peer);
      ++it;
      if (capped.size() > 16) break;
      continue;
    }
    int rc = post(w, peer->rail_addr[static_cast<size_t>(index_)]);
    if (rc == -FI_EAGAIN) {  // the caller reads completions, which drives progress
      if (!eagain_since_) eagain_since_ = Clock::now();
      break;
    }
    eagain_since_.reset();
    if (rc != 0) {
      t->finish(Internal(fabric_error(fmt::format("rail {}: fi_writemsg of {} bytes", index_, w.len),
                                      rc)),
                TransferErrorKind::kPostError);
    }
    it = ready_.erase(it);
  }
}

void FabricRail::send_notice_now(const std::shared_ptr<TransferState>& t) {
  if (free_send_slots_.empty()) {
    pending_notices_.push_back(t);
    return;
  }
  int slot = free_send_slots_.back();
  char* buf = send_buf_.data() + static_cast<size_t>(slot) * kNoticeBytes;
  NoticeWire wire{kNoticeMagic, engine_id_, *t->notify_tag};
  std::memcpy(buf, &wire, sizeof(wire));
  auto* op = new OpContext{};
  op->kind = OpContext::Kind::kNotice;
  op->work.transfer = t;
  op->slot = slot;
  ssize_t rc = fi_send(ep_, buf, sizeof(wire), fi_mr_desc(send_mr_),
                       t->peer->rail_addr[static_cast<size_t>(index_)], &op->ctx);
  if (rc == -FI_EAGAIN) {
    delete op;
    pending_notices_.push_back(t);
    return;
  }
  if (rc != 0) {
    delete op;
    t->finish(Internal(fabric_error(fmt::format("rail {}: fi_send of a notice", index_),
                                    static_cast<int>(rc))),
              TransferErrorKind::kPostError);
    return;
  }
  free_send_slots_.pop_back();
  op->posted = Clock::now();
  inflight_.insert(op);
}

void FabricRail::post_deferred_notices() {
  size_t n = pending_notices_.size();
  for (size_t i = 0; i < n; ++i) {
    auto t = pending_notices_.front();
    pending_notices_.pop_front();
    if (!t->is_done()) send_notice_now(t);
  }
  for (auto it = deferred_notices_.begin(); it != deferred_notices_.end();) {
    const auto& t = *it;
    bool blocked = false;
    Status failed;
    for (const auto& p : t->predecessors) {
      auto st = TransferHandle(p).poll();
      if (!st) { blocked = true; break; }
      if (!st->ok()) { failed = *st; break; }
    }
    if (blocked) { ++it; continue; }
    if (!failed.ok()) {
      t->finish(Aborted(fmt::format("notice {} not sent: an earlier transfer to peer {:016x} "
                                    "failed: {}", *t->notify_tag, t->peer->engine_id,
                                    failed.message())),
                TransferErrorKind::kCompletionError);
    } else if (!t->is_done()) {
      t->predecessors.clear();
      send_notice_now(t);
    }
    it = deferred_notices_.erase(it);
  }
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
                                   int err) {
  if (op->kind == OpContext::Kind::kRecv) {
    if (!error) {
      NoticeWire wire;
      std::memcpy(&wire, recv_buf_.data() + static_cast<size_t>(op->slot) * kNoticeBytes,
                  sizeof(wire));
      if (wire.magic == kNoticeMagic) {
        metrics_->add_notice_received();
        on_notice_(Notice{wire.from_engine, wire.tag});
      } else {
        log::warn("transfer rail {}: dropped a message that is not a notice", index_);
      }
    }
    int slot = op->slot;
    if (!stop_.load() && err != FI_ECANCELED) {
      Status s = post_recv(slot);
      if (!s.ok()) log::error("transfer rail {}: {}", index_, s.message());
    }
    return;
  }
  if (op->kind == OpContext::Kind::kWrite) {
    --writes_inflight_;
    --peer_inflight_[op->work.transfer->peer.get()];
  }
  if (op->abandoned) {  // its transfer already failed on a timeout
    auto it = std::find(abandoned_.begin(), abandoned_.end(), op);
    if (it != abandoned_.end()) abandoned_.erase(it);
    if (op->kind == OpContext::Kind::kNotice) free_send_slots_.push_back(op->slot);
    delete op;
    return;
  }
  inflight_.erase(op);
  auto t = op->work.transfer;
  last_completion_[t->peer.get()] = Clock::now();
  if (op->kind == OpContext::Kind::kNotice) free_send_slots_.push_back(op->slot);
  if (error) {
    if (is_connection_error(err)) t->peer->unreachable.store(true);
    t->finish(Unavailable(fmt::format("{} to peer {:016x} failed on rail {} ({}): {}",
                                      op->kind == OpContext::Kind::kWrite ? "RMA write" : "notice",
                                      t->peer->engine_id, index_, provider_name(), error_text)),
              TransferErrorKind::kCompletionError);
  } else if (op->kind == OpContext::Kind::kWrite) {
    finish_write(op);
  } else {
    metrics_->add_notice_sent();
    t->finish(Status::Ok());
  }
  delete op;
}

int FabricRail::read_completions() {
  fi_cq_data_entry entries[64];
  ssize_t n = fi_cq_read(cq_, entries, 64);
  if (n > 0) {
    for (ssize_t i = 0; i < n; ++i) {
      handle_completion(reinterpret_cast<OpContext*>(entries[i].op_context), false, {}, 0);
    }
    return static_cast<int>(n);
  }
  if (n == -FI_EAVAIL) {
    fi_cq_err_entry err{};
    ssize_t rc = fi_cq_readerr(cq_, &err, 0);
    if (rc < 0) return 0;
    if (err.err == FI_ECANCELED && stop_.load()) return 1;
    char buf[256];
    const char* prov = fi_cq_strerror(cq_, err.prov_errno, err.err_data, buf, sizeof(buf));
    std::string text = fmt::format("{} (provider: {})", fi_strerror(err.err), prov ? prov : "-");
    if (err.op_context) {
      handle_completion(reinterpret_cast<OpContext*>(err.op_context), true, text, err.err);
    } else {
      log::warn("transfer rail {}: error completion without context: {}", index_, text);
    }
    return 1;
  }
  return 0;
}

void FabricRail::check_timeouts() {
  auto now = Clock::now();
  if (now - last_timeout_check_ < std::chrono::milliseconds(5)) return;
  last_timeout_check_ = now;
  const auto bound = std::chrono::milliseconds(settings_.completion_timeout_ms);
  std::vector<OpContext*> stuck;
  for (OpContext* op : inflight_) {
    if (op->kind == OpContext::Kind::kRecv) continue;
    auto since = op->posted;
    auto it = last_completion_.find(op->work.transfer->peer.get());
    if (it != last_completion_.end() && it->second > since) since = it->second;
    if (now - since > bound) stuck.push_back(op);
  }
  for (OpContext* op : stuck) {
    inflight_.erase(op);
    op->abandoned = true;
    abandoned_.push_back(op);
    auto& t = op->work.transfer;
    t->peer->unreachable.store(true);
    t->finish(DeadlineExceeded(fmt::format(
                  "peer {:016x} did not complete a {} within {} ms on rail {} ({}); the peer is "
                  "marked unreachable",
                  t->peer->engine_id, op->kind == OpContext::Kind::kWrite ? "write" : "notice",
                  settings_.completion_timeout_ms, index_, provider_name())),
              TransferErrorKind::kTimeout);
  }
  // A write the provider keeps refusing with -FI_EAGAIN fails the same way.
  if (eagain_since_ && !ready_.empty() && now - *eagain_since_ > bound) {
    auto t = ready_.front().transfer;
    t->peer->unreachable.store(true);
    t->finish(DeadlineExceeded(fmt::format(
                  "rail {} ({}) could not post a write to peer {:016x} for {} ms (-FI_EAGAIN); "
                  "the peer is marked unreachable",
                  index_, provider_name(), t->peer->engine_id, settings_.completion_timeout_ms)),
              TransferErrorKind::kTimeout);
    eagain_since_.reset();
  }
  // Slices queued behind a failed or unreachable transfer are dropped by post_ready().
}

void FabricRail::run() {
  int idle_spins = 0;
  while (!stop_.load(std::memory_order_relaxed)) {
    {
      std::lock_guard<std::mutex> lock(mu_);
      while (!incoming_.empty()) {
        ready_.push_back(std::move(incoming_.front()));
        incoming_.pop_front();
      }
    }
    post_ready();
    if (!deferred_notices_.empty() || !pending_notices_.empty()) post_deferred_notices();
    int n = read_completions();
    if (!inflight_.empty() || eagain_since_) check_timeouts();
    if (n > 0) {
      idle_spins = 0;
      continue;
    }
    bool busy = !inflight_.empty() || !ready_.empty() || !deferred_notices_.empty();
    if (busy && ++idle_spins < 200) continue;
    idle_spins = 0;
    // Wait for completions (the provider progresses inside fi_cq_sread) or new work.
    int wait_ms = busy ? 1 : 20;
    if (cq_waitable_) {
      fi_cq_data_entry entries[16];
      ssize_t got = fi_cq_sread(cq_, entries, 16, nullptr, wait_ms);
      for (ssize_t i = 0; i < got; ++i) {
        handle_completion(reinterpret_cast<OpContext*>(entries[i].op_context), false, {}, 0);
      }
      if (got == -FI_EAVAIL) continue;
    } else {
      // No fd to sleep on: yield while operations are in flight, else nap briefly (a target
      // must keep progressing for incoming writes on providers with manual progress).
      if (busy) {
        std::this_thread::yield();
      } else {
        std::unique_lock<std::mutex> lock(mu_);
        cv_.wait_for(lock, std::chrono::microseconds(100),
                     [&] { return !incoming_.empty() || stop_.load(); });
      }
    }
  }
  // Cancel receives and drain; the endpoint is closed by the destructor.
}

}  // namespace cleave::transfer
