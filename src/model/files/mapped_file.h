// Read-only memory mapping of a whole file, shared by the model-file readers.
#pragma once

#include <cstddef>
#include <memory>
#include <span>
#include <string>

#include "cleave/common/status.h"

namespace cleave {

struct MappedFile {
  std::shared_ptr<void> mapping;  // unmaps when the last copy goes
  std::span<const std::byte> bytes;
};

// NotFound when the file cannot be opened, InvalidArgument when it is not a regular file,
// DataLoss when it is empty.
Result<MappedFile> map_file_readonly(const std::string& path);

}  // namespace cleave
