// DefaultCollate's machinery (collate.h): how each sample type is collated. Internal.
#pragma once

#include <algorithm>
#include <array>
#include <cstddef>
#include <cstdint>
#include <map>
#include <string>
#include <tuple>
#include <type_traits>
#include <utility>
#include <vector>

#include "shmtensor/dims.h"
#include "shmtensor/dtype.h"
#include "shmtensor/export.h"
#include "shmtensor/tensor.h"

namespace shmtensor::internal {

// shmtensor::empty_batch (collate.h has the contract); sizes as Dims (no heap for a few).
SHMTENSOR_API Tensor empty_batch(Dims sizes, DType dtype);

template <class T, class = void>
struct HasFields : std::false_type {};
template <class T>
struct HasFields<T, std::void_t<decltype(std::declval<T&>().shmtensor_fields())>>
    : std::true_type {};
template <class T, class = void>
struct HasBatchType : std::false_type {};
template <class T>
struct HasBatchType<T, std::void_t<typename T::batch_type>> : std::true_type {};

// The dtype a number collates to.
template <class T>
constexpr DType number_dtype() {
  if constexpr (std::is_same_v<T, bool>) return DType::kBool;
  else if constexpr (std::is_floating_point_v<T>) return sizeof(T) == 4 ? DType::kFloat32 : DType::kFloat64;
  else if constexpr (std::is_signed_v<T>)
    return sizeof(T) == 1 ? DType::kInt8 : sizeof(T) == 2 ? DType::kInt16 : sizeof(T) == 4 ? DType::kInt32 : DType::kInt64;
  else return sizeof(T) == 1 ? DType::kUInt8 : DType::kInt64;
}
template <DType D> struct CppOf;
template <> struct CppOf<DType::kBool> { using type = bool; };
template <> struct CppOf<DType::kUInt8> { using type = std::uint8_t; };
template <> struct CppOf<DType::kInt8> { using type = std::int8_t; };
template <> struct CppOf<DType::kInt16> { using type = std::int16_t; };
template <> struct CppOf<DType::kInt32> { using type = std::int32_t; };
template <> struct CppOf<DType::kInt64> { using type = std::int64_t; };
template <> struct CppOf<DType::kFloat32> { using type = float; };
template <> struct CppOf<DType::kFloat64> { using type = double; };

[[noreturn]] SHMTENSOR_API void throw_collate_mismatch(const std::string& what);

template <class T, class = void>
struct CollateImpl {
  static_assert(sizeof(T) == 0,
                "DefaultCollate cannot collate this sample type: use Tensor, numbers, strings, "
                "pair/tuple/vector/array/map of them, or a struct with SHMTENSOR_FIELDS; or "
                "pass your own collate_fn");
};

template <class T>
using Collated = typename CollateImpl<std::decay_t<T>>::type;

template <class T>
auto collate_all(std::vector<T>&& samples) {
  return CollateImpl<T>::collate(std::move(samples));
}

template <>
struct CollateImpl<Tensor> {
  using type = Tensor;
  static Tensor collate(std::vector<Tensor>&& samples) {
    if (samples.empty()) throw_collate_mismatch("cannot collate an empty batch");
    const Tensor& first = samples.front();
    if (!first.defined()) throw_collate_mismatch("cannot collate an undefined tensor");
    // [samples, *first.sizes()]
    Dims sizes(first.sizes().size() + 1, static_cast<std::int64_t>(samples.size()));
    std::copy(first.sizes().begin(), first.sizes().end(), sizes.begin() + 1);
    for (const Tensor& s : samples)
      if (s.defined() && s.dtype() != first.dtype())
        throw_collate_mismatch("cannot stack tensors of dtypes " + std::string(to_string(first.dtype())) +
                               " and " + std::string(to_string(s.dtype())));
    Tensor out = internal::empty_batch(std::move(sizes), first.dtype());
    stack_into(samples, out);
    return out;
  }
};

template <class T>
struct CollateImpl<T, std::enable_if_t<std::is_arithmetic_v<T>>> {
  using type = Tensor;
  static Tensor collate(std::vector<T>&& samples) {
    constexpr DType kDType = number_dtype<T>();
    using C = typename CppOf<kDType>::type;
    Tensor out = internal::empty_batch({static_cast<std::int64_t>(samples.size())}, kDType);
    C* p = out.data_ptr<C>();
    for (std::size_t i = 0; i < samples.size(); ++i) p[i] = static_cast<C>(samples[i]);
    return out;
  }
};

template <>
struct CollateImpl<std::string> {
  using type = std::vector<std::string>;
  static type collate(std::vector<std::string>&& samples) { return std::move(samples); }
};

// Position I of every sample (moved out), collated.
template <std::size_t I, class Tuple>
auto collate_position(std::vector<Tuple>& samples) {
  using E = std::decay_t<std::tuple_element_t<I, Tuple>>;
  std::vector<E> column;
  column.reserve(samples.size());
  for (auto& s : samples) column.push_back(std::move(std::get<I>(s)));
  return collate_all(std::move(column));
}

template <class... Ts>
struct CollateImpl<std::tuple<Ts...>> {
  using type = std::tuple<Collated<Ts>...>;
  static type collate(std::vector<std::tuple<Ts...>>&& samples) {
    return collate_columns(samples, std::index_sequence_for<Ts...>{});
  }
  template <std::size_t... I>
  static type collate_columns(std::vector<std::tuple<Ts...>>& samples, std::index_sequence<I...>) {
    return type{collate_position<I>(samples)...};
  }
};

template <class A, class B>
struct CollateImpl<std::pair<A, B>> {
  using type = std::pair<Collated<A>, Collated<B>>;
  static type collate(std::vector<std::pair<A, B>>&& samples) {
    auto first = collate_position<0>(samples);
    auto second = collate_position<1>(samples);
    return type{std::move(first), std::move(second)};
  }
};

// Element i of every sample (which must all have `n` elements), collated. `column` is the
// caller's buffer, reused from element to element (one allocation for all of them): cleared
// here, whatever the previous collate left in it.
template <class Seq, class E>
auto collate_element(std::vector<Seq>& samples, std::size_t i, std::vector<E>& column) {
  column.clear();
  column.reserve(samples.size());
  for (auto& s : samples) column.push_back(std::move(s[i]));
  return collate_all(std::move(column));
}

template <class T, class A>
struct CollateImpl<std::vector<T, A>> {
  using type = std::vector<Collated<T>>;
  static type collate(std::vector<std::vector<T, A>>&& samples) {
    type out;
    if (samples.empty()) return out;
    const std::size_t n = samples.front().size();
    for (const auto& s : samples)
      if (s.size() != n)
        throw_collate_mismatch("each sample's vector must have the same length (" +
                               std::to_string(n) + " and " + std::to_string(s.size()) + ")");
    out.reserve(n);
    std::vector<T> column;
    for (std::size_t i = 0; i < n; ++i) out.push_back(collate_element(samples, i, column));
    return out;
  }
};

template <class T, std::size_t N>
struct CollateImpl<std::array<T, N>> {
  using type = std::array<Collated<T>, N>;
  static type collate(std::vector<std::array<T, N>>&& samples) {
    type out;
    std::vector<T> column;
    for (std::size_t i = 0; i < N; ++i) out[i] = collate_element(samples, i, column);
    return out;
  }
};

template <class K, class V, class C, class A>
struct CollateImpl<std::map<K, V, C, A>> {
  using type = std::map<K, Collated<V>, C>;
  static type collate(std::vector<std::map<K, V, C, A>>&& samples) {
    type out;
    if (samples.empty()) return out;
    for (const auto& s : samples)
      if (s.size() != samples.front().size())
        throw_collate_mismatch("each sample's map must have the same keys");
    for (const auto& [key, unused] : samples.front()) {
      std::vector<V> column;
      column.reserve(samples.size());
      for (auto& s : samples) {
        auto it = s.find(key);
        if (it == s.end()) throw_collate_mismatch("each sample's map must have the same keys");
        column.push_back(std::move(it->second));
      }
      out.emplace(key, collate_all(std::move(column)));
    }
    return out;
  }
};

// Structs with SHMTENSOR_FIELDS.
template <class T>
using FieldTuple = decltype(std::declval<T&>().shmtensor_fields());
template <class T, class Seq>
struct StructBatch;
template <class T, std::size_t... I>
struct StructBatch<T, std::index_sequence<I...>> {
  using Fields = FieldTuple<T>;
  using Tuple = std::tuple<Collated<std::tuple_element_t<I, Fields>>...>;
  static constexpr bool kSelf =
      (std::is_same_v<Collated<std::tuple_element_t<I, Fields>>,
                      std::decay_t<std::tuple_element_t<I, Fields>>> && ...);
};
template <class T>
struct NamedBatchType {
  using type = typename T::batch_type;
};
template <class T>
struct StructBatchType {
  using B = StructBatch<T, std::make_index_sequence<std::tuple_size_v<FieldTuple<T>>>>;
  using type = std::conditional_t<B::kSelf, T, typename B::Tuple>;
};

template <class T>
struct CollateImpl<T, std::enable_if_t<HasFields<T>::value>> {
  static constexpr std::size_t kN = std::tuple_size_v<FieldTuple<T>>;
  using type = typename std::conditional_t<HasBatchType<T>::value, NamedBatchType<T>,
                                           StructBatchType<T>>::type;

  static type collate(std::vector<T>&& samples) {
    return collate_fields(samples, std::make_index_sequence<kN>{});
  }
  template <std::size_t... I>
  static type collate_fields(std::vector<T>& samples, std::index_sequence<I...>) {
    auto columns = std::make_tuple(collate_field<I>(samples)...);
    if constexpr (std::is_same_v<type, typename StructBatchType<T>::B::Tuple>) {
      return columns;
    } else {
      type out{};
      auto fields = out.shmtensor_fields();
      static_assert(std::tuple_size_v<decltype(fields)> == kN,
                    "batch_type must have SHMTENSOR_FIELDS with as many fields as the sample");
      ((std::get<I>(fields) = std::move(std::get<I>(columns))), ...);
      return out;
    }
  }
  template <std::size_t I>
  static auto collate_field(std::vector<T>& samples) {
    using F = std::decay_t<std::tuple_element_t<I, FieldTuple<T>>>;
    std::vector<F> column;
    column.reserve(samples.size());
    for (auto& s : samples) column.push_back(std::move(std::get<I>(s.shmtensor_fields())));
    return collate_all(std::move(column));
  }
};

}  // namespace shmtensor::internal
