// A fault-injecting, in-memory RailPort for FabricRail unit tests: no provider, no network.
//
// A FakeFabric is the test's handle: it holds the knobs (what to refuse, fail, hold or never
// complete) and records what the rail did (every accepted post, in order, with the completions
// the rail read). Its endpoints keep a completion queue of their own; an accepted operation is
// completed at the next read unless the test holds it (hold_completions) or its outcome says
// otherwise. Thread-safe: the rail's thread and the test may use it at once.
#pragma once

#include <rdma/fi_errno.h>

#include <cstring>
#include <deque>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "transfer/rail_port.h"

namespace cleave::transfer::fake {

struct FakeOp {
  enum class Kind { kWrite, kSend } kind = Kind::kWrite;
  int endpoint = 0;       // 0 for the first endpoint opened, 1 after a reopen, ...
  std::string peer;       // the peer's name, as the rail inserted it into the AV
  uint64_t remote_addr = 0;
  uint64_t len = 0;
  uint64_t key = 0;
  uint64_t flags = 0;
  std::string payload;    // kSend: the bytes sent
  void* context = nullptr;
};

// What becomes of an accepted operation.
struct Outcome {
  enum class Kind { kComplete, kError, kNever } kind = Kind::kComplete;
  int err = 0;  // kError: the fi_errno of the error completion
  static Outcome complete() { return {}; }
  static Outcome error(int err) { return {Kind::kError, err}; }
  static Outcome never() { return {Kind::kNever, 0}; }
};

class FakeFabric {
 public:
  // --- knobs (set under `mu`, or before the rail exists) ---
  std::mutex mu;
  const char* provider = "fake";
  size_t tx_depth = 1024;
  uint64_t max_msg_size = 1ull << 30;
  // Every post (write or send) is refused with -FI_EAGAIN this many times before one is
  // accepted; the count starts again after each accepted post.
  int refuse_each_post = 0;
  // A provider queue of this many entries: posts are refused with -FI_EAGAIN while this many
  // operations are accepted and their completions not yet read (0: unlimited).
  size_t queue_entries = 0;
  // Accepted operations wait for release() instead of completing at the next read.
  bool hold_completions = false;
  std::function<Outcome(const FakeOp&)> outcome;  // unset: every operation completes
  int fail_open_after = -1;                       // open_endpoint fails once this many opened
  bool remote_write_counter = true;  // false: like tcp, no FI_RMA_EVENT (the rail sends wake-ups)

  // --- what happened (read under `mu`) ---
  std::vector<FakeOp> accepted;          // every accepted post, in order
  std::vector<std::string> events;       // "write <peer> <addr>", "done <addr>", "send <peer>"...
  uint64_t refusals = 0;                 // posts answered -FI_EAGAIN
  uint64_t reads = 0;                    // calls to read() (progress)
  size_t writes_in_flight = 0;           // accepted writes whose completion was not read yet
  size_t max_writes_in_flight = 0;
  std::vector<size_t> peer_writes_in_flight_max;  // by AV address of the first endpoint
  int endpoints_opened = 0;
  int endpoints_closed = 0;
  size_t recvs_posted = 0;               // receive buffers currently posted, all endpoints

  // Moves up to `n` held operations (oldest first) to their endpoint's completion queue.
  void release(size_t n = static_cast<size_t>(-1));
  // Delivers `bytes` into the oldest posted receive of the newest endpoint; false if none.
  bool deliver_message(const std::string& bytes);

  size_t held() {
    std::lock_guard<std::mutex> lock(mu);
    return held_.size();
  }
  size_t accepted_count() {
    std::lock_guard<std::mutex> lock(mu);
    return accepted.size();
  }

 private:
  friend class FakeEndpoint;
  friend class FakePort;
  struct Completion {
    class FakeEndpoint* ep;
    void* context;
    int err;  // 0: success
    bool write;
    uint64_t remote_addr;
    std::string peer;
  };
  std::deque<Completion> held_;
  std::vector<class FakeEndpoint*> live_;
};

class FakeEndpoint final : public RailEndpoint {
 public:
  FakeEndpoint(std::shared_ptr<FakeFabric> f, int id)
      : f_(std::move(f)), id_(id), name_("fake-ep-" + std::to_string(id)),
        counter_(f_->remote_write_counter) {}
  ~FakeEndpoint() override {
    std::lock_guard<std::mutex> lock(f_->mu);
    ++f_->endpoints_closed;
    f_->recvs_posted -= recvs_.size();
    for (const auto& c : cq_) if (c.write) --f_->writes_in_flight;
    std::erase_if(f_->held_, [&](const FakeFabric::Completion& c) {
      if (c.ep != this) return false;
      if (c.write) --f_->writes_in_flight;
      return true;
    });
    f_->writes_in_flight -= never_writes_;
    std::erase(f_->live_, this);
  }

