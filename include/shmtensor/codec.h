// Encoding values into messages that cross processes, and decoding them back.
//
// A value is encodable when Codec<T> is specialised for it. Provided: Tensor (its storage
// travels by reference: moved into shared memory once, never copied), arithmetic types and
// enums, std::string, std::vector, std::array, std::map, std::unordered_map, std::pair,
// std::tuple, std::optional, std::variant, std::monostate, Connection and Queue<T> (their
// fds travel), and user structs that opt in with one line:
//
//   struct Sample {
//     Tensor image;
//     int64_t label;
//     std::string path;
//     SHMTENSOR_FIELDS(image, label, path)   // inside the struct; public fields
//   };
//
// Or specialise Codec<T> yourself with static encode(Encoder&, const T&) and
// static T decode(Decoder&).
//
// The plain-data encoding is native-endian, fixed-width, length-prefixed (see
// docs/wire_format.md). Decoding validates every length against the bytes that are left, so
// a hostile message is a ProtocolError, never an overrun or a huge allocation.
#pragma once

#include <array>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <tuple>
#include <type_traits>
#include <unordered_map>
#include <utility>
#include <variant>
#include <vector>

#include "shmtensor/error.h"
#include "shmtensor/export.h"
#include "shmtensor/tensor.h"

namespace shmtensor {

namespace internal {
struct EncoderState;
struct DecoderState;
struct CodecAccess;  // the wire layer's access to what follows (src/wire/wire.h)
}  // namespace internal

template <class T, class Enable = void>
struct Codec;

// Collects the bytes, storage references and fds of one message. Not thread-safe; one per
// message.
class SHMTENSOR_API Encoder {
 public:
  Encoder();
  ~Encoder();
  Encoder(Encoder&&) noexcept;
  Encoder& operator=(Encoder&&) noexcept;

  void write_bytes(const void* data, std::size_t n) {
    const auto* p = static_cast<const std::byte*>(data);
    payload_.insert(payload_.end(), p, p + n);
  }
  template <class T>
  void write_pod(const T& v) {
    static_assert(std::is_trivially_copyable_v<T>);
    write_bytes(&v, sizeof v);
  }
  void write_size(std::size_t n) { write_pod<std::uint64_t>(n); }
  // Records a reference to the tensor's storage (several tensors on one storage become one
  // reference). The storage moves into shared memory when the message is sent, once the
  // transport has admitted it, not here. Throws Error for more than 64 dimensions.
  void write_tensor(const Tensor& t);
  // Records a reference to a whole storage, as write_tensor does for a tensor's, with no
  // view: the receiver gets the storage (over the same memory). An undefined storage
  // arrives undefined, one of 0 bytes as a new empty one. Throws Error for a CUDA storage
  // of 0 bytes.
  void write_storage(const Storage& s);
  // Attaches a duplicate of `fd` to the message (for Connection and Queue). Throws
  // SystemError (EMFILE).
  void write_fd(int fd);

  template <class T>
  void encode(const T& v) {
    Codec<std::decay_t<T>>::encode(*this, v);
  }

 private:
  friend struct internal::CodecAccess;
  // The index of `impl` in the message's storage table, added if it is not there yet.
  std::uint32_t record_storage(const std::shared_ptr<internal::StorageImpl>& impl);
  std::vector<std::byte> payload_;
  std::unique_ptr<internal::EncoderState> state_;
};

// Reads one received message. Every read checks bounds and throws ProtocolError.
class SHMTENSOR_API Decoder {
 public:
  ~Decoder();
  Decoder(Decoder&&) noexcept;
  Decoder& operator=(Decoder&&) noexcept;

  void read_bytes(void* out, std::size_t n);
  template <class T>
  [[nodiscard]] T read_pod() {
    static_assert(std::is_trivially_copyable_v<T>);
    T v;
    read_bytes(&v, sizeof v);
    return v;
  }
  // A length prefix, checked to be at most remaining() / min_element_bytes (so a hostile
  // count cannot trigger a huge allocation or a long loop). With 0 (elements that may take
  // no payload bytes, like Connection), at most remaining() + the fds left + 65536.
  [[nodiscard]] std::size_t read_size(std::size_t min_element_bytes = 1);
  [[nodiscard]] std::size_t remaining() const noexcept;
  [[nodiscard]] Tensor read_tensor();
  [[nodiscard]] Storage read_storage();
  // Takes ownership of the next attached fd; the caller must close it (or hand it on).
  [[nodiscard]] int take_fd();

  template <class T>
  [[nodiscard]] T decode() {
    return Codec<T>::decode(*this);
  }
  // Throws ProtocolError if bytes are left over (called after the top-level value).
  void finish();

