// POST /v1/completions bodies: every field, the shared sampling fields, and every 400 with its
// exact param.
#include <string>
#include <vector>

#include <gtest/gtest.h>

#include "cleave/router/openai_request.h"

namespace cleave::openai {
namespace {

CompletionRequest parse_ok(const std::string& body, const RequestLimits& limits = {}) {
  auto r = parse_completion_request(body, limits);
  EXPECT_TRUE(r.ok()) << body << " -> " << (r.ok() ? "" : r.error().message);
  return r.ok() ? std::move(r).value() : CompletionRequest{};
}

ApiError parse_error(const std::string& body, const RequestLimits& limits = {}) {
  auto r = parse_completion_request(body, limits);
  EXPECT_FALSE(r.ok()) << body << " was accepted";
  return r.ok() ? ApiError{} : r.error();
}

// A 400 invalid_request_error with this param whose message contains `text`.
void expect_400(const std::string& body, const std::string& param, const std::string& text = {},
                const RequestLimits& limits = {}) {
  const ApiError e = parse_error(body, limits);
  EXPECT_EQ(e.http_status, 400) << body;
  EXPECT_EQ(e.type, "invalid_request_error") << body;
  EXPECT_EQ(e.param, param) << body << " -> " << e.message;
  EXPECT_NE(e.message.find(text), std::string::npos)
      << body << " -> " << e.message << " (wanted: " << text << ")";
}

std::string with(const std::string& fields) {
  return R"({"model":"m","prompt":"hi")" + (fields.empty() ? "" : "," + fields) + "}";
}

TEST(CompletionRequestTest, MinimalRequestGetsOpenAiDefaults) {
  const CompletionRequest r = parse_ok(R"({"model":"stories","prompt":"Once upon"})");
  EXPECT_EQ(r.model, "stories");
  ASSERT_EQ(r.prompts.size(), 1u);
  EXPECT_FALSE(r.prompts[0].is_token_ids);
  EXPECT_EQ(r.prompts[0].text, "Once upon");
  EXPECT_EQ(r.n, 1);
  EXPECT_FALSE(r.echo);
  EXPECT_FALSE(r.stream);
  EXPECT_FALSE(r.stream_options.include_usage);
  EXPECT_FALSE(r.sampling.max_tokens.has_value());
  EXPECT_FALSE(r.sampling.seed.has_value());
  const SamplingParams& p = r.sampling.params;
  EXPECT_EQ(p.temperature, 1.0f);
  EXPECT_EQ(p.top_p, 1.0f);
  EXPECT_EQ(p.top_k, 0);
  EXPECT_EQ(p.logprobs, -1);
  EXPECT_TRUE(p.stop.empty());
  // The model is optional (the server's default model).
  EXPECT_EQ(parse_ok(R"({"prompt":""})").model, "");
}

TEST(CompletionRequestTest, PromptForms) {
  CompletionRequest r = parse_ok(R"({"prompt":""})");
  ASSERT_EQ(r.prompts.size(), 1u);
  EXPECT_EQ(r.prompts[0].text, "");  // the empty prompt is a valid prompt (BOS only)

  r = parse_ok(R"({"prompt":["a","b c"]})");
  ASSERT_EQ(r.prompts.size(), 2u);
  EXPECT_EQ(r.prompts[1].text, "b c");

  r = parse_ok(R"({"prompt":[1,2,3.0]})");
  ASSERT_EQ(r.prompts.size(), 1u);
  EXPECT_TRUE(r.prompts[0].is_token_ids);
  EXPECT_EQ(r.prompts[0].token_ids, (std::vector<int32_t>{1, 2, 3}));

  r = parse_ok(R"({"prompt":[[5],[6,7]]})");
  ASSERT_EQ(r.prompts.size(), 2u);
  EXPECT_EQ(r.prompts[1].token_ids, (std::vector<int32_t>{6, 7}));
}

TEST(CompletionRequestTest, BadPrompts) {
  expect_400(R"({"model":"m"})", "prompt", "Missing required parameter: 'prompt'.");
  expect_400(R"({"prompt":null})", "prompt", "Missing required parameter");
  expect_400(R"({"prompt":[]})", "prompt", "must not be an empty array");
  expect_400(R"({"prompt":5})", "prompt", "expected a string, an array of strings");
  expect_400(R"({"prompt":{"a":1}})", "prompt", "got an object");
  expect_400(R"({"prompt":["a",1]})", "prompt[1]", "expected a string");
  expect_400(R"({"prompt":[1,"a"]})", "prompt[1]", "token id");
  expect_400(R"({"prompt":[1,2.5]})", "prompt[1]", "token id");
  expect_400(R"({"prompt":[-1]})", "prompt[0]", "-1");
  expect_400(R"({"prompt":[[1],[]]})", "prompt[1]", "must not be empty");
  expect_400(R"({"prompt":[[1],"a"]})", "prompt[1]", "array of token ids");
  expect_400(R"({"prompt":[[1],[2,"x"]]})", "prompt[1][1]", "token id");
  expect_400(R"({"prompt":[true]})", "prompt", "expected a string, an array");
  RequestLimits vocab;
  vocab.vocab_size = 512;
  EXPECT_TRUE(parse_completion_request(R"({"prompt":[0,511]})", vocab).ok());
  expect_400(R"({"prompt":[0,512]})", "prompt[1]", "vocabulary [0, 512)", vocab);
  expect_400(R"({"prompt":[[1],[512]]})", "prompt[1][0]", "512", vocab);
  RequestLimits few;
  few.max_prompts = 2;
  expect_400(R"({"prompt":["a","b","c"]})", "prompt", "at most 2 prompts", few);
}

TEST(CompletionRequestTest, EveryFieldIsRead) {
  // Every field at once (echo without logprobs; echo with logprobs is tested below).
  const CompletionRequest q = parse_ok(R"({
    "model": "m", "prompt": "x", "max_tokens": 32, "temperature": 0.5, "top_p": 0.9,
    "top_k": 40, "min_p": 0.05, "seed": 1234, "stop": ["\n\n", "END"],
    "stop_token_ids": [2, 7], "presence_penalty": 0.5, "frequency_penalty": -0.5,
    "repetition_penalty": 1.1, "n": 3, "best_of": 3, "echo": true,
    "ignore_eos": true, "min_tokens": 4, "user": "u-1", "stream": true,
    "stream_options": {"include_usage": true}, "suffix": "", "logit_bias": {},
    "metadata": {"k": "v"}, "store": false, "service_tier": "auto",
    "skip_special_tokens": true, "include_stop_str_in_output": false
  })");
  const SamplingParams& p = q.sampling.params;
  EXPECT_EQ(q.sampling.max_tokens, 32);
  EXPECT_FLOAT_EQ(p.temperature, 0.5f);
  EXPECT_FLOAT_EQ(p.top_p, 0.9f);
  EXPECT_EQ(p.top_k, 40);
  EXPECT_FLOAT_EQ(p.min_p, 0.05f);
  EXPECT_EQ(q.sampling.seed, 1234u);
  EXPECT_EQ(p.stop, (std::vector<std::string>{"\n\n", "END"}));
  EXPECT_EQ(p.stop_token_ids, (std::vector<int32_t>{2, 7}));
  EXPECT_FLOAT_EQ(p.presence_penalty, 0.5f);
  EXPECT_FLOAT_EQ(p.frequency_penalty, -0.5f);
  EXPECT_FLOAT_EQ(p.repetition_penalty, 1.1f);
  EXPECT_EQ(p.logprobs, -1);
  EXPECT_EQ(q.n, 3);
  EXPECT_TRUE(q.echo);
  EXPECT_TRUE(p.ignore_eos);
  EXPECT_EQ(p.min_tokens, 4);
  EXPECT_EQ(q.user, "u-1");
  EXPECT_TRUE(q.stream);
  EXPECT_TRUE(q.stream_options.include_usage);

