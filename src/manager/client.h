// The library's side of the manager daemon (shmtensor-manager), used by the memory layer
// for file_system segments. Every name is registered before it is created, so no crash
// window exists in which a name is unknown to the manager.
//
// Installs itself as the memory layer's SegmentObserver (memory/segment_observer.h) when
// the program starts; client.cc says how that survives static linking.
//
// Thread-safe (one mutex). A process is connected while it holds names, and disconnects
// when it holds none (so an idle process keeps no fd and the daemon can exit). Messages
// are one-way except the hello that opens a connection: registering a name costs one
// send(). While connected, a thread of the client watches the connection: when the
// daemon's end closes (it was killed), it starts a replacement at once, reconnects and
// re-registers what this process holds (the replacement carries on from the dead one's
// journal and sweeps). A send that finds the daemon gone (EPIPE, never SIGPIPE) does the
// same. The watching thread exists only while connected.
//
// fork: the child never uses its parent's connection. pthread_atfork handlers announce the
// fork (the parent sends kForkBegin before it; the child sends kForkChild, one non-blocking
// send of a preformatted message, on the inherited socket and closes it), so the daemon
// knows that the child holds every name its parent held, even if the child never calls
// the library again. The child connects on its own when it next needs to.
#pragma once

#include <sys/types.h>

#include <string>

#include "memory/channel_registry.h"
#include "os/unique_fd.h"

namespace shmtensor::internal::manager {

// Before shm_open(O_CREAT|O_EXCL) of `name` (e.g. "/shmtensor_12_ab..._3").
// Starts the daemon if none runs. Throws Error saying why and where it looked if the
// daemon cannot be started (SystemError when a system call failed, e.g. EMFILE).
void register_created(const std::string& name);
// After this process opened (mapped) an existing name it did not create. Never throws: if
// the daemon cannot be reached the name is still released by its refcount, and a later
// daemon's sweep covers a crash.
void register_opened(const std::string& name) noexcept;
// After this process released its count of `name` (and unlinked it if it was the last).
void release(const std::string& name, bool unlinked) noexcept;

// Waits until the daemon has processed every message this process sent, made its
// decisions and written its journal (for tests and tools). Connects (starting a daemon)
// if needed; a daemon that dies meanwhile is replaced and asked again. Throws Error.
void sync();
// A new connection to the daemon (started if none runs), its hello answered; the daemon's
// pid in *daemon_pid. The connection's sends and receives time out after 10 s. Throws
// Error as register_created, or when the daemon refuses this process (another uid). The
// features its hello-ack names (protocol.h, kFeature*) in *features when not null.
UniqueFd greeted_connection(pid_t* daemon_pid, std::uint64_t* features = nullptr);

// The named-channel registry's functions (channel_client.cc), which the static initializer
// of client.cc installs (memory/channel_registry.h).
const ChannelRegistry& channel_registry_client() noexcept;
// Installs the manager client's fork handlers (once), which run the three below.
void install_client_fork_handlers() noexcept;
// The kept-fd connection's fork handlers (channel_client.cc), run by the manager client's:
// its lock is held across fork, and the child closes its copy of the parent's connection.
void keeper_prepare_fork() noexcept;
void keeper_parent_after_fork() noexcept;
void keeper_child_after_fork() noexcept;

// The pid of the daemon this process is connected to, 0 when not connected.
pid_t connected_daemon_pid() noexcept;
// The number of names this process holds as far as the manager client knows.
std::size_t held_name_count() noexcept;

}  // namespace shmtensor::internal::manager

// Defined in client.cc and referred to by a "-u" link option of the shmtensor target, so
// that a static link keeps client.cc (and the static initializer that installs the
// observer). Does nothing.
extern "C" void shmtensor_manager_client_anchor() noexcept;
