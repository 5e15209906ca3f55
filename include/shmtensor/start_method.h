// How a child process starts, and the hook a re-executed child needs.
#pragma once

#include "shmtensor/export.h"

namespace shmtensor {

// kFork: the child is a fork of the caller and runs any callable with its captures
//   (cheap; inherits queues, connections and every other object). Unsafe when the caller
//   has other threads that hold locks (CUDA, some thread pools): the child has one thread.
// kExec: the child is this program again (/proc/self/exe, started by posix_spawn) with the
//   same command line; shmtensor::init() at the top of main then runs the function. Only a
//   plain function or a captureless lambda can run this way (see docs/processes.md), and
//   its arguments travel as encoded values.
enum class StartMethod { kFork, kExec };

// Call at the top of main, before anything else: in a process started by the exec start
// method it runs that process's function and ends the process (never returning); anywhere
// else it does nothing. argc/argv are not needed and may be 0/nullptr.
//
// Where you do not own main (GoogleTest's gtest_main), call it from a global test
// environment's SetUp(): that runs after all static initialization and before any test.
// Calling it from a static initializer also works, but then the function may run before
// other globals of the program are constructed.
SHMTENSOR_API void init(int argc, char** argv);

// True in a process started by the exec start method whose function has not run yet (that
// is, before init()). Cheap (reads the environment); safe in a static initializer.
SHMTENSOR_API bool is_exec_child() noexcept;

}  // namespace shmtensor
