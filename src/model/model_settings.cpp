#include "cleave/model/model_settings.h"

namespace cleave {

void register_model_settings(ModelSettings& m, SettingsRegistry& r) {
  r.add_string("model.path", &m.path,
               "GGUF file or Hugging Face model directory; empty serves the embedded default.",
               "--model");
}

}  // namespace cleave
