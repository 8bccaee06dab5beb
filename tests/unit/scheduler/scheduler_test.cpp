// Scheduler policy over a real KvBlockPool: chunked prefill within the token budget, admission
// limits, prefix-cache hits (never the last token), preemption of the most recently admitted,
// failure of a sequence that cannot fit alone, abort in every state, and a randomized workload
// that simulates the KV contents to check that every chunk reads exactly the KV of its prefix.
#include "cleave/scheduler/scheduler.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <map>
#include <random>

namespace cleave {
namespace {

std::unique_ptr<KvBlockPool> make_pool(int64_t num_blocks, int64_t block_size = 4) {
  KvLayout l;
  l.block_size = block_size;
  l.n_layers = 1;
  l.n_kv_heads = 1;
  l.head_dim = 4;
  l.num_blocks = num_blocks;
  auto p = KvBlockPool::create(l);
  EXPECT_TRUE(p.ok()) << p.status().to_string();
  return p.ok() ? std::move(*p) : nullptr;
}

std::vector<int32_t> iota_tokens(int64_t n, int32_t first = 1) {
  std::vector<int32_t> t(static_cast<size_t>(n));
  for (int64_t i = 0; i < n; ++i) t[static_cast<size_t>(i)] = first + static_cast<int32_t>(i);
  return t;
}

SchedulerOptions opts(int64_t budget, int64_t max_seqs = 64, bool prefix = true) {
  SchedulerOptions o;
  o.max_tokens_per_step = budget;
  o.max_num_seqs = max_seqs;
  o.prefix_caching = prefix;
  return o;
}

const ScheduledChunk* chunk_of(const StepPlan& plan, SequenceId id) {
  for (const auto& c : plan.chunks)
    if (c.seq->id == id) return &c;
  return nullptr;
}

// Completes the plan and appends `token` to every sequence whose chunk sampled.
void run_step(Scheduler& s, const StepPlan& plan, int32_t token = 7) {
  s.complete(plan);
  for (const auto& c : plan.chunks)
    if (c.samples) {
      ASSERT_TRUE(s.append_token(c.seq->id, token).ok());
    }
}

TEST(SchedulerTest, OptionsAreValidated) {
  EXPECT_FALSE(opts(0).validate().ok());
  EXPECT_FALSE(opts(8, 0).validate().ok());
  EXPECT_TRUE(opts(8, 1).validate().ok());
}

TEST(SchedulerTest, AddRejectsBadSequences) {
  auto pool = make_pool(4);
  Scheduler s(*pool, opts(64));
  EXPECT_EQ(s.add(1, {}).code(), StatusCode::kInvalidArgument);
  ASSERT_TRUE(s.add(1, iota_tokens(3)).ok());
  EXPECT_EQ(s.add(1, iota_tokens(3)).code(), StatusCode::kAlreadyExists);
  const Status big = s.add(2, iota_tokens(17));  // 5 blocks of 4 > 4
  EXPECT_EQ(big.code(), StatusCode::kResourceExhausted);
  EXPECT_NE(big.message().find("17 tokens"), std::string::npos) << big.message();
  EXPECT_TRUE(s.add(3, iota_tokens(16)).ok());
}

TEST(SchedulerTest, PrefillThenDecodeOneTokenEach) {
  auto pool = make_pool(64);
  Scheduler s(*pool, opts(256));
  ASSERT_TRUE(s.add(1, iota_tokens(10)).ok());
  ASSERT_TRUE(s.add(2, iota_tokens(6, 100)).ok());
  StepPlan plan;
  s.schedule(plan);
  ASSERT_EQ(plan.chunks.size(), 2u);
  EXPECT_EQ(plan.chunks[0].seq->id, 1u);
  EXPECT_EQ(plan.chunks[0].start_pos, 0);
  EXPECT_EQ(plan.chunks[0].num_tokens, 10);
  EXPECT_TRUE(plan.chunks[0].samples);
  EXPECT_EQ(plan.chunks[0].seq->block_table.size(), 3u);
  EXPECT_EQ(plan.chunks[1].num_tokens, 6);
  EXPECT_EQ(plan.chunks[1].seq->block_table.size(), 2u);
  EXPECT_EQ(plan.num_tokens, 16);
  EXPECT_EQ(s.num_running(), 2);
  run_step(s, plan);

  s.schedule(plan);
  ASSERT_EQ(plan.chunks.size(), 2u);
  for (const auto& c : plan.chunks) {
    EXPECT_EQ(c.num_tokens, 1);
    EXPECT_TRUE(c.samples);
    EXPECT_EQ(c.start_pos, c.seq->prompt_len);
    EXPECT_EQ(c.tokens()[0], 7);
  }
  // Positions 10 and 6 still fall in the blocks the prompts took.
  EXPECT_EQ(chunk_of(plan, 1)->seq->block_table.size(), 3u);
  EXPECT_EQ(chunk_of(plan, 2)->seq->block_table.size(), 2u);
  run_step(s, plan);
  EXPECT_EQ(s.counters().prompt_tokens_computed, 16u);
  EXPECT_EQ(s.counters().generated_tokens_computed, 2u);
  EXPECT_EQ(s.counters().steps, 2u);

  EXPECT_TRUE(s.finish(1));
  EXPECT_FALSE(s.finish(1));
  EXPECT_TRUE(s.abort(2));
  EXPECT_TRUE(s.idle());
  EXPECT_EQ(pool->used_blocks(), 0);
  EXPECT_EQ(pool->free_blocks() + pool->cached_blocks(), pool->total_blocks());
}

TEST(SchedulerTest, ChunkedPrefillSplitsLongPromptsAcrossSteps) {
  auto pool = make_pool(64);
  Scheduler s(*pool, opts(8));
  ASSERT_TRUE(s.add(1, iota_tokens(20)).ok());
  ASSERT_TRUE(s.add(2, iota_tokens(5, 50)).ok());
  StepPlan plan;
  s.schedule(plan);
  ASSERT_EQ(plan.chunks.size(), 1u);  // budget spent on sequence 1
  EXPECT_EQ(plan.chunks[0].num_tokens, 8);
  EXPECT_FALSE(plan.chunks[0].samples);
  EXPECT_EQ(plan.chunks[0].seq->block_table.size(), 2u);  // only what the chunk needs
  run_step(s, plan);
  s.schedule(plan);
  ASSERT_EQ(plan.chunks.size(), 1u);
  EXPECT_EQ(plan.chunks[0].start_pos, 8);
  EXPECT_EQ(plan.chunks[0].num_tokens, 8);
  run_step(s, plan);
  s.schedule(plan);
  ASSERT_EQ(plan.chunks.size(), 2u);  // the last 4 of sequence 1, then 4 of sequence 2
  EXPECT_EQ(plan.chunks[0].num_tokens, 4);
  EXPECT_TRUE(plan.chunks[0].samples);
  EXPECT_EQ(plan.chunks[1].seq->id, 2u);
  EXPECT_EQ(plan.chunks[1].num_tokens, 4);
  EXPECT_FALSE(plan.chunks[1].samples);
  run_step(s, plan);
  s.schedule(plan);
  ASSERT_EQ(plan.chunks.size(), 2u);  // decode of 1, last prompt token of 2
  EXPECT_EQ(plan.chunks[0].num_tokens, 1);
  EXPECT_EQ(plan.chunks[1].num_tokens, 1);
  EXPECT_TRUE(plan.chunks[1].samples);
  run_step(s, plan);
  EXPECT_EQ(s.counters().prompt_tokens_computed, 25u);
}

TEST(SchedulerTest, MaxNumSeqsLimitsAdmission) {
  auto pool = make_pool(64);
  Scheduler s(*pool, opts(256, 2));
  for (SequenceId id = 1; id <= 3; ++id) ASSERT_TRUE(s.add(id, iota_tokens(3)).ok());
  StepPlan plan;
  s.schedule(plan);
  EXPECT_EQ(plan.chunks.size(), 2u);
  EXPECT_EQ(s.num_running(), 2);
  EXPECT_EQ(s.num_waiting(), 1);
  run_step(s, plan);
  ASSERT_TRUE(s.finish(1));
  s.schedule(plan);
  ASSERT_EQ(plan.chunks.size(), 2u);
  EXPECT_EQ(plan.chunks[1].seq->id, 3u);
}

TEST(SchedulerTest, AdmissionWaitsForBlocksInArrivalOrder) {
  auto pool = make_pool(4);
  Scheduler s(*pool, opts(256));
  ASSERT_TRUE(s.add(1, iota_tokens(12)).ok());   // 3 blocks
  ASSERT_TRUE(s.add(2, iota_tokens(8, 40)).ok()); // 2 blocks: does not fit beside 1
  ASSERT_TRUE(s.add(3, iota_tokens(2, 80)).ok()); // would fit, but must not overtake 2
  StepPlan plan;
  s.schedule(plan);
  ASSERT_EQ(plan.chunks.size(), 1u);
  EXPECT_EQ(s.num_waiting(), 2);
  run_step(s, plan);
  ASSERT_TRUE(s.finish(1));
  s.schedule(plan);
  ASSERT_EQ(plan.chunks.size(), 2u);
  EXPECT_EQ(plan.chunks[0].seq->id, 2u);
  EXPECT_EQ(plan.chunks[1].seq->id, 3u);
}

TEST(SchedulerTest, PrefixCacheReusesFullBlocksButNeverTheLastToken) {
  auto pool = make_pool(64);
  Scheduler s(*pool, opts(256));
  const std::vector<int32_t> prompt = iota_tokens(40);
  ASSERT_TRUE(s.add(1, prompt).ok());
  StepPlan plan;
  s.schedule(plan);
  run_step(s, plan);
  ASSERT_TRUE(s.finish(1));
  EXPECT_EQ(pool->cached_blocks(), 10);
  EXPECT_EQ(pool->used_blocks(), 0);

  // The same prompt: 9 blocks hit; the last block is recomputed to get logits.
  ASSERT_TRUE(s.add(2, prompt).ok());
  s.schedule(plan);
  ASSERT_EQ(plan.chunks.size(), 1u);
  EXPECT_EQ(plan.chunks[0].start_pos, 36);
  EXPECT_EQ(plan.chunks[0].num_tokens, 4);
  EXPECT_EQ(plan.chunks[0].seq->num_cached_prompt_tokens, 36);
  run_step(s, plan);

  // All but the last 4 tokens shared with a running sequence: its blocks are shared.
  std::vector<int32_t> other = prompt;
  other.resize(38);
  other.push_back(500);
  other.push_back(501);
  other.push_back(502);
  ASSERT_TRUE(s.add(3, other).ok());
  s.schedule(plan);
  const ScheduledChunk* c3 = chunk_of(plan, 3);
  ASSERT_NE(c3, nullptr);
  EXPECT_EQ(c3->start_pos, 36);
  EXPECT_EQ(c3->num_tokens, 5);
  const Sequence* s2 = s.find(2);
  for (int b = 0; b < 9; ++b) {
    EXPECT_EQ(c3->seq->block_table[b], s2->block_table[b]);
    EXPECT_EQ(pool->refcount(s2->block_table[b]), 2);
  }
  EXPECT_NE(c3->seq->block_table[9], s2->block_table[9]);
  run_step(s, plan);
  EXPECT_EQ(s.counters().prompt_tokens_cached, 72u);
  EXPECT_EQ(s.counters().prompt_tokens_computed, 40u + 4u + 5u);
  ASSERT_TRUE(s.finish(2));
  ASSERT_TRUE(s.finish(3));
  EXPECT_EQ(pool->used_blocks(), 0);
}

TEST(SchedulerTest, PrefixCachingOffComputesEverything) {
  auto pool = make_pool(64);
  Scheduler s(*pool, opts(256, 64, /*prefix=*/false));
  StepPlan plan;
  for (SequenceId id = 1; id <= 2; ++id) {
    ASSERT_TRUE(s.add(id, iota_tokens(40)).ok());
    s.schedule(plan);
    ASSERT_EQ(plan.chunks.size(), 1u);
    EXPECT_EQ(plan.chunks[0].start_pos, 0);
    run_step(s, plan);
    ASSERT_TRUE(s.finish(id));
  }
  EXPECT_EQ(pool->cached_blocks(), 0);
  EXPECT_EQ(s.counters().prompt_tokens_cached, 0u);
}

TEST(SchedulerTest, DecodeOutOfBlocksPreemptsTheMostRecentlyAdmitted) {
  auto pool = make_pool(7);
  Scheduler s(*pool, opts(256));
  ASSERT_TRUE(s.add(1, iota_tokens(8)).ok());        // 2 full blocks each
  ASSERT_TRUE(s.add(2, iota_tokens(8, 100)).ok());
  ASSERT_TRUE(s.add(3, iota_tokens(8, 200)).ok());
  StepPlan plan;
  s.schedule(plan);
  ASSERT_EQ(plan.chunks.size(), 3u);
  run_step(s, plan);
  EXPECT_EQ(pool->free_blocks(), 1);
  // Each needs a third block for position 8: sequence 1 takes the free one; for sequence 2,
  // sequence 3 (admitted last) is preempted and one of its released blocks is evicted.
  s.schedule(plan);
  EXPECT_EQ(plan.preempted, std::vector<SequenceId>{3});
  ASSERT_EQ(plan.chunks.size(), 2u);  // no admission in a step that preempted
  EXPECT_EQ(plan.chunks[0].seq->id, 1u);
  EXPECT_EQ(plan.chunks[1].seq->id, 2u);
  EXPECT_EQ(s.counters().preemptions, 1u);
  const Sequence* s3 = s.find(3);
  ASSERT_NE(s3, nullptr);
  EXPECT_EQ(s3->state, SequenceState::kWaiting);
  EXPECT_EQ(s3->num_computed_tokens, 0);
  EXPECT_EQ(s3->preemptions, 1);
  EXPECT_TRUE(s3->block_table.empty());
  ASSERT_EQ(s3->tokens.size(), 9u);  // the generated token is kept
  EXPECT_EQ(s3->tokens[8], 7);
  run_step(s, plan);
  ASSERT_TRUE(s.finish(1));

  // Sequence 3 resumes: its first block is still cached (its tail block was evicted first), the
  // rest, generated token included, is recomputed; its chunk samples the next token.
  s.schedule(plan);
  ASSERT_EQ(plan.chunks.size(), 2u);
  EXPECT_EQ(plan.chunks[1].seq->id, 3u);
  EXPECT_EQ(plan.chunks[1].start_pos, 4);
  EXPECT_EQ(plan.chunks[1].num_tokens, 5);
  EXPECT_TRUE(plan.chunks[1].samples);
  EXPECT_EQ(plan.chunks[1].seq->num_cached_prompt_tokens, 4);
  run_step(s, plan);
  EXPECT_EQ(s.counters().generated_tokens_computed, 2u + 1u + 1u);
  ASSERT_TRUE(s.finish(2));
  ASSERT_TRUE(s.finish(3));
  EXPECT_EQ(pool->used_blocks(), 0);
}

TEST(SchedulerTest, SequenceThatCannotFitAloneFails) {
  auto pool = make_pool(3);
  Scheduler s(*pool, opts(256));
  ASSERT_TRUE(s.add(1, iota_tokens(10)).ok());
  ASSERT_TRUE(s.add(2, iota_tokens(2, 50)).ok());
  StepPlan plan;
  int failed_at = -1;
  for (int step = 0; step < 100 && failed_at < 0; ++step) {
    s.schedule(plan);
    if (!plan.failed.empty()) {
      ASSERT_EQ(plan.failed.size(), 1u);
      EXPECT_EQ(plan.failed[0].id, 1u);
      EXPECT_EQ(plan.failed[0].num_tokens, 13);
      EXPECT_EQ(plan.failed[0].blocks_needed, 4);
      failed_at = step;
    }
    run_step(s, plan);
  }
  ASSERT_GE(failed_at, 0);
  EXPECT_EQ(s.find(1), nullptr);
  EXPECT_EQ(s.counters().failed, 1u);
  // The other one carries on.
  ASSERT_NE(s.find(2), nullptr);
  s.schedule(plan);
  EXPECT_EQ(plan.chunks.size(), 1u);
  run_step(s, plan);
  ASSERT_TRUE(s.finish(2));
  EXPECT_EQ(pool->used_blocks(), 0);
}

TEST(SchedulerTest, WithBlocksComingBackTheFrontWaitsAndOnlyWhatNeverFitsFails) {
  auto pool = make_pool(6);
  Scheduler s(*pool, opts(64));
  std::vector<BlockId> held;  // blocks of another claim (a reservation, say)
  ASSERT_TRUE(pool->allocate(4, held).ok());
  ASSERT_TRUE(s.add(1, iota_tokens(12)).ok());  // 3 blocks, 2 free
  StepPlan plan;
  s.schedule(plan, /*blocks_coming_back=*/4);
  EXPECT_TRUE(plan.empty());
  EXPECT_TRUE(plan.blocked);
  EXPECT_TRUE(plan.failed.empty());
  EXPECT_EQ(s.num_waiting(), 1);
  // The same pool, but the caller says none of them comes back: it can never fit.
  s.schedule(plan, 0);
  EXPECT_FALSE(plan.blocked);
  ASSERT_EQ(plan.failed.size(), 1u);
  EXPECT_EQ(plan.failed[0].id, 1u);
  EXPECT_EQ(s.counters().failed, 1u);
  pool->release(held);
  // Back: it fits.
  ASSERT_TRUE(s.add(2, iota_tokens(12)).ok());
  s.schedule(plan, 0);
  ASSERT_EQ(plan.chunks.size(), 1u);
  EXPECT_FALSE(plan.blocked);
  EXPECT_TRUE(s.finish(2));
  EXPECT_EQ(pool->used_blocks(), 0);
}

TEST(SchedulerTest, AbortFreesBlocksInEveryState) {
  auto pool = make_pool(32);
  Scheduler s(*pool, opts(8));
  ASSERT_TRUE(s.add(1, iota_tokens(20)).ok());  // mid-prefill after one step
  ASSERT_TRUE(s.add(2, iota_tokens(3, 90)).ok());  // waiting
  StepPlan plan;
  s.schedule(plan);
  run_step(s, plan);
  EXPECT_GT(pool->used_blocks(), 0);
  EXPECT_TRUE(s.abort(1));
  EXPECT_EQ(pool->used_blocks(), 0);
  EXPECT_TRUE(s.abort(2));
  ASSERT_TRUE(s.add(3, iota_tokens(3, 70)).ok());
  s.schedule(plan);
  run_step(s, plan);
  s.schedule(plan);  // decoding
  ASSERT_EQ(plan.chunks.size(), 1u);
  EXPECT_EQ(plan.chunks[0].num_tokens, 1);
  run_step(s, plan);
  EXPECT_TRUE(s.abort(3));
  EXPECT_TRUE(s.idle());
  EXPECT_EQ(pool->used_blocks(), 0);
  EXPECT_EQ(pool->free_blocks() + pool->cached_blocks(), pool->total_blocks());
}

TEST(SchedulerTest, AppendTokenNeedsASampledSequence) {
  auto pool = make_pool(32);
  Scheduler s(*pool, opts(4));
  ASSERT_TRUE(s.add(1, iota_tokens(6)).ok());
  EXPECT_EQ(s.append_token(1, 3).code(), StatusCode::kFailedPrecondition);  // waiting
  StepPlan plan;
  s.schedule(plan);
  s.complete(plan);
  EXPECT_EQ(s.append_token(1, 3).code(), StatusCode::kFailedPrecondition);  // mid-prefill
  EXPECT_EQ(s.append_token(9, 3).code(), StatusCode::kFailedPrecondition);  // unknown
}

TEST(SchedulerTest, DestructorReleasesEverything) {
  auto pool = make_pool(16);
  {
    Scheduler s(*pool, opts(64));
    ASSERT_TRUE(s.add(1, iota_tokens(20)).ok());
    StepPlan plan;
    s.schedule(plan);
    s.complete(plan);
  }
  EXPECT_EQ(pool->used_blocks(), 0);
}

// A randomized workload against a simulated KV: every position's slot holds a fingerprint of
// the tokens up to it. Each chunk must find the right fingerprints for every earlier position
// (from its own computation or from the prefix cache) and may write only to blocks it alone
// holds. Sequences end after a random number of tokens or are aborted at random.
class KvSimulation {
 public:
  explicit KvSimulation(const KvBlockPool& pool)
      : pool_(pool), bs_(pool.layout().block_size),
        slots_(static_cast<size_t>(pool.total_blocks() * pool.layout().block_size), 0) {}

