// The prefill side of the KV handoff: where a request's KV goes (KvDestination, the decode
// worker's reservation), the plan of RDMA writes for one layer's newly computed positions, and
// KvSender, the engine loop's KvExportSink that submits those writes to
// the transfer engine layer by layer and then sends the notice ordered after them.
#pragma once

#include <chrono>
#include <cstdint>
#include <functional>
#include <memory>
#include <mutex>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "cleave/common/status.h"
#include "cleave/kvcache/kv_layout.h"  // KvLayout and pairing_mismatch
#include "cleave/transfer/transfer_engine.h"
#include "cleave/worker/engine_loop.h"

namespace cleave {

// A decode worker's reservation for one request, as the control plane carries it.
struct KvDestination {
  RequestId request_id = 0;
  std::string worker_id;
  std::string transfer_address;       // the decode worker's TransferEngine::address()
  transfer::RemoteDescriptor region;  // its KV pool's registration
  KvLayout layout;                    // its KV layout (num_blocks is its own pool's)
  std::string model_fingerprint;
  std::vector<BlockId> blocks;        // reserved blocks in position order
  uint64_t notice_tag = 0;            // the notice that says the KV is in place carries this
  std::chrono::milliseconds lease{0};
};

// Appends to `out` the writes that copy K/V of positions [begin, end) of `layer` from the local
// pool (registered as `local_region`, blocks `local_blocks` in position order) into the
// destination's blocks (`remote_blocks`, same positions). A block whose every position is in
// the range is one write of the whole (layer, block) unit (K and V together), so that runs of
// consecutive ids on both sides coalesce into one write in the transfer engine; a block the
// range cuts becomes two writes, its K rows and its V rows of those positions. Writes for
// disjoint ranges therefore never overlap. Writes come out in position order.
// Preconditions (asserted): 0 <= begin <= end, blocks cover `end` positions on both sides,
// layouts compatible (same block_size, kv_dim, dtype).
void plan_kv_writes(const KvLayout& local, uint64_t local_region,
                    std::span<const BlockId> local_blocks, const KvLayout& remote,
                    const transfer::RemoteDescriptor& remote_region,
                    std::span<const BlockId> remote_blocks, int64_t layer, int64_t begin,
                    int64_t end, std::vector<transfer::WriteOp>& out);

// The first token a notice carries to a decode worker whose Decode was opened before the
// prefill ended (transfer::Notice::value): bit 32 marks a token, the low 32 bits hold it, so
// that a notice without one (value 0) is told apart from token 0.
inline uint64_t notice_value(int32_t first_token) {
  return (uint64_t{1} << 32) | static_cast<uint32_t>(first_token);
}
inline std::optional<int32_t> token_of_notice_value(uint64_t value) {
  if ((value >> 32) != 1) return std::nullopt;
  return static_cast<int32_t>(static_cast<uint32_t>(value));
}

// The KvExportSink of one prefill request.
//
// on_layer_ready (engine thread) plans the layer's writes and submits them as one batch (no
// waiting); the call that completes the last layer of the whole prompt also sends the notice
// (ordered after every write), so the decode worker hears of its KV as soon as the transfer
// allows, not after the rest of the step. finish() (the RPC handler's thread, after the
// engine's finished event) waits for every batch and the notice (sending the notice itself
// only if no call did). A failed batch makes the next
// on_layer_ready return false, so the engine cancels the prefill at once.
//
// The lease: the decode worker gives the blocks back (and revokes the key the writes use) when
// dest.lease runs out. The sender counts the lease from create() (the two hosts' clocks cannot
// be compared) and stops posting lease_margin(lease) before its end: nothing is handed to the
// transfer engine after that (batches carry it as their post_by, so slices still queued in
// the engine are not posted either), the transfer fails with DEADLINE_EXCEEDED naming the
// lease, and no notice is sent. The margin covers the time from the decode worker's Reserve
// to create() (the Reserve reply, the router, the Prefill call: the lease began that much
// earlier than the sender counts) and the flight of the last posted write, so that what was
// posted lands before the key is revoked. A lease of 0 (none given) sets no bound.
// renew_lease() moves the bound when the decode worker has renewed the lease (RenewLease).
class KvSender final : public KvExportSink, public std::enable_shared_from_this<KvSender> {
 public:
  // min(lease / 10, 500 ms): 500 ms of the default 10 s lease, 20 ms of a 200 ms one.
  static std::chrono::milliseconds lease_margin(std::chrono::milliseconds lease);

