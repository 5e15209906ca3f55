// The whole public API of shmtensor.
#pragma once

#include "shmtensor/dtype.h"
#include "shmtensor/error.h"
#include "shmtensor/pool.h"
#include "shmtensor/process.h"
#include "shmtensor/sharing_strategy.h"
#include "shmtensor/spawn.h"
#include "shmtensor/start_method.h"
#include "shmtensor/storage.h"
#include "shmtensor/tensor.h"
