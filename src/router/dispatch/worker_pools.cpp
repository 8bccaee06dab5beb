// Pool membership, readiness from probes, pairing of prefill and decode workers, and the
// choice of workers for one attempt of a request.
#include "dispatch/worker_pools.h"

#include <algorithm>

#include "cleave/common/log.h"
#include "cleave/control/channel.h"
#include "cleave/control/worker_client.h"
#include "cleave/kvcache/prefix_hash.h"
#include "fmt/format.h"

namespace cleave::router {

std::string_view pool_role_name(PoolRole role) {
  switch (role) {
    case PoolRole::kUnified: return "unified";
    case PoolRole::kPrefill: return "prefill";
    case PoolRole::kDecode: return "decode";
  }
  return "unknown";
}

WorkerEndpoint::WorkerEndpoint(uint64_t k, PoolRole r, std::string addr)
    : key(k), role(r), address(std::move(addr)) {
  channel = make_worker_channel(address);
  stub = v1::Worker::NewStub(channel);
  generic = std::make_unique<grpc::GenericStub>(channel);
}

WorkerPools::WorkerPools(const DispatcherOptions& options) : options_(options) {
  uint64_t seed = options.policy_seed;
  if (seed == 0) seed = std::random_device{}() | (static_cast<uint64_t>(std::random_device{}()) << 32);
  pool(PoolRole::kUnified).policy = make_dispatch_policy(options.unified.policy, options, seed);
  pool(PoolRole::kPrefill).policy = make_dispatch_policy(options.prefill.policy, options, seed + 1);
  pool(PoolRole::kDecode).policy = make_dispatch_policy(options.decode.policy, options, seed + 2);
}

std::vector<PoolRole> WorkerPools::roles() const {
  if (options_.mode == DispatchMode::kUnified) return {PoolRole::kUnified};
  return {PoolRole::kPrefill, PoolRole::kDecode};
}

void WorkerPools::set_members(PoolRole role, const std::vector<std::string>& addresses) {
  release_retired();
  std::lock_guard<std::mutex> lock(mu_);
  Pool& p = pool(role);
  for (auto it = p.members.begin(); it != p.members.end();) {
    if (std::find(addresses.begin(), addresses.end(), it->first) != addresses.end()) {
      ++it;
      continue;
    }
    log::info("dispatch: worker {} left the {} pool", it->first, pool_role_name(role));
    forget_worker(it->second.endpoint->key);
    retired_.push_back(std::move(it->second.endpoint));
    it = p.members.erase(it);
  }
  for (const std::string& a : addresses) {
    if (p.members.count(a) > 0) continue;
    Member m;
    m.endpoint = std::make_shared<WorkerEndpoint>(next_key_++, role, a);
    m.not_ready_why = "not probed yet";
    log::info("dispatch: worker {} joined the {} pool", a, pool_role_name(role));
    p.members.emplace(a, std::move(m));
  }
}

void WorkerPools::release_retired() {
  std::vector<std::shared_ptr<WorkerEndpoint>> unused;
  {
    std::lock_guard<std::mutex> lock(mu_);
    for (auto it = retired_.begin(); it != retired_.end();) {
      // Only the pools hold it, and nothing can take it from them any more.
      if (it->use_count() == 1) {
        unused.push_back(std::move(*it));
        it = retired_.erase(it);
      } else {
        ++it;
      }
    }
  }
  // `unused` goes here, outside the lock: destroying a channel may wait for its calls' end.
}

std::vector<std::pair<std::shared_ptr<WorkerEndpoint>, bool>> WorkerPools::probe_targets() const {
  std::lock_guard<std::mutex> lock(mu_);
  std::vector<std::pair<std::shared_ptr<WorkerEndpoint>, bool>> out;
  for (const Pool& p : pools_) {
    for (const auto& [address, m] : p.members) out.emplace_back(m.endpoint, !m.has_info || !m.ready);
  }
  return out;
}

WorkerPools::Member* WorkerPools::find(const std::shared_ptr<WorkerEndpoint>& worker) {
  Pool& p = pool(worker->role);
  auto it = p.members.find(worker->address);
  if (it == p.members.end() || it->second.endpoint != worker) return nullptr;
  return &it->second;
}

void WorkerPools::set_ready(Member& m, bool ready, const std::string& why) {
  const WorkerEndpoint& e = *m.endpoint;
  if (ready && !m.ready) {
    log::info("dispatch: {} worker {} ('{}') is ready", pool_role_name(e.role), e.address,
              m.info.worker_id());
  } else if (!ready && (m.ready || why != m.not_ready_why)) {
    log::warn("dispatch: {} worker {} is not ready: {}", pool_role_name(e.role), e.address, why);
  }
  m.ready = ready;
  m.not_ready_why = ready ? std::string() : why;
}

void WorkerPools::forget_worker(uint64_t key) {
  for (auto it = pairings_.begin(); it != pairings_.end();) {
    if (it->first.first == key || it->first.second == key) it = pairings_.erase(it);
    else ++it;
  }
  for (auto it = pair_backoffs_.begin(); it != pair_backoffs_.end();) {
    if (it->first.first == key || it->first.second == key) it = pair_backoffs_.erase(it);
    else ++it;
  }
  for (Pool& p : pools_) p.policy->forget(key);
}

namespace {

// The facts that change when a different process answers at the same address.
bool same_worker(const v1::WorkerInfo& a, const v1::WorkerInfo& b) {
  return a.worker_id() == b.worker_id() && a.pid() == b.pid() &&
         a.model_fingerprint() == b.model_fingerprint() &&
         a.transfer_address() == b.transfer_address() &&
         a.kv_layout().SerializeAsString() == b.kv_layout().SerializeAsString();
}

}  // namespace

void WorkerPools::apply_probe(const std::shared_ptr<WorkerEndpoint>& worker, ProbeResult r) {
  std::lock_guard<std::mutex> lock(mu_);
  Member* m = find(worker);
  if (m == nullptr) return;  // left the pool meanwhile
  if (r.info_fetched && r.info_status.ok()) {
    if (m->has_info && !same_worker(m->info, r.info)) {
      log::info("dispatch: {} worker {} restarted or changed (now '{}', pid {})",
                pool_role_name(worker->role), worker->address, r.info.worker_id(), r.info.pid());
      forget_worker(worker->key);
    }
    m->info = std::move(r.info);
    m->has_info = true;
    worker->transfer_engine_id.store(m->info.transfer_engine_id(), std::memory_order_relaxed);
    if (hash_block_size_ == 0) {
      hash_block_size_ = options_.prefix_block_size > 0 ? options_.prefix_block_size
                                                        : m->info.kv_layout().block_size();
      hash_seed_ = prefix_hash_seed_for_model(m->info.model_fingerprint());
    }
  }
  if (r.load_status.ok()) {
    m->load = std::move(r.load);
    m->inflight_at_load = worker->inflight.load(std::memory_order_relaxed);
    m->prefill_tokens_at_load = worker->prefill_tokens.load(std::memory_order_relaxed);
  }
  // A probe whose every failure is a timeout: the worker is slow (busy), not gone.
  const auto timed_out_or_ok = [](const Status& s) {
    return s.ok() || s.code() == StatusCode::kDeadlineExceeded;
  };
  const bool only_timeouts = timed_out_or_ok(r.health) && timed_out_or_ok(r.load_status) &&
                             (!r.info_fetched || timed_out_or_ok(r.info_status));
  std::string why;
  if (!r.health.ok()) why = r.health.to_string();
  else if (!r.load_status.ok()) why = r.load_status.to_string();
  else if (r.info_fetched && !r.info_status.ok()) why = r.info_status.to_string();
  else if (!m->has_info) why = "its GetInfo has not answered yet";
  else if (m->info.role() != pool_role_name(worker->role)) {
    why = fmt::format("it is a {} worker ('{}'), not a {} worker", m->info.role(),
                      m->info.worker_id(), pool_role_name(worker->role));
  }
  if (why.empty()) {
    m->slow_probes = 0;
  } else if (m->ready && only_timeouts && ++m->slow_probes < options_.probe_failures) {
    log::info("dispatch: {} worker {}: probe {} of {} in a row timed out; still ready: {}",
              pool_role_name(worker->role), worker->address, m->slow_probes,
              options_.probe_failures, why);
    return;
  }
  set_ready(*m, why.empty(), why);
  update_pairings();
}

void WorkerPools::mark_failed(const std::shared_ptr<WorkerEndpoint>& worker, const Status& why) {
  std::lock_guard<std::mutex> lock(mu_);
  Member* m = find(worker);
  if (m != nullptr) set_ready(*m, false, why.to_string());
}

void WorkerPools::mark_pair_failed(const std::shared_ptr<WorkerEndpoint>& prefill,
                                   const std::shared_ptr<WorkerEndpoint>& decode,
                                   const Status& why) {
  const auto now = std::chrono::steady_clock::now();
  std::lock_guard<std::mutex> lock(mu_);
  PairBackoff& b = pair_backoffs_[{prefill->key, decode->key}];
  const bool recent = b.length.count() > 0 && now < b.until + kPairBackoffMax;
  b.length = recent ? std::min(kPairBackoffMax, 2 * b.length) : kPairBackoffMin;
  b.until = now + b.length;
  log::warn("dispatch: KV transfer from prefill worker {} to decode worker {} failed; the pair is "
            "avoided for {} ms: {}", prefill->address, decode->address, b.length.count(),
            why.message());
}

bool WorkerPools::backing_off(uint64_t prefill, uint64_t decode,
                              std::chrono::steady_clock::time_point now) const {
  auto it = pair_backoffs_.find({prefill, decode});
  return it != pair_backoffs_.end() && now < it->second.until;
}

void WorkerPools::update_pairings() {
  if (options_.mode != DispatchMode::kDisaggregated) return;
  for (const auto& [pa, p] : pool(PoolRole::kPrefill).members) {
    if (!p.ready) continue;
    for (const auto& [da, d] : pool(PoolRole::kDecode).members) {
      if (!d.ready) continue;
      const auto key = std::make_pair(p.endpoint->key, d.endpoint->key);
      if (pairings_.count(key) > 0) continue;
      const Status s = check_pairing(p.info, d.info);
      if (!s.ok()) {
        log::error("dispatch: prefill worker {} and decode worker {} cannot pair: {}", pa, da,
                   s.message());
      }
      pairings_[key] = s;
    }
  }
}

bool WorkerPools::paired(uint64_t prefill, uint64_t decode) const {
  auto it = pairings_.find({prefill, decode});
  return it != pairings_.end() && it->second.ok();
}

WorkerCandidate WorkerPools::candidate(const Member& m) {
  WorkerCandidate c;
  c.worker = m.endpoint->key;
  const int64_t since = m.endpoint->inflight.load(std::memory_order_relaxed) - m.inflight_at_load;
  c.load = std::max<int64_t>(0, m.load.waiting() + m.load.running() + since);
  c.kv_usage = m.load.kv_usage();
  return c;
}

int64_t WorkerPools::prefill_tokens_on(const Member& m) {
  const int64_t others = m.load.prefill_tokens() - m.prefill_tokens_at_load;
  return m.endpoint->prefill_tokens.load(std::memory_order_relaxed) + std::max<int64_t>(0, others);
}

std::vector<uint64_t> WorkerPools::block_hashes(PoolRole role,
                                                std::span<const int32_t> prompt) const {
  int64_t block_size = 0;
  uint64_t seed = 0;
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (!pool(role).policy->wants_block_hashes()) return {};
    block_size = hash_block_size_;
    seed = hash_seed_;
  }
  if (block_size <= 0) return {};
  return hash_full_blocks(prompt, block_size, seed);
}

