// The `cleave` binary: wiring only; each subcommand lives in its own cmd_*.cpp.
#include <cstdio>

#include "commands.h"

int main(int argc, char** argv) {
  CLI::App app{"cleave: a disaggregated LLM inference server"};
  app.require_subcommand(1);
  app.set_version_flag("--version", "cleave 0.1.0");
  int exit_code = 0;
  cleave::cli::add_generate_command(app, &exit_code);
  cleave::cli::add_tokenize_command(app, &exit_code);
  cleave::cli::add_convert_command(app, &exit_code);
  cleave::cli::add_model_command(app, &exit_code);
  cleave::cli::add_config_command(app, &exit_code);
  try {
    app.parse(argc, argv);
  } catch (const CLI::ParseError& e) {
    return app.exit(e) == 0 ? 0 : 2;
  }
  return exit_code;
}