  void run_chunk(const ScheduledChunk& c) {
    const Sequence& seq = *c.seq;
    const int64_t end = c.start_pos + c.num_tokens;
    ASSERT_GE(static_cast<int64_t>(seq.block_table.size()) * bs_, end);
    uint64_t fp = 0xcbf29ce484222325ull;
    for (int64_t p = 0; p < end; ++p) {
      fp = (fp ^ static_cast<uint64_t>(static_cast<uint32_t>(seq.tokens[static_cast<size_t>(p)]))) *
           0x100000001b3ull;
      const BlockId b = seq.block_table[static_cast<size_t>(p / bs_)];
      uint64_t& slot = slots_[static_cast<size_t>(b * bs_ + p % bs_)];
      if (p < c.start_pos) {
        ASSERT_EQ(slot, fp) << "sequence " << seq.id << " position " << p << " block " << b;
      } else {
        ASSERT_EQ(pool_.refcount(b), 1) << "sequence " << seq.id << " writes shared block " << b;
        slot = fp;
      }
    }
  }

 private:
  const KvBlockPool& pool_;
  int64_t bs_;
  std::vector<uint64_t> slots_;
};

SchedulerCounters random_workload(uint32_t seed, int64_t pool_blocks, int64_t budget,
                                  int64_t max_seqs) {
  auto pool = make_pool(pool_blocks);
  Scheduler s(*pool, opts(budget, max_seqs));
  KvSimulation kv(*pool);
  std::mt19937 rng(seed);
  std::map<SequenceId, int64_t> target_len;  // total tokens at which a sequence ends
  // Prompts share prefixes: drawn from a few stems plus a random tail.
  std::vector<std::vector<int32_t>> stems;
  for (int i = 0; i < 4; ++i) stems.push_back(iota_tokens(24, 1000 * (i + 1)));
  SequenceId next_id = 1;
  int64_t submitted = 0, finished = 0;
  StepPlan plan;
  for (int step = 0; step < 5000; ++step) {
    if (submitted < 60 && rng() % 3 == 0) {
      std::vector<int32_t> prompt = stems[rng() % stems.size()];
      prompt.resize(1 + rng() % 24);
      const int tail = static_cast<int>(rng() % 10);
      for (int i = 0; i < tail; ++i) prompt.push_back(static_cast<int32_t>(rng() % 50));
      target_len[next_id] = static_cast<int64_t>(prompt.size()) + 1 + rng() % 20;
      EXPECT_TRUE(s.add(next_id, prompt).ok());
      ++next_id;
      ++submitted;
    }
    s.schedule(plan);
    EXPECT_LE(plan.num_tokens, budget);
    EXPECT_LE(s.num_running(), max_seqs);
    for (const FailedSequence& f : plan.failed) {
      target_len.erase(f.id);
      ++finished;
    }
    for (const auto& c : plan.chunks) kv.run_chunk(c);
    s.complete(plan);
    for (const auto& c : plan.chunks) {
      if (!c.samples) continue;
      const SequenceId id = c.seq->id;
      if (static_cast<int64_t>(c.seq->tokens.size()) >= target_len[id]) {
        EXPECT_TRUE(s.finish(id));
        target_len.erase(id);
        ++finished;
      } else {
        EXPECT_TRUE(s.append_token(id, static_cast<int32_t>(rng() % 50)).ok());
      }
    }
    if (!target_len.empty() && rng() % 23 == 0) {  // abort one at random, whatever its state
      auto it = target_len.begin();
      std::advance(it, rng() % target_len.size());
      EXPECT_TRUE(s.abort(it->first));
      target_len.erase(it);
      ++finished;
    }
    EXPECT_EQ(pool->free_blocks() + pool->cached_blocks() + pool->used_blocks(), pool->total_blocks());
    if (submitted == 60 && s.idle()) break;
  }
  EXPECT_TRUE(s.idle()) << "workload did not drain: " << s.num_running() << " running, "
                        << s.num_waiting() << " waiting";
  EXPECT_EQ(finished, 60);
  EXPECT_EQ(pool->used_blocks(), 0);
  EXPECT_EQ(pool->free_blocks() + pool->cached_blocks(), pool->total_blocks());
  return s.counters();
}

TEST(SchedulerTest, RandomWorkloadAmpleBlocks) {
  for (uint32_t seed = 0; seed < 5; ++seed) {
    const SchedulerCounters c = random_workload(seed, 256, 32, 16);
    EXPECT_GT(c.prompt_tokens_cached, 0u);
    EXPECT_EQ(c.preemptions, 0u);
  }
}

TEST(SchedulerTest, RandomWorkloadTightBlocksPreemptsAndDrains) {
  for (uint32_t seed = 0; seed < 5; ++seed) {
    const SchedulerCounters c = random_workload(100 + seed, 14, 16, 8);
    EXPECT_GT(c.preemptions, 0u);
    EXPECT_EQ(c.failed, 0u);  // the longest sequence (53 tokens) fits the pool alone
  }
}

}  // namespace
}  // namespace cleave

