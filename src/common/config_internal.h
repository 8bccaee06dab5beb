// What config.cpp shares with config_profiles.cpp (not part of the public interface).
#pragma once

#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "cleave/common/status.h"
#include "yaml-cpp/yaml.h"

namespace cleave::config_internal {

// A YAML mapping as dotted keys and scalar values ("engine.threads" -> "4"); InvalidArgument
// naming `source` for a sequence or a non-mapping where a mapping belongs.
Status flatten_yaml(const YAML::Node& node, const std::string& prefix, std::string_view source,
                    std::vector<std::pair<std::string, std::string>>& out);

}  // namespace cleave::config_internal
