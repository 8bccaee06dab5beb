// Continuous batching policy: running sequences first (with preemption of the most recently
// admitted when blocks run out), then admission in arrival order with the prefix cache.
#include "cleave/scheduler/scheduler.h"

#include <algorithm>

#include "fmt/format.h"

namespace cleave {

Status SchedulerOptions::validate() const {
  if (max_tokens_per_step < 1) {
    return InvalidArgument(fmt::format(
        "scheduler: max_tokens_per_step is {}, it must be at least 1", max_tokens_per_step));
  }
  if (max_num_seqs < 1) {
    return InvalidArgument(
        fmt::format("scheduler: max_num_seqs is {}, it must be at least 1", max_num_seqs));
  }
  return Status::Ok();
}

Scheduler::Scheduler(KvBlockPool& pool, const SchedulerOptions& opts)
    : pool_(pool), opts_(opts), block_size_(pool.layout().block_size) {
  running_.reserve(static_cast<size_t>(std::max<int64_t>(opts_.max_num_seqs, 1)));
}

Scheduler::~Scheduler() {
  for (auto& [id, seq] : sequences_) release_blocks(*seq);
}

Status Scheduler::add(SequenceId id, std::vector<int32_t> prompt, bool compute_whole_prompt) {
  if (prompt.empty()) {
    return InvalidArgument(fmt::format("scheduler: sequence {} has an empty prompt", id));
  }
  if (sequences_.count(id) != 0) {
    return AlreadyExists(fmt::format("scheduler: sequence id {} is already in use", id));
  }
  const int64_t need = blocks_for(static_cast<int64_t>(prompt.size()));
  if (need > pool_.total_blocks()) {
    return ResourceExhausted(fmt::format(
        "scheduler: the prompt of sequence {} has {} tokens and needs {} KV blocks of {} tokens; "
        "the pool has {} blocks in all (raise the KV cache size)",
        id, prompt.size(), need, block_size_, pool_.total_blocks()));
  }
  auto seq = std::make_unique<Sequence>();
  seq->id = id;
  seq->prompt_len = static_cast<int64_t>(prompt.size());
  seq->tokens = std::move(prompt);
  seq->arrival = next_arrival_++;
  seq->state = SequenceState::kWaiting;
  seq->compute_whole_prompt_ = compute_whole_prompt;
  waiting_.push_back(seq.get());
  sequences_.emplace(id, std::move(seq));
  return Status::Ok();
}

Status Scheduler::add_prefilled(SequenceId id, std::vector<int32_t> prompt, int32_t first_token,
                                std::vector<BlockId> blocks) {
  if (prompt.empty()) {
    return InvalidArgument(fmt::format("scheduler: sequence {} has an empty prompt", id));
  }
  if (sequences_.count(id) != 0) {
    return AlreadyExists(fmt::format("scheduler: sequence id {} is already in use", id));
  }
  const int64_t prompt_len = static_cast<int64_t>(prompt.size());
  if (static_cast<int64_t>(blocks.size()) < blocks_for(prompt_len)) {
    return InvalidArgument(fmt::format(
        "scheduler: sequence {} has a prompt of {} tokens but {} KV blocks of {} tokens", id,
        prompt_len, blocks.size(), block_size_));
  }
  if (static_cast<int64_t>(running_.size()) >= opts_.max_num_seqs) {
    return Unavailable(fmt::format("scheduler: {} sequences are running already", running_.size()));
  }
  auto seq = std::make_unique<Sequence>();
  seq->id = id;
  seq->prompt_len = prompt_len;
  seq->tokens = std::move(prompt);
  seq->tokens.push_back(first_token);
  seq->block_table = std::move(blocks);
  seq->num_computed_tokens = prompt_len;
  seq->arrival = next_arrival_++;
  seq->state = SequenceState::kRunning;
  if (opts_.prefix_caching) {
    const int64_t full = prompt_len / block_size_;
    extend_hashes(*seq, full);
    for (int64_t b = 0; b < full; ++b) {
      pool_.register_full_block(seq->block_table[static_cast<size_t>(b)],
                                seq->block_hashes_[static_cast<size_t>(b)]);
    }
    seq->num_registered_blocks_ = full;
  }
  running_.push_back(seq.get());
  sequences_.emplace(id, std::move(seq));
  return Status::Ok();
}

int64_t Scheduler::blocks_missing(const Sequence& seq, int64_t end) const {
  return std::max<int64_t>(0, blocks_for(end) - static_cast<int64_t>(seq.block_table.size()));
}

bool Scheduler::grow(Sequence& seq, int64_t end) {
  const int64_t missing = blocks_missing(seq, end);
  if (missing == 0) return true;
  if (!pool_.can_allocate(missing)) return false;
  return pool_.allocate(missing, seq.block_table).ok();
}

void Scheduler::release_blocks(Sequence& seq) {
  // The pool releases last to first, so the head of the chain is evicted last.
  pool_.release(seq.block_table);
  seq.block_table.clear();
  seq.num_registered_blocks_ = 0;
}

void Scheduler::preempt(Sequence& seq) {
  release_blocks(seq);
  seq.num_computed_tokens = 0;
  seq.num_cached_prompt_tokens = 0;
  seq.state = SequenceState::kWaiting;
  ++seq.preemptions;
  ++counters_.preemptions;
  waiting_.push_front(&seq);
}

void Scheduler::extend_hashes(Sequence& seq, int64_t num_full_blocks) {
  auto& hashes = seq.block_hashes_;
  while (static_cast<int64_t>(hashes.size()) < num_full_blocks) {
    const size_t i = hashes.size();
    const uint64_t parent = hashes.empty() ? opts_.hash_seed : hashes.back();
    hashes.push_back(hash_block(parent, std::span<const int32_t>(seq.tokens).subspan(
                                            i * static_cast<size_t>(block_size_),
                                            static_cast<size_t>(block_size_))));
  }
}

bool Scheduler::try_admit(Sequence& seq, int64_t budget, StepPlan& plan) {
  const int64_t total = static_cast<int64_t>(seq.tokens.size());
  // Prefix cache hits: the longest chain of cached full blocks, leaving at least one token.
  std::vector<BlockId>& table = seq.block_table;  // empty while waiting
  int64_t hits_cached_now = 0;  // hits with no holder: acquiring them takes them off the LRU list
  if (opts_.prefix_caching && !seq.compute_whole_prompt_) {
    const int64_t max_hits = (total - 1) / block_size_;
    extend_hashes(seq, max_hits);
    for (int64_t b = 0; b < max_hits; ++b) {
      const std::optional<BlockId> hit = pool_.lookup(seq.block_hashes_[static_cast<size_t>(b)]);
      if (!hit) break;
      table.push_back(*hit);
      if (pool_.refcount(*hit) == 0) ++hits_cached_now;
    }
  }
  const int64_t hits = static_cast<int64_t>(table.size());
  const int64_t cached = hits * block_size_;
  const int64_t n = std::min(total - cached, budget);
  const int64_t end = cached + n;
  const int64_t fresh = blocks_for(end) - hits;
  if (fresh > pool_.free_blocks() + pool_.cached_blocks() - hits_cached_now) {
    table.clear();
    return false;
  }
  for (BlockId b : table) pool_.acquire(b);
  if (fresh > 0 && !pool_.allocate(fresh, table).ok()) {
    release_blocks(seq);
    return false;
  }
  seq.num_computed_tokens = cached;
  seq.num_registered_blocks_ = hits;
  const int64_t prompt_cached = std::min(cached, seq.prompt_len);
  seq.num_cached_prompt_tokens = prompt_cached;
  counters_.prompt_tokens_cached += static_cast<uint64_t>(prompt_cached);
  counters_.generated_tokens_cached += static_cast<uint64_t>(cached - prompt_cached);
  seq.state = SequenceState::kRunning;
  running_.push_back(&seq);
  plan.chunks.push_back(ScheduledChunk{&seq, cached, n, end == total});
  return true;
}

void Scheduler::schedule(StepPlan& plan, int64_t blocks_coming_back) {
  plan.clear();
  const bool held_elsewhere = blocks_coming_back > 0;
  int64_t budget = opts_.max_tokens_per_step;
  bool preempted_any = false;
  size_t i = 0;
  while (i < running_.size() && budget > 0) {
    Sequence& seq = *running_[i];
    const int64_t n = std::min(seq.num_uncomputed(), budget);
    if (n <= 0) {  // sampled, but the caller has not appended a token: nothing to run
      ++i;
      continue;
    }
    const int64_t end = seq.num_computed_tokens + n;
    bool fits = grow(seq, end);
    while (!fits && running_.back() != &seq) {
      Sequence& victim = *running_.back();
      running_.pop_back();
      preempt(victim);
      plan.preempted.push_back(victim.id);
      preempted_any = true;
      fits = grow(seq, end);
    }
    if (!fits) {
      if (i == 0 && held_elsewhere && blocks_for(end) <= pool_.total_blocks()) {
        // Alone, with every other running sequence preempted, but blocks held outside come
        // back: it keeps what it has and waits for them, and nothing is admitted meanwhile.
        plan.blocked = true;
        preempted_any = true;
      } else if (i == 0) {
        // Alone, with every other running sequence preempted and nothing held elsewhere (or
        // more blocks than the pool has): it can never fit.
        plan.failed.push_back(FailedSequence{seq.id, static_cast<int64_t>(seq.tokens.size()),
                                             blocks_for(end)});
        ++counters_.failed;
        remove(seq);
      } else {
        running_.pop_back();
        preempt(seq);
        plan.preempted.push_back(seq.id);
        preempted_any = true;
      }
      break;
    }
    plan.chunks.push_back(ScheduledChunk{&seq, seq.num_computed_tokens, n,
                                         end == static_cast<int64_t>(seq.tokens.size())});
    budget -= n;
    ++i;
  }
  if (!preempted_any) {
    while (!waiting_.empty() && budget > 0 &&
           static_cast<int64_t>(running_.size()) < opts_.max_num_seqs) {
      Sequence& seq = *waiting_.front();
      if (!try_admit(seq, budget, plan)) {
        if (!running_.empty()) break;  // waits for blocks to come back
        const int64_t total = static_cast<int64_t>(seq.tokens.size());
        const int64_t chunk_blocks = blocks_for(std::min(total, budget));  // with no cache hit
        if (held_elsewhere && chunk_blocks <= pool_.total_blocks()) {
          plan.blocked = true;  // fits once reservations and pins are back
          break;
        }
        // Nothing holds a block, and its next chunk still does not fit: it never will.
        plan.failed.push_back(FailedSequence{seq.id, total, chunk_blocks});
        ++counters_.failed;
        remove(seq);
        continue;
      }
      waiting_.pop_front();
      budget -= plan.chunks.back().num_tokens;
    }
  }
  plan.num_tokens = opts_.max_tokens_per_step - budget;
  if (!plan.chunks.empty()) ++counters_.steps;
}

void Scheduler::complete(const StepPlan& plan) {
  for (const ScheduledChunk& c : plan.chunks) {
    auto it = sequences_.find(c.seq->id);
    if (it == sequences_.end() || it->second.get() != c.seq) continue;
    Sequence& seq = *it->second;
    if (seq.state != SequenceState::kRunning || seq.num_computed_tokens != c.start_pos) continue;
    const int64_t end = c.start_pos + c.num_tokens;
    const int64_t prompt_part =
        std::max<int64_t>(0, std::min(end, seq.prompt_len) - c.start_pos);
    counters_.prompt_tokens_computed += static_cast<uint64_t>(prompt_part);
    counters_.generated_tokens_computed += static_cast<uint64_t>(c.num_tokens - prompt_part);
    seq.num_computed_tokens = end;
    if (!opts_.prefix_caching) continue;
    const int64_t full = end / block_size_;
    if (full <= seq.num_registered_blocks_) continue;
    extend_hashes(seq, full);
    for (int64_t b = seq.num_registered_blocks_; b < full; ++b) {
      pool_.register_full_block(seq.block_table[static_cast<size_t>(b)],
                                seq.block_hashes_[static_cast<size_t>(b)]);
    }
    seq.num_registered_blocks_ = full;
  }
}

Status Scheduler::append_token(SequenceId id, int32_t token) {
  auto it = sequences_.find(id);
  if (it == sequences_.end()) {
    return FailedPrecondition(fmt::format("scheduler: append_token: unknown sequence {}", id));
  }
  Sequence& seq = *it->second;
  if (seq.state != SequenceState::kRunning || seq.num_uncomputed() != 0) {
    return FailedPrecondition(fmt::format(
        "scheduler: append_token: sequence {} is not waiting for a token ({} of {} tokens "
        "computed, {})",
        id, seq.num_computed_tokens, seq.tokens.size(),
        seq.state == SequenceState::kRunning ? "running" : "waiting"));
  }
  seq.tokens.push_back(token);
  return Status::Ok();
}

void Scheduler::remove(Sequence& seq) {
  if (seq.state == SequenceState::kWaiting) {
    auto it = std::find(waiting_.begin(), waiting_.end(), &seq);
    if (it != waiting_.end()) waiting_.erase(it);
  } else {
    auto it = std::find(running_.begin(), running_.end(), &seq);
    if (it != running_.end()) running_.erase(it);
  }
  release_blocks(seq);
  sequences_.erase(seq.id);
}

bool Scheduler::finish(SequenceId id) {
  auto it = sequences_.find(id);
  if (it == sequences_.end()) return false;
  remove(*it->second);
  return true;
}

const Sequence* Scheduler::find(SequenceId id) const {
  auto it = sequences_.find(id);
  return it == sequences_.end() ? nullptr : it->second.get();
}

}  // namespace cleave
