// The dispatcher's view of its workers: one WorkerEndpoint per worker address (a gRPC channel,
// the generated stub for the callback API, what the last probe found), grouped in pools, the
// accepted (prefill, decode) pairs, and the choice of workers for one attempt of a request.
//
// Thread-safety: WorkerPools is thread-safe (one mutex, never held across I/O or a policy-free
// callback). An endpoint's channel and stubs are immutable after construction and thread-safe;
// its `inflight` counter is atomic; everything else about it lives under the WorkerPools mutex.
// Endpoints are shared: a request in flight keeps the endpoint it uses alive after the worker
// has left its pool. The pools keep a departed worker's endpoint too, until nothing else holds
// it, and drop it on the discovery thread (release_retired): a request's last reference goes
// on one of gRPC's callback threads, and a channel must not be destroyed there (gRPC joins its
// callback threads when the process's last channel goes: such a thread would join itself and
// then use the freed completion queue).
#pragma once

#include <grpcpp/generic/generic_stub.h>
#include <grpcpp/grpcpp.h>

#include <atomic>
#include <chrono>
#include <cstdint>
#include <map>
#include <memory>
#include <mutex>
#include <span>
#include <string>
#include <vector>

#include "cleave/common/status.h"
#include "cleave/router/dispatch_options.h"
#include "cleave/router/dispatch_policy.h"
#include "cleave/router/dispatcher.h"
#include "cleave/v1/worker.grpc.pb.h"

namespace cleave::router {

enum class PoolRole : uint8_t { kUnified = 0, kPrefill = 1, kDecode = 2 };
inline constexpr int kNumPoolRoles = 3;
std::string_view pool_role_name(PoolRole role);  // "unified", "prefill", "decode"

struct WorkerEndpoint {
  WorkerEndpoint(uint64_t key, PoolRole role, std::string address);

  const uint64_t key;  // unique in the dispatcher
  const PoolRole role;
  const std::string address;  // "host:port"
  std::shared_ptr<grpc::Channel> channel;
  std::unique_ptr<v1::Worker::Stub> stub;
  std::unique_ptr<grpc::GenericStub> generic;  // grpc.health.v1.Health/Check
  // This router's requests using the worker now.
  std::atomic<int64_t> inflight{0};
  // A prefill worker: the prompt tokens (resume tokens included) of this router's prefills in
  // flight on it, from the attempt's start to the Prefill's answer (prefill_queue_tokens; the
  // other routers' come from its LoadReport, see WorkerPools::choose).
  std::atomic<int64_t> prefill_tokens{0};
  // Its transfer engine's id (WorkerInfo), once a probe has fetched it; 0 before. A Reserve
  // names the chosen prefill worker's so that the decode worker takes its notice only.
  std::atomic<uint64_t> transfer_engine_id{0};
};

// What one probe of one worker found.
struct ProbeResult {
  Status health;  // OK when grpc.health.v1 answered SERVING
  Status load_status;
  v1::LoadReport load;
  bool info_fetched = false;  // GetInfo was asked (first probe, or after the worker was down)
  Status info_status;
  v1::WorkerInfo info;
};

// The workers one attempt of a request uses: `unified`, or `prefill` + `decode`.
struct Assignment {
  std::shared_ptr<WorkerEndpoint> unified;
  std::shared_ptr<WorkerEndpoint> prefill;
  std::shared_ptr<WorkerEndpoint> decode;
};

class WorkerPools {
 public:
  explicit WorkerPools(const DispatcherOptions& options);

  DispatchMode mode() const { return options_.mode; }
  // The pools the mode uses.
  std::vector<PoolRole> roles() const;

  // Makes the workers of `role` exactly `addresses`: new ones join (not ready until probed),
  // missing ones leave (requests in flight on them go on).
  void set_members(PoolRole role, const std::vector<std::string>& addresses);
  // Drops the endpoints of departed workers that nothing else holds any more (on the caller's
  // thread: never call it from a gRPC callback).
  void release_retired();
  // Every endpoint of every pool, and whether each needs GetInfo on its next probe.
  std::vector<std::pair<std::shared_ptr<WorkerEndpoint>, bool>> probe_targets() const;
  // Records a probe: ready when SERVING, GetLoad answered, the info known and of the pool's
  // role. A ready worker whose probe only timed out stays ready until probe_failures such
  // probes in a row. A worker whose info changed (restart) loses its pairings and prefix
  // history.
  void apply_probe(const std::shared_ptr<WorkerEndpoint>& worker, ProbeResult result);
  // An RPC failed UNAVAILABLE: out of its pool until a probe succeeds.
  void mark_failed(const std::shared_ptr<WorkerEndpoint>& worker, const Status& why);
  // A KV transfer from `prefill` to `decode` failed (the Prefill answered ABORTED): the path
  // between them failed, not necessarily either worker (a partition between two hosts leaves
  // both serving others; a dead decode worker fails its probe and Reserve on its own). The
  // pair is avoided for a back-off (kPairBackoffMin, doubling while failures follow within
  // kPairBackoffMax of the last one's end, up to kPairBackoffMax); choose() takes it only when
  // no other pair can serve.
  void mark_pair_failed(const std::shared_ptr<WorkerEndpoint>& prefill,
                        const std::shared_ptr<WorkerEndpoint>& decode, const Status& why);
  static constexpr std::chrono::milliseconds kPairBackoffMin{1000};
  static constexpr std::chrono::milliseconds kPairBackoffMax{30000};

