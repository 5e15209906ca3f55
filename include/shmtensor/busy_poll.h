// Opt-in busy polling for latency-critical receivers: Connection::recv and Queue::get look
// for a message, without sleeping, for a short while before they block.
//
// A blocking receive spins a few microseconds (4) on the message ring, then sleeps in the
// kernel and is woken when the message arrives; on a machine with several CPUs that
// wake-up can cost tens of microseconds (a sleeping CPU, or a wake-up sent to another
// one). A receiver that polls keeps spinning for up to the budget instead, and sees the
// message within tens of nanoseconds of its publication, at the price of the CPU time it
// spends polling.
//
//   shmtensor::set_busy_poll(std::chrono::microseconds(50));  // this process, every thread
//
// Each receive polls for at most the budget, then blocks as before (after the 4 µs spin
// every blocking receive makes): a receiver with nothing to receive never burns a CPU for
// more than the budget plus 4 µs per call. The budget adapts per
// thread to how long its receives wait: a message that came within the budget set makes
// the next poll twice that wait, a longer wait (or none) halves it, down to 1/64 of the
// budget set; every 64th receive polls for the whole budget, so that two peers that both
// block find out when polling on both sides would pay. A process
// that may run on one CPU only (its affinity mask, as `taskset -c 0` sets it) never polls:
// its peer would need the CPU it spins on. Off by default. One queue's gets can have a
// budget of their own in place of the process's: Queue::set_busy_poll (queue.h).
#pragma once

#include "shmtensor/export.h"
#include "shmtensor/timeout.h"

namespace shmtensor {

// Sets this process's busy-poll budget: how long a receive may poll before it blocks.
// Duration(0) turns polling off (the default). The environment variable
// SHMTENSOR_BUSY_POLL_US (microseconds) sets the starting value. Throws
// std::invalid_argument for a negative budget or one above 1 second.
SHMTENSOR_API void set_busy_poll(Duration budget);
// The budget set (Duration(0): off).
SHMTENSOR_API Duration get_busy_poll();

}  // namespace shmtensor