bool WorkerPools::allowed_in(const Member& m, std::span<const uint64_t> excluded) {
  return m.ready && std::find(excluded.begin(), excluded.end(), m.endpoint->key) == excluded.end();
}

std::string WorkerPools::describe(PoolRole role, std::span<const uint64_t> excluded) const {
  const Pool& p = pool(role);
  size_t ready = 0;
  for (const auto& [a, m] : p.members) ready += m.ready ? 1 : 0;
  std::string s = fmt::format("no {} worker can take the request ({} known, {} ready",
                              pool_role_name(role), p.members.size(), ready);
  if (!excluded.empty()) s += fmt::format(", {} already tried", excluded.size());
  return s + ")";
}

Result<Assignment> WorkerPools::choose(std::span<const int32_t> prompt,
                                       std::span<const uint64_t> excluded,
                                       int64_t prefill_tokens, bool* busy) {
  if (busy) *busy = false;
  auto allowed = [&](const Member& m) { return allowed_in(m, excluded); };
  Assignment out;
  if (options_.mode == DispatchMode::kUnified) {
    const std::vector<uint64_t> hashes = block_hashes(PoolRole::kUnified, prompt);
    std::lock_guard<std::mutex> lock(mu_);
    Pool& p = pool(PoolRole::kUnified);
    std::vector<WorkerCandidate> cands;
    std::vector<const Member*> members;
    for (const auto& [a, m] : p.members) {
      if (!allowed(m)) continue;
      cands.push_back(candidate(m));
      members.push_back(&m);
    }
    if (cands.empty()) return Unavailable(describe(PoolRole::kUnified, excluded));
    const size_t i = p.policy->pick(cands, hashes);
    p.policy->routed(cands[i].worker, hashes);
    out.unified = members[i]->endpoint;
    return out;
  }

  const std::vector<uint64_t> prefill_hashes = block_hashes(PoolRole::kPrefill, prompt);
  const std::vector<uint64_t> decode_hashes = block_hashes(PoolRole::kDecode, prompt);
  std::lock_guard<std::mutex> lock(mu_);
  if (!pair_backoffs_.empty()) {
    auto first = choose_pair(prefill_hashes, decode_hashes, excluded, prefill_tokens, busy, true);
    if (first.ok() || (busy && *busy)) return first;
    if (busy) *busy = false;
  }
  return choose_pair(prefill_hashes, decode_hashes, excluded, prefill_tokens, busy, false);
}