  const std::string& name() const override { return name_; }
  bool waitable() const override { return false; }

  int av_insert(const std::string& peer_name, fi_addr_t* addr) override {
    std::lock_guard<std::mutex> lock(f_->mu);
    av_.push_back(peer_name);
    *addr = av_.size() - 1;
    return 1;
  }

  ssize_t write(void* local, size_t len, void* local_desc, fi_addr_t dest, uint64_t remote_addr,
                uint64_t key, uint64_t flags, void* context) override {
    FakeOp op;
    op.kind = FakeOp::Kind::kWrite;
    op.remote_addr = remote_addr;
    op.len = len;
    op.key = key;
    op.flags = flags;
    op.context = context;
    return post(std::move(op), dest);
  }

  ssize_t send(const void* buf, size_t len, void* desc, fi_addr_t dest, uint64_t flags,
               void* context) override {
    FakeOp op;
    op.kind = FakeOp::Kind::kSend;
    op.len = len;
    op.flags = flags;
    op.payload.assign(static_cast<const char*>(buf), len);
    op.context = context;
    return post(std::move(op), dest);
  }

  ssize_t recv(void* buf, size_t len, void* desc, void* context) override {
    std::lock_guard<std::mutex> lock(f_->mu);
    recvs_.push_back({buf, len, context});
    ++f_->recvs_posted;
    return 0;
  }

  ssize_t read(fi_cq_data_entry* entries, size_t count) override {
    std::lock_guard<std::mutex> lock(f_->mu);
    ++f_->reads;
    if (count == 0) return 0;
    if (cq_.empty()) return -FI_EAGAIN;
    if (cq_.front().err != 0) return -FI_EAVAIL;
    size_t n = 0;
    while (n < count && !cq_.empty() && cq_.front().err == 0) {
      std::memset(&entries[n], 0, sizeof(entries[n]));
      entries[n].op_context = cq_.front().context;
      reaped(cq_.front());
      cq_.pop_front();
      ++n;
    }
    return static_cast<ssize_t>(n);
  }

  ssize_t read_error(fi_cq_err_entry* entry) override {
    std::lock_guard<std::mutex> lock(f_->mu);
    if (cq_.empty() || cq_.front().err == 0) return -FI_EAGAIN;
    std::memset(entry, 0, sizeof(*entry));
    entry->op_context = cq_.front().context;
    entry->err = cq_.front().err;
    entry->prov_errno = -cq_.front().err;
    reaped(cq_.front());
    cq_.pop_front();
    return 1;
  }

  std::string provider_error(const fi_cq_err_entry& entry) override {
    return "fake provider error " + std::to_string(entry.prov_errno);
  }
  ssize_t wait(fi_cq_data_entry*, size_t, int) override { return -FI_EAGAIN; }
  void signal() override {}
  uint64_t remote_writes() override { return 0; }
  bool counts_remote_writes() const override { return counter_; }

 private:
  friend class FakeFabric;
  struct Recv {
    void* buf;
    size_t len;
    void* context;
  };

  ssize_t post(FakeOp op, fi_addr_t dest) {
    std::lock_guard<std::mutex> lock(f_->mu);
    FakeFabric& f = *f_;
    if (dest >= av_.size()) return -FI_EINVAL;
    op.endpoint = id_;
    op.peer = av_[dest];
    const bool write = op.kind == FakeOp::Kind::kWrite;
    if (refusals_left_ < 0) refusals_left_ = f.refuse_each_post;
    if (refusals_left_ > 0) {
      --refusals_left_;
      ++f.refusals;
      return -FI_EAGAIN;
    }
    if (f.queue_entries > 0 && unreaped_ >= f.queue_entries) {
      ++f.refusals;
      return -FI_EAGAIN;
    }
    refusals_left_ = f.refuse_each_post;
    Outcome out = f.outcome ? f.outcome(op) : Outcome::complete();
    f.events.push_back(fmt_event(write ? "write" : "send", op));
    ++unreaped_;
    if (write) {
      ++f.writes_in_flight;
      f.max_writes_in_flight = std::max(f.max_writes_in_flight, f.writes_in_flight);
      if (id_ == 0) {
        if (f.peer_writes_in_flight_max.size() <= dest) f.peer_writes_in_flight_max.resize(dest + 1);
        if (peer_inflight_.size() <= dest) peer_inflight_.resize(dest + 1);
        ++peer_inflight_[dest];
        f.peer_writes_in_flight_max[dest] =
            std::max(f.peer_writes_in_flight_max[dest], peer_inflight_[dest]);
      }
    }
    FakeFabric::Completion c{this, op.context, out.kind == Outcome::Kind::kError ? out.err : 0,
                             write, op.remote_addr, op.peer};
    f.accepted.push_back(std::move(op));
    if (out.kind == Outcome::Kind::kNever) {
      if (write) ++never_writes_;
    } else if (f.hold_completions) {
      f.held_.push_back(std::move(c));
    } else {
      cq_.push_back(std::move(c));
    }
    return 0;
  }

