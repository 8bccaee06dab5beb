// The gRPC API's stream: deltas into a pending GenerateTextResponse (inference.proto). Consecutive
// chunks of one choice merge into one delta while the reactor has not taken the message, so a
// client reading slower than tokens arrive gets fewer, larger messages.
#include "cleave/router/json_writer.h"
#include "frontend/exchange.h"

namespace cleave::router {
namespace {

class GrpcStream final : public ExchangeStream {
 public:
  explicit GrpcStream(const PreparedRequest& r) : id_(r.id), created_(r.created) {
    openai::append_utf8_replacing(model_, r.model);
  }

  void chunk(int32_t index, std::string_view text, int32_t token,
             const openai::LogprobToken* logprob, std::optional<FinishReason> finish) override {
    v1::ChoiceDelta* d = delta_for(index);
    // Protobuf strings must be valid UTF-8 (a serialization that fails would end the call).
    if (!text.empty()) openai::append_utf8_replacing(*d->mutable_text(), text);
    if (token >= 0) d->add_token_ids(token);
    if (logprob != nullptr) {
      v1::TokenLogprob* lp = d->add_logprobs();
      lp->set_token(logprob->token);
      lp->set_logprob(logprob->logprob);
      for (const auto& alt : logprob->top) {
        v1::LogprobAlternative* t = lp->add_top_logprobs();
        t->set_token(alt.token);
        t->set_logprob(alt.logprob);
      }
    }
    if (finish) d->set_finish_reason(std::string(openai::finish_reason_text(*finish)));
  }

  void complete(const openai::Usage& usage) override {
    begin_message();
    v1::CompletionUsage* u = pending_.mutable_usage();
    u->set_prompt_tokens(usage.prompt_tokens);
    u->set_completion_tokens(usage.completion_tokens);
    u->set_total_tokens(usage.prompt_tokens + usage.completion_tokens);
    u->set_cached_tokens(usage.cached_tokens);
  }

  // The status that ends the call carries the error.
  void fail(const openai::ApiError& /*error*/) override {}

  void discard() override {
    pending_.Clear();
    has_ = false;
  }

  void take(ExchangeOutput& out) override {
    out.message.Clear();
    out.message.Swap(&pending_);
    out.has_message = has_;
    has_ = false;
  }

 private:
  void begin_message() {
    if (has_) return;
    has_ = true;
    pending_.set_id(id_);
    pending_.set_created(created_);
    pending_.set_model(model_);
  }

  // The delta a chunk of choice `index` goes into: the message's last one when it is that
  // choice's and not finished, else a new one.
  v1::ChoiceDelta* delta_for(int32_t index) {
    begin_message();
    const int n = pending_.choices_size();
    if (n > 0) {
      v1::ChoiceDelta* last = pending_.mutable_choices(n - 1);
      if (last->index() == index && last->finish_reason().empty()) return last;
    }
    v1::ChoiceDelta* d = pending_.add_choices();
    d->set_index(index);
    return d;
  }

  const std::string id_;
  std::string model_;
  const int64_t created_;
  v1::GenerateTextResponse pending_;
  bool has_ = false;
};

}  // namespace

std::unique_ptr<ExchangeStream> make_grpc_stream(const PreparedRequest& request) {
  return std::make_unique<GrpcStream>(request);
}

}  // namespace cleave::router
