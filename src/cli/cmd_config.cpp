// `cleave config show|table`: the effective configuration and the settings reference.
#include <iostream>

#include "cleave/cli/config.h"
#include "commands.h"

namespace cleave::cli {

void add_config_command(CLI::App& app, int* exit_code) {
  auto* cmd = app.add_subcommand("config", "Show the effective configuration or list all settings");
  cmd->require_subcommand(1);

  auto* show = cmd->add_subcommand(
      "show",
      "Print the effective configuration (defaults < --config file or directory < the "
      "worker's profile < CLEAVE_* env < --set)");
  auto file = std::make_shared<std::string>();
  auto sets = std::make_shared<std::vector<std::string>>();
  show->add_option("--config", *file, "YAML config file");
  show->add_option("--set", *sets, "Override a setting: key=value (repeatable)");
  show->callback([file, sets, exit_code] {
    Config config;
    SettingsRegistry registry;
    register_settings(config, registry);
    Status s = load_config(registry, *file, *sets);
    // What a worker with these settings applies (worker.role, worker.instance_type).
    if (s.ok()) {
      s = select_worker_profile(registry, config.worker.instance_type, config.worker.role,
                                config.worker.profile)
              .status();
    }
    if (!s.ok()) {
      std::cerr << "cleave config: " << s.message() << "\n";
      *exit_code = 2;
      return;
    }
    std::cout << registry.to_yaml();
  });

  auto* table = cmd->add_subcommand("table", "Print the settings table (markdown) for the README");
  table->callback([] {
    Config config;
    SettingsRegistry registry;
    register_settings(config, registry);
    std::cout << registry.markdown_table();
  });
}

}  // namespace cleave::cli
