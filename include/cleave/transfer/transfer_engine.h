// The transfer engine: one-sided RMA writes from this process's registered memory into a
// peer's registered memory over libfabric (FI_EP_RDM, FI_RMA | FI_MSG), and small notices
// delivered strictly after the data they announce.
//
// Thread-safety: every public method may be called from any thread. Each rail has one
// progress thread ("xfer-railN") that owns its endpoint: it posts queued slices (paced by the
// TX depth, answering -FI_EAGAIN with progress), reads completions and errors, enforces the
// completion timeout and receives notices. The engine must outlive every handle's use.
//
// Dead peers: a peer that stops completing fails its transfers after completion_timeout_ms. A
// peer on this host (same boot id and pid namespace, carried in address()) is also checked with
// kill(pid, 0): writes to a process that has exited fail at once and nothing more is posted to
// it. A watchdog thread ("xfer-watchdog") catches a rail stuck inside the provider (libfabric
// 1.17's shm spins forever on the lock of a peer killed while holding it): after
// min(completion_timeout_ms, 1 s), or 20 ms when the post in progress targets a dead process,
// it fails the transfers that rail had started, moves its untouched queued work to a fresh
// rail and leaks the stuck one. Peers that connected to a replaced rail must connect again.
// A caller thread that was itself posting when the peer died can stay stuck in the provider.
// A fault of one peer fails only that peer's transfers: the rail's endpoint is rebuilt, and
// other peers' writes and notices go out again on the new one (a notice keeps its id, and the
// receiver hands a copy over once). A write the target refuses (its key was revoked) fails at
// once on tcp (the target drops the connection); shm never answers it, so it fails after
// completion_timeout_ms.
//
// Ordering: a batch's notice is sent only after every write of the batch has completed (with
// FI_DELIVERY_COMPLETE when the provider accepts it), so a peer that sees the notice can read
// the data. notify(peer, tag) is ordered after every batch previously submitted to that peer.
#pragma once

#include <chrono>
#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "cleave/common/status.h"
#include "cleave/transfer/memory_region.h"
#include "cleave/transfer/transfer_metrics.h"
#include "cleave/transfer/transfer_options.h"

namespace cleave::transfer {

// One write: `len` bytes from `local` region at `local_offset` to the peer's `remote` region at
// `remote_offset`. The local region id must be one this engine registered; `remote` must be a
// descriptor of the peer the batch goes to.
struct WriteOp {
  uint64_t local_region = 0;
  uint64_t local_offset = 0;
  RemoteDescriptor remote;
  uint64_t remote_offset = 0;
  uint64_t len = 0;
};

struct Batch {
  uint64_t peer = 0;  // from connect()
  std::vector<WriteOp> writes;
  // When set, a notice with this tag goes to the peer after every write has been placed.
  std::optional<uint64_t> notify_tag;
  // When set, nothing of the batch (write slice or notice) is handed to the provider at or
  // after this instant: the transfer then fails with DEADLINE_EXCEEDED ("not posted by its
  // deadline") and its notice is not sent. What was posted before stays posted (a write on its
  // way cannot be called back). For a destination that stops accepting writes at a known time
  // (a reservation's lease).
  std::optional<std::chrono::steady_clock::time_point> post_by = std::nullopt;
};

// A notice received from a peer.
struct Notice {
  uint64_t from_engine = 0;  // the sender's engine id
  uint64_t tag = 0;
  uint64_t value = 0;        // notify()'s value: a word the notice carries (0 when none given)
};

struct TransferState;

// Completion handle of one submitted batch. Cheap to copy; all copies see the same transfer.
class TransferHandle {
 public:
  TransferHandle() = default;
  explicit TransferHandle(std::shared_ptr<TransferState> s) : state_(std::move(s)) {}

  bool valid() const { return state_ != nullptr; }
  // Non-blocking: nullopt while in flight, else the final status.
  std::optional<Status> poll() const;
  // Blocks until the transfer finishes (its own completion timeout bounds this) or `timeout`
  // passes (DEADLINE_EXCEEDED, the transfer keeps going).
  Status wait(std::chrono::milliseconds timeout = std::chrono::milliseconds::max()) const;
  uint64_t bytes() const;
  // When the transfer finished (its last completion was read), once it has; for latency
  // figures that must not include the time until somebody looked.
  std::optional<std::chrono::steady_clock::time_point> completed_at() const;
  // Runs `fn` once the transfer has finished: at once on this thread when it already has,
  // else on the thread that finishes it (a rail's progress thread, the watchdog, or a waiter
  // driving progress), with no lock held. `fn` must be quick and must not block: it holds up
  // the completions behind it. Every transfer finishes within its completion timeout, so `fn`
  // always runs (at the latest when the engine shuts down and fails what is left).
  void on_done(std::function<void()> fn) const;

