// The control-plane client moved to the control module (cleave::control); this header keeps
// the old include working.
#pragma once

#include "cleave/control/worker_client.h"
