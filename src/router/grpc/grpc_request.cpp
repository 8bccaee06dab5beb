// GenerateTextRequest -> OpenAI request body, and ApiError -> gRPC status.
#include "grpc/grpc_request.h"

#include <fmt/format.h>
#include <nlohmann/json.hpp>

namespace cleave::router {
namespace {

using json = nlohmann::ordered_json;

// The fields both endpoints share.
void add_sampling_fields(const v1::GenerateTextRequest& r, json& body) {
  if (!r.model().empty()) body["model"] = r.model();
  if (r.has_max_tokens()) body["max_tokens"] = r.max_tokens();
  if (r.has_temperature()) body["temperature"] = r.temperature();
  if (r.has_top_p()) body["top_p"] = r.top_p();
  if (r.has_top_k()) body["top_k"] = r.top_k();
  if (r.has_min_p()) body["min_p"] = r.min_p();
  if (r.has_seed()) body["seed"] = r.seed();
  if (r.stop_size() > 0) {
    json stop = json::array();
    for (const auto& s : r.stop()) stop.push_back(s);
    body["stop"] = std::move(stop);
  }
  if (r.stop_token_ids_size() > 0) {
    json ids = json::array();
    for (int32_t id : r.stop_token_ids()) ids.push_back(id);
    body["stop_token_ids"] = std::move(ids);
  }
  if (r.has_presence_penalty()) body["presence_penalty"] = r.presence_penalty();
  if (r.has_frequency_penalty()) body["frequency_penalty"] = r.frequency_penalty();
  if (r.has_repetition_penalty()) body["repetition_penalty"] = r.repetition_penalty();
  if (r.has_n()) body["n"] = r.n();
  if (r.ignore_eos()) body["ignore_eos"] = true;
  if (r.has_min_tokens()) body["min_tokens"] = r.min_tokens();
  if (!r.user().empty()) body["user"] = r.user();
}

openai::ApiResult<json> completions_body(const v1::GenerateTextRequest& r) {
  json body = json::object();
  json prompts = json::array();
  for (int i = 0; i < r.prompts_size(); ++i) {
    const v1::Prompt& p = r.prompts(i);
    if (p.kind_case() == v1::Prompt::kText) {
      prompts.push_back(p.text());
    } else if (p.kind_case() == v1::Prompt::kTokenIds) {
      json ids = json::array();
      for (int32_t id : p.token_ids().ids()) ids.push_back(id);
      prompts.push_back(std::move(ids));
    } else {
      return openai::invalid_request(
          fmt::format("prompts[{}] has neither text nor token_ids.", i), "prompts");
    }
  }
  body["prompt"] = std::move(prompts);
  add_sampling_fields(r, body);
  if (r.logprobs()) {
    body["logprobs"] = r.has_top_logprobs() ? r.top_logprobs() : 0;
  } else if (r.has_top_logprobs()) {
    return openai::invalid_request("'top_logprobs' requires 'logprobs' to be true.",
                                   "top_logprobs");
  }
  if (r.echo()) body["echo"] = true;
  if (r.has_add_generation_prompt() || r.continue_final_message() ||
      !r.chat_template_kwargs_json().empty()) {
    return openai::invalid_request(
        "add_generation_prompt, continue_final_message and chat_template_kwargs_json apply to "
        "messages, not to prompts.",
        "prompts");
  }
  return body;
}

openai::ApiResult<json> chat_body(const v1::GenerateTextRequest& r) {
  json body = json::object();
  json messages = json::array();
  for (const v1::ChatMessage& m : r.messages()) {
    json msg = json::object();
    msg["role"] = m.role();
    if (m.has_content()) {
      msg["content"] = m.content();
    } else {
      msg["content"] = nullptr;
    }
    if (!m.name().empty()) msg["name"] = m.name();
    if (!m.tool_call_id().empty()) msg["tool_call_id"] = m.tool_call_id();
    messages.push_back(std::move(msg));
  }
  body["messages"] = std::move(messages);
  add_sampling_fields(r, body);
  if (r.logprobs()) body["logprobs"] = true;
  if (r.has_top_logprobs()) body["top_logprobs"] = r.top_logprobs();
  if (r.echo()) {
    return openai::invalid_request("echo applies to prompts, not to messages.", "echo");
  }
  if (r.has_add_generation_prompt()) body["add_generation_prompt"] = r.add_generation_prompt();
  if (r.continue_final_message()) body["continue_final_message"] = true;
  if (!r.chat_template_kwargs_json().empty()) {
    json kwargs = json::parse(r.chat_template_kwargs_json(), nullptr, /*allow_exceptions=*/false);
    if (!kwargs.is_object()) {
      return openai::invalid_request("'chat_template_kwargs_json' must be a JSON object.",
                                     "chat_template_kwargs_json");
    }
    body["chat_template_kwargs"] = std::move(kwargs);
  }
  return body;
}

}  // namespace

openai::ApiResult<std::string> openai_body_of(const v1::GenerateTextRequest& request,
                                              openai::Endpoint* endpoint) {
  const bool prompts = request.prompts_size() > 0;
  const bool messages = request.messages_size() > 0;
  if (prompts == messages) {
    return openai::invalid_request(
        prompts ? "A GenerateTextRequest holds prompts or messages, not both."
                : "A GenerateTextRequest needs prompts (completions) or messages (chat).",
        "prompts");
  }
  *endpoint = prompts ? openai::Endpoint::kCompletions : openai::Endpoint::kChatCompletions;
  auto body = prompts ? completions_body(request) : chat_body(request);
  if (!body.ok()) return body.error();
  return body->dump();
}

openai::ApiResult<PreparedRequest> prepare_generate(const RouterFrontend& frontend,
                                                    const v1::GenerateTextRequest& request) {
  openai::Endpoint endpoint{};
  auto body = openai_body_of(request, &endpoint);
  if (!body.ok()) return body.error();
  return endpoint == openai::Endpoint::kCompletions ? frontend.prepare_completion(*body)
                                                    : frontend.prepare_chat(*body);
}

grpc::StatusCode grpc_code_of(const openai::ApiError& error) {
  switch (error.http_status) {
    case 400:
    case 413:
    case 422: return grpc::StatusCode::INVALID_ARGUMENT;
    case 401: return grpc::StatusCode::UNAUTHENTICATED;
    case 403: return grpc::StatusCode::PERMISSION_DENIED;
    case 404: return grpc::StatusCode::NOT_FOUND;
    case 429: return grpc::StatusCode::RESOURCE_EXHAUSTED;
    case 503: return grpc::StatusCode::UNAVAILABLE;
    case 504: return grpc::StatusCode::DEADLINE_EXCEEDED;
    default: return grpc::StatusCode::INTERNAL;
  }
}

grpc::Status grpc_status_of(const openai::ApiError& error, grpc::ServerContextBase* context) {
  if (context != nullptr) {
    context->AddTrailingMetadata("cleave-error-type", error.type);
    if (!error.param.empty()) context->AddTrailingMetadata("cleave-error-param", error.param);
    if (!error.code.empty()) context->AddTrailingMetadata("cleave-error-code", error.code);
  }
  return grpc::Status(grpc_code_of(error), error.message);
}

}  // namespace cleave::router
