// Continuous batching policy over a KvBlockPool: which sequences run in the next engine step,
// how many of their tokens, and which blocks they write. No model and no threads here: the
// engine loop (src/worker) runs the forward pass and sampling, and reports back.
//
// A sequence's tokens are its prompt followed by the tokens generated so far. Its KV is
// computed for the first num_computed_tokens of them; the rest run in later steps, in chunks.
// States:
//   waiting  - holds no blocks; in arrival order (a preempted sequence goes back to the front)
//   running  - admitted; holds blocks for its computed tokens (and for the chunk scheduled)
//   finished - removed with finish() / abort(); its blocks are released at once
//
// One step (schedule()):
//   1. Running sequences, oldest admission first: each gets its next chunk (a decode token, or
//      the next piece of its prompt) within the step's token budget (max_tokens_per_step), and
//      blocks for it. When the blocks cannot be had, the most recently admitted running
//      sequence is preempted (blocks released, num_computed_tokens reset to 0; its generated
//      tokens are kept and recomputed with the prompt later), repeatedly. The oldest running
//      sequence is never preempted for a younger one, so it always makes progress; when it
//      cannot fit with every other sequence preempted, it waits (keeping its blocks, nothing
//      admitted behind it) while blocks held outside the scheduler will come back (see below),
//      and is removed and reported as failed (ResourceExhausted) when none will or when its
//      chunk needs more blocks than the pool has.
//   2. If nobody was preempted, waiting sequences are admitted in arrival order (no skipping)
//      while the budget, max_num_seqs and the pool allow. On admission the prefix cache is
//      consulted: the longest chain of cached full blocks of the sequence's tokens is acquired
//      and those tokens count as computed ("cached"), but never the last token, which must be
//      computed to give logits. A sequence is admitted only when blocks for its first chunk can
//      be had (evicting unreferenced cached blocks as the pool sees fit). When nothing runs and
//      the front does not fit, it waits while blocks held outside the scheduler will come back,
//      unless its chunk needs more blocks than the pool has; it is removed and reported as
//      failed when it does not fit with no block held anywhere (a preempted sequence that
//      outgrew the pool).
//   Blocks held outside (schedule()'s `blocks_coming_back`: reservations and pins, see
//   block_ledger.h) all come back in bounded time, so a wait ends: either the blocks come back
//   and the sequence fits (or fails at once, nothing being held any more), or it was never going
//   to fit and fails now. A step that waits plans no chunk for the waiter and sets plan.blocked,
//   so that the caller sleeps until something changes instead of spinning.
// After the forward pass, complete() advances num_computed_tokens and registers every block
// that became full in the prefix cache (prompt and generated tokens alike: a block's KV depends
// only on the tokens up to it). A chunk that reaches the last known token "samples": its logits
// give the next token, which the caller appends with append_token() (or ends the sequence).
//
// Thread-safety: none; owned by the engine thread, like the pool.
#pragma once

#include <cstdint>
#include <deque>
#include <memory>
#include <span>
#include <unordered_map>
#include <vector>

#include "cleave/common/status.h"
#include "cleave/kvcache/kv_block_pool.h"
#include "cleave/kvcache/prefix_hash.h"

namespace cleave {

using SequenceId = uint64_t;

enum class SequenceState : uint8_t { kWaiting, kRunning };

struct SchedulerOptions {
  int64_t max_tokens_per_step = 256;  // token budget of one step (decode tokens + prefill chunks)
  int64_t max_num_seqs = 64;          // most running sequences
  bool prefix_caching = true;         // reuse and register cached full blocks
  uint64_t hash_seed = kPrefixHashSeed;  // mix a model fingerprint in to keep models apart

  // InvalidArgument naming the field when a value is out of range (both limits >= 1).
  Status validate() const;
};

// A sequence as the scheduler tracks it. Read-only outside the scheduler.
struct Sequence {
  SequenceId id = 0;
  std::vector<int32_t> tokens;         // prompt, then generated tokens
  int64_t prompt_len = 0;
  std::vector<BlockId> block_table;    // block i holds positions [i*bs, (i+1)*bs)
  int64_t num_computed_tokens = 0;     // KV present for tokens[0, num_computed_tokens)
  int64_t num_cached_prompt_tokens = 0;  // prompt tokens served by the prefix cache (last admission)
  SequenceState state = SequenceState::kWaiting;
  uint64_t arrival = 0;                // order of add()
  int32_t preemptions = 0;

  int64_t num_generated() const { return static_cast<int64_t>(tokens.size()) - prompt_len; }
  int64_t num_uncomputed() const { return static_cast<int64_t>(tokens.size()) - num_computed_tokens; }

 private:
  friend class Scheduler;
  std::vector<uint64_t> block_hashes_;  // chain keys of the full blocks of `tokens` known so far
  bool compute_whole_prompt_ = false;   // never served by the prefix cache
  int64_t num_registered_blocks_ = 0;   // block_table[0, n) have been offered to the prefix cache
};

// One sequence's share of a step: tokens[start_pos, start_pos + num_tokens) at those positions.
struct ScheduledChunk {
  const Sequence* seq = nullptr;  // valid until the sequence is finished or aborted
  int64_t start_pos = 0;
  int64_t num_tokens = 0;
  bool samples = false;  // ends at the last known token: its logits give the next token

