// Settings of the libfabric transfer engine. Plain fields with defaults in code; the config
// registry binds them to keys `transfer.*` (int64_t / std::string / bool, as the registry wants).
#pragma once

#include "cleave/transfer/transfer_settings.h"

namespace cleave::transfer {

// Defined in transfer_settings.h with its registration; the command line composes every
// module's settings in one registry and one settings table (cli/config.h).
using TransferSettings = ::cleave::TransferSettings;

}  // namespace cleave::transfer
