// The embedded default model: a small synthetic Llama (see synth.h) that cleave serves when the
// user names no model. It is generated once, deterministically, into the cache directory
// ($CLEAVE_CACHE_DIR, else $XDG_CACHE_HOME/cleave, else $HOME/.cache/cleave, else
// /tmp/cleave-cache) and reused afterwards. Concurrent callers are safe: the file is written
// under a temporary name and renamed into place.
#pragma once

#include <string>

#include "cleave/common/status.h"
#include "cleave/model/synth.h"

namespace cleave {

SynthOptions default_model_options();
std::string default_model_cache_dir();
// The path of the default model, generating it first when it is not there yet.
Result<std::string> ensure_default_model();

}  // namespace cleave
