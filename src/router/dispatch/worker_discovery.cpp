// Discovery (static lists, DNS) and the probe rounds of the "dispatch-health" thread.
#include "dispatch/worker_discovery.h"

#include <arpa/inet.h>
#include <netdb.h>
#include <sys/socket.h>

#include <algorithm>
#include <atomic>
#include <memory>

#include "cleave/common/log.h"
#include "cleave/common/thread_pool.h"
#include "cleave/control/proto_convert.h"
#include "fmt/format.h"

namespace cleave::router {

Result<std::vector<std::string>> resolve_worker_addresses(const std::string& name, int port) {
  addrinfo hints{};
  hints.ai_family = AF_UNSPEC;
  hints.ai_socktype = SOCK_STREAM;
  addrinfo* res = nullptr;
  const int rc = ::getaddrinfo(name.c_str(), nullptr, &hints, &res);
  if (rc != 0) {
    return Unavailable(fmt::format("cannot resolve worker DNS name '{}': {}", name, gai_strerror(rc)));
  }
  std::vector<std::string> out;
  for (addrinfo* a = res; a != nullptr; a = a->ai_next) {
    char text[INET6_ADDRSTRLEN] = {};
    if (a->ai_family == AF_INET) {
      const auto* sin = reinterpret_cast<const sockaddr_in*>(a->ai_addr);
      if (::inet_ntop(AF_INET, &sin->sin_addr, text, sizeof(text)) == nullptr) continue;
      out.push_back(fmt::format("{}:{}", text, port));
    } else if (a->ai_family == AF_INET6) {
      const auto* sin6 = reinterpret_cast<const sockaddr_in6*>(a->ai_addr);
      if (::inet_ntop(AF_INET6, &sin6->sin6_addr, text, sizeof(text)) == nullptr) continue;
      out.push_back(fmt::format("[{}]:{}", text, port));
    }
  }
  ::freeaddrinfo(res);
  std::sort(out.begin(), out.end());
  out.erase(std::unique(out.begin(), out.end()), out.end());
  if (out.empty()) return Unavailable(fmt::format("worker DNS name '{}' has no address", name));
  return out;
}

int parse_health_status(const std::string& bytes) {
  // Varint-keyed fields; the status is field 1 (tag 0x08). Unknown fields are skipped.
  int status = 0;  // proto3 default: UNKNOWN
  size_t i = 0;
  auto varint = [&](uint64_t* v) {
    *v = 0;
    for (int shift = 0; shift < 64 && i < bytes.size(); shift += 7) {
      const auto b = static_cast<uint8_t>(bytes[i++]);
      *v |= static_cast<uint64_t>(b & 0x7f) << shift;
      if ((b & 0x80) == 0) return true;
    }
    return false;
  };
  while (i < bytes.size()) {
    uint64_t tag = 0;
    if (!varint(&tag)) return -1;
    const uint64_t wire = tag & 7;
    uint64_t v = 0;
    if (wire == 0) {
      if (!varint(&v)) return -1;
      if ((tag >> 3) == 1) status = static_cast<int>(v);
    } else if (wire == 2) {
      if (!varint(&v) || v > bytes.size() - i) return -1;
      i += v;
    } else if (wire == 1 || wire == 5) {
      const size_t n = wire == 1 ? 8 : 4;
      if (n > bytes.size() - i) return -1;
      i += n;
    } else {
      return -1;
    }
  }
  return status;
}

WorkerDiscovery::WorkerDiscovery(const DispatcherOptions& options, WorkerPools& pools)
    : options_(options), pools_(pools) {}

WorkerDiscovery::~WorkerDiscovery() { stop(); }

void WorkerDiscovery::start() {
  thread_ = std::thread([this] { loop(); });
}

void WorkerDiscovery::stop() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    stopping_ = true;
  }
  cv_.notify_all();
  if (thread_.joinable()) thread_.join();
}

void WorkerDiscovery::loop() {
  set_thread_name("dispatch-health");
  bool first = true;
  while (true) {
    run_round(first);
    first = false;
    std::unique_lock<std::mutex> lock(mu_);
    if (cv_.wait_for(lock, options_.health_interval, [&] { return stopping_; })) return;
  }
}

void WorkerDiscovery::run_round(bool force_resolve) {
  refresh_members(force_resolve);
  probe_all();
}

