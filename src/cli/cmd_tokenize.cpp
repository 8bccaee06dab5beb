// `cleave tokenize`: encodes text with a model's tokenizer and prints the token ids.
//   --model M --text "..."      one line: the ids, space-separated
//   --model M --suite FILE.inp  one line per case (cases end with "\n__ggml_vocab_test__\n"),
//                               each id preceded by a space, as the .out files of the suites
// M is a GGUF file (a vocab-only one is enough) or a directory with tokenizer.json.
#include <cstdio>
#include <fstream>
#include <iostream>
#include <sstream>
#include <string>

#include "fmt/format.h"
#include "cleave/model/tokenizer.h"
#include "commands.h"

namespace cleave::cli {
namespace {

struct TokenizeArgs {
  std::string model;
  std::string text;
  std::string suite;
  bool add_bos = false;
  bool parse_special = false;
  bool pieces = false;
};

Result<std::string> read_file(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) return NotFound(fmt::format("cannot open '{}'", path));
  std::ostringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

int run_tokenize(const TokenizeArgs& a) {
  auto tok = load_tokenizer(a.model);
  if (!tok.ok()) {
    std::fprintf(stderr, "error: %s: %s\n", a.model.c_str(), tok.status().to_string().c_str());
    return 1;
  }
  EncodeOptions opts;
  opts.add_bos = a.add_bos;
  opts.parse_special = a.parse_special;
  std::string out;
  auto print_ids = [&](const std::vector<int32_t>& ids, bool leading_space) {
    for (size_t i = 0; i < ids.size(); ++i) {
      if (leading_space || i > 0) out.push_back(' ');
      out += std::to_string(ids[i]);
      if (a.pieces) out += fmt::format("'{}'", (*tok)->token_to_piece(ids[i], true));
    }
    out.push_back('\n');
  };
  if (!a.suite.empty()) {
    auto content = read_file(a.suite);
    if (!content.ok()) {
      std::fprintf(stderr, "error: %s\n", content.status().message().c_str());
      return 1;
    }
    static constexpr std::string_view kSep = "\n__ggml_vocab_test__\n";
    std::string_view rest = *content;
    // Every case is followed by the separator; text after the last separator (normally none)
    // is one more case.
    while (!rest.empty()) {
      size_t p = rest.find(kSep);
      std::string_view text = p == std::string_view::npos ? rest : rest.substr(0, p);
      print_ids((*tok)->encode(text, opts), true);
      if (p == std::string_view::npos) break;
      rest.remove_prefix(p + kSep.size());
    }
  } else {
    print_ids((*tok)->encode(a.text, opts), false);
  }
  std::fwrite(out.data(), 1, out.size(), stdout);
  return 0;
}

}  // namespace

void add_tokenize_command(CLI::App& app, int* exit_code) {
  auto args = std::make_shared<TokenizeArgs>();
  CLI::App* cmd = app.add_subcommand("tokenize", "Encode text with a model's tokenizer and print the ids");
  cmd->add_option("--model", args->model, "GGUF file (vocab-only is enough) or HF directory")
      ->required();
  auto* text = cmd->add_option("--text", args->text, "text to encode");
  auto* suite = cmd->add_option("--suite", args->suite,
                                "tokenizer test input (.inp): one output line per case");
  text->excludes(suite);
  cmd->add_flag("--add-bos", args->add_bos, "prepend BOS");
  cmd->add_flag("--parse-special", args->parse_special, "recognise special token text");
  cmd->add_flag("--pieces", args->pieces, "print each token's text after its id");
  cmd->callback([args, exit_code, text, suite] {
    if (text->count() == 0 && suite->count() == 0) {
      std::fprintf(stderr, "error: tokenize needs --text or --suite\n");
      *exit_code = 2;
      return;
    }
    *exit_code = run_tokenize(*args);
  });
}

}  // namespace cleave::cli
