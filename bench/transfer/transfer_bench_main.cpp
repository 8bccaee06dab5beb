// Standalone `transfer_bench bench transfer ...`: the same subcommand as `cleave bench
// transfer`, built without the rest of the CLI (handy while iterating on the engine).
#include "CLI/CLI.hpp"

namespace cleave::cli {
CLI::App* add_bench_command(CLI::App& app, int* exit_code);
}

int main(int argc, char** argv) {
  CLI::App app{"transfer_bench"};
  app.require_subcommand(1);
  int exit_code = 0;
  cleave::cli::add_bench_command(app, &exit_code);
  try {
    app.parse(argc, argv);
  } catch (const CLI::ParseError& e) {
    return app.exit(e) == 0 ? 0 : 2;
  }
  return exit_code;
}
