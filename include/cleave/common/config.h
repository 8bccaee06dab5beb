// Typed configuration with one declaration per setting.
//
// Every setting is a field of a plain struct with its default in code. A SettingsRegistry binds
// each field to a dotted key ("engine.threads"), an environment variable ("CLEAVE_ENGINE_THREADS")
// and optionally a command-line flag, and applies sources in increasing precedence:
//   defaults (in code) < YAML file < environment (CLEAVE_*) < flags.
// The caller applies them in that order: load_yaml_file(), load_env(), then set() per flag.
// Unknown keys in a file are errors that name the key and the file, so typos never pass silently.
// The registry is also the source of the README's settings table (markdown_table()).
//
// The "file" may be a directory (a Kubernetes ConfigMap mounted as a volume): its *.yaml files
// in name order, then every other file, named after a setting key ("pools.prefill.replicas")
// and holding that setting's value. A setting given twice there, or a file that names no
// setting, is an error. Names starting with '.' are skipped.
//
// Profiles: the file's `profiles:` section maps a name (an instance type such as p5e.48xlarge,
// or `default`) to settings in the file's own nesting, with optional per-role subsections
// (`prefill:`, `decode:`, `unified:`, which win over the profile's other settings). A worker
// applies one of them (select_worker_profile) between the file and the environment:
//   defaults < file < the selected profile < environment < flags.
#pragma once

#include <cstdint>
#include <functional>
#include <map>
#include <string>
#include <string_view>
#include <vector>

#include "cleave/common/status.h"

namespace YAML {
class Node;
}

namespace cleave {

class SettingsRegistry {
 public:
  struct Setting {
    std::string key;           // "engine.threads"
    std::string env;           // "CLEAVE_ENGINE_THREADS"
    std::string flag;          // "--threads", or empty when the setting has no flag
    std::string help;
    std::string type;          // "int", "float", "bool", "string", or "a|b|c" for enums
    std::string default_value; // rendered at registration time
    std::string source = "default";  // where the current value came from
    std::function<Status(std::string_view)> set;
    std::function<std::string()> get;
  };

  // Fields must outlive the registry. Ranges are inclusive.
  void add_int(std::string key, int64_t* field, std::string help, int64_t min, int64_t max,
               std::string flag = "");
  void add_float(std::string key, double* field, std::string help, double min, double max,
                 std::string flag = "");
  void add_bool(std::string key, bool* field, std::string help, std::string flag = "");
  void add_string(std::string key, std::string* field, std::string help, std::string flag = "");
  void add_enum(std::string key, std::string* field, std::vector<std::string> choices,
                std::string help, std::string flag = "");

  // Sets one setting from text; InvalidArgument names the key, the value and what is allowed.
  Status set(std::string_view key, std::string_view value, std::string_view source);
  // "key=value" (as given to --set).
  Status set_assignment(std::string_view assignment, std::string_view source);
  // A YAML file, or a directory as described above.
  Status load_yaml_file(const std::string& path);
  Status load_yaml_string(std::string_view yaml, std::string_view source_name);
  // Reads every registered setting's env variable through `getenv_fn` (default ::getenv).
  Status load_env(const std::function<const char*(const char*)>& getenv_fn = nullptr);

  // A profile of the file (keys and values checked when the file is read).
  struct Profile {
    std::string source;                                       // the file that defined it
    std::vector<std::pair<std::string, std::string>> common;  // every role
    std::map<std::string, std::vector<std::pair<std::string, std::string>>, std::less<>> by_role;
  };
  const std::map<std::string, Profile, std::less<>>& profiles() const { return profiles_; }
  // Applies profile `name` for a worker of `role` to every setting whose value comes from the
  // defaults or a file (env and flags keep theirs); the source reads "profile NAME (FILE)".
  // Returns the keys it set. NotFound when there is no such profile.
  Result<std::vector<std::string>> apply_profile(std::string_view name, std::string_view role);

  const std::vector<Setting>& settings() const { return settings_; }
  const Setting* find(std::string_view key) const;
  // The effective configuration as YAML, with each value's source as a comment.
  std::string to_yaml() const;
  // | Setting | Default | Env | Flag | Description | rows, for the README.
  std::string markdown_table() const;

 private:
  Setting& add(std::string key, std::string help, std::string type, std::string flag);
  Status load_directory(const std::string& dir);
  Status read_profiles(const YAML::Node& profiles, std::string_view source_name);
  std::vector<Setting> settings_;
  std::map<std::string, size_t, std::less<>> index_;
  std::map<std::string, Profile, std::less<>> profiles_;
};

// "engine.threads" -> "CLEAVE_ENGINE_THREADS".
std::string env_name_for_key(std::string_view key);

// ---- common's own settings ----

struct LogSettings {
  std::string level = "info";
};

// Binds log.* to `registry` (the field must outlive it). Every other module binds its own
// settings (model/model_settings.h, engine/engine_settings.h, transfer/transfer_settings.h,
// worker/worker_settings.h, router/router_settings.h); the command line composes them all in
// one registry (cli/config.h).
void register_log_settings(LogSettings& settings, SettingsRegistry& registry);

// Applies file (when non-empty) < env < overrides ("key=value" each, from flags) on top of the
// defaults already in the fields bound to `registry`.
Status load_config(SettingsRegistry& registry, const std::string& file,
                   const std::vector<std::string>& overrides);

// A worker's profile, once its settings are loaded: reads `instance_type` (worker.instance_type;
// from the file it names when it starts with '@', and puts the value read there), picks the
// profile of that name, else `default`, else none, and applies it for `role` (worker.role;
// SettingsRegistry::apply_profile). Sets `profile` (worker.profile) to the name chosen ("" for
// none) and returns a line for the log saying what was chosen and set.
Result<std::string> select_worker_profile(SettingsRegistry& registry, std::string& instance_type,
                                          std::string_view role, std::string& profile);

}  // namespace cleave
