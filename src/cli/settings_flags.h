// The settings of a long-running subcommand (`serve`, `router`, `worker`): --config FILE, --set key=value
// (repeatable) and each setting's own flag from the settings registry (cleave/cli/config.h), applied as
// defaults < file < env (CLEAVE_*) < --set < dedicated flags.
#pragma once

#include <functional>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "CLI/CLI.hpp"
#include "cleave/cli/config.h"
#include "cleave/common/status.h"

namespace cleave::cli {

struct SettingsFlags {
  Config config;
  SettingsRegistry registry;
  std::string config_file;
  std::vector<std::string> sets;
  std::map<std::string, std::string> flag_values;  // setting key -> value of its flag, if given

  SettingsFlags() { register_settings(config, registry); }
  SettingsFlags(const SettingsFlags&) = delete;
  SettingsFlags& operator=(const SettingsFlags&) = delete;
};

// Adds --config, --set and the dedicated flag of every setting for which `include` is true.
void add_settings_flags(CLI::App* sub, const std::shared_ptr<SettingsFlags>& flags,
                        const std::function<bool(const SettingsRegistry::Setting&)>& include);

// Applies the file, the environment, --set and the flags; InvalidArgument naming the setting.
Status load_settings_flags(SettingsFlags& flags);

}  // namespace cleave::cli