Result<Assignment> WorkerPools::choose_pair(const std::vector<uint64_t>& prefill_hashes,
                                            const std::vector<uint64_t>& decode_hashes,
                                            std::span<const uint64_t> excluded,
                                            int64_t prefill_tokens, bool* busy,
                                            bool avoid_failed_pairs) {
  const int64_t limit = options_.prefill_queue_tokens;
  auto has_room = [&](const Member& m) {
    if (limit <= 0) return true;
    const int64_t in_flight = prefill_tokens_on(m);
    return in_flight == 0 || in_flight + prefill_tokens <= limit;
  };
  auto allowed = [&](const Member& m) { return allowed_in(m, excluded); };
  const auto now = std::chrono::steady_clock::now();
  auto can_pair = [&](const Member& p, const Member& d) {
    return paired(p.endpoint->key, d.endpoint->key) &&
           !(avoid_failed_pairs && backing_off(p.endpoint->key, d.endpoint->key, now));
  };
  Assignment out;
  Pool& pp = pool(PoolRole::kPrefill);
  Pool& dp = pool(PoolRole::kDecode);
  std::vector<WorkerCandidate> cands;
  std::vector<const Member*> members;
  bool any_decode = false;
  bool partner_full = false;  // a pair exists whose prefill worker lacks only room
  for (const auto& [a, d] : dp.members) {
    if (!allowed(d)) continue;
    any_decode = true;
    bool has_partner = false;
    for (const auto& [b, p] : pp.members) {
      if (!allowed(p) || !can_pair(p, d)) continue;
      if (has_room(p)) {
        has_partner = true;
        break;
      }
      partner_full = true;
    }
    if (!has_partner) continue;
    cands.push_back(candidate(d));
    members.push_back(&d);
  }
  if (cands.empty()) {
    if (!any_decode) return Unavailable(describe(PoolRole::kDecode, excluded));
    if (partner_full) {
      if (busy) *busy = true;
      return ResourceExhausted(fmt::format(
          "every prefill worker that can take the request has {} prompt tokens or more of this "
          "router's prefills in flight (prefill_queue_tokens)",
          limit));
    }
    return Unavailable(describe(PoolRole::kPrefill, excluded) + " paired with a ready decode worker");
  }
  size_t i = dp.policy->pick(cands, decode_hashes);
  dp.policy->routed(cands[i].worker, decode_hashes);
  out.decode = members[i]->endpoint;
  const Member* members_d = members[i];

  cands.clear();
  members.clear();
  for (const auto& [b, p] : pp.members) {
    if (!allowed(p) || !can_pair(p, *members_d) || !has_room(p)) continue;
    cands.push_back(candidate(p));
    members.push_back(&p);
  }
  i = pp.policy->pick(cands, prefill_hashes);
  pp.policy->routed(cands[i].worker, prefill_hashes);
  out.prefill = members[i]->endpoint;
  return out;
}

