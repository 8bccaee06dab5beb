#include "cleave/common/config.h"

#include <cerrno>
#include <cmath>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <set>
#include <sstream>

#include "config_internal.h"
#include "fmt/format.h"
#include "yaml-cpp/yaml.h"

namespace cleave {
namespace {

std::string trim(std::string_view s) {
  size_t b = 0, e = s.size();
  while (b < e && (s[b] == ' ' || s[b] == '\t')) ++b;
  while (e > b && (s[e - 1] == ' ' || s[e - 1] == '\t')) --e;
  return std::string(s.substr(b, e - b));
}

std::string join(const std::vector<std::string>& v, std::string_view sep) {
  std::string out;
  for (size_t i = 0; i < v.size(); ++i) {
    if (i) out += sep;
    out += v[i];
  }
  return out;
}

// Flattens a YAML mapping into dotted keys; sequences are refused (no setting takes a list yet).
Status flatten(const YAML::Node& node, const std::string& prefix, std::string_view source,
               std::vector<std::pair<std::string, std::string>>& out) {
  if (!node.IsMap()) {
    return InvalidArgument(fmt::format("{}: '{}' must be a mapping", source,
                                       prefix.empty() ? "<top level>" : prefix));
  }
  for (const auto& kv : node) {
    std::string key = kv.first.as<std::string>();
    std::string full = prefix.empty() ? key : prefix + "." + key;
    const YAML::Node& v = kv.second;
    if (v.IsMap()) {
      CLEAVE_RETURN_IF_ERROR(flatten(v, full, source, out));
    } else if (v.IsScalar()) {
      out.emplace_back(full, v.Scalar());
    } else if (v.IsNull()) {
      out.emplace_back(full, "");
    } else {
      return InvalidArgument(fmt::format("{}: '{}' must be a single value", source, full));
    }
  }
  return Status::Ok();
}

}  // namespace

namespace config_internal {
Status flatten_yaml(const YAML::Node& node, const std::string& prefix, std::string_view source,
                    std::vector<std::pair<std::string, std::string>>& out) {
  return flatten(node, prefix, source, out);
}
}  // namespace config_internal

std::string env_name_for_key(std::string_view key) {
  std::string env = "CLEAVE_";
  for (char c : key) {
    if (c == '.' || c == '-') env += '_';
    else if (c >= 'a' && c <= 'z') env += static_cast<char>(c - 'a' + 'A');
    else env += c;
  }
  return env;
}

SettingsRegistry::Setting& SettingsRegistry::add(std::string key, std::string help,
                                                 std::string type, std::string flag) {
  index_[key] = settings_.size();
  Setting s;
  s.env = env_name_for_key(key);
  s.key = std::move(key);
  s.help = std::move(help);
  s.type = std::move(type);
  s.flag = std::move(flag);
  settings_.push_back(std::move(s));
  return settings_.back();
}

void SettingsRegistry::add_int(std::string key, int64_t* field, std::string help, int64_t min,
                               int64_t max, std::string flag) {
  Setting& s = add(key, std::move(help), "int", std::move(flag));
  s.get = [field] { return std::to_string(*field); };
  s.set = [field, key, min, max](std::string_view text) -> Status {
    std::string t = trim(text);
    errno = 0;
    char* end = nullptr;
    long long v = std::strtoll(t.c_str(), &end, 10);
    if (t.empty() || *end != '\0' || errno == ERANGE)
      return InvalidArgument(fmt::format("{}: '{}' is not an integer", key, text));
    if (v < min || v > max)
      return InvalidArgument(fmt::format("{}: {} is out of range [{}, {}]", key, v, min, max));
    *field = v;
    return Status::Ok();
  };
  s.default_value = s.get();
}

void SettingsRegistry::add_float(std::string key, double* field, std::string help, double min,
                                 double max, std::string flag) {
  Setting& s = add(key, std::move(help), "float", std::move(flag));
  s.get = [field] { return fmt::format("{}", *field); };
  s.set = [field, key, min, max](std::string_view text) -> Status {
    std::string t = trim(text);
    char* end = nullptr;
    double v = std::strtod(t.c_str(), &end);
    if (t.empty() || *end != '\0' || !std::isfinite(v))
      return InvalidArgument(fmt::format("{}: '{}' is not a number", key, text));
    if (v < min || v > max)
      return InvalidArgument(fmt::format("{}: {} is out of range [{}, {}]", key, v, min, max));
    *field = v;
    return Status::Ok();
  };
  s.default_value = s.get();
}

void SettingsRegistry::add_bool(std::string key, bool* field, std::string help, std::string flag) {
  Setting& s = add(key, std::move(help), "bool", std::move(flag));
  s.get = [field] { return std::string(*field ? "true" : "false"); };
  s.set = [field, key](std::string_view text) -> Status {
    std::string t = trim(text);
    for (auto& c : t) c = static_cast<char>(std::tolower(static_cast<unsigned char>(c)));
    if (t == "true" || t == "1" || t == "yes" || t == "on") *field = true;
    else if (t == "false" || t == "0" || t == "no" || t == "off") *field = false;
    else return InvalidArgument(fmt::format("{}: '{}' is not a boolean (true/false)", key, text));
    return Status::Ok();
  };
  s.default_value = s.get();
}

void SettingsRegistry::add_string(std::string key, std::string* field, std::string help,
                                  std::string flag) {
  Setting& s = add(key, std::move(help), "string", std::move(flag));
  s.get = [field] { return *field; };
  s.set = [field](std::string_view text) -> Status {
    *field = std::string(text);
    return Status::Ok();
  };
  s.default_value = s.get();
}

void SettingsRegistry::add_enum(std::string key, std::string* field,
                                std::vector<std::string> choices, std::string help,
                                std::string flag) {
  Setting& s = add(key, std::move(help), join(choices, "|"), std::move(flag));
  s.get = [field] { return *field; };
  s.set = [field, key, choices](std::string_view text) -> Status {
    std::string t = trim(text);
    for (const auto& c : choices) {
      if (c == t) {
        *field = t;
        return Status::Ok();
      }
    }
    return InvalidArgument(
        fmt::format("{}: '{}' is not one of {}", key, text, join(choices, ", ")));
  };
  s.default_value = s.get();
}

const SettingsRegistry::Setting* SettingsRegistry::find(std::string_view key) const {
  auto it = index_.find(key);
  return it == index_.end() ? nullptr : &settings_[it->second];
}

Status SettingsRegistry::set(std::string_view key, std::string_view value,
                             std::string_view source) {
  auto it = index_.find(key);
  if (it == index_.end())
    return InvalidArgument(fmt::format("{}: unknown setting '{}'", source, key));
  Setting& s = settings_[it->second];
  Status st = s.set(value);
  if (!st.ok()) return st.with_context(source);
  s.source = std::string(source);
  return Status::Ok();
}

Status SettingsRegistry::set_assignment(std::string_view assignment, std::string_view source) {
  size_t eq = assignment.find('=');
  if (eq == std::string_view::npos || eq == 0)
    return InvalidArgument(fmt::format("{}: '{}' is not of the form key=value", source, assignment));
  return set(trim(assignment.substr(0, eq)), assignment.substr(eq + 1), source);
}

Status SettingsRegistry::load_yaml_string(std::string_view yaml, std::string_view source_name) {
  std::vector<std::pair<std::string, std::string>> flat;
  try {
    YAML::Node root = YAML::Load(std::string(yaml));
    if (root.IsNull()) return Status::Ok();  // an empty file is a valid, empty config
    if (root.IsMap() && root["profiles"]) {
      CLEAVE_RETURN_IF_ERROR(read_profiles(root["profiles"], source_name));
      root.remove("profiles");
    }
    CLEAVE_RETURN_IF_ERROR(flatten(root, "", source_name, flat));
  } catch (const YAML::Exception& e) {
    return InvalidArgument(fmt::format("{}: YAML error: {}", source_name, e.what()));
  }
  for (const auto& [k, v] : flat) CLEAVE_RETURN_IF_ERROR(set(k, v, source_name));
  return Status::Ok();
}

Status SettingsRegistry::load_yaml_file(const std::string& path) {
  std::error_code ec;
  if (std::filesystem::is_directory(path, ec)) return load_directory(path);
  std::ifstream in(path);
  if (!in) return NotFound(fmt::format("cannot read config file '{}'", path));
  std::stringstream ss;
  ss << in.rdbuf();
  return load_yaml_string(ss.str(), path);
}

Status SettingsRegistry::load_env(const std::function<const char*(const char*)>& getenv_fn) {
  for (auto& s : settings_) {
    const char* v = getenv_fn ? getenv_fn(s.env.c_str()) : std::getenv(s.env.c_str());
    if (v != nullptr) CLEAVE_RETURN_IF_ERROR(set(s.key, v, "env " + s.env));
  }
  return Status::Ok();
}

std::string SettingsRegistry::to_yaml() const {
  // Group by the first key component; keys have at most two levels today, but render any depth.
  YAML::Emitter out;
  out << YAML::BeginMap;
  std::string open_section;
  for (const auto& s : settings_) {
    size_t dot = s.key.find('.');
    std::string section = dot == std::string::npos ? "" : s.key.substr(0, dot);
    std::string leaf = dot == std::string::npos ? s.key : s.key.substr(dot + 1);
    if (section != open_section) {
      if (!open_section.empty()) out << YAML::EndMap;
      if (!section.empty()) out << YAML::Key << section << YAML::Value << YAML::BeginMap;
      open_section = section;
    }
    out << YAML::Key << leaf << YAML::Value << s.get() << YAML::Comment(s.source);
  }
  if (!open_section.empty()) out << YAML::EndMap;
  out << YAML::EndMap;
  return std::string(out.c_str()) + "\n";
}

std::string SettingsRegistry::markdown_table() const {
  std::string t = "| Setting | Type | Default | Env | Flag | Description |\n";
  t += "|---|---|---|---|---|---|\n";
  for (const auto& s : settings_) {
    std::string type;
    for (char c : s.type) type += c == '|' ? std::string("\\|") : std::string(1, c);
    t += fmt::format("| `{}` | {} | `{}` | `{}` | {} | {} |\n", s.key, type,
                     s.default_value.empty() ? "\"\"" : s.default_value, s.env,
                     s.flag.empty() ? "" : "`" + s.flag + "`", s.help);
  }
  return t;
}

void register_log_settings(LogSettings& l, SettingsRegistry& r) {
  r.add_enum("log.level", &l.level, {"trace", "debug", "info", "warn", "error", "off"},
             "Log level (logs go to stderr).", "--log-level");
}

Status load_config(SettingsRegistry& registry, const std::string& file,
                   const std::vector<std::string>& overrides) {
  if (!file.empty()) CLEAVE_RETURN_IF_ERROR(registry.load_yaml_file(file));
  CLEAVE_RETURN_IF_ERROR(registry.load_env());
  for (const auto& o : overrides) CLEAVE_RETURN_IF_ERROR(registry.set_assignment(o, "flag"));
  return Status::Ok();
}

}  // namespace cleave
