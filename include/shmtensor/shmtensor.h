// The whole public API of shmtensor.
#pragma once

#include "shmtensor/collate.h"
#include "shmtensor/data_loader.h"
#include "shmtensor/dtype.h"
#include "shmtensor/error.h"
#include "shmtensor/pool.h"
#include "shmtensor/process.h"
#include "shmtensor/sampler.h"
#include "shmtensor/sharing_strategy.h"
#include "shmtensor/spawn.h"
#include "shmtensor/start_method.h"
#include "shmtensor/storage.h"
#include "shmtensor/tensor.h"