bool WorkerPools::fits_whole_pool(const std::shared_ptr<WorkerEndpoint>& decode,
                                  int64_t tokens) const {
  std::lock_guard<std::mutex> lock(mu_);
  const Pool& p = pool(decode->role);
  auto it = p.members.find(decode->address);
  if (it == p.members.end() || it->second.endpoint != decode) return false;  // it left
  const Member& m = it->second;
  const int64_t bs = m.has_info ? m.info.kv_layout().block_size() : 0;
  if (bs <= 0 || m.load.blocks_total() <= 0) return true;
  return (tokens + bs - 1) / bs <= m.load.blocks_total();
}

bool WorkerPools::ready() const {
  std::lock_guard<std::mutex> lock(mu_);
  return ready_locked();
}

bool WorkerPools::ready_locked() const {
  if (options_.mode == DispatchMode::kUnified) {
    for (const auto& [a, m] : pool(PoolRole::kUnified).members) {
      if (m.ready) return true;
    }
    return false;
  }
  for (const auto& [pa, p] : pool(PoolRole::kPrefill).members) {
    if (!p.ready) continue;
    for (const auto& [da, d] : pool(PoolRole::kDecode).members) {
      if (d.ready && paired(p.endpoint->key, d.endpoint->key)) return true;
    }
  }
  return false;
}

