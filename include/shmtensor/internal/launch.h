// How a Process (process.h) is told what to run, for both start methods: the launch spec,
// and the exec plumbing that finds a function again in a re-executed child and sends it its
// arguments. Internal: spawn(), Pool and DataLoader build launch specs with make_launch.
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <tuple>
#include <type_traits>
#include <utility>

#include "shmtensor/codec.h"
#include "shmtensor/connection.h"
#include "shmtensor/internal/connection_access.h"
#include "shmtensor/error.h"

namespace shmtensor::internal {

// What kExec runs: `entry` (an instantiation of exec_entry below, in the caller's binary)
// is called in the re-executed child with the address of the user's function, the child's
// index and the fd of its end of the argument connection (-1 when there are no arguments).
using ExecEntry = void (*)(std::uintptr_t fn, int index, int args_fd);

// Sends a child's arguments. Made before fork; child_fd() is inherited by the child;
// after_fork() runs in the parent once the child exists (it drops the parent's copy of the
// child's end and sends).
class ExecArgs {
 public:
  virtual ~ExecArgs() = default;
  virtual int child_fd() const = 0;
  virtual void after_fork() = 0;
};

struct LaunchSpec {
  std::function<void()> fork_body;  // kFork: runs in the forked child
  ExecEntry exec_entry = nullptr;   // kExec; null when the callable cannot cross exec
  std::uintptr_t exec_fn = 0;
  int index = 0;
  std::function<std::unique_ptr<ExecArgs>()> exec_args;  // empty: no arguments
  std::string exec_unavailable;  // why kExec cannot run this callable
};

// Function-pointer traits (noexcept or not).
template <class T>
struct FnTraits {
  static constexpr bool kIsFunction = false;
};
template <class R, class... P>
struct FnTraits<R (*)(P...)> {
  static constexpr bool kIsFunction = true;
  using Result = R;
  using Params = std::tuple<std::decay_t<P>...>;
  static constexpr std::size_t kArity = sizeof...(P);
};
template <class R, class... P>
struct FnTraits<R (*)(P...) noexcept> : FnTraits<R (*)(P...)> {};

// The function pointer a plain function or captureless lambda converts to; void if none.
template <class F, class = void>
struct FnPointerOf {
  using type = void;
};
template <class F>
struct FnPointerOf<F, std::void_t<decltype(+std::declval<std::decay_t<F>&>())>> {
  using P = decltype(+std::declval<std::decay_t<F>&>());
  using type = std::conditional_t<FnTraits<P>::kIsFunction, P, void>;
};

// Tuple of the parameters after the first `skip` ones.
template <std::size_t skip, class Tuple, class Seq>
struct TupleTailImpl;
template <std::size_t skip, class Tuple, std::size_t... I>
struct TupleTailImpl<skip, Tuple, std::index_sequence<I...>> {
  using type = std::tuple<std::tuple_element_t<skip + I, Tuple>...>;
};
template <std::size_t skip, class Tuple>
using TupleTail = typename TupleTailImpl<skip, Tuple,
                                         std::make_index_sequence<std::tuple_size_v<Tuple> - skip>>::type;

// Receives the argument tuple in a re-executed child, from its end of the connection the
// parent sent it on (ExecArgsOver::after_fork).
template <class Tuple>
Tuple receive_exec_args(int args_fd) {
  if constexpr (std::tuple_size_v<Tuple> == 0) {
    (void)args_fd;
    return Tuple{};
  } else {
    if (args_fd < 0) throw Error("exec child: arguments expected but no connection was passed");
    Connection connection = Connection::adopt(args_fd);
    return connection.recv<Tuple>();
  }
}

// The arguments of one exec child: encoded and sent over a fresh connection once the child
// exists. The message (tensors by reference, queue and connection fds attached) waits in
// the socket until the re-executed child reads it, so the parent does not wait for it.
template <class Tuple>
class ExecArgsOver final : public ExecArgs {
 public:
  explicit ExecArgsOver(const Tuple& args) : args_(args) {
    // A bare socket pair: the child gets its end as one inherited fd.
    auto ends = ConnectionAccess::socket_pair();
    mine_ = std::move(ends.first);
    theirs_ = std::move(ends.second);
  }
  int child_fd() const override { return theirs_.native_handle(); }
  void after_fork() override {
    theirs_.close();
    mine_.send(args_);
    mine_.close();
  }