  // Workers for one attempt of a request with `prompt`, none of them in `excluded` (keys).
  // Unavailable (saying what is missing) when the pools cannot serve it now. Disaggregated,
  // with prefill_queue_tokens set: only a prefill worker with room for `prefill_tokens` more
  // (or none in flight), counting every router's prefills on it, is chosen; when every one
  // that could take the request lacks only that, *busy is set and the status is
  // ResourceExhausted (the caller waits for room).
  Result<Assignment> choose(std::span<const int32_t> prompt, std::span<const uint64_t> excluded,
                            int64_t prefill_tokens, bool* busy);

  // Whether `tokens` of KV fit the whole pool of the decode worker `decode` as its last
  // probe reported it (true when nothing is known yet): a Reserve it refused for want of free
  // blocks may then succeed once blocks come back.
  bool fits_whole_pool(const std::shared_ptr<WorkerEndpoint>& decode, int64_t tokens) const;

  bool ready() const;
  // Dispatcher::readiness(): OK when ready(); FailedPrecondition with the pairing refusals when
  // ready workers exist in both pools but no pair of them is accepted; else Unavailable naming
  // each pool without a ready worker and its workers' last reasons.
  Status readiness() const;
  std::vector<PoolSnapshot> snapshot() const;
  v1::WorkerInfo model_info() const;

 private:
  struct Member {
    std::shared_ptr<WorkerEndpoint> endpoint;
    bool ready = false;
    bool has_info = false;
    v1::WorkerInfo info;
    v1::LoadReport load;
    int64_t inflight_at_load = 0;  // endpoint->inflight when `load` was taken
    int64_t prefill_tokens_at_load = 0;  // endpoint->prefill_tokens then
    std::string not_ready_why;     // last reason, logged on change
    int slow_probes = 0;           // probes in a row that timed out while ready
  };
  struct Pool {
    std::map<std::string, Member> members;  // by address
    std::unique_ptr<DispatchPolicy> policy;
  };

  Pool& pool(PoolRole role) { return pools_[static_cast<int>(role)]; }
  const Pool& pool(PoolRole role) const { return pools_[static_cast<int>(role)]; }
  Member* find(const std::shared_ptr<WorkerEndpoint>& worker);
  // Prompt tokens in flight on prefill worker `m` from every router: this router's now, plus
  // the other routers' as its last probe found them (what it reported beyond ours then).
  static int64_t prefill_tokens_on(const Member& m);
  void set_ready(Member& m, bool ready, const std::string& why);
  void forget_worker(uint64_t key);
  void update_pairings();
  bool paired(uint64_t prefill, uint64_t decode) const;
  // Ready and not in `excluded` (keys of workers this request tried).
  static bool allowed_in(const Member& m, std::span<const uint64_t> excluded);
  // Why no worker of `role` can take a request that excludes `excluded`.
  std::string describe(PoolRole role, std::span<const uint64_t> excluded) const;
  // Whether the pair is in its back-off at `now` (mark_pair_failed).
  bool backing_off(uint64_t prefill, uint64_t decode, std::chrono::steady_clock::time_point now) const;
  // choose()'s disaggregated part; `avoid_failed_pairs`: pairs in their back-off count as not
  // paired.
  Result<Assignment> choose_pair(const std::vector<uint64_t>& prefill_hashes,
                                 const std::vector<uint64_t>& decode_hashes,
                                 std::span<const uint64_t> excluded, int64_t prefill_tokens,
                                 bool* busy, bool avoid_failed_pairs);
  bool ready_locked() const;
  static WorkerCandidate candidate(const Member& m);
  // The block hashes prefix_aware needs for `prompt` in the pool of `role`; empty when its
  // policy does not read them or no worker's info is known yet.
  std::vector<uint64_t> block_hashes(PoolRole role, std::span<const int32_t> prompt) const;

  const DispatcherOptions options_;
  mutable std::mutex mu_;
  Pool pools_[kNumPoolRoles];
  // (prefill key, decode key) -> check_pairing's verdict (OK: accepted); computed once both
  // workers are ready.
  std::map<std::pair<uint64_t, uint64_t>, Status> pairings_;
  // (prefill key, decode key) -> the back-off of a pair whose KV transfer failed.
  struct PairBackoff {
    std::chrono::steady_clock::time_point until;
    std::chrono::milliseconds length{0};
  };
  std::map<std::pair<uint64_t, uint64_t>, PairBackoff> pair_backoffs_;
  // Endpoints of workers that left their pool, kept until nothing else holds them.
  std::vector<std::shared_ptr<WorkerEndpoint>> retired_;
  uint64_t next_key_ = 1;
  // Hashing parameters from the first known worker info (0 until then).
  int64_t hash_block_size_ = 0;
  uint64_t hash_seed_ = 0;
};

}  // namespace cleave::router
