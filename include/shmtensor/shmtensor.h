// The whole public API of shmtensor: every header of include/shmtensor/, so that `#include
// <shmtensor/shmtensor.h>` gives every public type (tests/docs/umbrella_check.sh keeps this
// true). Those of include/shmtensor/internal/ are what these need; users do not include them.
#pragma once

#include "shmtensor/broadcast.h"
#include "shmtensor/busy_poll.h"
#include "shmtensor/codec.h"
#include "shmtensor/collate.h"
#include "shmtensor/connection.h"
#include "shmtensor/data_loader.h"
#include "shmtensor/data_loader_errors.h"
#include "shmtensor/device.h"
#include "shmtensor/dtype.h"
#include "shmtensor/error.h"
#include "shmtensor/pool.h"
#include "shmtensor/pool_results.h"
#include "shmtensor/process.h"
#include "shmtensor/queue.h"
#include "shmtensor/sampler.h"
#include "shmtensor/sharing_strategy.h"
#include "shmtensor/spawn.h"
#include "shmtensor/start_method.h"
#include "shmtensor/storage.h"
#include "shmtensor/tensor.h"
#include "shmtensor/timeout.h"