 private:
  std::shared_ptr<TransferState> state_;
};

class TransferEngine {
 public:
  // Picks the provider (settings.provider, "auto" tries efa, verbs;ofi_rxm, shm when
  // `peers_on_this_host`, tcp;ofi_rxm), opens the rails and starts their progress threads.
  // The chosen provider is logged at info level.
  static Result<std::unique_ptr<TransferEngine>> create(const TransferSettings& settings,
                                                        bool peers_on_this_host = false);
  ~TransferEngine();
  TransferEngine(const TransferEngine&) = delete;
  TransferEngine& operator=(const TransferEngine&) = delete;

  // "tcp;ofi_rxm", "shm", "efa"...: what libfabric actually gave us.
  const std::string& provider() const;
  // Whether the provider was opened with FI_HMEM: it can register CUDA memory (GPUDirect).
  bool hmem() const;
  // Whether a registration of its own per use, deregistered after, is a cheap and real
  // revocation on this provider: true for tcp and shm (keys we choose, a table entry each);
  // false for efa, verbs and the rest, whose registration cache hands a second registration of
  // the same memory the first one's key (deregistering it revokes nothing) and where a fresh
  // registration would pin the whole region again.
  bool revokes_keys() const { return provider_revokes_keys(provider()); }
  static bool provider_revokes_keys(std::string_view provider);
  uint64_t engine_id() const;
  int rails() const;
  // Serialized endpoint names of every rail plus the engine id, for the control plane.
  std::string address() const;

  // Registers [ptr, ptr+len). CUDA memory needs a CUDA build and an FI_HMEM provider.
  Result<MemoryRegion> register_memory(void* ptr, uint64_t len, MemoryKind kind);
  // NotFound for an unknown id. The caller makes sure no transfer uses the region any more.
  Status deregister(uint64_t region_id);

  // Inserts the peer's endpoint names (from its address()) into the address vectors and
  // returns the peer id to use in batches. Connecting twice to one engine returns the same id
  // and clears an earlier "unreachable" mark. Where the provider makes a connection at the
  // first message (ofi_rxm over tcp or verbs, efa), each rail sends the peer a small message
  // now, so that the connection is made before the first batch rather than inside its
  // completion bound. Waits for a rail busy with a rebuild; Unavailable when a rail is found
  // stuck inside the provider (it is being replaced: connect again).
  Result<uint64_t> connect(std::string_view peer_address);
  // False when `peer` (a connect() id) is marked unreachable: a transfer to it failed (or was
  // refused) since its last connect(), so submit() refuses new batches until it is connected
  // again. A caller that has fresh word of the peer (a granted reservation) reconnects then.
  bool reachable(uint64_t peer) const;

  // Validates every write (regions, ranges, overflow, key owner) before posting anything:
  // a bad batch returns an error and nothing is sent. Then coalesces adjacent writes, slices
  // them and queues the slices over the rails.
  Result<TransferHandle> submit(const Batch& batch);
  // A notice ordered after every batch submitted to `peer` before this call, carrying `value`
  // (e.g. the first token sampled after the KV it announces); `post_by` as in Batch.
  Result<TransferHandle> notify(
      uint64_t peer, uint64_t tag, uint64_t value = 0,
      std::optional<std::chrono::steady_clock::time_point> post_by = std::nullopt);

  // Notices received so far (and removes them); wait_notice blocks up to `timeout` for one.
  std::vector<Notice> take_notices();
  Result<Notice> wait_notice(std::chrono::milliseconds timeout);

  TransferMetricsSnapshot metrics() const;

  struct Impl;

 private:
  explicit TransferEngine(std::unique_ptr<Impl> impl);
  std::unique_ptr<Impl> impl_;
};

// Coalescing and slicing, exposed for tests. Writes whose local and remote ranges both follow
// the previous one (same regions) are merged; the result is cut into pieces of at most
// `slice_bytes`. Order of non-adjacent writes is kept.
struct PlannedSlice {
  uint64_t local_region;
  uint64_t local_offset;
  size_t remote_index;  // index into the batch's writes whose descriptor to use
  uint64_t remote_offset;
  uint64_t len;
};
std::vector<PlannedSlice> plan_slices(const std::vector<WriteOp>& writes, uint64_t slice_bytes);

}  // namespace cleave::transfer
