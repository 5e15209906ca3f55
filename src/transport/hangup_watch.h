// A process's watch over sockets whose hang-up must wake someone asleep on a futex: one
// thread, started with the first watch and stopped (joined, its fds closed) with the last,
// blocked in epoll_wait on the watched sockets.
//
// Why it exists: a Connection's receiver sleeps on its ring's futex, and a peer killed by
// SIGKILL calls no close() that would wake it; only its socket says it is gone. Without a
// watch the receiver sleeps in 50 ms slices and looks at the socket between them, and a
// futex wait with a time limit costs a kernel timer each time it sleeps (its share of a
// round trip: docs/history.md, "Sleeping without a timer"). With one, it
// sleeps with no time limit and the watch wakes it when the socket hangs up
// (docs/transport.md, "The hang-up watch").
//
// The thread blocks every signal (a signal for the process is never delivered to it), has
// a 64 KiB stack, and is named "shmtensor-watch". A forked child starts with no watch and
// no thread (the fork handlers close the fds it inherited); its first watch starts its own.
#pragma once

#include <cstddef>
#include <cstdint>

namespace shmtensor::internal {

// Calls fire(context) once, on the watch's thread, when `sock` hangs up (EPOLLHUP,
// EPOLLRDHUP or EPOLLERR), or at once if it has already. fire runs under the watch's lock:
// it must be quick, must not throw, and must not call watch_hangup or unwatch_hangup.
// Returns the watch's id, or 0 when none could be made (no thread or fd could be had, or
// epoll refused the socket): the caller must then not count on being woken.
std::uint64_t watch_hangup(int sock, void (*fire)(void* context), void* context) noexcept;

// Ends a watch, before its socket is closed and its context freed: once this returns, fire
// is neither running nor will run for `id`. Ending the last watch stops the thread. An id
// that is not a live watch of this process (0, ended, or made before a fork in the parent)
// is ignored.
void unwatch_hangup(std::uint64_t id) noexcept;

// For tests: whether this process's watch thread is running, and how many watches it has.
bool hangup_watch_running() noexcept;
std::size_t hangup_watch_count() noexcept;

}  // namespace shmtensor::internal
