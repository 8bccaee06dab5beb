// Config directories (a mounted ConfigMap), the `profiles:` section, and a worker's choice of
// profile from its node's instance type.
#include <algorithm>
#include <filesystem>
#include <fstream>
#include <map>
#include <set>
#include <sstream>

#include "cleave/common/config.h"
#include "config_internal.h"
#include "fmt/format.h"

namespace cleave {
namespace {

namespace fs = std::filesystem;

constexpr std::string_view kRoles[] = {"prefill", "decode", "unified"};
// Settings a profile cannot set: they decide which profile applies.
constexpr std::string_view kNotInProfiles[] = {"worker.role", "worker.instance_type"};

std::string trim_space(std::string_view s) {
  size_t b = 0, e = s.size();
  while (b < e && (s[b] == ' ' || s[b] == '\t' || s[b] == '\n' || s[b] == '\r')) ++b;
  while (e > b && (s[e - 1] == ' ' || s[e - 1] == '\t' || s[e - 1] == '\n' || s[e - 1] == '\r'))
    --e;
  return std::string(s.substr(b, e - b));
}

Result<std::string> read_text(const std::string& path) {
  std::ifstream in(path);
  if (!in) return NotFound(fmt::format("cannot read '{}'", path));
  std::stringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

bool is_role(std::string_view s) {
  return std::find(std::begin(kRoles), std::end(kRoles), s) != std::end(kRoles);
}

bool file_source(const std::string& source) {
  return source != "flag" && source.rfind("env ", 0) != 0 && source.rfind("profile ", 0) != 0;
}

}  // namespace

Status SettingsRegistry::load_directory(const std::string& dir) {
  std::error_code ec;
  std::vector<std::string> names;
  for (const auto& entry : fs::directory_iterator(dir, ec)) {
    std::string name = entry.path().filename().string();
    // A mounted ConfigMap also holds "..data" and "..<timestamp>" (its atomic-update links).
    if (name.empty() || name[0] == '.') continue;
    names.push_back(std::move(name));
  }
  if (ec) return NotFound(fmt::format("cannot read config directory '{}': {}", dir, ec.message()));
  std::sort(names.begin(), names.end());
  auto is_yaml = [](const std::string& n) {
    return n.size() > 5 && n.compare(n.size() - 5, 5, ".yaml") == 0;
  };
  // The YAML files first, in name order; a setting in two of them is an error.
  std::set<std::string> yaml_paths;
  for (const std::string& name : names) {
    if (!is_yaml(name)) continue;
    const std::string path = (fs::path(dir) / name).string();
    std::map<std::string, std::string> before;
    for (const Setting& s : settings_) {
      if (yaml_paths.count(s.source) > 0) before[s.key] = s.source;
    }
    CLEAVE_RETURN_IF_ERROR(load_yaml_file(path));
    for (const Setting& s : settings_) {
      auto it = before.find(s.key);
      if (it != before.end() && s.source == path) {
        return InvalidArgument(
            fmt::format("{} is set twice: in {} and in {}", s.key, it->second, path));
      }
    }
    yaml_paths.insert(path);
  }
  // Then one file per setting.
  for (const std::string& name : names) {
    if (is_yaml(name)) continue;
    const std::string path = (fs::path(dir) / name).string();
    if (!fs::is_regular_file(path, ec)) continue;
    const Setting* s = find(name);
    if (s == nullptr) {
      return InvalidArgument(fmt::format(
          "{}: no setting is named '{}' (a config directory holds *.yaml files and files named "
          "after setting keys, e.g. pools.prefill.replicas)",
          path, name));
    }
    if (yaml_paths.count(s->source) > 0) {
      return InvalidArgument(
          fmt::format("{} is set twice: in {} and in {}", name, s->source, path));
    }
    CLEAVE_ASSIGN_OR_RETURN(std::string text, read_text(path));
    CLEAVE_RETURN_IF_ERROR(set(name, trim_space(text), path));
  }
  return Status::Ok();
}

Status SettingsRegistry::read_profiles(const YAML::Node& profiles, std::string_view source_name) {
  using config_internal::flatten_yaml;
  if (!profiles.IsMap()) {
    return InvalidArgument(fmt::format(
        "{}: 'profiles' must map profile names (instance types, or default) to settings",
        source_name));
  }
  // Each value must be one the setting accepts; checked on the field, which is then restored.
  auto check = [&](const std::string& where,
                   const std::vector<std::pair<std::string, std::string>>& flat) -> Status {
    for (const auto& [key, value] : flat) {
      const std::string full = fmt::format("{}.{}", where, key);
      auto it = index_.find(key);
      if (it == index_.end()) {
        return InvalidArgument(
            fmt::format("{}: unknown setting '{}' (in {})", source_name, key, full));
      }
      if (std::find(std::begin(kNotInProfiles), std::end(kNotInProfiles), key) !=
          std::end(kNotInProfiles)) {
        return InvalidArgument(fmt::format(
            "{}: {}: a profile cannot set {} (it selects the profile)", source_name, full, key));
      }
      Setting& s = settings_[it->second];
      const std::string before = s.get();
      Status st = s.set(value);
      (void)s.set(before);
      if (!st.ok()) return st.with_context(fmt::format("{}: {}", source_name, full));
    }
    return Status::Ok();
  };
  for (const auto& kv : profiles) {
    const std::string name = kv.first.as<std::string>();
    const std::string where = "profiles." + name;
    if (!kv.second.IsMap()) {
      return InvalidArgument(
          fmt::format("{}: '{}' must be a mapping of settings", source_name, where));
    }
    if (auto it = profiles_.find(name); it != profiles_.end()) {
      return InvalidArgument(fmt::format("{}: profile '{}' is defined twice (in {} and here)",
                                         source_name, name, it->second.source));
    }
    Profile p;
    p.source = std::string(source_name);
    for (const auto& entry : kv.second) {
      const std::string key = entry.first.as<std::string>();
      if (is_role(key)) {
        if (!entry.second.IsMap()) {
          return InvalidArgument(
              fmt::format("{}: '{}.{}' must be a mapping of settings", source_name, where, key));
        }
        std::vector<std::pair<std::string, std::string>> flat;
        CLEAVE_RETURN_IF_ERROR(flatten_yaml(entry.second, "", source_name, flat));
        CLEAVE_RETURN_IF_ERROR(check(where + "." + key, flat));
        auto& list = p.by_role[key];
        list.insert(list.end(), flat.begin(), flat.end());
        continue;
      }
      YAML::Node one;
      one[key] = entry.second;
      std::vector<std::pair<std::string, std::string>> flat;
      CLEAVE_RETURN_IF_ERROR(flatten_yaml(one, "", source_name, flat));
      CLEAVE_RETURN_IF_ERROR(check(where, flat));
      p.common.insert(p.common.end(), flat.begin(), flat.end());
    }
    profiles_[name] = std::move(p);
  }
  return Status::Ok();
}

Result<std::vector<std::string>> SettingsRegistry::apply_profile(std::string_view name,
                                                                 std::string_view role) {
  auto it = profiles_.find(name);
  if (it == profiles_.end()) return NotFound(fmt::format("no profile named '{}'", name));
  const Profile& p = it->second;
  const std::string source = fmt::format("profile {} ({})", name, p.source);
  std::vector<std::string> keys;
  auto apply = [&](const std::vector<std::pair<std::string, std::string>>& list) -> Status {
    for (const auto& [key, value] : list) {
      const Setting* s = find(key);
      if (s == nullptr)
        return InvalidArgument(fmt::format("{}: unknown setting '{}'", source, key));
      if (!file_source(s->source) && s->source != source) continue;  // env and flags win
      CLEAVE_RETURN_IF_ERROR(set(key, value, source));
      if (std::find(keys.begin(), keys.end(), key) == keys.end()) keys.push_back(key);
    }
    return Status::Ok();
  };
  CLEAVE_RETURN_IF_ERROR(apply(p.common));
  if (auto r = p.by_role.find(role); r != p.by_role.end()) CLEAVE_RETURN_IF_ERROR(apply(r->second));
  return keys;
}

Result<std::string> select_worker_profile(SettingsRegistry& registry, std::string& instance_type,
                                          std::string_view role, std::string& profile) {
  std::string& type = instance_type;
  if (!type.empty() && type[0] == '@') {
    const std::string path = type.substr(1);
    Result<std::string> text = read_text(path);
    if (!text.ok()) {
      return NotFound(fmt::format("worker.instance_type: {} (the file the node-info step writes)",
                                  text.status().message()));
    }
    type = trim_space(*text);
  }
  const auto& profiles = registry.profiles();
  std::string name;
  if (!type.empty() && profiles.count(type) > 0) {
    name = type;
  } else if (profiles.count("default") > 0) {
    name = "default";
  }
  const std::string what =
      type.empty() ? std::string("no instance type") : fmt::format("instance type '{}'", type);
  profile = name;
  if (name.empty()) {
    if (profiles.empty()) return fmt::format("{}; no profiles configured", what);
    std::vector<std::string> names;
    for (const auto& [n, p] : profiles) names.push_back(n);
    return fmt::format(
        "{}: no profile of that name and no 'default' (profiles: {}); using the "
        "settings as they are",
        what, fmt::join(names, ", "));
  }
  CLEAVE_ASSIGN_OR_RETURN(std::vector<std::string> keys,
                          registry.apply_profile(name, role));
  std::vector<std::string> set;
  for (const std::string& k : keys) set.push_back(fmt::format("{}={}", k, registry.find(k)->get()));
  return fmt::format(
      "{}: profile '{}' for the {} role ({})", what, name, role,
      set.empty() ? std::string("nothing to set") : fmt::format("{}", fmt::join(set, ", ")));
}

}  // namespace cleave
