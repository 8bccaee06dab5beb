// Request preparation: model name, chat template, tokenization, sampling parameters, seeds.
#include "cleave/router/router_frontend.h"

#include <algorithm>
#include <ctime>
#include <filesystem>

#include <fmt/format.h>

#include "cleave/model/model_file.h"
#include "cleave/router/openai_response.h"
#include "frontend/router_metrics.h"

namespace cleave::router {
namespace {

using openai::ApiError;
using openai::ApiResult;
using openai::Endpoint;

bool is_py_space(char c) {
  return c == ' ' || c == '\t' || c == '\n' || c == '\r' || c == '\v' || c == '\f';
}
std::string_view lstrip(std::string_view s) {
  while (!s.empty() && is_py_space(s.front())) s.remove_prefix(1);
  return s;
}
std::string_view strip(std::string_view s) {
  s = lstrip(s);
  while (!s.empty() && is_py_space(s.back())) s.remove_suffix(1);
  return s;
}

// transformers' continue_final_message: the rendered chat is cut right after the final
// message's content, so that generation continues it instead of starting a new turn.
ApiResult<std::string> cut_after_final_message(std::string rendered, std::string_view final_msg) {
  const std::string_view stripped = strip(final_msg);
  const size_t at = rendered.rfind(stripped);
  if (at == std::string::npos) {
    return openai::invalid_request(
        "continue_final_message is set but the final message does not appear in the chat after "
        "applying the chat template! This can happen if the chat template deletes portions of "
        "the final message. Please verify the chat template and final message in your chat to "
        "ensure they are compatible.",
        "continue_final_message");
  }
  const std::string_view left = lstrip(final_msg);
  const bool spacing_kept = std::string_view(rendered).substr(at, left.size()) == final_msg;
  rendered.resize(at + (spacing_kept ? left.size() : stripped.size()));
  return rendered;
}

std::string token_text(const TokenizerSpec& spec, int32_t id) {
  if (id < 0 || static_cast<size_t>(id) >= spec.tokens.size()) return {};
  return spec.tokens[static_cast<size_t>(id)];
}

}  // namespace

RouterFrontend::RouterFrontend(FrontendOptions options, std::shared_ptr<const Tokenizer> tokenizer,
                               ChatTemplate chat_template, bool fallback_template,
                               Dispatcher& dispatcher, std::unique_ptr<RouterMetrics> metrics)
    : options_(std::move(options)),
      tokenizer_(std::move(tokenizer)),
      template_(std::move(chat_template)),
      fallback_template_(fallback_template),
      bos_text_(token_text(tokenizer_->spec(), tokenizer_->bos_id())),
      eos_text_(token_text(tokenizer_->spec(), tokenizer_->eos_id())),
      dispatcher_(dispatcher),
      metrics_(std::move(metrics)),
      created_(static_cast<int64_t>(std::time(nullptr))) {
  options_.limits.vocab_size = tokenizer_->vocab_size();
}

RouterFrontend::~RouterFrontend() = default;

Result<std::unique_ptr<RouterFrontend>> RouterFrontend::create(
    FrontendOptions options, std::shared_ptr<const Tokenizer> tokenizer, ChatTemplate chat_template,
    Dispatcher& dispatcher, metrics::MetricsRegistry& registry) {
  if (options.served_model_names.empty() || options.served_model_names.front().empty()) {
    return InvalidArgument("the router needs a served model name");
  }
  if (!tokenizer) return InvalidArgument("the router needs the model's tokenizer");
  if (options.max_model_len < 0) {
    return InvalidArgument(fmt::format("max_model_len {} is negative", options.max_model_len));
  }
  CLEAVE_ASSIGN_OR_RETURN(auto metrics, RouterMetrics::create(registry));
  const bool fallback = chat_template.source() == kFallbackChatTemplate;
  return std::unique_ptr<RouterFrontend>(new RouterFrontend(std::move(options), std::move(tokenizer),
                                                            std::move(chat_template), fallback,
                                                            dispatcher, std::move(metrics)));
}

Result<std::unique_ptr<RouterFrontend>> RouterFrontend::create_from_model_file(
    const std::string& path, FrontendOptions options, Dispatcher& dispatcher,
    metrics::MetricsRegistry& registry) {
  CLEAVE_ASSIGN_OR_RETURN(auto file, load_model(path));
  CLEAVE_ASSIGN_OR_RETURN(auto tokenizer, Tokenizer::create(file->tokenizer()));
  auto chat_template = chat_template_or_fallback(file->tokenizer().chat_template);
  if (!chat_template.ok()) {
    return chat_template.status().with_context(fmt::format("the chat template of {}", path));
  }
  if (options.served_model_names.empty()) {
    std::string name = file->config().name;
    if (name.empty()) name = std::filesystem::path(path).filename().string();
    options.served_model_names.push_back(std::move(name));
  }
  if (options.max_model_len == 0) options.max_model_len = file->config().context_length;
  return create(std::move(options), std::shared_ptr<const Tokenizer>(std::move(tokenizer)),
                std::move(*chat_template), dispatcher, registry);
}

int64_t RouterFrontend::max_model_len() const {
  int64_t len = options_.max_model_len;
  const int64_t reported = dispatcher_.model_info().max_context();
  if (reported > 0) len = len > 0 ? std::min(len, reported) : reported;
  return len;
}

std::optional<ApiError> RouterFrontend::check_model(const std::string& model) const {
  if (model.empty()) return std::nullopt;
  const auto& names = options_.served_model_names;
  if (std::find(names.begin(), names.end(), model) != names.end()) return std::nullopt;
  return openai::model_not_found(model);
}

std::optional<ApiError> RouterFrontend::add_prompt(Endpoint endpoint,
                                                   const openai::SamplingFields& sampling,
                                                   int32_t n, std::vector<int32_t> tokens,
                                                   std::string text, int64_t max_len,
                                                   uint64_t default_seed,
                                                   PreparedRequest* out) const {
  const bool chat = endpoint == Endpoint::kChatCompletions;
  if (tokens.empty()) {
    return openai::invalid_request(chat ? "The messages render to an empty prompt."
                                        : "The prompt is empty.",
                                   chat ? "messages" : "prompt");
  }
  auto params = openai::resolve_sampling_params(sampling, endpoint,
                                                static_cast<int64_t>(tokens.size()), max_len,
                                                tokenizer_->vocab_size(), default_seed);
  if (!params.ok()) return params.error();
  out->prompt_tokens.push_back(static_cast<int64_t>(tokens.size()));
  out->prompt_first_ids.push_back(tokens.front());
  out->prompt_texts.push_back(std::move(text));
  for (int32_t i = 0; i < n; ++i) {
    DispatchRequest d;
    d.params = *params;
    d.params.seed = openai::choice_seed(params->seed, i);
    d.prompt = i + 1 < n ? tokens : std::move(tokens);
    out->dispatches.push_back(std::move(d));
  }
  return std::nullopt;
}

ApiResult<PreparedRequest> RouterFrontend::prepare_completion(std::string_view body) const {
  auto req = openai::parse_completion_request(body, options_.limits);
  if (!req.ok()) return req.error();
  if (auto err = check_model(req->model)) return *err;
  const int64_t max_len = max_model_len();
  if (max_len <= 0) return openai::no_worker_available("the model's context length is not known yet");

  PreparedRequest p;
  p.endpoint = Endpoint::kCompletions;
  p.id = openai::random_request_id("cmpl-");
  p.created = static_cast<int64_t>(std::time(nullptr));
  p.model = model_name();
  p.stream = req->stream;
  p.include_usage = req->stream_options.include_usage;
  p.logprobs = req->sampling.params.logprobs >= 0;
  p.echo = req->echo;
  p.echo_only = req->echo_only;
  p.n = req->n;
  // max_tokens 0: the workers generate one token, which the response leaves out (as vLLM).
  if (req->echo_only) req->sampling.max_tokens = 1;
  p.dispatches.reserve(req->prompts.size() * static_cast<size_t>(req->n));
  const uint64_t default_seed = openai::random_seed();
  const EncodeOptions encode{.add_bos = tokenizer_->spec().add_bos, .parse_special = true};
  for (auto& prompt : req->prompts) {
    std::vector<int32_t> tokens;
    std::string text;
    if (prompt.is_token_ids) {
      tokens = std::move(prompt.token_ids);
      if (p.echo) text = tokenizer_->decode(tokens);
    } else {
      tokens = tokenizer_->encode(prompt.text, encode);
      text = std::move(prompt.text);
    }
    if (auto err = add_prompt(Endpoint::kCompletions, req->sampling, req->n, std::move(tokens),
                              std::move(text), max_len, default_seed, &p)) {
      return std::move(*err);
    }
  }
  return p;
}

ApiResult<PreparedRequest> RouterFrontend::prepare_chat(std::string_view body) const {
  auto req = openai::parse_chat_completion_request(body, options_.limits);
  if (!req.ok()) return req.error();
  if (auto err = check_model(req->model)) return *err;
  const int64_t max_len = max_model_len();
  if (max_len <= 0) return openai::no_worker_available("the model's context length is not known yet");

  ChatTemplateInputs in;
  for (const auto& m : req->messages) {
    nlohmann::ordered_json msg = nlohmann::ordered_json::object();
    msg["role"] = m.role;
    if (m.content) {
      msg["content"] = *m.content;
    } else {
      msg["content"] = nullptr;
    }
    if (!m.name.empty()) msg["name"] = m.name;
    if (!m.tool_call_id.empty()) msg["tool_call_id"] = m.tool_call_id;
    in.messages.push_back(std::move(msg));
  }
  in.add_generation_prompt = req->add_generation_prompt;
  if (tokenizer_->bos_id() >= 0) in.bos_token = bos_text_;
  if (tokenizer_->eos_id() >= 0) in.eos_token = eos_text_;
  if (!req->chat_template_kwargs_json.empty()) {
    in.extra = nlohmann::ordered_json::parse(req->chat_template_kwargs_json, nullptr,
                                             /*allow_exceptions=*/false);
    if (!in.extra.is_object()) {
      return openai::invalid_request("'chat_template_kwargs' must be a JSON object.",
                                     "chat_template_kwargs");
    }
  }
  auto rendered = template_.apply(in);
  if (!rendered.ok()) {
    // The template's own raise_exception("...") gives exactly its message; a template that
    // runs past its limits on this input is the request's fault too.
    return openai::invalid_request(rendered.status().message(), "messages");
  }
  std::string text = std::move(*rendered);
  if (req->continue_final_message) {
    const auto& last = req->messages.back();
    auto cut = cut_after_final_message(std::move(text), last.content.value_or(""));
    if (!cut.ok()) return cut.error();
    text = std::move(*cut);
  }
  const EncodeOptions encode{.add_bos = fallback_template_ && tokenizer_->spec().add_bos,
                             .parse_special = true};
  std::vector<int32_t> tokens = tokenizer_->encode(text, encode);

  PreparedRequest p;
  p.endpoint = Endpoint::kChatCompletions;
  p.id = openai::random_request_id("chatcmpl-");
  p.created = static_cast<int64_t>(std::time(nullptr));
  p.model = model_name();
  p.stream = req->stream;
  p.include_usage = req->stream_options.include_usage;
  p.logprobs = req->sampling.params.logprobs >= 0;
  p.n = req->n;
  p.dispatches.reserve(static_cast<size_t>(req->n));
  if (auto err = add_prompt(Endpoint::kChatCompletions, req->sampling, req->n, std::move(tokens),
                            std::string(), max_len, openai::random_seed(), &p)) {
    return std::move(*err);
  }
  return p;
}

std::string RouterFrontend::models_json() const {
  std::vector<openai::ModelCard> cards;
  const int64_t len = max_model_len();
  for (const auto& name : options_.served_model_names) {
    cards.push_back(openai::ModelCard{.id = name, .created = created_, .owned_by = "cleave",
                                      .max_model_len = len});
  }
  return openai::models_response_json(cards);
}

ApiResult<std::string> RouterFrontend::model_json(std::string_view name) const {
  const auto& names = options_.served_model_names;
  if (std::find(names.begin(), names.end(), name) == names.end()) {
    return openai::model_not_found(name);
  }
  // One card: the list's only element, without the list around it.
  std::string list = openai::models_response_json(std::vector<openai::ModelCard>{
      {.id = std::string(name), .created = created_, .owned_by = "cleave",
       .max_model_len = max_model_len()}});
  const size_t begin = list.find('[');
  const size_t end = list.rfind(']');
  return list.substr(begin + 1, end - begin - 1);
}

std::string RouterFrontend::render_metrics() const {
  metrics_->refresh_pools(dispatcher_.pools());
  return metrics_->registry->render();
}

}  // namespace cleave::router