  const CompletionRequest lp = parse_ok(with(R"("logprobs":5)"));
  EXPECT_EQ(lp.sampling.params.logprobs, 5);
  EXPECT_EQ(parse_ok(with(R"("logprobs":0)")).sampling.params.logprobs, 0);
}

TEST(CompletionRequestTest, NullMeansAbsent) {
  const CompletionRequest r = parse_ok(with(
      R"("max_tokens":null,"temperature":null,"stop":null,"seed":null,"n":null,"logprobs":null,)"
      R"("stream":null,"stream_options":null,"suffix":null,"best_of":null,"logit_bias":null,)"
      R"("user":null,"echo":null,"model":null,"response_format":null,"top_k":null)"));
  EXPECT_FALSE(r.sampling.max_tokens.has_value());
  EXPECT_EQ(r.sampling.params.temperature, 1.0f);
  EXPECT_EQ(r.n, 1);
  EXPECT_EQ(r.sampling.params.logprobs, -1);
}

TEST(CompletionRequestTest, UnknownFieldsAreRejectedByName) {
  expect_400(with(R"("temprature":0.5)"), "temprature",
             "Unrecognized request argument supplied: temprature");
  expect_400(with(R"("messages":[])"), "messages", "Unrecognized request argument");
  expect_400(with(R"("top_logprobs":2)"), "top_logprobs", "Unrecognized request argument");
}

TEST(CompletionRequestTest, OutOfRangeValuesNameFieldAndValue) {
  struct Case {
    std::string fields, param, text;
  };
  const std::vector<Case> cases = {
      {R"("temperature":-0.1)", "temperature", "-0.1"},
      {R"("temperature":1e999)", "", "not valid JSON"},
      {R"("top_p":0)", "top_p", "(0, 1]"},
      {R"("top_p":1.5)", "top_p", "1.5"},
      {R"("top_k":-2)", "top_k", "-2"},
      {R"("min_p":1.01)", "min_p", "1.01"},
      {R"("min_p":-0.5)", "min_p", "-0.5"},
      {R"("presence_penalty":2.5)", "presence_penalty", "[-2, 2]"},
      {R"("frequency_penalty":-3)", "frequency_penalty", "-3"},
      {R"("repetition_penalty":0)", "repetition_penalty", "> 0"},
      {R"("repetition_penalty":-1)", "repetition_penalty", "-1"},
      {R"("max_tokens":0)", "max_tokens", "must be >= 1"},
      {R"("max_tokens":-5)", "max_tokens", "-5"},
      {R"("max_tokens":4294967296)", "max_tokens", "4294967296"},
      {R"("max_completion_tokens":0)", "max_completion_tokens", "0"},
      {R"("min_tokens":-1)", "min_tokens", "-1"},
      {R"("max_tokens":5,"min_tokens":6)", "min_tokens", "max_tokens = 5"},
      {R"("n":0)", "n", "[1, 16]"},
      {R"("n":17)", "n", "17"},
      {R"("best_of":17)", "best_of", "17"},
      {R"("logprobs":21)", "logprobs", "[0, 20]"},
      {R"("logprobs":-1)", "logprobs", "-1"},
      {R"("stop_token_ids":[-1])", "stop_token_ids[0]", "-1"},
      {R"("seed":1e30)", "seed", "64 bits"},
      {R"("stop":["a","b","c","d","e","f","g","h","i","j","k","l","m","n","o","p","q"])",
       "stop", "at most 16"},
  };
  for (const Case& c : cases) expect_400(with(c.fields), c.param, c.text);
}

TEST(CompletionRequestTest, TypeErrorsNameFieldAndValue) {
  struct Case {
    std::string fields, param, text;
  };
  const std::vector<Case> cases = {
      {R"("temperature":"hot")", "temperature", R"(expected a number, but got a string ("hot"))"},
      {R"("temperature":true)", "temperature", "a boolean"},
      {R"("max_tokens":16.5)", "max_tokens", "expected an integer, but got a number (16.5)"},
      {R"("max_tokens":true)", "max_tokens", "expected an integer"},
      {R"("max_tokens":"16")", "max_tokens", R"("16")"},
      {R"("n":[1])", "n", "an array"},
      {R"("stream":1)", "stream", "expected a boolean"},
      {R"("stream":"true")", "stream", "expected a boolean"},
      {R"("echo":0)", "echo", "expected a boolean"},
      {R"("ignore_eos":"yes")", "ignore_eos", "expected a boolean"},
      {R"("stop":5)", "stop", "a string or an array of strings"},
      {R"("stop":["a",5])", "stop[1]", "expected a string"},
      {R"("stop_token_ids":5)", "stop_token_ids", "an array of token ids"},
      {R"("stop_token_ids":[1,"x"])", "stop_token_ids[1]", "token id"},
      {R"("seed":"42")", "seed", "expected an integer"},
      {R"("seed":4.5)", "seed", "expected an integer"},
      {R"("user":5)", "user", "expected a string"},
      {R"("model":5)", "model", "expected a string"},
      {R"("logprobs":true)", "logprobs", "expected an integer"},
      {R"("stream_options":true)", "stream_options", "expected an object"},
      {R"("suffix":5)", "suffix", "expected a string"},
      {R"("logit_bias":[])", "logit_bias", "expected an object"},
  };
  for (const Case& c : cases) expect_400(with(c.fields), c.param, c.text);
}

TEST(CompletionRequestTest, IntegersMayBeWrittenAsIntegralFloats) {
  const CompletionRequest r = parse_ok(with(R"("max_tokens":16.0,"n":2e0,"top_k":-1.0)"));
  EXPECT_EQ(r.sampling.max_tokens, 16);
  EXPECT_EQ(r.n, 2);
  EXPECT_EQ(r.sampling.params.top_k, -1);
}

TEST(CompletionRequestTest, MaxCompletionTokensWinsOverMaxTokens) {
  EXPECT_EQ(parse_ok(with(R"("max_tokens":10,"max_completion_tokens":20)")).sampling.max_tokens,
            20);
  EXPECT_EQ(parse_ok(with(R"("max_completion_tokens":20,"max_tokens":10)")).sampling.max_tokens,
            20);
  EXPECT_EQ(parse_ok(with(R"("max_completion_tokens":7)")).sampling.max_tokens, 7);
}

TEST(CompletionRequestTest, Seeds) {
  EXPECT_EQ(parse_ok(with(R"("seed":0)")).sampling.seed, 0u);
  EXPECT_EQ(parse_ok(with(R"("seed":-1)")).sampling.seed, UINT64_MAX);
  EXPECT_EQ(parse_ok(with(R"("seed":18446744073709551615)")).sampling.seed, UINT64_MAX);
  EXPECT_EQ(parse_ok(with(R"("seed":-9223372036854775808)")).sampling.seed, 1ull << 63);
  EXPECT_EQ(parse_ok(with(R"("seed":42.0)")).sampling.seed, 42u);
}

TEST(CompletionRequestTest, StopStrings) {
  EXPECT_EQ(parse_ok(with(R"("stop":"\n")")).sampling.params.stop,
            (std::vector<std::string>{"\n"}));
  // "" asks for no stop string.
  EXPECT_TRUE(parse_ok(with(R"("stop":"")")).sampling.params.stop.empty());
  EXPECT_EQ(parse_ok(with(R"("stop":["","x"])")).sampling.params.stop,
            (std::vector<std::string>{"x"}));
  EXPECT_TRUE(parse_ok(with(R"("stop":[])")).sampling.params.stop.empty());
  RequestLimits vocab;
  vocab.vocab_size = 100;
  expect_400(with(R"("stop_token_ids":[100])"), "stop_token_ids[0]", "[0, 100)", vocab);
  RequestLimits few;
  few.max_stop_token_ids = 2;
  expect_400(with(R"("stop_token_ids":[1,2,3])"), "stop_token_ids", "at most 2", few);
}

TEST(CompletionRequestTest, StreamOptions) {
  expect_400(with(R"("stream_options":{"include_usage":true})"), "stream_options",
             "only allowed when 'stream' is true");
  expect_400(with(R"("stream":false,"stream_options":{"include_usage":true})"), "stream_options",
             "only allowed");
  expect_400(with(R"("stream":true,"stream_options":{"include_usage":1})"),
             "stream_options.include_usage", "expected a boolean");
  expect_400(with(R"("stream":true,"stream_options":{"foo":true})"), "stream_options.foo",
             "Unrecognized stream option");
  expect_400(with(R"("stream":true,"stream_options":{"continuous_usage_stats":true})"),
             "stream_options.continuous_usage_stats", "not supported");
  const CompletionRequest r =
      parse_ok(with(R"("stream":true,"stream_options":{"include_usage":false,)"
                    R"("continuous_usage_stats":false})"));
  EXPECT_FALSE(r.stream_options.include_usage);
  EXPECT_TRUE(parse_ok(with(R"("stream":true,"stream_options":{})")).stream);
}

TEST(CompletionRequestTest, UnsupportedOpenAiFieldsAskingForSomething) {
  expect_400(with(R"("suffix":"tail")"), "suffix", "not supported");
  expect_400(with(R"("best_of":3)"), "best_of", "best_of equal to n (1)");
  EXPECT_EQ(parse_ok(with(R"("best_of":2,"n":2)")).n, 2);
  expect_400(with(R"("echo":true,"logprobs":1,"stream":true)"), "echo", "without streaming");
  expect_400(with(R"("logit_bias":{"50256":-100})"), "logit_bias", "not supported");
  expect_400(with(R"("response_format":{"type":"json_object"})"), "response_format",
             "not supported");
  EXPECT_TRUE(parse_completion_request(with(R"("response_format":{"type":"text"})")).ok());
  expect_400(with(R"("service_tier":"flex")"), "service_tier", "not supported");
  expect_400(with(R"("skip_special_tokens":false)"), "skip_special_tokens", "not supported");
  expect_400(with(R"("include_stop_str_in_output":true)"), "include_stop_str_in_output",
             "not supported");
  expect_400(with(R"("metadata":"x")"), "metadata", "expected an object");
  EXPECT_TRUE(parse_completion_request(with(R"("store":true)")).ok());
}

TEST(CompletionRequestTest, MalformedBodies) {
  for (const std::string& body : {std::string(""), std::string("{"), std::string("{\"prompt\":}"),
                                  std::string("{\"prompt\":\"x\"} trailing"),
                                  std::string("{'prompt':'x'}"), std::string("\xFF"),
                                  std::string("{\"prompt\":\"\xC3\"}")}) {
    const ApiError e = parse_error(body);
    EXPECT_EQ(e.http_status, 400);
    EXPECT_EQ(e.type, "invalid_request_error");
    EXPECT_EQ(e.param, "");
    EXPECT_NE(e.message.find("not valid JSON"), std::string::npos) << e.message;
    EXPECT_EQ(e.message.find("[json.exception"), std::string::npos) << e.message;
  }
  for (const char* body : {"[1,2]", "\"prompt\"", "42", "null"}) {
    const ApiError e = parse_error(body);
    EXPECT_NE(e.message.find("must be a JSON object"), std::string::npos) << e.message;
  }
  const std::string deep = std::string(10000, '[') + std::string(10000, ']');
  EXPECT_NE(parse_error(deep).message.find("nested more than 64"), std::string::npos);
  const std::string deep_value =
      R"({"prompt":"x","metadata":)" + std::string(65, '[') + std::string(65, ']') + "}";
  EXPECT_NE(parse_error(deep_value).message.find("nested"), std::string::npos);
  // Brackets inside strings do not count as nesting.
  EXPECT_TRUE(parse_completion_request(R"({"prompt":")" + std::string(500, '[') +
                                       R"(\"{{{"})")
                  .ok());
}

}  // namespace
}  // namespace cleave::openai

