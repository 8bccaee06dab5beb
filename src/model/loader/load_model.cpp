#include <filesystem>

#include "cleave/model/model_file.h"
#include "fmt/format.h"
#include "loaders.h"

namespace cleave {

Result<std::unique_ptr<ModelFile>> load_model(const std::string& path) {
  std::error_code ec;
  const auto st = std::filesystem::status(path, ec);
  if (ec || !std::filesystem::exists(st))
    return NotFound(fmt::format("model '{}' does not exist", path));
  Result<std::unique_ptr<ModelFile>> m =
      std::filesystem::is_directory(st) ? detail::load_hf_model(path) : detail::load_gguf_model(path);
  if (!m.ok()) return m.status();
  CLEAVE_RETURN_IF_ERROR((*m)->validate_tensors());
  return m;
}

}  // namespace cleave