void WorkerDiscovery::refresh_members(bool force_resolve) {
  const auto now = std::chrono::steady_clock::now();
  for (PoolRole role : pools_.roles()) {
    const WorkerPoolOptions& p = role == PoolRole::kUnified   ? options_.unified
                                 : role == PoolRole::kPrefill ? options_.prefill
                                                              : options_.decode;
    const int r = static_cast<int>(role);
    if (!p.dns_name.empty() && (force_resolve || now - resolved_at_[r] >= p.dns_refresh)) {
      resolved_at_[r] = now;
      auto addrs = resolve_worker_addresses(p.dns_name, p.dns_port);
      if (addrs.ok()) {
        resolved_[r] = std::move(*addrs);
      } else {
        log::warn("dispatch: {} pool: {} (keeping the {} addresses known)", pool_role_name(role),
                  addrs.status().message(), resolved_[r].size());
      }
    }
    std::vector<std::string> members = p.workers;
    members.insert(members.end(), resolved_[r].begin(), resolved_[r].end());
    std::sort(members.begin(), members.end());
    members.erase(std::unique(members.begin(), members.end()), members.end());
    pools_.set_members(role, members);
  }
}

namespace {

// Counts the outstanding probes of one round.
struct ProbeLatch {
  std::mutex mu;
  std::condition_variable cv;
  size_t remaining = 0;
  void done() {
    std::lock_guard<std::mutex> lock(mu);
    if (--remaining == 0) cv.notify_all();
  }
};

// The three RPCs of one worker's probe; lives until the round has ended.
struct ProbeOp {
  std::shared_ptr<WorkerEndpoint> worker;
  ProbeLatch* latch = nullptr;
  std::atomic<int> pending{0};
  ProbeResult result;
  grpc::ClientContext health_ctx, load_ctx, info_ctx;
  grpc::ByteBuffer health_request{nullptr, 0};
  grpc::ByteBuffer health_response;
  v1::GetLoadRequest load_request;
  v1::GetInfoRequest info_request;

  void one_done() {
    if (pending.fetch_sub(1) == 1) latch->done();
  }
  Status error(const char* rpc, const grpc::Status& s) const {
    return from_grpc(s).with_context(fmt::format("worker {}: {}", worker->address, rpc));
  }
};

}  // namespace

void WorkerDiscovery::probe_all() {
  pools_.release_retired();
  auto targets = pools_.probe_targets();
  if (targets.empty()) return;
  ProbeLatch latch;
  latch.remaining = targets.size();
  std::vector<std::unique_ptr<ProbeOp>> ops;
  ops.reserve(targets.size());
  const auto deadline = std::chrono::system_clock::now() + options_.timeouts.probe;
  for (auto& [worker, want_info] : targets) {
    auto op = std::make_unique<ProbeOp>();
    op->worker = worker;
    op->latch = &latch;
    op->pending = want_info ? 3 : 2;
    op->result.info_fetched = want_info;
    ops.push_back(std::move(op));
  }
  for (auto& op_ptr : ops) {
    ProbeOp* op = op_ptr.get();
    WorkerEndpoint& w = *op->worker;
    op->health_ctx.set_deadline(deadline);
    w.generic->UnaryCall(&op->health_ctx, "/grpc.health.v1.Health/Check", grpc::StubOptions(),
                         &op->health_request, &op->health_response, [op](grpc::Status s) {
                           if (!s.ok()) {
                             op->result.health = op->error("health check", s);
                           } else {
                             std::vector<grpc::Slice> slices;
                             std::string bytes;
                             if (op->health_response.Dump(&slices).ok()) {
                               for (const auto& sl : slices) {
                                 bytes.append(reinterpret_cast<const char*>(sl.begin()), sl.size());
                               }
                             }
                             const int status = parse_health_status(bytes);
                             if (status != 1) {
                               op->result.health = Unavailable(fmt::format(
                                   "worker {}: health check: {}", op->worker->address,
                                   status == 2 ? "NOT_SERVING" : fmt::format("status {}", status)));
                             }
                           }
                           op->one_done();
                         });
    op->load_ctx.set_deadline(deadline);
    w.stub->async()->GetLoad(&op->load_ctx, &op->load_request, &op->result.load,
                             [op](grpc::Status s) {
                               if (!s.ok()) op->result.load_status = op->error("GetLoad", s);
                               op->one_done();
                             });
    if (op->result.info_fetched) {
      op->info_ctx.set_deadline(deadline);
      w.stub->async()->GetInfo(&op->info_ctx, &op->info_request, &op->result.info,
                               [op](grpc::Status s) {
                                 if (!s.ok()) op->result.info_status = op->error("GetInfo", s);
                                 op->one_done();
                               });
    }
  }
  {
    // Every RPC has a deadline, so every callback comes.
    std::unique_lock<std::mutex> lock(latch.mu);
    latch.cv.wait(lock, [&] { return latch.remaining == 0; });
  }
  for (auto& op : ops) pools_.apply_probe(op->worker, std::move(op->result));
}

}  // namespace cleave::router