namespace cleave::openai {
namespace {

TEST(CompletionRequestTest, EchoWithLogprobsAsksForThePromptsLogprobs) {
  const CompletionRequest r = parse_ok(with(R"("echo":true,"logprobs":3,"max_tokens":0)"));
  EXPECT_TRUE(r.echo);
  EXPECT_TRUE(r.echo_only);
  EXPECT_EQ(r.sampling.params.logprobs, 3);
  EXPECT_EQ(r.sampling.params.prompt_logprobs, 3);
  EXPECT_FALSE(r.sampling.max_tokens);
  const CompletionRequest g = parse_ok(with(R"("echo":true,"logprobs":0,"max_tokens":5)"));
  EXPECT_FALSE(g.echo_only);
  EXPECT_EQ(g.sampling.params.prompt_logprobs, 0);
  EXPECT_EQ(*g.sampling.max_tokens, 5);
  // Without echo nothing of the prompt is scored.
  EXPECT_EQ(parse_ok(with(R"("logprobs":2)")).sampling.params.prompt_logprobs, -1);
  EXPECT_EQ(parse_ok(with(R"("echo":true)")).sampling.params.prompt_logprobs, -1);
  EXPECT_TRUE(parse_ok(with(R"("echo":true,"max_completion_tokens":0)")).echo_only);
}

TEST(CompletionRequestTest, EchoWithLogprobsErrors) {
  expect_400(with(R"("max_tokens":0)"), "max_tokens", "0 only with echo");
  expect_400(with(R"("echo":true,"logprobs":21,"max_tokens":0)"), "logprobs", "21");
  expect_400(with(R"("echo":true,"logprobs":-1,"max_tokens":0)"), "logprobs");
  expect_400(with(R"("echo":true,"max_tokens":0,"max_completion_tokens":4)"), "max_tokens",
             "cannot be combined");
  expect_400(with(R"("max_completion_tokens":0)"), "max_completion_tokens", "0 only with echo");
  expect_400(with(R"("echo":true,"logprobs":2,"stream":true,"max_tokens":0)"), "echo",
             "without streaming");
}

}  // namespace
}  // namespace cleave::openai
