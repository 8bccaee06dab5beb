// Single-sequence generation loop: prefill, then sample / detokenize / decode one token a step.
#include "cleave/engine/generator.h"

#include <algorithm>
#include <chrono>

#include "cleave/engine/token_finisher.h"
#include "fmt/format.h"

namespace cleave {
namespace {

double seconds_since(std::chrono::steady_clock::time_point t0) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
}

}  // namespace

Generator::Generator(LlamaModel& model, const Tokenizer& tokenizer)
    : model_(model),
      tokenizer_(tokenizer),
      logits_(static_cast<size_t>(model.config().vocab_size), 0.0f) {}

Status Generator::acquire_blocks(int64_t blocks) {
  if (!kv_ || kv_->total_blocks() < blocks) {
    kv_.reset();  // release the old buffer before asking for the larger one
    CLEAVE_ASSIGN_OR_RETURN(kv_, model_.create_kv_pool(kBlockSize, blocks));
  }
  table_.clear();
  return kv_->allocate(blocks, table_);
}

Result<GenerationResult> Generator::generate(std::span<const int32_t> prompt,
                                             const SamplingParams& params,
                                             const TokenCallback& on_token) {
  const int64_t vocab = model_.config().vocab_size;
  const int64_t context = model_.max_context();
  if (prompt.empty()) return InvalidArgument("generate: the prompt has no tokens (add BOS)");
  if (static_cast<int64_t>(prompt.size()) > context) {
    return OutOfRange(fmt::format("generate: the prompt has {} tokens, the context holds {}",
                                  prompt.size(), context));
  }
  CLEAVE_RETURN_IF_ERROR(params.validate(static_cast<int32_t>(vocab)));

  GenerationResult result;
  result.stats.prompt_tokens = static_cast<int64_t>(prompt.size());
  if (params.max_tokens <= 0) return result;

  // Positions run: the prompt, then one per generated token but the last.
  const int64_t positions =
      std::min(context, static_cast<int64_t>(prompt.size()) + int64_t{params.max_tokens});
  CLEAVE_RETURN_IF_ERROR(acquire_blocks((positions + kBlockSize - 1) / kBlockSize));
  struct ReleaseBlocks {
    KvBlockPool& kv;
    std::vector<BlockId>& table;
    ~ReleaseBlocks() {
      kv.release(table);
      table.clear();
    }
  } release_blocks{*kv_, table_};

  const auto t_prefill = std::chrono::steady_clock::now();
  CLEAVE_RETURN_IF_ERROR(model_.forward(prompt, 0, table_, *kv_, logits_));
  result.stats.prefill_seconds = seconds_since(t_prefill);
  const auto t_decode = std::chrono::steady_clock::now();

  const std::vector<int32_t> eos_ids = TokenFinisher::end_of_generation_ids(tokenizer_, vocab);
  TokenFinisher finisher(tokenizer_, params, eos_ids, prompt.back());

  std::vector<int32_t>& generated = result.tokens;
  generated.reserve(static_cast<size_t>(params.max_tokens));
  int64_t pos = static_cast<int64_t>(prompt.size());
  for (;;) {
    GeneratedToken ev;
    ev.sample = sample_token(logits_, params, prompt, generated, static_cast<uint64_t>(pos),
                             finisher.suppressed(static_cast<int64_t>(generated.size())));
    ev.token = ev.sample.token;
    generated.push_back(ev.token);
    if (params.logprobs >= 0) result.logprobs.push_back(ev.sample);

    // pos >= context: no room left to run this token.
    TokenFinisher::Outcome outcome =
        finisher.push(ev.token, static_cast<int64_t>(generated.size()), pos >= context);
    ev.text = std::move(outcome.text);
    const bool ending = outcome.finished;
    if (ending) {
      result.finish_reason = outcome.finish_reason;
      result.stop_string = std::move(outcome.stop_string);
    }
    result.text += ev.text;
    const bool keep_going = on_token ? on_token(ev) : true;
    if (ending) break;
    if (!keep_going) {
      result.finish_reason = FinishReason::kCancelled;
      break;
    }
    const int32_t token = ev.token;
    CLEAVE_RETURN_IF_ERROR(model_.forward(std::span<const int32_t>(&token, 1), pos, table_, *kv_, logits_));
    ++pos;
    ++result.stats.decode_steps;
  }
  result.stats.generated_tokens = static_cast<int64_t>(generated.size());
  result.stats.decode_seconds = seconds_since(t_decode);
  return result;
}

}  // namespace cleave