  std::span<const int32_t> tokens() const {
    return std::span<const int32_t>(seq->tokens).subspan(static_cast<size_t>(start_pos),
                                                         static_cast<size_t>(num_tokens));
  }
};

// A sequence removed because it cannot fit in the pool even alone.
struct FailedSequence {
  SequenceId id = 0;
  int64_t num_tokens = 0;     // its prompt and generated tokens when it failed
  int64_t blocks_needed = 0;  // blocks its next chunk needed
};

struct StepPlan {
  std::vector<ScheduledChunk> chunks;  // running sequences first, then newly admitted ones
  std::vector<SequenceId> preempted;   // sent back to waiting in this step
  std::vector<FailedSequence> failed;  // removed: cannot fit in the pool even alone
  int64_t num_tokens = 0;              // sum of chunk sizes (<= max_tokens_per_step)
  // A sequence does not fit now but will once the blocks held outside the scheduler are back:
  // it waits (nothing behind it is admitted). With no chunk, nothing changes until then.
  bool blocked = false;

  bool empty() const { return chunks.empty(); }
  void clear() {
    chunks.clear();
    preempted.clear();
    failed.clear();
    num_tokens = 0;
    blocked = false;
  }
};

struct SchedulerCounters {
  uint64_t steps = 0;                     // schedule() calls that planned work
  uint64_t prompt_tokens_computed = 0;    // prompt positions run through the model
  uint64_t prompt_tokens_cached = 0;      // prompt positions served by the prefix cache
  uint64_t generated_tokens_computed = 0; // generated positions run (decode and recompute)
  uint64_t generated_tokens_cached = 0;   // generated positions served by the cache on resume
  uint64_t preemptions = 0;
  uint64_t failed = 0;                    // sequences removed because they could never fit
};

class Scheduler {
 public:
  // `pool` must outlive the scheduler. The scheduler allocates its sequences' blocks; other
  // claims (reservations, pins) go through the BlockLedger that owns it (block_ledger.h).
  Scheduler(KvBlockPool& pool, const SchedulerOptions& opts);
  ~Scheduler();  // releases every block still held
  Scheduler(const Scheduler&) = delete;
  Scheduler& operator=(const Scheduler&) = delete;

  const SchedulerOptions& options() const { return opts_; }
  int64_t block_size() const { return block_size_; }

  // Queues a new sequence (waiting). InvalidArgument for an empty prompt; AlreadyExists for an
  // id in use; ResourceExhausted when the prompt and one generated token need more blocks than
  // the whole pool has. `compute_whole_prompt`: the prefix cache is not consulted for it
  // (every prompt position is computed, e.g. for its prompt log-probabilities); its blocks
  // still enter the cache.
  Status add(SequenceId id, std::vector<int32_t> prompt, bool compute_whole_prompt = false);
  // Adds a sequence whose prompt KV is already in `blocks` (written there by a prefill worker;
  // block i holds positions [i*bs, (i+1)*bs)) and whose first generated token is
  // `first_token`. It starts running at once with num_computed_tokens = prompt length, taking
  // over one reference on each block; its next chunk is the decode of first_token. Its full
  // prompt blocks enter the prefix cache. InvalidArgument for an empty prompt or blocks that do
  // not cover it; AlreadyExists for an id in use; Unavailable (nothing taken) when
  // max_num_seqs sequences are running: try again after a step.
  Status add_prefilled(SequenceId id, std::vector<int32_t> prompt, int32_t first_token,
                       std::vector<BlockId> blocks);

  // Plans the next step into `plan` (cleared first; its vectors keep their capacity). Blocks
  // for every scheduled chunk are allocated here. Sequences in plan.failed are already removed.
  // `blocks_coming_back`: blocks held outside the scheduler that will be released in bounded
  // time (admission waits for them rather than failing; see the top of this header).
  // No finish()/abort() may happen between schedule() and complete() for a scheduled sequence.
  void schedule(StepPlan& plan, int64_t blocks_coming_back = 0);
  // Records that the plan's forward pass ran: advances num_computed_tokens and registers the
  // blocks that became full in the prefix cache.
  void complete(const StepPlan& plan);

  // Appends a token generated for a running sequence whose last chunk sampled.
  // FailedPrecondition when the sequence is not running or has uncomputed tokens left.
  Status append_token(SequenceId id, int32_t token);

  // Removes the sequence whatever its state and releases its blocks at once. false when the id
  // is unknown (already finished, failed or aborted).
  bool finish(SequenceId id);
  bool abort(SequenceId id) { return finish(id); }

  // nullptr when unknown.
  const Sequence* find(SequenceId id) const;
  int64_t num_waiting() const { return static_cast<int64_t>(waiting_.size()); }
  int64_t num_running() const { return static_cast<int64_t>(running_.size()); }
  bool idle() const { return waiting_.empty() && running_.empty(); }
  const SchedulerCounters& counters() const { return counters_; }

 private:
  int64_t blocks_for(int64_t num_tokens) const { return (num_tokens + block_size_ - 1) / block_size_; }
  // Blocks `seq` needs added to its table to hold its first `end` tokens.
  int64_t blocks_missing(const Sequence& seq, int64_t end) const;
  // Allocates blocks so that `seq` holds its first `end` tokens; false (nothing taken) if the
  // pool cannot give them.
  bool grow(Sequence& seq, int64_t end);
  void release_blocks(Sequence& seq);
  void preempt(Sequence& seq);
  void extend_hashes(Sequence& seq, int64_t num_full_blocks);
  // Admission of the waiting front; false when it does not fit now.
  bool try_admit(Sequence& seq, int64_t budget, StepPlan& plan);
  void remove(Sequence& seq);

  KvBlockPool& pool_;
  SchedulerOptions opts_;
  int64_t block_size_;
  std::unordered_map<SequenceId, std::unique_ptr<Sequence>> sequences_;
  std::deque<Sequence*> waiting_;
  std::vector<Sequence*> running_;  // admission order, oldest first
  uint64_t next_arrival_ = 0;
  SchedulerCounters counters_;
};

}  // namespace cleave
