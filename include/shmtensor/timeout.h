// How long a call may wait: the one timeout type of the API.
#pragma once

#include <chrono>
#include <optional>

namespace shmtensor {

// A length of time in seconds. Every std::chrono duration converts to it implicitly:
// 5s, 100ms, Duration(0.25).
using Duration = std::chrono::duration<double>;

// The longest a call waits: a Duration, or std::nullopt to wait as long as it takes. A
// duration converts to it implicitly, so `p.join(5s)` and `p.join()` both read naturally.
// Zero or less means: do not wait, only look (except DataLoaderOptions::timeout, where 0
// means no limit, as torch's timeout=0).
using Timeout = std::optional<Duration>;

}  // namespace shmtensor
