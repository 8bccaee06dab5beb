// The router's request front: what the HTTP frontend (http_server.h), and later the gRPC one,
// do between a parsed OpenAI request and the dispatcher (DESIGN.md §1 step 1).
//
// RouterFrontend owns the served model's tokenizer and chat template and uses a Dispatcher it
// does not own. prepare_completion / prepare_chat turn a request body into the dispatches of
// one response: parse and validate (openai_request.h), check the model name (404), render the
// chat template (a template's own raise_exception, or any other template failure: 400 with its
// message), tokenize, resolve each prompt's sampling parameters (400 context_length_exceeded,
// the default max_tokens) and give every request a seed (the client's, else a random one; the
// choices of n > 1 get choice_seed(seed, i)). One DispatchRequest per choice, in choice order:
// choice index = prompt index * n + i.
//
// Tokenization: completions text prompts get the tokenizer's BOS rule (add_bos) and special
// token text is recognised, as vLLM does (add_special_tokens=True); token id prompts are used
// as given. Chat prompts are the rendered template tokenized with special token text
// recognised and no BOS added (the template writes it: add_special_tokens=False, as
// transformers and vLLM do), except with the plain fallback template, whose text carries no
// BOS, where the tokenizer's BOS rule applies.
//
// Metrics: the frontend registers the router's request metrics in the registry it is given
// (RouterMetrics, vLLM's names with the cleave: prefix); render_metrics() refreshes the pool
// gauges from Dispatcher::pools() and renders the whole registry (the dispatcher's families
// too when it shares the registry).
//
// Thread-safety: after create(), every const method may be called from any number of threads.
#pragma once

#include <chrono>
#include <cstdint>
#include <memory>
#include <string>
#include <string_view>
#include <vector>

#include "cleave/common/metrics.h"
#include "cleave/common/status.h"
#include "cleave/model/chat_template.h"
#include "cleave/model/tokenizer.h"
#include "cleave/router/dispatcher.h"
#include "cleave/router/openai_error.h"
#include "cleave/router/openai_request.h"

namespace cleave::router {

struct FrontendOptions {
  // Names the model is served under; the first is the default (a request without "model")
  // and the one responses carry. At least one.
  std::vector<std::string> served_model_names;
  // Positions of the model's context. 0: the dispatcher's model_info().max_context; when the
  // dispatcher reports one, the smaller of the two applies.
  int64_t max_model_len = 0;
  // Request parsing limits; vocab_size is set from the tokenizer.
  openai::RequestLimits limits;
};

// One response's worth of dispatches and what the response needs to be written.
struct PreparedRequest {
  openai::Endpoint endpoint = openai::Endpoint::kCompletions;
  std::string id;       // "cmpl-…" / "chatcmpl-…"
  int64_t created = 0;  // Unix seconds
  std::string model;    // the served name the response reports
  bool stream = false;
  bool include_usage = false;  // stream_options.include_usage
  bool logprobs = false;       // every choice carries a "logprobs" object
  bool echo = false;           // completions: each choice's text starts with its prompt's text
  bool echo_only = false;      // completions with max_tokens 0: the prompt alone (the one token
                               // the workers generate is left out)
  int32_t n = 1;               // choices per prompt
  std::vector<std::string> prompt_texts;   // per prompt: the text echo repeats
  std::vector<int64_t> prompt_tokens;      // per prompt: its token count
  std::vector<int32_t> prompt_first_ids;   // per prompt: its first token (echo with logprobs)
  std::vector<DispatchRequest> dispatches;  // per choice, in choice order
};

struct RouterMetrics;

class RouterFrontend {
 public:
  // `dispatcher` and `registry` must outlive the frontend. InvalidArgument for no served model
  // name; the registry's error when a metric family clashes with one registered differently.
  static Result<std::unique_ptr<RouterFrontend>> create(
      FrontendOptions options, std::shared_ptr<const Tokenizer> tokenizer, ChatTemplate chat_template,
      Dispatcher& dispatcher, metrics::MetricsRegistry& registry);

  // The tokenizer and chat template of the model file at `path` (GGUF or Hugging Face
  // directory; the weights are mapped, not read). No served name in `options`: the model's
  // name (general.name), else the file name. max_model_len 0: the model's context length.
  static Result<std::unique_ptr<RouterFrontend>> create_from_model_file(
      const std::string& path, FrontendOptions options, Dispatcher& dispatcher,
      metrics::MetricsRegistry& registry);

  ~RouterFrontend();
  RouterFrontend(const RouterFrontend&) = delete;
  RouterFrontend& operator=(const RouterFrontend&) = delete;

  openai::ApiResult<PreparedRequest> prepare_completion(std::string_view body) const;
  openai::ApiResult<PreparedRequest> prepare_chat(std::string_view body) const;

  // GET /v1/models and GET /v1/models/{name} (404 model_not_found for another name).
  std::string models_json() const;
  openai::ApiResult<std::string> model_json(std::string_view name) const;

  // Prometheus text of the registry, with the pool gauges refreshed first.
  std::string render_metrics() const;

  // The context length requests are checked against now.
  int64_t max_model_len() const;
  const std::string& model_name() const { return options_.served_model_names.front(); }
  const std::vector<std::string>& served_model_names() const {
    return options_.served_model_names;
  }
  int64_t created() const { return created_; }  // served since (Unix seconds)
  const Tokenizer& tokenizer() const { return *tokenizer_; }
  Dispatcher& dispatcher() const { return dispatcher_; }
  RouterMetrics& metrics() const { return *metrics_; }

 private:
  RouterFrontend(FrontendOptions options, std::shared_ptr<const Tokenizer> tokenizer,
                 ChatTemplate chat_template, bool fallback_template, Dispatcher& dispatcher,
                 std::unique_ptr<RouterMetrics> metrics);

  // 404 unless `model` is empty or one of the served names.
  std::optional<openai::ApiError> check_model(const std::string& model) const;
  // The dispatches of one prompt (n choices) appended to `out`.
  std::optional<openai::ApiError> add_prompt(openai::Endpoint endpoint,
                                             const openai::SamplingFields& sampling, int32_t n,
                                             std::vector<int32_t> tokens, std::string text,
                                             int64_t max_len, uint64_t default_seed,
                                             PreparedRequest* out) const;

  FrontendOptions options_;
  std::shared_ptr<const Tokenizer> tokenizer_;
  ChatTemplate template_;
  bool fallback_template_;  // the model has none: the plain fallback renders
  std::string bos_text_, eos_text_;
  Dispatcher& dispatcher_;
  std::unique_ptr<RouterMetrics> metrics_;
  int64_t created_;  // served since (Unix seconds), for the model list
};

}  // namespace cleave::router