 private:
  friend struct internal::CodecAccess;
  explicit Decoder(std::unique_ptr<internal::DecoderState> state);
  std::unique_ptr<internal::DecoderState> state_;
};

// ---- codecs --------------------------------------------------------------------------

// The fewest payload bytes an encoded T takes: 0 when it may take none (Connection,
// Queue and std::monostate: their fds travel beside the payload). A decoder bounds a length
// prefix with it (Decoder::read_size).
template <class T, class Enable = void>
struct MinEncodedBytes : std::integral_constant<std::size_t, 0> {};
template <class T>
inline constexpr std::size_t kMinEncodedBytes = MinEncodedBytes<std::decay_t<T>>::value;
template <class T>
struct MinEncodedBytes<T, std::enable_if_t<std::is_arithmetic_v<T> || std::is_enum_v<T>>>
    : std::integral_constant<std::size_t, sizeof(T)> {};
template <>
struct MinEncodedBytes<Tensor> : std::integral_constant<std::size_t, 1> {};
template <>
struct MinEncodedBytes<Storage> : std::integral_constant<std::size_t, 4> {};
template <>
struct MinEncodedBytes<std::string> : std::integral_constant<std::size_t, 8> {};
template <class T, class A>
struct MinEncodedBytes<std::vector<T, A>> : std::integral_constant<std::size_t, 8> {};
template <class K, class V, class C, class A>
struct MinEncodedBytes<std::map<K, V, C, A>> : std::integral_constant<std::size_t, 8> {};
template <class K, class V, class H, class E, class A>
struct MinEncodedBytes<std::unordered_map<K, V, H, E, A>> : std::integral_constant<std::size_t, 8> {
};
template <class T>
struct MinEncodedBytes<std::optional<T>> : std::integral_constant<std::size_t, 1> {};
template <class... Ts>
struct MinEncodedBytes<std::variant<Ts...>> : std::integral_constant<std::size_t, 4> {};
template <class T, std::size_t N>
struct MinEncodedBytes<std::array<T, N>>
    : std::integral_constant<std::size_t, N * kMinEncodedBytes<T>> {};
template <class A, class B>
struct MinEncodedBytes<std::pair<A, B>>
    : std::integral_constant<std::size_t, kMinEncodedBytes<A> + kMinEncodedBytes<B>> {};
template <class... Ts>
struct MinEncodedBytes<std::tuple<Ts...>>
    : std::integral_constant<std::size_t, (std::size_t{0} + ... + kMinEncodedBytes<Ts>)> {};
template <class T>
struct MinEncodedBytes<T, std::void_t<decltype(std::declval<T&>().shmtensor_fields())>>
    : MinEncodedBytes<std::decay_t<decltype(std::declval<T&>().shmtensor_fields())>> {};

template <class T>
struct Codec<T, std::enable_if_t<std::is_arithmetic_v<T> || std::is_enum_v<T>>> {
  static void encode(Encoder& e, const T& v) { e.write_pod(v); }
  static T decode(Decoder& d) { return d.read_pod<T>(); }
};
// bool is encoded as one byte 0/1 (a bool object with another bit pattern is UB).
template <>
struct Codec<bool> {
  static void encode(Encoder& e, const bool& v) { e.write_pod<std::uint8_t>(v ? 1 : 0); }
  static bool decode(Decoder& d) {
    auto b = d.read_pod<std::uint8_t>();
    if (b > 1) throw ProtocolError("invalid bool byte in message");
    return b != 0;
  }
};

template <>
struct Codec<Tensor> {
  static void encode(Encoder& e, const Tensor& t) { e.write_tensor(t); }
  static Tensor decode(Decoder& d) { return d.read_tensor(); }
};

template <>
struct Codec<Storage> {
  static void encode(Encoder& e, const Storage& s) { e.write_storage(s); }
  static Storage decode(Decoder& d) { return d.read_storage(); }
};

template <>
struct Codec<std::string> {
  static void encode(Encoder& e, const std::string& s) {
    e.write_size(s.size());
    e.write_bytes(s.data(), s.size());
  }
  static std::string decode(Decoder& d) {
    std::string s(d.read_size(1), '\0');
    d.read_bytes(s.data(), s.size());
    return s;
  }
};

template <>
struct Codec<std::monostate> {
  static void encode(Encoder&, const std::monostate&) {}
  static std::monostate decode(Decoder&) { return {}; }
};

template <class T, class A>
struct Codec<std::vector<T, A>> {
  static void encode(Encoder& e, const std::vector<T, A>& v) {
    e.write_size(v.size());
    if constexpr (std::is_arithmetic_v<T> && !std::is_same_v<T, bool>) {
      e.write_bytes(v.data(), v.size() * sizeof(T));
    } else {
      for (const auto& x : v) e.encode(x);
    }
  }
  static std::vector<T, A> decode(Decoder& d) {
    std::vector<T, A> v;
    if constexpr (std::is_arithmetic_v<T> && !std::is_same_v<T, bool>) {
      v.resize(d.read_size(sizeof(T)));
      d.read_bytes(v.data(), v.size() * sizeof(T));
    } else {
      std::size_t n = d.read_size(kMinEncodedBytes<T>);
      v.reserve(n);
      for (std::size_t i = 0; i < n; ++i) v.push_back(d.decode<T>());
    }
    return v;
  }
};

template <class T, std::size_t N>
struct Codec<std::array<T, N>> {
  static void encode(Encoder& e, const std::array<T, N>& a) {
    for (const auto& x : a) e.encode(x);
  }
  static std::array<T, N> decode(Decoder& d) {
    std::array<T, N> a;
    for (auto& x : a) x = d.decode<T>();
    return a;
  }
};

template <class A, class B>
struct Codec<std::pair<A, B>> {
  static void encode(Encoder& e, const std::pair<A, B>& p) {
    e.encode(p.first);
    e.encode(p.second);
  }
  static std::pair<A, B> decode(Decoder& d) {
    A a = d.decode<A>();
    B b = d.decode<B>();
    return {std::move(a), std::move(b)};
  }
};

template <class... Ts>
struct Codec<std::tuple<Ts...>> {
  static void encode(Encoder& e, const std::tuple<Ts...>& t) {
    std::apply([&](const auto&... xs) { (e.encode(xs), ...); }, t);
  }
  static std::tuple<Ts...> decode(Decoder& d) {
    // Braced init: elements are decoded left to right.
    return std::tuple<Ts...>{d.decode<Ts>()...};
  }
};

template <class M>
struct MapCodec {
  static void encode(Encoder& e, const M& m) {
    e.write_size(m.size());
    for (const auto& [k, v] : m) {
      e.encode(k);
      e.encode(v);
    }
  }
  static M decode(Decoder& d) {
    M m;
    std::size_t n = d.read_size(kMinEncodedBytes<typename M::key_type> +
                                kMinEncodedBytes<typename M::mapped_type>);
    for (std::size_t i = 0; i < n; ++i) {
      auto k = d.decode<typename M::key_type>();
      auto v = d.decode<typename M::mapped_type>();
      m.emplace(std::move(k), std::move(v));
    }
    return m;
  }
};
template <class K, class V, class C, class A>
struct Codec<std::map<K, V, C, A>> : MapCodec<std::map<K, V, C, A>> {};
template <class K, class V, class H, class E, class A>
struct Codec<std::unordered_map<K, V, H, E, A>> : MapCodec<std::unordered_map<K, V, H, E, A>> {};

template <class T>
struct Codec<std::optional<T>> {
  static void encode(Encoder& e, const std::optional<T>& o) {
    e.write_pod<std::uint8_t>(o ? 1 : 0);
    if (o) e.encode(*o);
  }
  static std::optional<T> decode(Decoder& d) {
    if (!d.decode<bool>()) return std::nullopt;
    return d.decode<T>();
  }
};

template <class... Ts>
struct Codec<std::variant<Ts...>> {
  static void encode(Encoder& e, const std::variant<Ts...>& v) {
    e.write_pod<std::uint32_t>(static_cast<std::uint32_t>(v.index()));
    std::visit([&](const auto& x) { e.encode(x); }, v);
  }
  static std::variant<Ts...> decode(Decoder& d) {
    auto index = d.read_pod<std::uint32_t>();
    if (index >= sizeof...(Ts)) throw ProtocolError("variant index out of range in message");
    return decode_at(d, index, std::index_sequence_for<Ts...>{});
  }

