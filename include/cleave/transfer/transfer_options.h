// Settings of the libfabric transfer engine. Plain fields with defaults in code; the config
// registry binds them to keys `transfer.*` (int64_t / std::string / bool, as the registry wants).
#pragma once

#include "cleave/common/config.h"

namespace cleave::transfer {

// Defined with the rest of the configuration (cleave/common/config.h) so that one file, one
// registry and one settings table cover every subsystem.
using TransferSettings = ::cleave::TransferSettings;

}  // namespace cleave::transfer
