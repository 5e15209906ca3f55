// libFuzzer harness for the message decoder: any bytes, as a datagram without fds, must
// decode or throw shmtensor::Error — never crash, overrun, leak or allocate without bound.
#include <cstddef>
#include <cstdint>
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
                           std::tuple<double, bool, std::vector<float>>>;
}

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  try {
    shmtensor::Decoder d = shmtensor::internal::parse_frame(
        std::span<const std::byte>(reinterpret_cast<const std::byte*>(data), size), {});
    Value v = d.decode<Value>();
    d.finish();
    (void)v;
  } catch (const shmtensor::Error&) {
  } catch (const std::invalid_argument&) {
  } catch (const std::out_of_range&) {
  }
  return 0;
}