namespace cleave {
namespace {

TEST(SchedulerTest, PrefilledSequenceRunsFromItsFirstToken) {
  auto pool = make_pool(16);
  Scheduler s(*pool, opts(64, 1));
  std::vector<BlockId> blocks;
  ASSERT_TRUE(pool->allocate(3, blocks).ok());  // a prompt of 10 tokens: positions 0..9
  EXPECT_EQ(s.add_prefilled(1, iota_tokens(10), 99, {blocks[0]}).code(),
            StatusCode::kInvalidArgument);  // one block cannot hold 10 tokens
  EXPECT_EQ(s.add_prefilled(1, {}, 99, blocks).code(), StatusCode::kInvalidArgument);
  ASSERT_TRUE(s.add_prefilled(1, iota_tokens(10), 99, blocks).ok());
  EXPECT_EQ(s.add_prefilled(1, iota_tokens(10), 99, blocks).code(), StatusCode::kAlreadyExists);
  // max_num_seqs is 1: a second waits for a slot.
  std::vector<BlockId> more;
  ASSERT_TRUE(pool->allocate(1, more).ok());
  EXPECT_EQ(s.add_prefilled(2, iota_tokens(3), 5, more).code(), StatusCode::kUnavailable);
  pool->release(more);

  const Sequence* seq = s.find(1);
  ASSERT_NE(seq, nullptr);
  EXPECT_EQ(seq->state, SequenceState::kRunning);
  EXPECT_EQ(seq->num_computed_tokens, 10);
  EXPECT_EQ(seq->tokens.back(), 99);
  EXPECT_EQ(seq->num_generated(), 1);
  // Full prompt blocks (two of 4 tokens) entered the prefix cache.
  const auto keys = hash_full_blocks(iota_tokens(10), 4);
  ASSERT_EQ(keys.size(), 2u);
  EXPECT_EQ(pool->lookup(keys[0]), blocks[0]);
  EXPECT_EQ(pool->lookup(keys[1]), blocks[1]);

  StepPlan plan;
  s.schedule(plan);
  ASSERT_EQ(plan.chunks.size(), 1u);
  EXPECT_EQ(plan.chunks[0].start_pos, 10);
  EXPECT_EQ(plan.chunks[0].num_tokens, 1);
  EXPECT_TRUE(plan.chunks[0].samples);
  run_step(s, plan);
  EXPECT_EQ(s.find(1)->num_computed_tokens, 11);
  EXPECT_TRUE(s.finish(1));
  EXPECT_EQ(pool->used_blocks(), 0);
}

}  // namespace
}  // namespace cleave
