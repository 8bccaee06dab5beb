// `cleave template`: renders a chat template the way the server does.
//   --template FILE.jinja --cases FILE.cases.json
//       one JSON line per case, in the cases' order: {"rendered": "..."} or {"error": "..."}.
//       Each case's members (but expected / expected_error) are the template's variables;
//       tools and documents default to null, add_generation_prompt to false; strftime_now reads
//       the file's strftime_now_fixed when present.
//   --template FILE.jinja --context FILE.json [--now 2024-07-26T12:00:00]
//       one JSON line for one context object.
// Exit status: 0 when every case was rendered or raised its error; 1 when a file cannot be read
// or the template does not parse; 2 for bad usage.
#include <cstdio>
#include <fstream>
#include <memory>
#include <optional>
#include <sstream>
#include <string>

#include "cleave/model/chat_template.h"
#include "commands.h"
#include "nlohmann/json.hpp"

namespace cleave::cli {
namespace {

using ordered_json = nlohmann::ordered_json;

struct TemplateArgs {
  std::string template_file;
  std::string cases_file;
  std::string context_file;
  std::string now;
};

Result<std::string> read_text(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) return NotFound("cannot open '" + path + "'");
  std::ostringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

Result<ordered_json> read_json(const std::string& path) {
  CLEAVE_ASSIGN_OR_RETURN(std::string text, read_text(path));
  ordered_json j = ordered_json::parse(text, nullptr, /*allow_exceptions=*/false);
  if (j.is_discarded()) return InvalidArgument("'" + path + "' is not valid JSON");
  return j;
}

void print_result(const Result<std::string>& r) {
  ordered_json line = ordered_json::object();
  if (r.ok()) {
    line["rendered"] = *r;
  } else {
    line["error"] = r.status().message();
  }
  const std::string s = line.dump(-1, ' ', false, nlohmann::json::error_handler_t::replace);
  std::fwrite(s.data(), 1, s.size(), stdout);
  std::fputc('\n', stdout);
}

int fail(const Status& st) {
  std::fprintf(stderr, "error: %s\n", st.message().c_str());
  return 1;
}

int run_template(const TemplateArgs& a) {
  auto source = read_text(a.template_file);
  if (!source.ok()) return fail(source.status());
  auto tmpl = ChatTemplate::parse(*source);
  if (!tmpl.ok()) return fail(tmpl.status().with_context(a.template_file));

  if (!a.context_file.empty()) {
    auto context = read_json(a.context_file);
    if (!context.ok()) return fail(context.status());
    std::optional<std::tm> now;
    if (!a.now.empty()) {
      auto t = parse_chat_template_time(a.now);
      if (!t.ok()) return fail(t.status());
      now = *t;
    }
    print_result(tmpl->render(*context, now));
    return 0;
  }

  auto cases = read_json(a.cases_file);
  if (!cases.ok()) return fail(cases.status());
  if (!cases->is_object() || !cases->contains("cases") || !(*cases)["cases"].is_array()) {
    return fail(InvalidArgument("'" + a.cases_file + "' has no \"cases\" array"));
  }
  std::optional<std::tm> now;
  const std::string fixed = a.now.empty() ? cases->value("strftime_now_fixed", "") : a.now;
  if (!fixed.empty()) {
    auto t = parse_chat_template_time(fixed);
    if (!t.ok()) return fail(t.status());
    now = *t;
  }
  for (const ordered_json& c : (*cases)["cases"]) {
    if (!c.is_object()) {
      print_result(InvalidArgument("case is not a JSON object"));
      continue;
    }
    ordered_json context = ordered_json::object();
    context["tools"] = nullptr;
    context["documents"] = nullptr;
    context["add_generation_prompt"] = false;
    for (auto it = c.begin(); it != c.end(); ++it) {
      if (it.key() == "expected" || it.key() == "expected_error") continue;
      context[it.key()] = it.value();
    }
    print_result(tmpl->render(context, now));
  }
  std::fflush(stdout);
  return 0;
}

}  // namespace

void add_template_command(CLI::App& app, int* exit_code) {
  auto args = std::make_shared<TemplateArgs>();
  CLI::App* cmd = app.add_subcommand(
      "template", "Render a chat template (as the server does) for test cases or a context");
  cmd->add_option("--template", args->template_file, "the template (.jinja)")->required();
  auto* cases = cmd->add_option("--cases", args->cases_file,
                                "cases file (.cases.json): one JSON line per case");
  auto* context = cmd->add_option("--context", args->context_file,
                                  "a JSON object of template variables: one JSON line");
  cases->excludes(context);
  cmd->add_option("--now", args->now, "strftime_now's fixed time, e.g. 2024-07-26T12:00:00");
  cmd->callback([args, exit_code, cases, context] {
    if (cases->count() == 0 && context->count() == 0) {
      std::fprintf(stderr, "error: template needs --cases or --context\n");
      *exit_code = 2;
      return;
    }
    *exit_code = run_template(*args);
  });
}

}  // namespace cleave::cli
