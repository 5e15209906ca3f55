// Describing an exception as text, for reporting it to another process. Internal.
#pragma once

#include <string>

#include "shmtensor/export.h"

namespace shmtensor::internal {

// "<demangled type>: <what()>" of the exception being handled (call inside a catch block;
// "(not derived from std::exception; no message)" stands for a missing what()).
SHMTENSOR_API std::string describe_current_exception();

}  // namespace shmtensor::internal