  // `engine` outlives the sender; `peer` is engine.connect(dest.transfer_address).
  // InvalidArgument when dest.blocks do not cover `prompt_len` positions or the layouts are
  // not compatible (pairing_mismatch), FailedPrecondition for a fingerprint mismatch.
  static Result<std::shared_ptr<KvSender>> create(transfer::TransferEngine& engine, uint64_t peer,
                                                  const transfer::MemoryRegion& local_region,
                                                  const KvLayout& local_layout,
                                                  std::string_view local_fingerprint,
                                                  KvDestination dest, int64_t prompt_len);

  bool on_layer_ready(int64_t layer, int64_t begin, int64_t end,
                      std::span<const BlockId> block_table, bool last) override;

  // Sends the notice (dest.notice_tag) ordered after every write unless on_layer_ready did,
  // then waits until the notice is placed at the peer or a batch failed, at most `timeout`. OK means the decode worker can
  // read the KV. After it returns (whatever the result) no write reads the local blocks any
  // more, unless it returned DeadlineExceeded with writes still in flight (then call drain()).
  Status finish(std::chrono::milliseconds timeout);
  // Waits (at most `timeout`) for every submitted batch to end, successfully or not; for a
  // prefill that was cancelled or failed before finish(). true when nothing is in flight.
  bool drain(std::chrono::milliseconds timeout);

  // Call before the engine gets the request: the last layer does not send the notice; the
  // notice goes from finish_async(), carrying its value (the first token: notice_value()), so
  // that a decode worker whose Decode is already open starts from it at once.
  void hold_notice();

  // finish() and drain() without a waiting thread, for the Prefill reactor. Call them after the
  // engine's finished event (no batch is submitted after it). `done` runs once, when every
  // batch (and the notice) has ended: at once on this thread if they have, else on the thread
  // that ends the last of them (TransferHandle::on_done), so it must not block. Each transfer
  // ends within the transfer engine's completion timeout, so `done` always comes.
  // finish_async: sends the notice as finish() does, carrying `notice_value` when it goes from
  // here (after hold_notice()); `done` gets finish()'s result.
  void finish_async(std::function<void(Status)> done, uint64_t notice_value = 0);
  // when_drained: no notice; for a prefill that failed or was cancelled.
  void when_drained(std::function<void()> done);

  // Bytes submitted so far.
  uint64_t bytes() const;
  // Seconds from the last layer's KV of the last chunk being computed (the on_layer_ready call
  // with last = true for the last layer) to the notice's completion at the transfer engine
  // (TransferHandle::completed_at); valid after finish() OK.
  double tail_seconds() const;
  // Seconds from the first write's submission to the notice's completion.
  double transfer_seconds() const;
  // The first failure seen by on_layer_ready, finish() or drain(); OK while none.
  Status failure() const;
  // The decode worker renewed the lease for `lease` (the router asked it first): nothing is
  // posted after lease - lease_margin(dest.lease) from now, unless the bound is later already.
  // false when the destination gave no lease, or the writes have stopped (failed, or the
  // bound had passed: a lease that ended is not brought back). Any thread.
  bool renew_lease(std::chrono::milliseconds lease);
  // The writes stopped because the destination's lease ended (not a transfer fault): the
  // decode worker is fine, this side was too late.
  bool lease_ended() const;

 private:
  KvSender() = default;
  // Sends the notice (with `notice_value`) unless it went or a layer is short (which it records
  // as the failure).
  void start_finish(uint64_t notice_value = 0);
  // finish()'s result once every batch and the notice have ended.
  Status finished_result();
  // Runs `done` once every batch and the notice have ended, their failures recorded first.
  void when_all_done(std::function<void()> done);
  struct State;
  std::shared_ptr<State> state_;
};

}  // namespace cleave