 private:
  Tuple args_;
  Connection mine_;
  Connection theirs_;
};

// Whether Codec<T> is defined (top level only: a container of something unencodable still
// fails to compile when the exec path is instantiated).
template <class T, class = void>
struct HasCodec : std::false_type {};
template <class T>
struct HasCodec<T, std::void_t<decltype(&Codec<T>::encode)>> : std::true_type {};
template <class Tuple>
struct AllHaveCodec;
template <class... T>
struct AllHaveCodec<std::tuple<T...>> : std::bool_constant<(HasCodec<T>::value && ...)> {};

// Runs in the re-executed child: calls fn(index, args...) (kIndexed) or fn(args...).
template <class FnPtr, bool kIndexed>
void exec_entry(std::uintptr_t fn_address, int index, int args_fd) {
  FnPtr fn = reinterpret_cast<FnPtr>(fn_address);
  using Params = typename FnTraits<FnPtr>::Params;
  if constexpr (kIndexed) {
    auto args = receive_exec_args<TupleTail<1, Params>>(args_fd);
    std::apply([&](auto&... a) { fn(index, std::move(a)...); }, args);
  } else {
    auto args = receive_exec_args<Params>(args_fd);
    std::apply([&](auto&... a) { fn(std::move(a)...); }, args);
  }
}

// Builds what Process::start needs for both start methods. With kIndexed the callable is
// called as fn(index, args...), otherwise fn(args...).
template <bool kIndexed, class F, class... Args>
LaunchSpec make_launch(int index, F&& fn, Args&&... args) {
  LaunchSpec spec;
  spec.index = index;
  using FnPtr = typename FnPointerOf<F>::type;
  if constexpr (!std::is_void_v<FnPtr>) {
    constexpr std::size_t kArity = FnTraits<FnPtr>::kArity;
    constexpr std::size_t kGiven = sizeof...(Args) + (kIndexed ? 1 : 0);
    using Params = typename FnTraits<FnPtr>::Params;
    using Sent = std::conditional_t<kIndexed, TupleTail<(kArity > 0 ? 1 : 0), Params>, Params>;
    if constexpr (kArity != kGiven) {
      spec.exec_unavailable = "the function takes " + std::to_string(kArity) +
                              " parameters but is called with " + std::to_string(kGiven);
    } else if constexpr (!std::is_constructible_v<Sent, const std::decay_t<Args>&...>) {
      spec.exec_unavailable = "the arguments do not convert to the function's parameter types";
    } else if constexpr (!AllHaveCodec<Sent>::value) {
      spec.exec_unavailable =
          "a parameter type is not encodable (see codec.h), so it cannot be sent to a "
          "re-executed child: use StartMethod::kFork or an encodable type";
    } else {
      spec.exec_entry = &exec_entry<FnPtr, kIndexed>;
      spec.exec_fn = reinterpret_cast<std::uintptr_t>(+fn);
      if constexpr (std::tuple_size_v<Sent> > 0) {
        spec.exec_args = [sent = Sent(args...)]() -> std::unique_ptr<ExecArgs> {
          return std::make_unique<ExecArgsOver<Sent>>(sent);
        };
      }
    }
  } else {
    spec.exec_unavailable =
        "the exec start method runs a plain function or a captureless lambda (it finds it "
        "again by its offset in the executable); this callable has state (captures, or is "
        "a functor or generic lambda): use StartMethod::kFork or a plain function";
  }
  if constexpr (kIndexed) {
    spec.fork_body = [fn = std::decay_t<F>(std::forward<F>(fn)),
                      args = std::make_tuple(std::forward<Args>(args)...), index]() mutable {
      std::apply([&](auto&... a) { fn(index, a...); }, args);
    };
  } else {
    spec.fork_body = [fn = std::decay_t<F>(std::forward<F>(fn)),
                      args = std::make_tuple(std::forward<Args>(args)...)]() mutable {
      std::apply([&](auto&... a) { fn(a...); }, args);
    };
  }
  return spec;
}

}  // namespace shmtensor::internal
