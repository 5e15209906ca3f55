// What Pool (pool.h) sends to a worker and how a worker runs it: the entry points that
// call a task's function in the worker, and a task's failure as data. Internal.
#pragma once

#include <cstdint>
#include <functional>
#include <string>
#include <tuple>
#include <type_traits>
#include <utility>
#include <variant>
#include <vector>

#include "shmtensor/codec.h"
#include "shmtensor/export.h"
#include "shmtensor/internal/current_exception.h"
#include "shmtensor/internal/launch.h"

namespace shmtensor::internal {

// Runs in a worker: decodes the arguments, calls the function, encodes its result.
using PoolEntry = void (*)(std::uintptr_t fn, Decoder& args, Encoder& reply);

template <class FnPtr>
void pool_entry(std::uintptr_t fn_address, Decoder& d, Encoder& reply) {
  FnPtr fn = reinterpret_cast<FnPtr>(fn_address);
  using Params = typename FnTraits<FnPtr>::Params;
  auto args = d.template decode<Params>();
  d.finish();
  using R = typename FnTraits<FnPtr>::Result;
  if constexpr (std::is_void_v<R>) {
    std::apply([&](auto&... a) { fn(a...); }, args);
    reply.encode(std::monostate{});
  } else {
    reply.encode(std::apply([&](auto&... a) -> decltype(auto) { return fn(a...); }, args));
  }
}

// A chunk's reply: per input, its result or its exception's "<type>: <message>".
template <class R>
using ChunkReply = std::vector<std::variant<R, std::string>>;

// Runs in a worker: fn on every argument tuple of a chunk (map/imap/starmap with
// chunksize > 1). An input whose call throws fails alone; the others keep their results.
template <class FnPtr>
void pool_chunk_entry(std::uintptr_t fn_address, Decoder& d, Encoder& reply) {
  FnPtr fn = reinterpret_cast<FnPtr>(fn_address);
  using Params = typename FnTraits<FnPtr>::Params;
  using R = std::decay_t<typename FnTraits<FnPtr>::Result>;
  auto chunk = d.template decode<std::vector<Params>>();
  d.finish();
  ChunkReply<R> out;
  out.reserve(chunk.size());
  for (auto& args : chunk) {
    try {
      out.emplace_back(std::in_place_index<0>,
                       std::apply([&](auto&... a) -> decltype(auto) { return fn(a...); }, args));
    } catch (...) {
      out.emplace_back(std::in_place_index<1>, describe_current_exception());
    }
  }
  chunk.clear();  // drop the arguments (and their shared memory) before replying
  reply.encode(out);
}

// Why a task failed, as data. The exception is made (by throw_task_failure) in the thread
// that asks for the result, so that exception objects never cross threads: their
// reference counts live in uninstrumented libstdc++, which ThreadSanitizer cannot see.
struct TaskFailure {
  enum class Kind : std::uint8_t { kRaised, kWorkerDied, kError };
  Kind kind = Kind::kError;
  std::string text;  // kRaised: "<type>: <message>"; otherwise the whole message
  int pid = 0;
  int index = 0;  // kWorkerDied: the worker's slot
  int exit_code = 0;
  std::string signal_name;
};
// kRaised: TaskError; kWorkerDied: ProcessExitedException; kError: Error.
[[noreturn]] SHMTENSOR_API void throw_task_failure(const TaskFailure& failure);

struct PoolTask {
  PoolEntry entry = nullptr;
  std::uintptr_t fn = 0;
  std::function<void(Encoder&)> encode_args;  // called once, inside Pool::submit
  // In the dispatcher thread, with the reply and the pid of the worker that ran the task;
  // may throw.
  std::function<void(Decoder&, int pid)> on_result;
  std::function<void(TaskFailure)> on_error;  // in the dispatcher thread
};

template <class F>
using PoolFn = typename FnPointerOf<F>::type;

template <class F>
constexpr void check_pool_fn() {
  static_assert(!std::is_void_v<PoolFn<F>>,
                "Pool runs plain functions or captureless lambdas (they are named by address "
                "across processes); a capturing lambda or functor cannot be sent to a worker");
}

template <class F>
using PoolResult = std::decay_t<typename FnTraits<PoolFn<F>>::Result>;

}  // namespace shmtensor::internal
