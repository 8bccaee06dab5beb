// The `cleave` binary: wiring only; each subcommand lives in its own cmd_*.cpp.
#include <cstdio>
#include <cstdlib>

#include "cleave/common/log.h"
#include "cleave/common/version.h"

#include "commands.h"

int main(int argc, char** argv) {
  CLI::App app{"cleave: a disaggregated LLM inference server"};
  app.require_subcommand(1);
  app.set_version_flag("--version", std::string("cleave ") + cleave::kVersion);
  // Diagnostics go to stderr from the first line on; subcommands may re-initialise with their
  // role. CLEAVE_LOG_LEVEL sets the level (default warn for the command-line tools).
  {
    cleave::LogOptions log_opts;
    const char* level = std::getenv("CLEAVE_LOG_LEVEL");
    log_opts.level = level && *level ? level : "warn";
    if (!cleave::init_logging(log_opts).ok()) {
      std::fprintf(stderr, "cleave: CLEAVE_LOG_LEVEL='%s' is not a log level "
                   "(trace, debug, info, warn, error, off)\n", level);
      return 2;
    }
  }
  int exit_code = 0;
  cleave::cli::add_generate_command(app, &exit_code);
  cleave::cli::add_tokenize_command(app, &exit_code);
  cleave::cli::add_convert_command(app, &exit_code);
  cleave::cli::add_model_command(app, &exit_code);
  cleave::cli::add_config_command(app, &exit_code);
  cleave::cli::add_bench_serve_commands(cleave::cli::add_bench_command(app, &exit_code),
                                        &exit_code);
  cleave::cli::add_template_command(app, &exit_code);
  cleave::cli::add_client_command(app, &exit_code);
  cleave::cli::add_worker_command(app, &exit_code);
  cleave::cli::add_serve_command(app, &exit_code);
  cleave::cli::add_router_command(app, &exit_code);
  cleave::cli::add_tune_command(app, &exit_code);
  cleave::cli::add_perplexity_command(app, &exit_code);
  try {
    app.parse(argc, argv);
  } catch (const CLI::ParseError& e) {
    return app.exit(e) == 0 ? 0 : 2;
  }
  return exit_code;
}