  // Called with f_->mu held, for a completion the rail is reading now.
  void reaped(const FakeFabric::Completion& c) {
    --unreaped_;
    if (c.write) {
      --f_->writes_in_flight;
      if (id_ == 0) {
        for (size_t i = 0; i < av_.size(); ++i) {
          if (av_[i] == c.peer && i < peer_inflight_.size() && peer_inflight_[i] > 0) {
            --peer_inflight_[i];
            break;
          }
        }
      }
    }
    f_->events.push_back((c.err ? "error " : "done ") + c.peer + " " +
                         (c.write ? std::to_string(c.remote_addr) : std::string("notice")));
  }

  static std::string fmt_event(const char* what, const FakeOp& op) {
    return std::string(what) + " " + op.peer + " " +
           (op.kind == FakeOp::Kind::kWrite ? std::to_string(op.remote_addr) : "notice");
  }

  std::shared_ptr<FakeFabric> f_;
  int id_;
  std::string name_;
  bool counter_ = true;
  std::vector<std::string> av_;
  std::vector<size_t> peer_inflight_;
  std::deque<FakeFabric::Completion> cq_;
  std::deque<Recv> recvs_;
  int refusals_left_ = -1;  // -1: not yet initialised from the knob
  size_t unreaped_ = 0;
  size_t never_writes_ = 0;
};

inline void FakeFabric::release(size_t n) {
  std::lock_guard<std::mutex> lock(mu);
  while (n-- > 0 && !held_.empty()) {
    Completion c = std::move(held_.front());
    held_.pop_front();
    c.ep->cq_.push_back(std::move(c));
  }
}

inline bool FakeFabric::deliver_message(const std::string& bytes) {
  std::lock_guard<std::mutex> lock(mu);
  if (live_.empty() || live_.back()->recvs_.empty()) return false;
  FakeEndpoint* ep = live_.back();
  FakeEndpoint::Recv r = ep->recvs_.front();
  ep->recvs_.pop_front();
  --recvs_posted;
  std::memcpy(r.buf, bytes.data(), std::min(r.len, bytes.size()));
  ep->cq_.push_back({ep, r.context, 0, false, 0, "incoming"});
  ++ep->unreaped_;
  return true;
}

class FakeMemory final : public RailMemory {
 public:
  void* desc() const override { return nullptr; }
};

class FakePort final : public RailPort {
 public:
  explicit FakePort(std::shared_ptr<FakeFabric> f) : f_(std::move(f)) {}
  const char* provider_name() const override { return f_->provider; }
  size_t tx_depth() const override { return f_->tx_depth; }
  uint64_t max_msg_size() const override { return f_->max_msg_size; }
  Result<std::unique_ptr<RailMemory>> register_buffer(void*, size_t, uint64_t,
                                                      uint64_t) override {
    return std::unique_ptr<RailMemory>(std::make_unique<FakeMemory>());
  }
  Result<std::unique_ptr<RailEndpoint>> open_endpoint(int rail) override {
    std::lock_guard<std::mutex> lock(f_->mu);
    if (f_->fail_open_after >= 0 && f_->endpoints_opened >= f_->fail_open_after) {
      return Internal("fake: open_endpoint refused");
    }
    auto ep = std::make_unique<FakeEndpoint>(f_, f_->endpoints_opened++);
    f_->live_.push_back(ep.get());
    return std::unique_ptr<RailEndpoint>(std::move(ep));
  }

 private:
  std::shared_ptr<FakeFabric> f_;
};

}  // namespace cleave::transfer::fake
