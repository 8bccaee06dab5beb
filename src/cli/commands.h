// Subcommands of the `cleave` binary. Each add_* registers one subcommand on `app`; its callback
// stores the process exit code in *exit_code (0 success, 1 runtime error, 2 bad usage).
#pragma once

#include "CLI/CLI.hpp"

namespace cleave::cli {

void add_generate_command(CLI::App& app, int* exit_code);
void add_tokenize_command(CLI::App& app, int* exit_code);
void add_convert_command(CLI::App& app, int* exit_code);
void add_model_command(CLI::App& app, int* exit_code);  // `model synth`
void add_config_command(CLI::App& app, int* exit_code); // `config show|table`
// Returns the `bench` subcommand, to which add_bench_serve_commands adds its own.
CLI::App* add_bench_command(CLI::App& app, int* exit_code);  // `bench transfer`, and the two below
void add_bench_serve_commands(CLI::App* bench, int* exit_code);  // `bench serve`, `bench sweep`
void add_template_command(CLI::App& app, int* exit_code);  // chat templates
void add_client_command(CLI::App& app, int* exit_code); // one request on running workers
void add_worker_command(CLI::App& app, int* exit_code); // `worker --role ...`
void add_serve_command(CLI::App& app, int* exit_code);  // `serve`: workers + router
void add_router_command(CLI::App& app, int* exit_code); // `router`: the router alone
void add_tune_command(CLI::App& app, int* exit_code);   // `tune`: a config for a workload
void add_perplexity_command(CLI::App& app, int* exit_code);  // `perplexity`

}  // namespace cleave::cli
