#include "settings_flags.h"

#include "fmt/format.h"

namespace cleave::cli {

void add_settings_flags(CLI::App* sub, const std::shared_ptr<SettingsFlags>& flags,
                        const std::function<bool(const SettingsRegistry::Setting&)>& include) {
  sub->add_option("--config", flags->config_file, "YAML config file");
  sub->add_option("--set", flags->sets, "Override a setting: key=value (repeatable)");
  for (const auto& setting : flags->registry.settings()) {
    if (setting.flag.empty() || !include(setting)) continue;
    const std::string key = setting.key;
    SettingsFlags* raw = flags.get();
    sub->add_option_function<std::string>(
           setting.flag, [raw, key](const std::string& value) { raw->flag_values[key] = value; },
           fmt::format("{} (setting {}, {})", setting.help, key, setting.type))
        ->type_name("VALUE");
  }
}

Status load_settings_flags(SettingsFlags& flags) {
  CLEAVE_RETURN_IF_ERROR(load_config(flags.registry, flags.config_file, flags.sets));
  for (const auto& [key, value] : flags.flag_values) {
    CLEAVE_RETURN_IF_ERROR(flags.registry.set(key, value, "flag"));
  }
  return Status::Ok();
}

}  // namespace cleave::cli