Status WorkerPools::readiness() const {
  std::lock_guard<std::mutex> lock(mu_);
  if (ready_locked()) return Status::Ok();
  std::vector<std::string> missing;
  for (PoolRole role : roles()) {
    const Pool& p = pool(role);
    bool any_ready = false;
    std::string why;
    for (const auto& [address, m] : p.members) {
      any_ready = any_ready || m.ready;
      why += fmt::format("{}{}: {}", why.empty() ? "" : "; ", address, m.not_ready_why);
    }
    if (any_ready) continue;
    missing.push_back(p.members.empty()
                          ? fmt::format("the {} pool has no worker", pool_role_name(role))
                          : fmt::format("no {} worker is ready ({})", pool_role_name(role), why));
  }
  if (!missing.empty()) {
    std::string msg;
    for (const std::string& m : missing) msg += (msg.empty() ? "" : "; ") + m;
    return Unavailable(std::move(msg));
  }
  // Both pools have ready workers, and no pair of them is accepted: say why for each.
  std::string msg;
  for (const auto& [pa, p] : pool(PoolRole::kPrefill).members) {
    for (const auto& [da, d] : pool(PoolRole::kDecode).members) {
      if (!p.ready || !d.ready) continue;
      auto it = pairings_.find({p.endpoint->key, d.endpoint->key});
      if (it == pairings_.end() || it->second.ok()) continue;
      msg += (msg.empty() ? "" : "; ") + it->second.message();
    }
  }
  return FailedPrecondition(msg.empty() ? "no prefill and decode worker pair is accepted" : msg);
}

std::vector<PoolSnapshot> WorkerPools::snapshot() const {
  std::lock_guard<std::mutex> lock(mu_);
  std::vector<PoolSnapshot> out;
  for (PoolRole role : roles()) {
    PoolSnapshot s;
    s.name = std::string(pool_role_name(role));
    for (const auto& [a, m] : pool(role).members) {
      ++s.workers_known;
      if (!m.ready) continue;
      ++s.workers_ready;
      s.waiting += m.load.waiting();
      s.running += m.load.running();
      s.blocks_total += m.load.blocks_total();
      s.blocks_used += m.load.blocks_used();
    }
    s.kv_usage = s.blocks_total > 0
                     ? static_cast<double>(s.blocks_used) / static_cast<double>(s.blocks_total)
                     : 0.0;
    out.push_back(std::move(s));
  }
  return out;
}

v1::WorkerInfo WorkerPools::model_info() const {
  std::lock_guard<std::mutex> lock(mu_);
  // The worker that streams the tokens speaks for the model (context length, vocabulary).
  for (PoolRole role : {PoolRole::kUnified, PoolRole::kDecode, PoolRole::kPrefill}) {
    for (const auto& [a, m] : pool(role).members) {
      if (m.ready && m.has_info) return m.info;
    }
  }
  return {};
}

}  // namespace cleave::router
