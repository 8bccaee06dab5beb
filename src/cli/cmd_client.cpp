// `cleave client`: runs one request against running workers, disaggregated (a prefill and a
// decode worker) or on a unified worker, and prints the generated text as it streams (or, with
// --json, one JSON object with the tokens, text, finish reason, usage and timings). The request
// goes through the router's dispatcher (router/run_request.h) over the given addresses, with
// one attempt: a worker's error is reported, not retried elsewhere.
// The workers own the model: a text prompt is tokenized here only with --model (the same model
// file, for its tokenizer); otherwise the prompt is given as token ids.
#include <chrono>
#include <cstdio>
#include <memory>
#include <optional>
#include <random>
#include <string>
#include <vector>

#include "cleave/common/log.h"
#include "cleave/router/dispatch_options.h"
#include "cleave/router/run_request.h"
#include "cleave/model/model_file.h"
#include "cleave/model/tokenizer.h"
#include "commands.h"
#include "fmt/format.h"
#include "nlohmann/json.hpp"

namespace cleave::cli {
namespace {

struct ClientFlags {
  std::string unified;
  std::string prefill;
  std::string decode;
  std::optional<std::string> prompt;
  std::vector<int32_t> prompt_tokens;
  std::string model;
  int32_t max_tokens = 128;
  float temperature = 1.0f;
  int32_t top_k = 0;
  float top_p = 1.0f;
  std::optional<uint64_t> seed;
  bool ignore_eos = false;
  int32_t logprobs = -1;
  std::optional<uint64_t> request_id;
  int64_t lease_ms = 0;
  int64_t timeout_ms = 600000;
  bool json = false;
};

// How long the workers may take to be reachable (and paired), and the deadline of Reserve.
constexpr std::chrono::milliseconds kConnectTimeout{5000};
constexpr std::chrono::milliseconds kUnaryTimeout{10000};

uint64_t random_u64() {
  std::random_device rd;
  return (static_cast<uint64_t>(rd()) << 32) ^ rd();
}

// The prompt's token ids: --prompt-tokens as given, or --prompt encoded with --model's
// tokenizer (BOS as the model wants it; an empty prompt is BOS alone, as `generate` does).
Result<std::vector<int32_t>> prompt_ids(const ClientFlags& f) {
  if (!f.prompt) {
    if (f.prompt_tokens.empty()) return InvalidArgument("--prompt-tokens is empty");
    return f.prompt_tokens;
  }
  CLEAVE_ASSIGN_OR_RETURN(std::unique_ptr<ModelFile> file, load_model(f.model));
  CLEAVE_ASSIGN_OR_RETURN(std::unique_ptr<Tokenizer> tok, Tokenizer::create(file->tokenizer()));
  if (f.prompt->empty()) {
    if (tok->bos_id() < 0) {
      return InvalidArgument(fmt::format(
          "the prompt is empty and the model '{}' has no BOS token to start from", f.model));
    }
    return std::vector<int32_t>{tok->bos_id()};
  }
  std::vector<int32_t> ids = tok->encode(
      *f.prompt, EncodeOptions{.add_bos = tok->spec().add_bos, .parse_special = true});
  if (ids.empty()) return InvalidArgument("the prompt encodes to no tokens");
  return ids;
}

nlohmann::json usage_json(const v1::Usage& u) {
  return {{"prompt_tokens", u.prompt_tokens()},
          {"completion_tokens", u.completion_tokens()},
          {"cached_prompt_tokens", u.cached_prompt_tokens()}};
}

// The dispatcher over the given workers: one pool per role, one attempt per request. Its
// deadlines are --timeout-ms for the prefill, the first token and each later token.
Result<std::unique_ptr<router::Dispatcher>> client_dispatcher(const ClientFlags& f) {
  router::DispatcherOptions o;
  if (!f.unified.empty()) {
    o.mode = router::DispatchMode::kUnified;
    o.unified.workers = {f.unified};
    o.unified.policy = router::DispatchPolicyKind::kRoundRobin;
  } else {
    o.mode = router::DispatchMode::kDisaggregated;
    o.prefill.workers = {f.prefill};
    o.prefill.policy = router::DispatchPolicyKind::kRoundRobin;
    o.decode.workers = {f.decode};
    o.decode.policy = router::DispatchPolicyKind::kRoundRobin;
  }
  o.max_attempts = 1;
  o.lease = std::chrono::milliseconds(f.lease_ms);
  o.timeouts.reserve = kUnaryTimeout;
  o.timeouts.prefill = std::chrono::milliseconds(f.timeout_ms);
  o.timeouts.first_token = std::chrono::milliseconds(f.timeout_ms);
  o.timeouts.stream_idle = std::chrono::milliseconds(f.timeout_ms);
  return router::make_dispatcher(o);
}

Status run_client(const ClientFlags& f) {
  CLEAVE_ASSIGN_OR_RETURN(std::vector<int32_t> prompt, prompt_ids(f));

  const bool unified = !f.unified.empty();
  CLEAVE_ASSIGN_OR_RETURN(std::unique_ptr<router::Dispatcher> dispatcher, client_dispatcher(f));
  // Every worker answered its probe and, disaggregated, the pair was accepted (pairing check).
  CLEAVE_RETURN_IF_ERROR(router::wait_until_ready(*dispatcher, kConnectTimeout));

  router::DispatchRequest req;
  req.request_id = f.request_id ? *f.request_id : random_u64();
  req.prompt = std::move(prompt);
  req.params.max_tokens = f.max_tokens;
  req.params.temperature = f.temperature;
  req.params.top_k = f.top_k;
  req.params.top_p = f.top_p;
  req.params.ignore_eos = f.ignore_eos;
  req.params.logprobs = f.logprobs;
  req.params.seed = f.seed ? *f.seed : random_u64();
  if (!f.seed) log::info("seed {}", req.params.seed);

  nlohmann::json tokens = nlohmann::json::array();
  nlohmann::json logprobs = nlohmann::json::array();
  std::string text;
  auto on_event = [&](const v1::TokenEvent& ev) {
    if (f.json) {
      if (ev.has_token()) {
        tokens.push_back(ev.token());
        if (f.logprobs >= 0) {
          nlohmann::json top = nlohmann::json::array();
          for (const auto& t : ev.top_logprobs()) top.push_back({{"token", t.token()}, {"logprob", t.logprob()}});
          logprobs.push_back({{"token", ev.token()}, {"logprob", ev.logprob()}, {"top", top}});
        }
      }
      text += ev.text();
    } else if (!ev.text().empty()) {
      std::fwrite(ev.text().data(), 1, ev.text().size(), stdout);
      std::fflush(stdout);
    }
    return true;
  };
  CLEAVE_ASSIGN_OR_RETURN(router::RequestOutcome out,
                          router::run_request(*dispatcher, req, on_event));
  log::info("request {}: {} events, ttft {:.4f} s, total {:.4f} s, kv tail {:.6f} s, {} KV bytes",
            *req.request_id, out.events, out.ttft_seconds, out.total_seconds, out.kv_tail_seconds,
            out.kv_bytes);
  if (f.json) {
    nlohmann::json j = {
        {"request_id", *req.request_id},
        {"mode", unified ? "unified" : "disaggregated"},
        {"prompt_token_ids", req.prompt},
        {"tokens", tokens},
        {"text", text},
        {"finish_reason", out.last.finish_reason()},
        {"stop_string", out.last.stop_string()},
        {"usage", usage_json(out.last.usage())},
        {"seed", req.params.seed},
        {"ttft_seconds", out.ttft_seconds},
        {"total_seconds", out.total_seconds},
        {"handed_off", out.handed_off},
        {"kv_tail_seconds", out.kv_tail_seconds},
        {"kv_bytes", out.kv_bytes},
    };
    if (f.logprobs >= 0) j["logprobs"] = logprobs;
    // Invalid UTF-8 (a token cut inside a character) is replaced rather than thrown on.
    std::string s = j.dump(2, ' ', false, nlohmann::json::error_handler_t::replace);
    s.push_back('\n');
    std::fwrite(s.data(), 1, s.size(), stdout);
  }
  return Status::Ok();
}

}  // namespace

void add_client_command(CLI::App& app, int* exit_code) {
  auto f = std::make_shared<ClientFlags>();
  CLI::App* cmd = app.add_subcommand(
      "client", "Run one request on running workers (prefill + decode, or unified)");
  auto* unified = cmd->add_option("--unified", f->unified, "a unified worker's HOST:PORT");
  auto* prefill = cmd->add_option("--prefill", f->prefill, "a prefill worker's HOST:PORT");
  auto* decode = cmd->add_option("--decode", f->decode, "a decode worker's HOST:PORT");
  unified->excludes(prefill)->excludes(decode);
  prefill->needs(decode);
  decode->needs(prefill);
  auto* prompt = cmd->add_option("--prompt", f->prompt,
                                 "prompt text, tokenized with --model's tokenizer (empty: BOS alone)");
  auto* prompt_tokens = cmd->add_option("--prompt-tokens", f->prompt_tokens, "prompt token ids: 1,2,3")
                            ->delimiter(',');
  prompt->excludes(prompt_tokens);
  auto* model = cmd->add_option("--model", f->model,
                                "the workers' model file (GGUF or HF directory), for its tokenizer");
  prompt->needs(model);
  cmd->add_option("--max-tokens", f->max_tokens, "most tokens to generate")
      ->check(CLI::Range(1, 1 << 30))->capture_default_str();
  cmd->add_option("--temperature", f->temperature, "sampling temperature (0: greedy)")
      ->check(CLI::Range(0.0f, 100.0f))->capture_default_str();
  cmd->add_option("--top-k", f->top_k, "keep the K most likely tokens (0: off)")
      ->check(CLI::Range(0, 1 << 30))->capture_default_str();
  cmd->add_option("--top-p", f->top_p, "nucleus sampling mass (1: off)")
      ->check(CLI::Range(0.0f, 1.0f))->capture_default_str();
  cmd->add_option("--seed", f->seed, "sampling seed (default: random, logged)");
  cmd->add_flag("--ignore-eos", f->ignore_eos, "keep generating past end-of-generation tokens");
  cmd->add_option("--logprobs", f->logprobs, "with --json: each token's logprob and the top N (-1: off)")
      ->check(CLI::Range(-1, 20))->capture_default_str();
  cmd->add_option("--request-id", f->request_id, "request id (default: random)");
  cmd->add_option("--lease-ms", f->lease_ms, "decode reservation lease (0: the worker's default)")
      ->check(CLI::Range(int64_t{0}, int64_t{3600000}))->capture_default_str();
  cmd->add_option("--timeout-ms", f->timeout_ms,
                  "deadline of the prefill, of the first token and of each next one")
      ->check(CLI::Range(int64_t{1}, int64_t{86400000}))->capture_default_str();
  cmd->add_flag("--json", f->json, "print one JSON object (tokens, text, usage, timings)");
  cmd->callback([f, prompt, prompt_tokens, exit_code] {
    if (f->unified.empty() && f->prefill.empty()) {
      std::fprintf(stderr, "cleave client: give --unified HOST:PORT or --prefill HOST:PORT "
                           "--decode HOST:PORT\n");
      *exit_code = 2;
      return;
    }
    if (prompt->count() == 0 && prompt_tokens->count() == 0) {
      std::fprintf(stderr, "cleave client: give --prompt TEXT (with --model) or --prompt-tokens "
                           "1,2,3\n");
      *exit_code = 2;
      return;
    }
    Status st = run_client(*f);
    if (!st.ok()) {
      std::fflush(stdout);
      std::fprintf(stderr, "cleave client: %s\n", st.to_string().c_str());
      *exit_code = st.code() == StatusCode::kInvalidArgument ? 2 : 1;
    }
  });
}

}  // namespace cleave::cli
