// The model module's settings (model.*): plain fields with defaults in code, bound to the
// settings registry (cleave/common/config.h) by register_model_settings.
#pragma once

#include <string>

#include "cleave/common/config.h"

namespace cleave {

struct ModelSettings {
  std::string path;  // GGUF file or HF directory; empty = the embedded default model
};

// Binds model.* to `registry` (the field must outlive it).
void register_model_settings(ModelSettings& settings, SettingsRegistry& registry);

}  // namespace cleave