 private:
  template <std::size_t... I>
  static std::variant<Ts...> decode_at(Decoder& d, std::uint32_t index, std::index_sequence<I...>) {
    std::variant<Ts...> out;
    static_cast<void>(((index == I ? (out.template emplace<I>(
                                          d.decode<std::variant_alternative_t<I, std::variant<Ts...>>>()),
                                      true)
                                   : false) ||
                       ...));
    return out;
  }
};

// Opt-in structs: SHMTENSOR_FIELDS(a, b, c) inside the struct.
#define SHMTENSOR_FIELDS(...)                               \
  auto shmtensor_fields() { return std::tie(__VA_ARGS__); } \
  auto shmtensor_fields() const { return std::tie(__VA_ARGS__); }

template <class T>
struct Codec<T, std::void_t<decltype(std::declval<T&>().shmtensor_fields())>> {
  static void encode(Encoder& e, const T& v) {
    std::apply([&](const auto&... xs) { (e.encode(xs), ...); }, v.shmtensor_fields());
  }
  static T decode(Decoder& d) {
    T v{};
    std::apply([&](auto&... xs) { ((xs = d.decode<std::decay_t<decltype(xs)>>()), ...); },
               v.shmtensor_fields());
    return v;
  }
};

}  // namespace shmtensor
