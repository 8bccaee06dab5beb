// Chat templates: a Jinja2 interpreter that renders a model's own chat template (GGUF
// `tokenizer.chat_template`, tokenizer_config.json `chat_template`, chat_template.jinja) exactly
// as Hugging Face transformers' apply_chat_template does, and a plain fallback for models that
// ship none.
//
// The rendering environment is transformers': Jinja2's ImmutableSandboxedEnvironment with
// trim_blocks=True, lstrip_blocks=True and the loopcontrols extension ({% break %},
// {% continue %}), `{% generation %}` blocks rendered in place, a `tojson` filter that is
// json.dumps(x, ensure_ascii=False, indent=, separators=, sort_keys=), the globals
// raise_exception(message) and strftime_now(format), and undefined variables rendering as "".
// Values follow Python: truthiness, `in`, slicing, str methods, str()/repr() of lists and dicts,
// int/float arithmetic; dicts keep their insertion order (pass nlohmann::ordered_json to keep
// the order a client sent, which tojson of tools prints).
//
// Errors: parse() returns InvalidArgument for a syntax error ("... (line N)"). render() returns
// InvalidArgument whose message is exactly what Python would raise: for the template's own
// raise_exception("msg") it is exactly "msg" (the server answers such errors with HTTP 400);
// for a type error e.g. 'can only concatenate str (not "NoneType") to str'. A template can
// neither crash nor hang the process: output size, steps (loop iterations and calls) and
// recursion depth are bounded (ResourceExhausted past a limit).
//
// Thread-safety: a ChatTemplate is immutable after parse(); render() and apply() may run on any
// number of threads at once. Copies share the parsed program.
#pragma once

#include <cstdint>
#include <ctime>
#include <memory>
#include <optional>
#include <string>
#include <string_view>

#include "cleave/common/status.h"
#include "nlohmann/json.hpp"

namespace cleave {

namespace jinja {
struct Program;
struct Scope;
}  // namespace jinja

struct ChatTemplateLimits {
  size_t max_source_bytes = 1u << 20;   // template text
  int max_nesting = 100;                // nested blocks / sub-expressions in the source
  size_t max_output_bytes = 64u << 20;  // rendered text, and any one string or list on the way
  int64_t max_steps = 1'000'000;        // loop iterations + calls + filter applications
  int max_depth = 500;                  // recursion while rendering (macros, loops, expressions)
};

// The inputs of apply_chat_template.
struct ChatTemplateInputs {
  // OpenAI message objects ({"role", "content", "tool_calls", ...}).
  nlohmann::ordered_json messages = nlohmann::ordered_json::array();
  bool add_generation_prompt = true;
  std::optional<std::string> bos_token;  // nullopt: undefined in the template
  std::optional<std::string> eos_token;
  nlohmann::ordered_json tools = nullptr;      // null: `none` in the template
  nlohmann::ordered_json documents = nullptr;  // null: `none`
  // More template variables (vLLM's chat_template_kwargs, e.g. {"enable_thinking": false}).
  nlohmann::ordered_json extra = nlohmann::ordered_json::object();
  // A content given as a list of parts that are all {"type": "text", "text": ...} is passed as
  // one string, the texts joined by "\n" (as vLLM does for templates that expect strings).
  bool flatten_text_content = true;
  // strftime_now's clock as local broken-down time; nullopt: the local time at render.
  std::optional<std::tm> now;
};

class ChatTemplate {
 public:
  // Parses a template. InvalidArgument for a syntax error, an unknown filter or test, or a
  // template over the size / nesting limits.
  static Result<ChatTemplate> parse(std::string_view source, const ChatTemplateLimits& limits = {});

  // Renders with the members of `context` (a JSON object) as the template's variables, plus the
  // globals. Nothing else is defined: pass tools / documents = null to have them `none`.
  Result<std::string> render(const nlohmann::ordered_json& context,
                             const std::optional<std::tm>& now = std::nullopt) const;
  Result<std::string> render(const nlohmann::json& context,
                             const std::optional<std::tm>& now = std::nullopt) const;

  // apply_chat_template: messages, add_generation_prompt, tools, documents, the special tokens
  // and `extra` as variables.
  Result<std::string> apply(const ChatTemplateInputs& inputs) const;

  const std::string& source() const { return *source_; }

 private:
  ChatTemplate() = default;
  Result<std::string> render_scope(std::shared_ptr<jinja::Scope> globals,
                                   const std::optional<std::tm>& now) const;

  std::shared_ptr<const jinja::Program> program_;
  std::shared_ptr<const std::string> source_;
  ChatTemplateLimits limits_;
};

// The fallback for models without a template. Each message becomes "<role>: <content>\n\n"
// (a content given as parts contributes its text parts joined by "\n"; a null content is
// empty), and add_generation_prompt appends "assistant:". There is no BOS in the text: the
// tokenizer's add_bos rule applies. Example: [{user, "Hi"}] with a generation prompt renders
// "user: Hi\n\nassistant:".
extern const std::string_view kFallbackChatTemplate;
const ChatTemplate& fallback_chat_template();

// The model's template when it has one (non-empty source), else the fallback.
Result<ChatTemplate> chat_template_or_fallback(std::string_view source,
                                               const ChatTemplateLimits& limits = {});

// "2024-07-26T12:00:00" (or with a space, or a date only) as broken-down time with the weekday
// and day of the year filled in; InvalidArgument otherwise.
Result<std::tm> parse_chat_template_time(std::string_view iso);

}  // namespace cleave
