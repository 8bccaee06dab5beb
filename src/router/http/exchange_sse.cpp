// The HTTP API's stream: SSE chunks (openai_stream.h) into a pending buffer.
#include <span>

#include "cleave/router/openai_stream.h"
#include "frontend/exchange.h"

namespace cleave::router {
namespace {

class SseStream final : public ExchangeStream {
 public:
  explicit SseStream(const PreparedRequest& r)
      : encoder_(r.endpoint, r.id, r.created, r.model, static_cast<int32_t>(r.dispatches.size()),
                 r.logprobs),
        include_usage_(r.include_usage) {
    pending_.reserve(4096);
  }

  void chunk(int32_t index, std::string_view text, int32_t /*token*/,
             const openai::LogprobToken* logprob, std::optional<FinishReason> finish) override {
    // A token whose text is held back (incomplete UTF-8) makes no chunk unless it brings a
    // logprob or the finish.
    if (text.empty() && !finish && logprob == nullptr) return;
    std::span<const openai::LogprobToken> lp;
    if (logprob != nullptr) lp = std::span<const openai::LogprobToken>(logprob, 1);
    encoder_.append_chunk(pending_, index, text, lp, finish);
  }

  void complete(const openai::Usage& usage) override {
    if (include_usage_) encoder_.append_usage(pending_, usage);
    pending_ += openai::kSseDone;
  }

  void fail(const openai::ApiError& error) override {
    openai::append_sse_error(pending_, error);
    pending_ += openai::kSseDone;
  }

  void discard() override { pending_.clear(); }

  void take(ExchangeOutput& out) override { out.bytes.swap(pending_); }

 private:
  openai::StreamEncoder encoder_;
  const bool include_usage_;
  std::string pending_;  // SSE bytes not yet taken
};

}  // namespace

std::unique_ptr<ExchangeStream> make_sse_stream(const PreparedRequest& request) {
  return std::make_unique<SseStream>(request);
}

}  // namespace cleave::router
