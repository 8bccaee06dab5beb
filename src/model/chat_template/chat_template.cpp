// The public face of the interpreter: parse once, render per request.
#include "cleave/model/chat_template.h"

#include <chrono>
#include <cstdio>

#include "chat_template/interpreter.h"
#include "chat_template/parser.h"
#include "fmt/format.h"

namespace cleave {
namespace {

using jinja::Value;

constexpr int kMaxJsonDepth = 256;

template <typename Json>
Result<Value> from_json(const Json& j, int depth) {
  if (depth > kMaxJsonDepth) {
    return InvalidArgument(fmt::format("template input nested deeper than {} levels", kMaxJsonDepth));
  }
  switch (j.type()) {
    case nlohmann::json::value_t::null:
      return Value::none();
    case nlohmann::json::value_t::boolean:
      return Value(j.template get<bool>());
    case nlohmann::json::value_t::number_integer:
      return Value(j.template get<int64_t>());
    case nlohmann::json::value_t::number_unsigned: {
      const auto u = j.template get<uint64_t>();
      if (u > static_cast<uint64_t>(INT64_MAX)) return Value(static_cast<double>(u));
      return Value(static_cast<int64_t>(u));
    }
    case nlohmann::json::value_t::number_float:
      return Value(j.template get<double>());
    case nlohmann::json::value_t::string:
      return Value(j.template get_ref<const std::string&>());
    case nlohmann::json::value_t::array: {
      std::vector<Value> items;
      items.reserve(j.size());
      for (const auto& item : j) {
        CLEAVE_ASSIGN_OR_RETURN(Value v, from_json(item, depth + 1));
        items.push_back(std::move(v));
      }
      return Value::list(std::move(items));
    }
    case nlohmann::json::value_t::object: {
      auto d = std::make_shared<jinja::Dict>();
      d->entries.reserve(j.size());
      for (auto it = j.begin(); it != j.end(); ++it) {
        CLEAVE_ASSIGN_OR_RETURN(Value v, from_json(it.value(), depth + 1));
        CLEAVE_RETURN_IF_ERROR(d->set(Value(it.key()), std::move(v)));
      }
      return Value(jinja::DictPtr(std::move(d)));
    }
    default:
      return InvalidArgument("template input holds a value JSON cannot carry (binary)");
  }
}

template <typename Json>
Result<std::shared_ptr<jinja::Scope>> context_scope(const Json& context) {
  if (!context.is_object()) return InvalidArgument("template context must be a JSON object");
  auto globals = std::make_shared<jinja::Scope>();
  jinja::add_globals(*globals);
  auto vars = std::make_shared<jinja::Scope>();
  vars->parent = std::move(globals);
  for (auto it = context.begin(); it != context.end(); ++it) {
    CLEAVE_ASSIGN_OR_RETURN(Value v, from_json(it.value(), 1));
    vars->set(it.key(), std::move(v));
  }
  return vars;
}

// Python's datetime.strftime on Linux: the C library's strftime, plus %f (microseconds).
std::string format_time(const std::string& format, const std::tm& tm, int64_t micros) {
  std::string f;
  for (size_t i = 0; i < format.size(); ++i) {
    if (format[i] == '%' && i + 1 < format.size()) {
      if (format[i + 1] == 'f') {
        f += fmt::format("{:06d}", micros);
        ++i;
        continue;
      }
      f += format.substr(i, 2);
      ++i;
      continue;
    }
    f.push_back(format[i]);
  }
  if (f.empty()) return "";
  // A format whose output is empty makes strftime return 0 too: grow only up to a bound.
  for (size_t size = f.size() * 4 + 64; size <= (1u << 20); size *= 4) {
    std::string out(size, '\0');
    const size_t n = std::strftime(out.data(), out.size(), f.c_str(), &tm);
    if (n > 0) {
      out.resize(n);
      return out;
    }
  }
  return "";
}

std::function<std::string(const std::string&)> clock_for(const std::optional<std::tm>& now) {
  if (now) {
    const std::tm fixed = *now;
    return [fixed](const std::string& f) { return format_time(f, fixed, 0); };
  }
  return [](const std::string& f) {
    const auto t = std::chrono::system_clock::now();
    const std::time_t secs = std::chrono::system_clock::to_time_t(t);
    const auto micros = std::chrono::duration_cast<std::chrono::microseconds>(
                            t.time_since_epoch()).count() % 1000000;
    std::tm tm{};
    localtime_r(&secs, &tm);
    return format_time(f, tm, micros);
  };
}

nlohmann::ordered_json flatten_content(const nlohmann::ordered_json& messages) {
  if (!messages.is_array()) return messages;
  nlohmann::ordered_json out = messages;
  for (auto& m : out) {
    if (!m.is_object()) continue;
    auto it = m.find("content");
    if (it == m.end() || !it->is_array() || it->empty()) continue;
    std::string text;
    bool all_text = true;
    for (size_t i = 0; i < it->size(); ++i) {
      const auto& part = (*it)[i];
      if (!part.is_object() || part.value("type", "") != "text" || !part.contains("text") ||
          !part["text"].is_string()) {
        all_text = false;
        break;
      }
      if (i > 0) text += "\n";
      text += part["text"].get<std::string>();
    }
    if (all_text) *it = text;
  }
  return out;
}

}  // namespace

const std::string_view kFallbackChatTemplate =
    "{%- for message in messages -%}"
    "{%- if message['content'] is string -%}{%- set text = message['content'] -%}"
    "{%- elif message['content'] is iterable and message['content'] is not mapping -%}"
    "{%- set text = message['content'] | selectattr('type', 'equalto', 'text')"
    " | map(attribute='text') | join('\\n') -%}"
    "{%- else -%}{%- set text = '' -%}{%- endif -%}"
    "{{ message['role'] ~ ': ' ~ text ~ '\\n\\n' }}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{ 'assistant:' }}{%- endif -%}";

Result<ChatTemplate> ChatTemplate::parse(std::string_view source, const ChatTemplateLimits& limits) {
  if (source.size() > limits.max_source_bytes) {
    return InvalidArgument(fmt::format("chat template is {} bytes, more than the limit of {}",
                                       source.size(), limits.max_source_bytes));
  }
  ChatTemplate t;
  CLEAVE_ASSIGN_OR_RETURN(t.program_, jinja::parse_program(source, limits.max_nesting));
  t.source_ = std::make_shared<const std::string>(source);
  t.limits_ = limits;
  return t;
}

Result<std::string> ChatTemplate::render_scope(std::shared_ptr<jinja::Scope> globals,
                                               const std::optional<std::tm>& now) const {
  jinja::RenderLimits limits;
  limits.max_output_bytes = limits_.max_output_bytes;
  limits.max_steps = limits_.max_steps;
  limits.max_depth = limits_.max_depth;
  jinja::Interpreter interpreter(limits, clock_for(now));
  std::string out;
  CLEAVE_RETURN_IF_ERROR(interpreter.render(*program_, std::move(globals), &out));
  return out;
}

Result<std::string> ChatTemplate::render(const nlohmann::ordered_json& context,
                                         const std::optional<std::tm>& now) const {
  CLEAVE_ASSIGN_OR_RETURN(auto scope, context_scope(context));
  return render_scope(std::move(scope), now);
}

Result<std::string> ChatTemplate::render(const nlohmann::json& context,
                                         const std::optional<std::tm>& now) const {
  CLEAVE_ASSIGN_OR_RETURN(auto scope, context_scope(context));
  return render_scope(std::move(scope), now);
}

Result<std::string> ChatTemplate::apply(const ChatTemplateInputs& in) const {
  if (!in.extra.is_object()) return InvalidArgument("chat template extra variables must be an object");
  nlohmann::ordered_json context = nlohmann::ordered_json::object();
  for (auto it = in.extra.begin(); it != in.extra.end(); ++it) context[it.key()] = it.value();
  context["messages"] = in.flatten_text_content ? flatten_content(in.messages) : in.messages;
  context["add_generation_prompt"] = in.add_generation_prompt;
  context["tools"] = in.tools;
  context["documents"] = in.documents;
  if (in.bos_token) context["bos_token"] = *in.bos_token;
  if (in.eos_token) context["eos_token"] = *in.eos_token;
  return render(context, in.now);
}

const ChatTemplate& fallback_chat_template() {
  static const ChatTemplate t = [] {
    auto r = ChatTemplate::parse(kFallbackChatTemplate);
    if (!r.ok()) std::abort();  // a constant; its test would fail first
    return std::move(r).value();
  }();
  return t;
}

Result<ChatTemplate> chat_template_or_fallback(std::string_view source,
                                               const ChatTemplateLimits& limits) {
  if (source.empty()) return fallback_chat_template();
  return ChatTemplate::parse(source, limits);
}

Result<std::tm> parse_chat_template_time(std::string_view iso) {
  int y = 0, mo = 0, d = 0, h = 0, mi = 0, s = 0;
  const std::string text(iso);
  int n = std::sscanf(text.c_str(), "%4d-%2d-%2d%*1[T ]%2d:%2d:%2d", &y, &mo, &d, &h, &mi, &s);
  if (n != 6) {
    h = mi = s = 0;
    char tail = 0;
    n = std::sscanf(text.c_str(), "%4d-%2d-%2d%c", &y, &mo, &d, &tail);
    if (n != 3) return InvalidArgument(fmt::format("'{}' is not a date-time like 2024-07-26T12:00:00", iso));
  }
  if (mo < 1 || mo > 12 || d < 1 || d > 31 || h > 23 || mi > 59 || s > 60) {
    return InvalidArgument(fmt::format("'{}' is not a valid date-time", iso));
  }
  std::tm tm{};
  tm.tm_year = y - 1900;
  tm.tm_mon = mo - 1;
  tm.tm_mday = d;
  tm.tm_hour = h;
  tm.tm_min = mi;
  tm.tm_sec = s;
  std::tm normalized{};
  const std::time_t t = timegm(&tm);  // fills tm_wday / tm_yday through gmtime_r
  gmtime_r(&t, &normalized);
  normalized.tm_isdst = 0;
  return normalized;
}

}  // namespace cleave
