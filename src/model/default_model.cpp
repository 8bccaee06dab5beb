#include "cleave/model/default_model.h"

#include <sys/stat.h>
#include <unistd.h>

#include <cstdlib>
#include <filesystem>
#include <system_error>

#include "cleave/common/log.h"
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

Result<std::string> ensure_default_model() {
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

}  // namespace cleave
