// libFuzzer harness for the message decoder: any bytes, as a datagram without fds, must
// decode or throw shmtensor::Error — never crash, overrun, leak or allocate without bound.
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <map>
#include <span>
#include <string>
#include <variant>
#include <vector>

#include "shmtensor/codec.h"
#include "wire/wire.h"

namespace {
using Value = std::variant<std::int64_t, std::string, std::vector<shmtensor::Tensor>,
                           std::map<std::string, std::optional<shmtensor::Tensor>>,
                           std::tuple<double, bool, std::vector<float>>,
                           std::vector<shmtensor::Storage>>;
}

// What a parse of `bytes` as one Tensor came to: the tensor's layout, or the error's type
// and message.
template <class Parse>
std::string outcome(const Parse& parse) {
  try {
    const shmtensor::Tensor t = parse();
    if (!t.defined()) return "undefined tensor";
    return "tensor " + std::to_string(static_cast<int>(t.dtype())) + " " + std::to_string(t.dim()) +
           " " + std::to_string(t.storage_offset());
  } catch (const shmtensor::ProtocolError& e) {
    return std::string("ProtocolError ") + e.what();
  } catch (const shmtensor::Error& e) {
    return std::string("Error ") + e.what();
  } catch (const std::exception& e) {
    return std::string("exception ") + e.what();
  }
}

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  const std::span<const std::byte> bytes(reinterpret_cast<const std::byte*>(data), size);
  try {
    shmtensor::Decoder d = shmtensor::internal::parse_frame(bytes, {});
    Value v = d.decode<Value>();
    d.finish();
    (void)v;
  } catch (const shmtensor::Error&) {
  } catch (const std::invalid_argument&) {
  } catch (const std::out_of_range&) {
  }
  // The one-tensor path (wire.h, parse_tensor_frame) takes and refuses what the general
  // one does, with the same error; or it leaves the frame to it.
  bool left = false;  // parse_tensor_frame said false: not its shape
  const std::string fast = outcome([&] {
    shmtensor::Tensor t;
    left = !shmtensor::internal::parse_tensor_frame(bytes, nullptr, t);
    return t;
  });
  if (!left) {
    const std::string general = outcome([&] {
      shmtensor::Decoder d = shmtensor::internal::parse_frame(bytes, {});
      shmtensor::Tensor t = d.decode<shmtensor::Tensor>();
      d.finish();
      return t;
    });
    if (general != fast) {
      std::fprintf(stderr, "one-tensor path: %s\ngeneral path:    %s\n", fast.c_str(),
                   general.c_str());
      std::abort();
    }
  }
  return 0;
}
