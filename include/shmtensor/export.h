// SHMTENSOR_API: what libshmtensor.so (and the torch bridge, libshmtensor_torch.so, for
// shmtensor/torch.h) exports.
//
// The library is built with hidden visibility (-fvisibility=hidden,
// -fvisibility-inlines-hidden): a symbol is exported only where its declaration in a public
// header (include/shmtensor/, include/shmtensor/internal/) says SHMTENSOR_API. It marks
//  - each class with a member defined in the library: `class SHMTENSOR_API Tensor`. An
//    exception class is marked even when it is defined entirely in its header, so that its
//    typeinfo is one across the library and its users and `catch (const shmtensor::Error&)`
//    catches what the library throws;
//  - each free function defined in the library: `SHMTENSOR_API void empty_cache();`;
//  - each explicit specialization of a template whose members are defined in the library
//    (`template <> struct SHMTENSOR_API Codec<Connection>`).
// Templates and inline functions defined in the headers need nothing: they are compiled
// into their user. CONTRIBUTING.md ("Exported symbols") says when to use it;
// `ctest -R layers.exported_symbols` checks that no other internal symbol is exported, and
// `ctest -R layers.torch_exported_symbols` that the bridge exports no other of shmtensor.
#pragma once

#define SHMTENSOR_API __attribute__((visibility("default")))
