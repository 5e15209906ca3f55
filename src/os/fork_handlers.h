// The fork coordinator (os/fork_handlers.cc). Its declarations are in the library's
// installed internal headers, because the torch bridge (libshmtensor_torch, which sees only
// those) installs its handlers into it too.
#pragma once

#include "shmtensor/internal/fork_handlers.h"
